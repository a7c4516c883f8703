"""Triton kernels behind omni_accel/kernels/epilogue_fusion.py (imported only when a Triton path runs).

``concat_gelu``: ``out = cast(cat([a * a_scale, gelu_tanh(h + bias)], dim=-1))`` over 2-D tiles. Every tile lies in
one of the two inputs (the column block divides the first input's width), so a program branches once instead of
every element evaluating both inputs under masks, the column index needs no division, and loads and stores are
full-width vectors. That is what inductor's own kernel for the same expression lacks: on an H200, FLUX's single-block
epilogue (4608 x 15360) took 104 us there and 54 us here (``benchmarks/bench_fp8_epilogues.py``).

``concat_gelu_int8``: the same row rounded to the 16-bit dtype and quantized to int8 per row (the int8 linear's
per-token activation scale) in the same kernel, for an int8 ``proj_out``, where the unfused path wrote the 16-bit row
to memory and read it back in a second kernel. Rows up to 16,384 values wide are held whole in one program's registers
(each input read once); wider ones are read twice, for the row's largest value and again (from L2) for the cast.

GELU: the tanh form written as ``h * sigmoid(2 k (h + 0.044715 h^3))``, the sigmoid as one ``exp2`` and one
approximate reciprocal (rcp.approx, relative error ~2^-23, far below a bf16 or e4m3 output's rounding).

``qk_norm_rope``: FP8 attention's q or k from a fused projection's output: bias, RMSNorm per head, the interleaved
rotary embedding with each pair swapped in registers (``tl.split`` / ``tl.join``; inductor gathered the neighbour of
every element), K's mean, the static cast. 23 us per q or k at FLUX's shape inside the FP8 forward, where inductor's
kernel took 78 us for both.

``layernorm_modulate_cast``: AdaLN's ``LayerNorm(x) * (1 + scale) + shift`` for the rows of one or two streams (read in
place, not concatenated first), cast once per FP8 linear that reads it (up to three). 16 us per call at FLUX's shapes,
where inductor's kernels took 25-39 us. ``layernorm_modulate_int8``: the same rows quantized to int8 per row for the
int8 linears that read them (the row is whole in registers, so its largest value costs no second read). Its parts
form (``LAYERNORM_PARTS``, ``parts=True``) holds a width of one, three or five power-of-two blocks (FLUX's 3072 =
3 x 1024) as that many unpadded tiles, where the padded kernel computes the next power of two's lanes (4096) under
column masks, and takes each int8 value from the bits of one addition instead of ``_to_int8``'s two and a conversion.

Programmatic dependent launch (``pdl``, what inductor's ``triton.enable_pdl`` does for its own kernels): each kernel
waits for the kernels before it first thing and releases the next one after its loads, so on Hopper and newer the
GPU starts it while the previous kernel drains instead of after it.

Triton's interpreter (CI) rounds float32 -> e4m3 wrongly (127.9 -> 64 in Triton 3.9), so interpreted runs store the
scaled, saturated float32 value and the caller casts it with torch; compiled runs cast in the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_triton import INTERPRETED, _launcher, _on_device


def _pdl_launch(pdl: bool) -> dict:
    """The launch arguments for programmatic dependent launch (Hopper+): the kernel's PDL switch, which waits for
    the kernels before it at its start and lets the next one launch once its loads are issued, and Triton's
    ``launch_pdl``, which lets the GPU start it while the kernel before it drains. The interpreter runs no PTX."""
    return {"PDL": True, "launch_pdl": True} if pdl and not INTERPRETED else {"PDL": False}


@triton.jit
def _first_input_block(a_ptr, a_scale_ptr, rows, row_ok, first, cols, stride_a_row, stride_a_head,
                       A_HEAD: tl.constexpr, A_SCALED: tl.constexpr):
    """Columns [first, first + block) of the first input, float32; the block lies in one head. The first input may
    be (rows, heads, head dim) with any row / head strides (an attention output)."""
    head = first // A_HEAD
    a = a_ptr + rows * stride_a_row + head * stride_a_head + (first - head * A_HEAD) + cols
    y = tl.load(a, mask=row_ok, other=0.0).to(tl.float32)
    if A_SCALED:
        y = y * tl.load(a_scale_ptr)
    return y


@triton.jit
def _gelu_block(h_ptr, bias_ptr, rows, row_ok, c, stride_h_row, HAS_BIAS: tl.constexpr, APPROX: tl.constexpr,
                TANH: tl.constexpr = False):
    """gelu_tanh(h + bias) of columns ``c`` of h, float32 (``TANH``: see ``_gelu``)."""
    h = tl.load(h_ptr + rows * stride_h_row + c, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(bias_ptr + c).to(tl.float32)
    return _gelu(h, APPROX, TANH)


@triton.jit
def _sigmoid_gelu(h, APPROX: tl.constexpr):
    """gelu_tanh(h) for float32 h, as h * sigmoid(2 sqrt(2 / pi) (h + 0.044715 h^3))."""
    # exp(-2 sqrt(2 / pi) z) as 2^(-log2(e) 2 sqrt(2 / pi) z)
    e = tl.exp2(-2.302208198144325 * (h + 0.044715 * h * h * h))
    if APPROX:
        y = h * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e],
                                          dtype=tl.float32, is_pure=True, pack=1)
    else:  # the interpreter runs no PTX
        y = h / (1.0 + e)
    return y


@triton.jit
def _gelu(h, APPROX: tl.constexpr, TANH: tl.constexpr):
    """gelu_tanh(h) for float32 h: the sigmoid form, or with ``TANH`` (int8 outputs only) 0.5 h (1 + tanh(u)) with
    the hardware's tanh (``tanh.approx.f32``, one special-function instruction where the sigmoid form takes two). Its
    error (about 2^-11 relative to tanh) stays absolute in 1 + tanh, so a small negative GELU value (tanh near -1) can
    lose its leading digits: this form is only for values quantized to int8 per row, where the error, at most
    0.5 |h| 2^-11, is measured against the row's int8 step (its largest value / 127; benchmarks/bench_fp8_epilogues.py
    reports the int8 values it moves).
    The interpreter (no PTX) evaluates the same expression with an exact tanh."""
    if TANH:
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)  # sqrt(2 / pi) (h + 0.044715 h^3)
        if APPROX:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True,
                                          pack=1)
        else:
            e = tl.exp(-2.0 * tl.abs(u))  # tanh(|u|) = (1 - e^-2|u|) / (1 + e^-2|u|), no overflow
            t = tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        y = 0.5 * h * (1.0 + t)
    else:
        y = _sigmoid_gelu(h, APPROX)
    return y


@triton.jit
def _concat_gelu_kernel(
    a_ptr, a_scale_ptr, h_ptr, bias_ptr, inverse_ptr, out_ptr, n_rows,
    stride_a_row, stride_a_head, stride_h_row,
    A_COLS: tl.constexpr, A_HEAD: tl.constexpr, H_COLS: tl.constexpr,
    A_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, CAST: tl.constexpr, APPROX: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched early (programmatic dependent launch): wait for the kernels this one reads from
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < n_rows)[:, None]
    rows = rows.to(tl.int64)[:, None]
    first = tl.program_id(1) * BLOCK
    cols = tl.arange(0, BLOCK)[None, :]
    if first < A_COLS:
        y = _first_input_block(a_ptr, a_scale_ptr, rows, row_ok, first, cols, stride_a_row, stride_a_head,
                               A_HEAD, A_SCALED)
    else:
        y = _gelu_block(h_ptr, bias_ptr, rows, row_ok, first - A_COLS + cols, stride_h_row, HAS_BIAS, APPROX)
    if PDL:  # every input is read: the next kernel may launch
        tl.extra.cuda.gdc_launch_dependents()
    if CAST:
        y = tl.minimum(tl.maximum(y * tl.load(inverse_ptr), -448.0), 448.0)  # e4m3's largest finite value
    tl.store(out_ptr + rows * (A_COLS + H_COLS) + first + cols, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def _tile(a_cols: int, a_head: int, h_cols: int) -> tuple[int, int, int] | None:
    """(rows per program, column block, warps), or None when no power-of-two block divides both widths and the
    first input's head width. Measured on an H200 at FLUX's shape: 4 rows x 512 columns 54 us, 1 x 1024 63 us."""
    for block, rows, warps in ((512, 4, 4), (256, 8, 4), (128, 16, 4), (64, 32, 4), (32, 32, 2), (16, 32, 1)):
        if a_cols % block == 0 and h_cols % block == 0 and (a_head == a_cols or a_head % block == 0):
            return rows, block, warps
    return None


def supported(a_cols: int, a_head: int, h_cols: int) -> bool:
    return _tile(a_cols, a_head, h_cols) is not None


def concat_gelu(a: torch.Tensor | None, a_scale: torch.Tensor | None, h: torch.Tensor, bias: torch.Tensor | None,
                inverse: torch.Tensor | None, out_dtype: torch.dtype, tile: tuple[int, int, int] | None = None,
                pdl: bool = False) -> torch.Tensor:
    """a: (rows, heads, head dim) with stride(-1) == 1 or None, h: (rows, H) with stride(-1) == 1 -> (rows, A + H).
    ``tile``: (rows, column block, warps) instead of ``_tile``'s choice (the benchmark's sweep); ``pdl``: see
    ``_pdl_launch``."""
    n_rows, h_cols = h.shape
    heads, a_head = a.shape[1:] if a is not None else (0, 1)  # no first input: no column is its
    a_cols = heads * a_head
    rows, block, warps = tile or _tile(a_cols, a_head if a is not None else 0, h_cols)
    cast = inverse is not None
    store_dtype = torch.float32 if cast and INTERPRETED else out_dtype
    out = torch.empty(n_rows, a_cols + h_cols, dtype=store_dtype, device=h.device)
    if n_rows == 0:
        return out.to(out_dtype)
    grid = (triton.cdiv(n_rows, rows), (a_cols + h_cols) // block)
    with _on_device(h):
        _launcher(_concat_gelu_kernel, h.device)[grid](
            a if a is not None else h, a_scale if a_scale is not None else h, h, bias if bias is not None else h,
            inverse if cast else h, out, n_rows, a.stride(0) if a is not None else 0,
            a.stride(1) if a is not None else 0, h.stride(0),
            A_COLS=a_cols, A_HEAD=a_head, H_COLS=h_cols, A_SCALED=a_scale is not None, HAS_BIAS=bias is not None,
            CAST=cast, APPROX=not INTERPRETED, ROWS=rows, BLOCK=block, num_warps=warps, **_pdl_launch(pdl),
        )
    return out.to(out_dtype) if store_dtype != out_dtype else out


@triton.jit
def _as_16_bit(y, BF16: tl.constexpr, BIT_ROUND: tl.constexpr):
    """float32 ``y`` rounded to the 16-bit activation's dtype (to nearest even), as float32: the values the unfused
    path writes and then quantizes."""
    if BF16:
        if BIT_ROUND:  # the interpreter's float32 -> bf16 cast truncates: round the bits instead
            bits = y.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            rounded = bits.to(tl.float32, bitcast=True)
        else:
            rounded = y.to(tl.bfloat16).to(tl.float32)
    else:
        rounded = y.to(tl.float16).to(tl.float32)
    return rounded


@triton.jit
def _to_int8(y, scale, RECIPROCAL: tl.constexpr = False):
    """round(y / scale) clamped to +-127; the rounding (to nearest even) by adding and removing 1.5 * 2^23, which
    the interpreter runs too (libdevice's rint is PTX only). Clamping first is the same as clamping after: the
    bounds are integers. ``RECIPROCAL``: y times the row's correctly rounded 1 / scale, where ``/`` is the GPU's
    approximate division (a special-function instruction per value); both are within an ulp or two of the exact
    quotient, so an int8 value differs only at a rounding tie."""
    if RECIPROCAL:
        q = y * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    else:
        q = y / scale
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return ((q + 12582912.0) - 12582912.0).to(tl.int8)


@triton.jit
def _concat_gelu_int8_kernel(
    a_ptr, a_scale_ptr, h_ptr, bias_ptr, out_ptr, scale_ptr, n_rows,
    stride_a_row, stride_a_head, stride_h_row,
    A_COLS: tl.constexpr, A_HEAD: tl.constexpr, H_COLS: tl.constexpr,
    A_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, APPROX: tl.constexpr, BF16: tl.constexpr,
    ROWS: tl.constexpr, A_BLOCK: tl.constexpr, H_BLOCK: tl.constexpr, PDL: tl.constexpr,
    GELU_TANH: tl.constexpr = False, RECIPROCAL: tl.constexpr = False,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    row_ids = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (row_ids < n_rows)[:, None]
    rows = row_ids.to(tl.int64)[:, None]
    a_cols = tl.arange(0, A_BLOCK)[None, :]
    h_cols = tl.arange(0, H_BLOCK)[None, :]
    # pass 1: each row's largest |value| (of the 16-bit values the unfused path would quantize)
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for first in tl.range(0, A_COLS, A_BLOCK):
        y = _first_input_block(a_ptr, a_scale_ptr, rows, row_ok, first, a_cols, stride_a_row, stride_a_head,
                               A_HEAD, A_SCALED)
        amax = tl.maximum(amax, tl.max(tl.abs(_as_16_bit(y, BF16, not APPROX)), axis=1))
    for first in tl.range(0, H_COLS, H_BLOCK):
        y = _gelu_block(h_ptr, bias_ptr, rows, row_ok, first + h_cols, stride_h_row, HAS_BIAS, APPROX, GELU_TANH)
        amax = tl.maximum(amax, tl.max(tl.abs(_as_16_bit(y, BF16, not APPROX)), axis=1))
    scale = tl.maximum(amax, 1e-12) / 127.0
    tl.store(scale_ptr + row_ids, scale, mask=row_ids < n_rows)
    scale = scale[:, None]
    # pass 2: the same values again (their inputs are still in L2) and the int8 store
    out = out_ptr + rows * (A_COLS + H_COLS)
    for first in tl.range(0, A_COLS, A_BLOCK):
        y = _first_input_block(a_ptr, a_scale_ptr, rows, row_ok, first, a_cols, stride_a_row, stride_a_head,
                               A_HEAD, A_SCALED)
        tl.store(out + first + a_cols, _to_int8(_as_16_bit(y, BF16, not APPROX), scale, RECIPROCAL), mask=row_ok)
    for first in tl.range(0, H_COLS, H_BLOCK):
        y = _gelu_block(h_ptr, bias_ptr, rows, row_ok, first + h_cols, stride_h_row, HAS_BIAS, APPROX, GELU_TANH)
        y = _to_int8(_as_16_bit(y, BF16, not APPROX), scale, RECIPROCAL)
        tl.store(out + A_COLS + first + h_cols, y, mask=row_ok)
    if PDL:  # at the end: launched earlier, the next kernel's waiting programs would share the SMs with pass 2
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _concat_gelu_int8_row_kernel(
    a_ptr, a_scale_ptr, h_ptr, bias_ptr, out_ptr, scale_ptr,
    stride_a_row, stride_a_head, stride_h_row,
    A_COLS: tl.constexpr, A_HEAD: tl.constexpr, H_COLS: tl.constexpr,
    A_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, APPROX: tl.constexpr, BF16: tl.constexpr,
    WIDTH: tl.constexpr, PDL: tl.constexpr, GELU_TANH: tl.constexpr = False, RECIPROCAL: tl.constexpr = False,
):
    """``_concat_gelu_int8_kernel`` in one pass: a program holds its whole row (``WIDTH``, the power of two at or
    above A + H) in registers, so each input is read once from memory and the GELU computed once."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, WIDTH)
    in_a = col < A_COLS
    in_h = (col >= A_COLS) & (col < A_COLS + H_COLS)
    head = col // A_HEAD
    a = tl.load(a_ptr + row * stride_a_row + head * stride_a_head + (col - head * A_HEAD), mask=in_a,
                other=0.0).to(tl.float32)
    if A_SCALED:
        a = a * tl.load(a_scale_ptr)
    h_col = col - A_COLS  # negative in the first input's columns, which the mask leaves out
    h = tl.load(h_ptr + row * stride_h_row + h_col, mask=in_h, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(bias_ptr + h_col, mask=in_h, other=0.0).to(tl.float32)
    if PDL:  # every input is read: the next kernel may launch
        tl.extra.cuda.gdc_launch_dependents()
    y = _as_16_bit(tl.where(in_a, a, _gelu(h, APPROX, GELU_TANH)), BF16, not APPROX)
    scale = tl.maximum(tl.max(tl.abs(tl.where(in_a | in_h, y, 0.0)), axis=0), 1e-12) / 127.0
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * (A_COLS + H_COLS) + col, _to_int8(y, scale, RECIPROCAL), mask=in_a | in_h)


# The widest row the one-pass kernel holds in registers (64 float32 values per thread at 8 warps). At FLUX's
# single-block width (3,072 + 12,288) it reads each input once where the two-pass kernel read it twice.
ROW_KERNEL_MAX_WIDTH = 16384


def _row_kernel_launch(a_cols: int, h_cols: int) -> tuple[int, int] | None:
    """(the row's power-of-two register width, warps) of the one-pass kernel, or None when the row is wider."""
    width = triton.next_power_of_2(a_cols + h_cols)
    if width > ROW_KERNEL_MAX_WIDTH:
        return None
    return width, max(1, min(8, width // 2048))


def _largest_block(widths: tuple[int, ...], most: int = 1024) -> int | None:
    """The largest power-of-two column block (16 to ``most``) that divides every width, or None."""
    return next((b for b in (1024, 512, 256, 128, 64, 32, 16) if b <= most and all(w % b == 0 for w in widths)),
                None)


def _int8_tile(a_cols: int, a_head: int, h_cols: int) -> tuple[int, int, int, int] | None:
    """(rows per program, first input's column block, GELU column block, warps), or None. A block of the first input
    stays inside one head where heads are strided apart."""
    h_block = _largest_block((h_cols,))
    a_block = _largest_block((a_cols,) if a_head in (0, a_cols) else (a_cols, a_head)) if a_cols else 16
    if h_block is None or a_block is None:
        return None
    return 1, a_block, h_block, 4


def int8_supported(a_cols: int, a_head: int, h_cols: int) -> bool:
    return _row_kernel_launch(a_cols, h_cols) is not None or _int8_tile(a_cols, a_head, h_cols) is not None


def concat_gelu_int8(a: torch.Tensor | None, a_scale: torch.Tensor | None, h: torch.Tensor, bias: torch.Tensor | None,
                     dtype: torch.dtype, tile: tuple[int, int, int, int] | None = None,
                     pdl: bool = False, one_pass: bool = True, row_warps: int | None = None,
                     gelu_tanh: bool = False, reciprocal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``concat_gelu`` in ``dtype`` (bf16 / fp16), then each row to int8 with its own scale (kernels/int8.py's
    ``quantize_rows_int8``) in the same kernel: (int8 (rows, A + H), scale (rows, 1) float32). The 16-bit row is
    never written. Rows up to ``ROW_KERNEL_MAX_WIDTH`` wide go to the one-pass kernel, which reads each input once
    (with ``one_pass`` False, only those whose widths the two-pass kernel cannot tile); the others (or a ``tile``:
    (rows, first input's block, GELU block, warps)) to the two-pass kernel, which reads them twice, for the row's
    largest value and then for the cast. ``row_warps``: the
    one-pass kernel's warps instead of ``_row_kernel_launch``'s choice (the benchmark's sweep). ``gelu_tanh``: the
    GELU by the hardware's tanh (``_gelu``); ``reciprocal``: values times each row's 1 / scale instead of
    divided by it (``_to_int8``); both spare special-function instructions."""
    n_rows, h_cols = h.shape
    heads, a_head = a.shape[1:] if a is not None else (0, 0)
    a_cols = heads * a_head
    out = torch.empty(n_rows, a_cols + h_cols, dtype=torch.int8, device=h.device)
    scale = torch.empty(n_rows, 1, dtype=torch.float32, device=h.device)
    if n_rows == 0:
        return out, scale
    row_launch = _row_kernel_launch(a_cols, h_cols) if tile is None else None
    if row_launch is not None and not one_pass and _int8_tile(a_cols, a_head, h_cols) is not None:
        row_launch = None  # the two-pass kernel, asked for and able to tile these widths
    if row_launch is not None:
        width, warps = row_launch[0], row_warps or row_launch[1]
        with _on_device(h):
            _launcher(_concat_gelu_int8_row_kernel, h.device)[(n_rows,)](
                a if a is not None else h, a_scale if a_scale is not None else h, h, bias if bias is not None else h,
                out, scale, a.stride(0) if a is not None else 0, a.stride(1) if a is not None else 0, h.stride(0),
                A_COLS=a_cols, A_HEAD=max(a_head, 1), H_COLS=h_cols, A_SCALED=a_scale is not None,
                HAS_BIAS=bias is not None, APPROX=not INTERPRETED, BF16=dtype == torch.bfloat16, WIDTH=width,
                GELU_TANH=gelu_tanh, RECIPROCAL=reciprocal, num_warps=warps, **_pdl_launch(pdl),
            )
        return out, scale
    rows, a_block, h_block, warps = tile or _int8_tile(a_cols, a_head, h_cols)
    with _on_device(h):
        _launcher(_concat_gelu_int8_kernel, h.device)[(triton.cdiv(n_rows, rows),)](
            a if a is not None else h, a_scale if a_scale is not None else h, h, bias if bias is not None else h,
            out, scale, n_rows, a.stride(0) if a is not None else 0, a.stride(1) if a is not None else 0,
            h.stride(0), A_COLS=a_cols, A_HEAD=max(a_head, 1), H_COLS=h_cols, A_SCALED=a_scale is not None,
            HAS_BIAS=bias is not None, APPROX=not INTERPRETED, BF16=dtype == torch.bfloat16, ROWS=rows,
            A_BLOCK=a_block, H_BLOCK=h_block, GELU_TANH=gelu_tanh, RECIPROCAL=reciprocal, num_warps=warps,
            **_pdl_launch(pdl),
        )
    return out, scale


@triton.jit
def _normed_rows(src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, sample, position, head, ok, seq, stride_src,
                 first_col, stride_src2, first_col2, tokens_a, eps, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                 TWO: tl.constexpr):
    """RMSNorm of one head's D columns of a fused projection's output, in float32, for the rows given as (sample,
    position in the sequence, head) columns (int64, ROWS x 1) under the mask ``ok``; with TWO, each sample's first
    tokens_a positions are src's rows and the rest src2's (a joint block's text and image streams), each stream
    with its own bias and norm weight."""
    d = tl.arange(0, D)[None, :]
    if TWO:
        in_a = position < tokens_a
        col_a, col_b = first_col + head * D + d, first_col2 + head * D + d
        x = tl.load(src_ptr + (sample * tokens_a + position) * stride_src + col_a, mask=ok & in_a, other=0.0)
        x += tl.load(src2_ptr + (sample * (seq - tokens_a) + position - tokens_a) * stride_src2 + col_b,
                     mask=ok & ~in_a, other=0.0)
        x = x.to(tl.float32)
        if HAS_BIAS:
            x += tl.where(in_a, tl.load(bias_ptr + col_a).to(tl.float32), tl.load(bias2_ptr + col_b).to(tl.float32))
        weight = tl.where(in_a, tl.load(w_ptr + d).to(tl.float32), tl.load(w2_ptr + d).to(tl.float32))
    else:
        col = first_col + head * D + d
        x = tl.load(src_ptr + (sample * seq + position) * stride_src + col, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_ptr + col).to(tl.float32)
        weight = tl.load(w_ptr + d).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    return x * rstd * weight


@triton.jit
def _rotary_tile(cos_ptr, sin_ptr, position, ok, D: tl.constexpr):
    """The rotary tables' (S, D) rows at ``position`` (ROWS x 1, int64) under the mask ``ok``, float32."""
    d = tl.arange(0, D)[None, :]
    return (tl.load(cos_ptr + position * D + d, mask=ok, other=0.0).to(tl.float32),
            tl.load(sin_ptr + position * D + d, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _rotated(y, c, s, ROWS: tl.constexpr, D: tl.constexpr):
    """The rotary embedding on interleaved pairs: y * cos + swap(y) * sin * (-1, +1, ...), the swap in registers."""
    even, odd = tl.split(tl.reshape(y, (ROWS, D // 2, 2)))
    swapped = tl.reshape(tl.join(odd, even), (ROWS, D))
    return y * c + swapped * (s * ((tl.arange(0, D)[None, :] % 2) * 2 - 1).to(tl.float32))


@triton.jit
def _qk_norm_rope_kernel(
    src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, cos_ptr, sin_ptr, k_mean_ptr, inverse_ptr, out_ptr,
    n_rows, seq, stride_src, first_col, stride_src2, first_col2, tokens_a, eps,
    HEADS: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MEAN: tl.constexpr, CAST: tl.constexpr,
    TWO: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr, SHARED_TOKEN: tl.constexpr = False,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    # rows are (token, head) pairs of one part (q or k) of a fused projection's output: row = token * HEADS + head
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = (rows < n_rows)[:, None]
    token = (rows // HEADS).to(tl.int64)[:, None]
    head = (rows % HEADS)[:, None]
    d = tl.arange(0, D)[None, :]
    position = token % seq
    y = _normed_rows(src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, token // seq, position, head, ok, seq,
                     stride_src, first_col, stride_src2, first_col2, tokens_a, eps, D, HAS_BIAS, TWO)
    if SHARED_TOKEN:  # ROWS divides HEADS: the program's rows are heads of one token, which share cos and sin
        first = ((tl.program_id(0) * ROWS) // HEADS).to(tl.int64) % seq
        c = tl.broadcast_to(tl.load(cos_ptr + first * D + d).to(tl.float32), (ROWS, D))
        s = tl.broadcast_to(tl.load(sin_ptr + first * D + d).to(tl.float32), (ROWS, D))
    else:
        c, s = _rotary_tile(cos_ptr, sin_ptr, position, ok, D)
    out = _rotated(y, c, s, ROWS, D)
    if HAS_MEAN:
        out -= tl.load(k_mean_ptr + head * D + d)
    if CAST:
        out = tl.minimum(tl.maximum(out * tl.load(inverse_ptr), -448.0), 448.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + d, out.to(out_ptr.dtype.element_ty), mask=ok)


# Whether qk_norm_rope's programs load a token's cos / sin once for its heads (a broadcast across the program's rows)
# rather than once per row (vector loads that hit the cache after the first). Off: slower in the FLUX forward on an
# H200, the kernel's profiled time 3.21 against 2.69 ms per step (bench_peers_h200_flux_int8_ab_20261206.json); the
# broadcast lowers to scalar loads and a layout change.
QK_SHARED_ROTARY = False


def qk_norm_rope_supported(head_dim: int) -> bool:
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0  # tl.arange needs a power of two


def qk_norm_rope(src: torch.Tensor, bias: torch.Tensor | None, first_col: int, heads: int, weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, k_mean: torch.Tensor | None,
                 inverse: torch.Tensor | None, pdl: bool = False,
                 out_dtype: torch.dtype = torch.float8_e4m3fn, second: tuple | None = None,
                 share_rotary: bool | None = None) -> torch.Tensor:
    """src (rows, C) with stride(-1) == 1, columns [first_col, first_col + heads * D) of it -> (rows, heads, D):
    RMSNorm per head, interleaved rotary embedding with cos / sin (S, D) (row r is token r % S), K's mean
    subtracted, static cast to e4m3 with ``inverse``; without it, the float32 result rounded to ``out_dtype``.
    ``second``: (src2, bias2, first_col2, weight2, tokens_a): each sample's first tokens_a tokens are src's rows, its
    other S - tokens_a tokens src2's, normalized with weight2 (a joint block's two streams). ``share_rotary``
    (default ``QK_SHARED_ROTARY``): where a program's rows are heads of one token (its row count divides the heads),
    load that token's cos / sin once and broadcast them instead of loading them for every row."""
    share_rotary = QK_SHARED_ROTARY if share_rotary is None else share_rotary
    d = weight.numel()
    if second is not None and (bias is None) != (second[1] is None):  # the kernel has one bias switch for both
        raise ValueError("qk_norm_rope: give both streams a bias or neither")
    src2, bias2, first_col2, weight2, tokens_a = second if second is not None else (src, bias, 0, weight, 0)
    n_rows = (src.shape[0] + (src2.shape[0] if second is not None else 0)) * heads
    cast = inverse is not None
    out_dtype = torch.float8_e4m3fn if cast else out_dtype
    store_dtype = torch.float32 if INTERPRETED else out_dtype  # the interpreter's e4m3 and bf16 casts are off
    out = torch.empty(n_rows // heads, heads, d, dtype=store_dtype, device=src.device)
    if n_rows:
        rows = 8  # 8 (token, head) rows of 128 per program, 4 warps: 44 us at FLUX's q or k (bench_fp8_epilogues.py)
        with _on_device(src):
            _launcher(_qk_norm_rope_kernel, src.device)[(triton.cdiv(n_rows, rows),)](
                src, bias if bias is not None else src, weight, src2, bias2 if bias2 is not None else src2, weight2,
                cos, sin, k_mean if k_mean is not None else cos, inverse if cast else cos, out, n_rows, cos.shape[0],
                src.stride(0), first_col, src2.stride(0), first_col2, tokens_a, float(eps),
                HEADS=heads, D=d, HAS_BIAS=bias is not None, HAS_MEAN=k_mean is not None, CAST=cast,
                TWO=second is not None, ROWS=rows, SHARED_TOKEN=share_rotary and heads % rows == 0, num_warps=4,
                **_pdl_launch(pdl),
            )
    return out.to(out_dtype) if store_dtype != out_dtype else out


@triton.jit
def _modulated_norm_rows(a_ptr, b_ptr, scale_ptr, shift_ptr, n_rows, rows_a, eps,
                         C: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                         PDL: tl.constexpr):
    """LayerNorm(x) * (1 + scale) + shift of this program's ``ROWS`` rows in float32: (y, mask, rows as int64 (ROWS,
    1), cols (BLOCK,)). Rows [0, rows_a) come from a, the rest from b (the text and image streams a block
    concatenates); ROWS divides rows_a, so a program reads one of them."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    first = tl.program_id(0) * ROWS
    rows = first + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < C)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if SPLIT and first >= rows_a:
        x = tl.load(b_ptr + (rows64 - rows_a) * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(a_ptr + rows64 * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1)[:, None] / C
    centered = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1)[:, None] / C + eps)
    scale = tl.load(scale_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    shift = tl.load(shift_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    return centered * rstd * (1.0 + scale) + shift, mask, rows64, cols


@triton.jit
def _layernorm_modulate_cast_kernel(
    a_ptr, b_ptr, scale_ptr, shift_ptr, inverse0_ptr, inverse1_ptr, inverse2_ptr, out_ptr,
    n_rows, rows_a, eps,
    C: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, COUNT: tl.constexpr,
    PDL: tl.constexpr,
):
    y, mask, rows64, cols = _modulated_norm_rows(a_ptr, b_ptr, scale_ptr, shift_ptr, n_rows, rows_a, eps,
                                                 C, BLOCK, ROWS, SPLIT, PDL)
    out = out_ptr + rows64 * C + cols[None, :]
    q = tl.minimum(tl.maximum(y * tl.load(inverse0_ptr), -448.0), 448.0)
    tl.store(out, q.to(out_ptr.dtype.element_ty), mask=mask)
    if COUNT > 1:  # more linears read the same normalized rows, each with its own scale
        q = tl.minimum(tl.maximum(y * tl.load(inverse1_ptr), -448.0), 448.0)
        tl.store(out + n_rows * C, q.to(out_ptr.dtype.element_ty), mask=mask)
    if COUNT > 2:
        q = tl.minimum(tl.maximum(y * tl.load(inverse2_ptr), -448.0), 448.0)
        tl.store(out + 2 * n_rows * C, q.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layernorm_modulate_int8_kernel(
    a_ptr, b_ptr, scale_ptr, shift_ptr, out_ptr, row_scale_ptr,
    n_rows, rows_a, eps,
    C: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, BF16: tl.constexpr,
    APPROX: tl.constexpr, PDL: tl.constexpr, RECIPROCAL: tl.constexpr = False,
):
    """The int8 form: each row rounded to the 16-bit dtype, then to int8 with its own scale (the int8 linears'
    per-token activation quantization), the row's largest value taken in registers."""
    y, mask, rows64, cols = _modulated_norm_rows(a_ptr, b_ptr, scale_ptr, shift_ptr, n_rows, rows_a, eps,
                                                 C, BLOCK, ROWS, SPLIT, PDL)
    y = _as_16_bit(y, BF16, not APPROX)
    row_scale = tl.maximum(tl.max(tl.abs(tl.where(mask, y, 0.0)), axis=1), 1e-12) / 127.0
    tl.store(row_scale_ptr + rows64, row_scale[:, None], mask=rows64 < n_rows)
    tl.store(out_ptr + rows64 * C + cols[None, :], _to_int8(y, row_scale[:, None], RECIPROCAL), mask=mask)


@triton.jit
def _row_part(src_ptr, rows, row_ok, P: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
              EVEN_ROWS: tl.constexpr):
    """Columns [P * BLOCK, (P + 1) * BLOCK) of rows ``rows`` ((ROWS, 1) int64) of ``src_ptr``, float32; rows past
    the end read as 0 (no mask at all with ``EVEN_ROWS``: every program's rows are there)."""
    ptrs = src_ptr + rows * C + P * BLOCK + tl.arange(0, BLOCK)[None, :]
    if EVEN_ROWS:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=row_ok, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _parts_sum(x0, x1, x2, x3, x4, PARTS: tl.constexpr):
    """The row sums of the first ``PARTS`` tiles, (ROWS, 1): added tile to tile first, so one reduction (one pass
    through shared memory) serves them all."""
    total = x0
    if PARTS > 1:
        total += x1
    if PARTS > 2:
        total += x2
    if PARTS > 3:
        total += x3
    if PARTS > 4:
        total += x4
    return tl.sum(total, axis=1)[:, None]


@triton.jit
def _parts_abs_max(y0, y1, y2, y3, y4, PARTS: tl.constexpr):
    """The rows' largest magnitude over the first ``PARTS`` tiles, (ROWS,); max is exact, so the order is free."""
    top = tl.abs(y0)
    if PARTS > 1:
        top = tl.maximum(top, tl.abs(y1))
    if PARTS > 2:
        top = tl.maximum(top, tl.abs(y2))
    if PARTS > 3:
        top = tl.maximum(top, tl.abs(y3))
    if PARTS > 4:
        top = tl.maximum(top, tl.abs(y4))
    return tl.max(top, axis=1)


@triton.jit
def _as_bf16_pairs(y):
    """``_as_16_bit``'s bf16 rounding on the GPU, two values per conversion (cvt.rn.bf16x2.f32 rounds each as
    cvt.rn.bf16.f32 does), each widened back to float32 by a shift or a mask of the pair's register."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 pair; cvt.rn.bf16x2.f32 pair, $3, $2; shl.b32 $0, pair, 16; and.b32 $1, pair, 0xffff0000; }",
        "=r,=r,r,r", [y], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _modulated_part(centered, rstd, scale_ptr, shift_ptr, P: tl.constexpr, BLOCK: tl.constexpr,
                    BF16: tl.constexpr, APPROX: tl.constexpr):
    """Tile P of ``_modulated_norm_rows``' value, the same operations in the same order (so the same float32
    bits), rounded to the 16-bit dtype (``_as_16_bit``; bf16 on the GPU two values at a time)."""
    # loaded as (ROWS, BLOCK), the values' shape, so the load takes their layout: a (BLOCK,) load took another
    # one and went through shared memory (a barrier per conversion) to reach theirs
    cols = tl.broadcast_to(P * BLOCK + tl.arange(0, BLOCK)[None, :], centered.shape)
    scale = tl.load(scale_ptr + cols).to(tl.float32)
    shift = tl.load(shift_ptr + cols).to(tl.float32)
    y = centered * rstd * (1.0 + scale) + shift
    if BF16 and APPROX:  # the interpreter runs no PTX
        y = _as_bf16_pairs(y)
    else:
        y = _as_16_bit(y, BF16, not APPROX)
    return y


@triton.jit
def _store_int8_part(out_ptr, rows, row_ok, y, multiplier, P: tl.constexpr, C: tl.constexpr,
                     BLOCK: tl.constexpr, EVEN_ROWS: tl.constexpr, RECIPROCAL: tl.constexpr):
    """Tile P of the rows as ``_to_int8`` rounds it (``multiplier``: the row's scale, or with ``RECIPROCAL`` its
    correctly rounded reciprocal), without its subtraction and float -> int conversion: once 1.5 * 2^23 is added,
    the float's unit is 1 and its mantissa holds 2^22 + round(q), so the low byte of its bits is round(q) in two's
    complement (q is within +-127 after the clamp), the same int8 as ``_to_int8``'s, bit for bit."""
    if RECIPROCAL:
        q = y * multiplier
    else:
        q = y / multiplier
    # a no-op for finite q (127 and a few ulps at most), kept so that NaN and inf give _to_int8's values too
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    q8 = (q + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
    ptrs = out_ptr + rows * C + P * BLOCK + tl.arange(0, BLOCK)[None, :]
    if EVEN_ROWS:
        tl.store(ptrs, q8)
    else:
        tl.store(ptrs, q8, mask=row_ok)


@triton.jit
def _layernorm_modulate_int8_parts_kernel(
    a_ptr, b_ptr, scale_ptr, shift_ptr, out_ptr, row_scale_ptr,
    n_rows, rows_a, eps,
    C: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_ROWS: tl.constexpr, BF16: tl.constexpr, APPROX: tl.constexpr, PDL: tl.constexpr,
    RECIPROCAL: tl.constexpr = False,
):
    """``_layernorm_modulate_int8_kernel`` for C = PARTS x BLOCK (PARTS <= 5, BLOCK a power of two): each row as
    PARTS unpadded (ROWS, BLOCK) tiles x0..x4 (Triton holds no list of tensors; the names past PARTS are aliases
    standing for x0: what they compute is left out of every sum, max and store, and the compiler drops it), so no
    lane computes padding and no column needs a mask. Per value the same float32 operations as the padded kernel;
    its sums add the tiles first, another order (see ``layernorm_modulate_int8``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    first = tl.program_id(0) * ROWS
    rows = first + tl.arange(0, ROWS)
    row_ok = (rows < n_rows)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    src_ptr = a_ptr
    src_rows = rows64
    if SPLIT:
        if first >= rows_a:  # ROWS divides rows_a: the program's rows all come from b
            src_ptr = b_ptr
            src_rows = rows64 - rows_a
    x0 = _row_part(src_ptr, src_rows, row_ok, 0, C, BLOCK, EVEN_ROWS)
    x1 = _row_part(src_ptr, src_rows, row_ok, 1, C, BLOCK, EVEN_ROWS) if PARTS > 1 else x0
    x2 = _row_part(src_ptr, src_rows, row_ok, 2, C, BLOCK, EVEN_ROWS) if PARTS > 2 else x0
    x3 = _row_part(src_ptr, src_rows, row_ok, 3, C, BLOCK, EVEN_ROWS) if PARTS > 3 else x0
    x4 = _row_part(src_ptr, src_rows, row_ok, 4, C, BLOCK, EVEN_ROWS) if PARTS > 4 else x0
    mean = _parts_sum(x0, x1, x2, x3, x4, PARTS) / C
    c0 = x0 - mean
    c1 = x1 - mean
    c2 = x2 - mean
    c3 = x3 - mean
    c4 = x4 - mean
    rstd = tl.rsqrt(_parts_sum(c0 * c0, c1 * c1, c2 * c2, c3 * c3, c4 * c4, PARTS) / C + eps)
    y0 = _modulated_part(c0, rstd, scale_ptr, shift_ptr, 0, BLOCK, BF16, APPROX)
    y1 = _modulated_part(c1, rstd, scale_ptr, shift_ptr, 1, BLOCK, BF16, APPROX) if PARTS > 1 else y0
    y2 = _modulated_part(c2, rstd, scale_ptr, shift_ptr, 2, BLOCK, BF16, APPROX) if PARTS > 2 else y0
    y3 = _modulated_part(c3, rstd, scale_ptr, shift_ptr, 3, BLOCK, BF16, APPROX) if PARTS > 3 else y0
    y4 = _modulated_part(c4, rstd, scale_ptr, shift_ptr, 4, BLOCK, BF16, APPROX) if PARTS > 4 else y0
    if PDL:  # every input is read: the next kernel may launch
        tl.extra.cuda.gdc_launch_dependents()
    row_scale = tl.maximum(_parts_abs_max(y0, y1, y2, y3, y4, PARTS), 1e-12)[:, None] / 127.0
    if EVEN_ROWS:
        tl.store(row_scale_ptr + rows64, row_scale)
    else:
        tl.store(row_scale_ptr + rows64, row_scale, mask=row_ok)
    if RECIPROCAL:  # once per row, as _to_int8 does
        multiplier = tl.math.div_rn(tl.full(row_scale.shape, 1.0, tl.float32), row_scale)
    else:
        multiplier = row_scale
    _store_int8_part(out_ptr, rows64, row_ok, y0, multiplier, 0, C, BLOCK, EVEN_ROWS, RECIPROCAL)
    if PARTS > 1:
        _store_int8_part(out_ptr, rows64, row_ok, y1, multiplier, 1, C, BLOCK, EVEN_ROWS, RECIPROCAL)
    if PARTS > 2:
        _store_int8_part(out_ptr, rows64, row_ok, y2, multiplier, 2, C, BLOCK, EVEN_ROWS, RECIPROCAL)
    if PARTS > 3:
        _store_int8_part(out_ptr, rows64, row_ok, y3, multiplier, 3, C, BLOCK, EVEN_ROWS, RECIPROCAL)
    if PARTS > 4:
        _store_int8_part(out_ptr, rows64, row_ok, y4, multiplier, 4, C, BLOCK, EVEN_ROWS, RECIPROCAL)


def layernorm_modulate_rows(rows_a: int) -> int | None:
    """Rows per program that divide the first stream's rows (a program reads one stream), or None."""
    return next((r for r in (2, 1) if rows_a % r == 0), None)


def layernorm_modulate_cast(a: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor, shift: torch.Tensor,
                            eps: float, inverses: list[torch.Tensor], pdl: bool = False) -> torch.Tensor:
    """LayerNorm (no affine) of the rows of a then b ((rows, C), contiguous), * (1 + scale) + shift ((C,) views),
    cast to e4m3 once per inverse scale: (len(inverses), rows, C)."""
    c = a.shape[-1]
    n_rows = a.shape[0] + (b.shape[0] if b is not None else 0)
    store_dtype = torch.float32 if INTERPRETED else torch.float8_e4m3fn
    out = torch.empty(len(inverses), n_rows, c, dtype=store_dtype, device=a.device)
    rows = layernorm_modulate_rows(a.shape[0]) if b is not None else 2
    if n_rows:
        with _on_device(a):
            _launcher(_layernorm_modulate_cast_kernel, a.device)[(triton.cdiv(n_rows, rows),)](
                a, b if b is not None else a, scale, shift, inverses[0], inverses[min(1, len(inverses) - 1)],
                inverses[-1], out, n_rows, a.shape[0], float(eps), C=c, BLOCK=triton.next_power_of_2(c), ROWS=rows,
                SPLIT=b is not None, COUNT=len(inverses), num_warps=8, **_pdl_launch(pdl),
            )
    return out.to(torch.float8_e4m3fn) if store_dtype != torch.float8_e4m3fn else out


# layernorm_modulate_int8 through the parts kernel where C allows it. Measured on an H100 at FLUX's shape (4608 x 3072,
# 512 + 4096 rows, graph replay over copies larger than L2): 19.6 us per call at its default tile against 26.9 us for
# the padded kernel's (bench_fp8_epilogues_h100_lnparts_20261207.json); False: the padded kernel (the A side).
LAYERNORM_PARTS = True
# The parts kernel's (rows per program, warps) when no tile is given: the fastest of that sweep (19.6 us; 21.0-28.0
# for the other five tiles)
PARTS_TILE = (1, 4)


def layernorm_parts(c: int) -> tuple[int, int] | None:
    """(parts, block) with c = parts x block, block a power of two of at least 16 and parts 1, 3 or 5 (an even count
    is a wider power-of-two block): FLUX's 3072 = 3 x 1024, SD3's 1536 = 3 x 512, Wan's 5120 = 5 x 1024. None for
    widths the parts kernel does not take."""
    for parts in (1, 3, 5):
        block = c // parts
        if c % parts == 0 and block >= 16 and block & (block - 1) == 0:
            return parts, block
    return None


def layernorm_modulate_int8(a: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor, shift: torch.Tensor,
                            eps: float, dtype: torch.dtype, pdl: bool = False, reciprocal: bool = False,
                            tile: tuple[int, int] | None = None,
                            parts: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``layernorm_modulate_cast``'s rows rounded to ``dtype`` and quantized to int8 per row (kernels/int8.py's
    ``quantize_rows_int8``): (int8 (rows, C), scale (rows, 1) float32). ``reciprocal``: see ``_to_int8``; ``tile``:
    (rows per program, warps) instead of the default (``PARTS_TILE`` for the parts kernel, else 2 rows and 8 warps;
    the benchmark's sweep); its rows must divide a's. ``parts``
    (None: ``LAYERNORM_PARTS``): ``_layernorm_modulate_int8_parts_kernel`` where ``layernorm_parts`` splits C, else
    the padded kernel. Both do the same float32 operations per value; their row sums add in another order, so where
    a float32 sum rounds differently a value at a bf16 or int8 rounding boundary may move one step (as between the
    padded kernel's own tiles, whose reduction order follows the tile too)."""
    c = a.shape[-1]
    n_rows = a.shape[0] + (b.shape[0] if b is not None else 0)
    out = torch.empty(n_rows, c, dtype=torch.int8, device=a.device)
    row_scale = torch.empty(n_rows, 1, dtype=torch.float32, device=a.device)
    split = layernorm_parts(c) if (LAYERNORM_PARTS if parts is None else parts) else None
    rows, warps = tile or (PARTS_TILE if split else (layernorm_modulate_rows(a.shape[0]) if b is not None else 2, 8))
    if b is not None and a.shape[0] % rows:
        raise ValueError(f"layernorm_modulate_int8: tile rows {rows} must divide the first stream's {a.shape[0]} "
                         "rows (a program reads one stream); pick a divisor")
    if n_rows:
        args = (a, b if b is not None else a, scale, shift, out, row_scale, n_rows, a.shape[0], float(eps))
        flags = dict(C=c, ROWS=rows, SPLIT=b is not None, BF16=dtype == torch.bfloat16, APPROX=not INTERPRETED,
                     RECIPROCAL=reciprocal, num_warps=warps, **_pdl_launch(pdl))
        with _on_device(a):
            if split:
                _launcher(_layernorm_modulate_int8_parts_kernel, a.device)[(triton.cdiv(n_rows, rows),)](
                    *args, PARTS=split[0], BLOCK=split[1], EVEN_ROWS=n_rows % rows == 0, **flags)
            else:
                _launcher(_layernorm_modulate_int8_kernel, a.device)[(triton.cdiv(n_rows, rows),)](
                    *args, BLOCK=triton.next_power_of_2(c), **flags)
    return out, row_scale
