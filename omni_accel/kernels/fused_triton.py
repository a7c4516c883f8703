"""Triton kernels behind omni_accel/kernels/fused.py. Imported only when a Triton path is chosen (triton is optional).

Every kernel loads its inputs, computes in fp32 and rounds once to the output dtype. Rows are addressed through up
to three leading strides, so views that diffusers hands to its norms (heads unflattened from a fused QKV
projection, modulation chunks of one embedding) run without a copy; the last dim must have stride 1.

With ``TRITON_INTERPRET=1`` in the environment when triton is first imported, ``triton.jit`` returns interpreted
functions (numpy on the host) and the kernels run on CPU tensors -- how CI tests them. The variable must be set
before the import: triton decorates its own library functions (``tl.sum`` ...) then, and an interpreted kernel
cannot call a compiled ``tl.sum``. Without it the kernels only take CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Above this many elements per tile a program would spill registers; tiles are sized to about this.
_TILE = 4096


@triton.jit
def _layernorm_modulate_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr, n_rows, seq_len, n_cols,
    stride_xb, stride_xs, stride_scale_b, stride_shift_b, eps,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    b = rows // seq_len
    s = rows % seq_len
    x = tl.load(x_ptr + (b * stride_xb + s * stride_xs)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    scale = tl.load(scale_ptr + (b * stride_scale_b)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + (b * stride_shift_b)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * (1.0 + scale) + shift
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, d1, d2, stride0, stride1, stride2, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    i2 = rows % d2
    i1 = (rows // d2) % d1
    i0 = rows // (d2 * d1)
    base = i0 * stride0 + i1 * stride1 + i2 * stride2
    x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, d1, d2, stride0, stride1, stride2,
    stride_cos, stride_sin, half, eps,
    HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    # x (B, S, H, D): rows are (b, s, h); the rotary tables are (S, D) with interleaved (real, imag) pairs, the
    # layout of diffusers' apply_rotary_emb(use_real=True, use_real_unbind_dim=-1) that FLUX-style models use.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    pair = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (pair < half)[None, :]
    s = (rows // d2) % d1
    base = (rows // (d2 * d1)) * stride0 + s * stride1 + (rows % d2) * stride2
    even = base[:, None] + 2 * pair[None, :]
    x_re = tl.load(x_ptr + even, mask=mask, other=0.0).to(tl.float32)
    x_im = tl.load(x_ptr + even + 1, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x_re * x_re, axis=1) + tl.sum(x_im * x_im, axis=1)) / (2 * half) + eps)
    y_re = x_re * rstd[:, None]
    y_im = x_im * rstd[:, None]
    if HAS_WEIGHT:
        w_ok = pair < half
        y_re = y_re * tl.load(w_ptr + 2 * pair, mask=w_ok, other=0.0).to(tl.float32)[None, :]
        y_im = y_im * tl.load(w_ptr + 2 * pair + 1, mask=w_ok, other=0.0).to(tl.float32)[None, :]
    c = (s * stride_cos)[:, None] + 2 * pair[None, :]
    t = (s * stride_sin)[:, None] + 2 * pair[None, :]
    cos_re = tl.load(cos_ptr + c, mask=mask, other=0.0).to(tl.float32)
    cos_im = tl.load(cos_ptr + c + 1, mask=mask, other=0.0).to(tl.float32)
    sin_re = tl.load(sin_ptr + t, mask=mask, other=0.0).to(tl.float32)
    sin_im = tl.load(sin_ptr + t + 1, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + rows[:, None] * (2 * half) + 2 * pair[None, :]
    tl.store(out, (y_re * cos_re - y_im * sin_re).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 1, (y_im * cos_im + y_re * sin_im).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_residual_kernel(
    x_ptr, gate_ptr, y_ptr, out_ptr, seq_len, n_cols,
    stride_xb, stride_xs, stride_yb, stride_ys, stride_gate_b,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    b = row // seq_len
    s = row % seq_len
    x = tl.load(x_ptr + b * stride_xb + s * stride_xs + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + b * stride_yb + s * stride_ys + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + b * stride_gate_b + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x + g * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, n_cols, stride_x, fp8_max, min_amax,
    BLOCK: tl.constexpr,
):
    # one program per row: pass 1 finds the row's absolute maximum, pass 2 writes x / scale in e4m3. The second
    # read hits L2 (a row is at most a few tens of KB), so the kernel moves ~1 read + 0.5 write of the bf16 row.
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), min_amax) / fp8_max
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(out_ptr + row * n_cols + cols, q.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


# True when TRITON_INTERPRET=1 was set at triton's import: the kernels then run on CPU tensors (and slowly on CUDA ones)
INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)
if INTERPRETED != isinstance(tl.sum, InterpretedFunction):
    raise ImportError("TRITON_INTERPRET changed between triton's import and omni_accel's kernels; set it before "
                      "importing torch or triton")


def _launcher(kernel, device: torch.device):
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"Triton kernels need CUDA tensors (got {device}) unless TRITON_INTERPRET=1 is set "
                           "before triton is imported")
    return kernel


def _row_tile(n_cols: int) -> tuple[int, int, int]:
    """(rows per program, column block, warps): one tile of about _TILE elements; several rows when rows are short."""
    block = triton.next_power_of_2(n_cols)
    rows = max(1, min(64, _TILE // block))
    warps = min(max(rows * block // 256, 1), 8)
    return rows, block, warps


def _rows_3d(x: torch.Tensor) -> tuple[int, int, int, int, int]:
    """x (..., N) with stride(-1) == 1 and at most three leading dims -> (d1, d2, stride0, stride1, stride2)."""
    lead = list(x.shape[:-1])
    strides = list(x.stride()[:-1])
    while len(lead) < 3:
        lead.insert(0, 1)
        strides.insert(0, 0)
    return lead[1], lead[2], strides[0], strides[1], strides[2]


def _on_device(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else _NullContext()


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def layernorm_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """x (B, S, C) with stride(-1) == 1, scale / shift (B, C) (batch stride may be 0) -> LN(x) * (1 + scale) + shift."""
    batch, seq, n_cols = x.shape
    out = torch.empty((batch, seq, n_cols), dtype=out_dtype, device=x.device)
    if out.numel() == 0:  # a zero-size grid is not launched
        return out
    rows, block, warps = _row_tile(n_cols)
    n_rows = batch * seq
    grid = (triton.cdiv(n_rows, rows),)
    with _on_device(x):
        _launcher(_layernorm_modulate_kernel, x.device)[grid](
            x, scale, shift, out, n_rows, seq, n_cols, x.stride(0), x.stride(1), scale.stride(0), shift.stride(0),
            float(eps), ROWS=rows, BLOCK=block, num_warps=warps,
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """x (..., N) with stride(-1) == 1 and <= 3 leading dims -> x / rms(x) [* weight]; contiguous output."""
    n_cols = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.numel() == 0:  # a zero-size grid is not launched
        return out
    d1, d2, s0, s1, s2 = _rows_3d(x)
    n_rows = x.numel() // n_cols if n_cols else 0
    rows, block, warps = _row_tile(n_cols)
    grid = (triton.cdiv(n_rows, rows),)
    with _on_device(x):
        _launcher(_rms_norm_kernel, x.device)[grid](
            x, weight if weight is not None else x, out, n_rows, d1, d2, s0, s1, s2, n_cols, float(eps),
            HAS_WEIGHT=weight is not None, ROWS=rows, BLOCK=block, num_warps=warps,
        )
    return out


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """x (B, S, H, D) with stride(-1) == 1, cos / sin (S, D) with stride(-1) == 1 -> rope(rms_norm(x))."""
    half = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.numel() == 0:  # a zero-size grid is not launched
        return out
    d1, d2, s0, s1, s2 = _rows_3d(x)
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    rows, block, warps = _row_tile(x.shape[-1])
    block = max(block // 2, 1)
    grid = (triton.cdiv(n_rows, rows),)
    with _on_device(x):
        _launcher(_rms_norm_rope_kernel, x.device)[grid](
            x, weight if weight is not None else x, cos, sin, out, n_rows, d1, d2, s0, s1, s2,
            cos.stride(0), sin.stride(0), half, float(eps),
            HAS_WEIGHT=weight is not None, ROWS=rows, BLOCK=block, num_warps=warps,
        )
    return out


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x, y (B, S, C) with stride(-1) == 1, gate (B, C) -> x + gate[:, None] * y."""
    batch, seq, n_cols = x.shape
    out = torch.empty((batch, seq, n_cols), dtype=out_dtype, device=x.device)
    if out.numel() == 0:  # a zero-size grid is not launched
        return out
    block = min(triton.next_power_of_2(n_cols), 1024)
    grid = (batch * seq, triton.cdiv(n_cols, block))
    with _on_device(x):
        _launcher(_gated_residual_kernel, x.device)[grid](
            x, gate, y, out, seq, n_cols, x.stride(0), x.stride(1), y.stride(0), y.stride(1), gate.stride(0),
            BLOCK=block, num_warps=4,
        )
    return out


def quantize_rows_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, min_amax: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of a 2-D tensor (last dim contiguous): (x_fp8, fp32 scale (rows, 1))."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(cols), 2048)
    with _on_device(x):
        _launcher(_quantize_rows_fp8_kernel, x.device)[(rows,)](
            x, out, scale, cols, x.stride(0), fp8_max, min_amax, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out, scale
