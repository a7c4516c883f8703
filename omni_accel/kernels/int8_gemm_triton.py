"""An int8 GEMM with the int8 linear's rescale in its epilogue (Triton), beside cuBLAS's ``torch._int_mm``.

``torch._int_mm`` returns the int32 sums; the rescale ``sums * x_scale * w_scale -> bf16`` then runs in the next
kernel, so every output element crosses memory as 4 bytes written and 4 read where an FP8 ``_scaled_mm`` writes 2:
over FLUX.1-dev's 6.7 G linear outputs per forward that is about 27 GB more traffic. This kernel keeps the int32
tile in registers, scales it by the row's and the column's fp32 factors, adds the bias and writes the 16-bit output
once. On an H200 it ran FLUX.1-dev's block GEMMs at 910-1,063 TOPS where ``_int_mm`` plus the rescale reached
464-849 (and FP8's ``_scaled_mm`` 1,077-1,294 TFLOP/s); the FLUX forward with int8 linears took 107.8 ms against
134.3 with cuBLAS (``benchmarks/bench_fp8_gemm.py``, ``bench_peers.py``; docs/fp8.md).

Operands: ``x`` (M, K) int8 row-major, ``w`` (N, K) int8 row-major (the weight as ``nn.Linear`` stores it: the
kernel reads it as the (K, N) column-major matrix), ``x_scale`` (M, 1) and ``w_scale`` (1, N) fp32. K is a multiple
of 8 (the int8 layers' alignment); M and N take any size (masked tiles).

Three kernels compute the same sums (integer arithmetic: bit for bit the same output):

- ``_int8_gemm_rescale_kernel``: one program per output tile, operands loaded through pointers (Triton pipelines
  them with asynchronous copies).
- ``_int8_gemm_rescale_tma_kernel`` (``PERSISTENT_TMA``, the default above 1,024 rows on Hopper and newer): one
  program per SM walking the output tiles, operands and output moved by the Tensor Memory Accelerator from
  host-built descriptors. Why: the copy engine computes the addresses and masks that the pointer kernel spends
  registers and issue slots on, and a persistent program overlaps one tile's epilogue with the next tile's first
  loads. It needs 16-byte aligned rows (K a multiple of 16, N of 8); other shapes take the first kernel.
- ``_int8_gemm_rescale_ws_kernel`` (``WARP_SPECIALIZE``, the default in the TMA kernel's place on Hopper): the same
  persistent TMA loop, warp specialized -- a producer warp only issues the loads, two consumer warp groups only
  multiply and rescale -- as cuBLAS's Hopper kernels are built. 1.2x the TMA kernel on FLUX's large block shapes,
  ahead of e4m3's ``_scaled_mm`` on four of five (``benchmarks/bench_fp8_gemm.py``). Its descriptors are built on
  the device, which needs Triton's scratch allocator (``_ensure_scratch_allocator``: torch's, unless the caller set
  one).

Each has a twin (``_int8_gemm_rescale_residual*_kernel``) whose epilogue also applies a DiT block's gated
residual, ``residual + gate * product`` (``int8_mm_rescale``'s ``gate`` / ``residual``; op
``omni_accel::int8_mm_rescale_residual`` in kernels/int8.py, put in by kernels/epilogue_fusion.py): the block's hidden
state leaves the GEMM, and the 16-bit product is never written and read back by a separate kernel. The twins are
separate entry points so that the plain kernels keep their arguments; they call the same functions (the persistent
kernels' one body takes ``HAS_RESIDUAL``, a constexpr), and the plain kernels compile to the same code as before.
The persistent twins compute each tile as two half-width accumulators and read the residual through TMA
(``_tile_sums_halves``: that is what kept their sm_90 lowering free of spills, on Triton 3.6 and 3.9). The
split-tail kernel has no twin: a call with the residual keeps its last wave whole. The warp-specialized twin is not
used unless ``RESIDUAL_WARP_SPECIALIZED`` is set (wrong values on an H100, see there); ``RESIDUAL_WS_IO`` moves its
epilogue's residual load and / or output store to pointers (A/B variants, wrong on an H100 too).

``_int8_gemv_dot_kernel`` and ``_int8_gemv_kernel``: the int8 weight-only layers' matrix-vector product (16-bit x
of up to 16 rows, int8 weight, per-channel scale; kernels/int8.py's ``TRITON_GEMV``), bound by reading the weight
once: on the tensor cores with pipelined weight loads (``GEMV_KERNEL``'s default), or summed in registers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Triton's scratch allocator, which device-built TMA descriptors need (Triton 3.3+)
    from triton.runtime import _allocation
except ImportError:  # pragma: no cover - older Triton: no warp-specialized kernel
    _allocation = None

from .fused_triton import INTERPRETED, _launcher, _on_device
from .int8 import GEMV_MAX_ROWS  # rows of x a GEMV call takes (the tensor-core kernel pads them to one MMA tile)

try:  # host-side TMA descriptors (Triton 3.4+)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernel only
    TensorDescriptor = None

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): Hopper tiles (wgmma takes int8 with K = 32 per instruction).
# Measured on an H200 on FLUX.1-dev's block shapes (benchmarks/results/bench_fp8_gemm_h200_int8_20261205.json):
# 128x256x128 is the fastest or within 1 % of it from 4,096 rows up (910-1,063 TOPS); at 512 rows 128x128x128 is 4 %
# ahead. The interpreter (CI) gets small tiles so a test runs in seconds.
CONFIGS = {
    "128x256x128": (128, 256, 128, 8, 8, 3),
    "128x128x128": (128, 128, 128, 8, 4, 4),
    "256x128x128": (256, 128, 128, 8, 8, 3),
    "128x256x64": (128, 256, 64, 8, 8, 4),
    # tiles for few rows (FLUX's 512 text tokens): 512 x 9,216 outputs make 288 tiles of 128 x 128, 2.2 waves on 132
    # SMs. Measured on an H100 at FLUX's four 512-row shapes, 20 calls back to back
    # (benchmarks/results/bench_fp8_gemm_h100_int8_few_rows_20261205.json): 64x128x128 684 against 395 TOPS on the
    # q / k / v projection, 821 against 736 on the feed-forward's down projection, within 1.1 % on the other two.
    "64x128x128": (64, 128, 128, 8, 4, 4),
    "64x256x128": (64, 256, 128, 8, 4, 3),
    "128x64x128": (128, 64, 128, 8, 4, 4),
}
# The persistent TMA kernel's tiles, same fields; named "tma_" + tile.
TMA_CONFIGS = {
    "tma_128x256x128": (128, 256, 128, 8, 8, 3),
    "tma_128x128x128": (128, 128, 128, 8, 4, 4),
    "tma_128x256x64": (128, 256, 64, 8, 8, 4),
    "tma_256x128x128": (256, 128, 128, 8, 8, 3),
}
# The warp-specialized kernel's tiles, same fields; named "ws_" + tile. Warps are the consumers' (Triton splits the
# tile's rows between two consumer warp groups and adds the producer warps); with 8 warps Triton does not specialize.
# Measured on an H100 on FLUX.1-dev's block shapes (benchmarks/results/bench_fp8_gemm_h100_int8_ws_20261205.json),
# 20 calls back to back: ws_128x256x128 1,157-1,584 TOPS from 4,096 rows up where the TMA kernel's 128x256x128
# reached 957-1,296 and e4m3's _scaled_mm 1,200-1,346 (ahead of it on four of the five shapes). A 128x128x128 tile
# with 5 stages returned sums that differ from the reference, so it is not shipped.
WS_CONFIGS = {
    "ws_128x256x128": (128, 256, 128, 8, 4, 3),
    "ws_128x256x64": (128, 256, 64, 8, 4, 4),
}
FEW_ROWS = 1024  # up to this many rows: the smaller tile of the pointer kernel (more tiles to fill the GPU)
# The pointer kernel's tile up to FEW_ROWS rows (benchmarks' A/B rows set it): 64x128x128 by the per-shape figures
# above; the forward's A/B row (bench_peers.py's ours_int8_few128) is still to time.
FEW_ROWS_TILE = "64x128x128"
# Whether ``pick_config`` takes the persistent TMA kernel for more than FEW_ROWS rows where the shape and GPU allow it
# (benchmarks' A/B rows set it). Measured on an H200 on FLUX.1-dev's block shapes, 20 calls back to back
# (benchmarks/results/bench_fp8_gemm_h200_int8_tma_20261205.json): 4,096-4,608 rows ran at 967-1,242 TOPS with
# tma_128x256x128 against 903-1,264 with the pointer kernel's 128x256x128 (ahead on four of five shapes, 2 % behind
# on the fifth); at 512 rows the TMA tiles reached 552-572 TOPS and the pointer kernel's 128x128x128 803, so fewer
# rows keep the pointer kernel.
PERSISTENT_TMA = True
# Whether the warp-specialized kernel (``WS_TILE``) replaces the TMA kernel on Hopper (sm_90: the only GPUs it was
# measured on; benchmarks' A/B rows set it). The FLUX forward on an H100: 93.4 against 99.7 ms per step.
WARP_SPECIALIZE = True
# Whether a call with the gated residual takes the warp-specialized kernel's twin where the plain call would take the
# warp-specialized kernel (else the persistent TMA kernel's twin: ``residual_in_gemm`` tells the graph pass). Off: on
# an H100 with Triton 3.6 the twin wrote wrong values into a few 64 x 64 boxes of the output per call (0.1-0.3 % of
# the values, at every shape tried) where the pointer and TMA twins matched Inductor's unfused graph bit for bit; the
# sm_90 lowering shows no shared-memory or descriptor overlap, and every RESIDUAL_WS_IO variant is wrong too
# (benchmarks/results/bench_int8_residual_h100_20261206.json), so the cause is likely the main loop's two half-width
# accumulators. Even right, its half-width MMAs cost about what the fused add saves (docs/kernels.md).
RESIDUAL_WARP_SPECIALIZED = False
# How the warp-specialized twin's epilogue reads the residual and writes the output: 0 both through TMA (the twin
# above), 1 the output stored through pointers, 2 the residual loaded through pointers, 3 both through pointers. A/B
# variants: 1-3 spill registers, and on an H100 all four wrote wrong values (1 in most of the output).
RESIDUAL_WS_IO = 0
WS_TILE = "ws_128x256x128"
# Whether the warp-specialized kernel leaves a last wave that would fill at most half the SMs to a second kernel that
# splits each of its tiles along K over idle SMs (integer partial sums, added by the tile's last program). Why:
# FLUX's 4,608 x 3,072 outputs (the single blocks' output projection, K = 15,360, and unfused q / k / v, K = 3,072)
# make 432 tiles of 128 x 256, 3.27 waves on 132 SMs: the last quarter of those GEMMs runs on 36 SMs. Off until
# timed (bench_fp8_gemm.py, bench_peers.py's ours_int8_splittail).
SPLIT_TAIL = False
TAIL_MAX_SPLITS = 4  # the last program reads every split's partial tile: more splits, a longer epilogue
TAIL_LAUNCH = (8, 3)  # the split-tail kernel's (warps, stages): the pointer kernel's for the 128 x 256 x 128 tile


def pick_config(rows: int, tma: bool = False, warp_specialize: bool = False) -> str:
    if rows <= FEW_ROWS:
        return FEW_ROWS_TILE
    if not tma:
        return "128x256x128"
    return WS_TILE if warp_specialize else "tma_128x256x128"


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


# device-built descriptors and the scratch allocator they need: what the warp-specialized kernel takes from Triton
_WS_BUILDABLE = _allocation is not None and hasattr(tl, "make_tensor_descriptor")


def _warp_specialized_here(x_int8: torch.Tensor) -> bool:
    if not (WARP_SPECIALIZE and _WS_BUILDABLE):
        return False
    return INTERPRETED or (x_int8.is_cuda and _capability(x_int8.device.index or 0)[0] == 9)


def residual_in_gemm(rows: int, device: torch.device) -> bool:
    """Whether a GEMM of ``rows`` rows on ``device`` that the graph pass would give the gated residual runs it in
    the kernel the plain call would run: not where that kernel is the warp-specialized one and
    ``RESIDUAL_WARP_SPECIALIZED`` is off (the TMA kernel's twin would run instead, a slower main loop than the gated
    add saves). The TMA alignment of the operands is not known here; a call that misses it takes the pointer kernel
    either way."""
    if device.type != "cuda" or rows <= FEW_ROWS or not PERSISTENT_TMA:
        return True
    warp_specialized = WARP_SPECIALIZE and _WS_BUILDABLE and _capability(device.index or 0)[0] == 9
    return RESIDUAL_WARP_SPECIALIZED or not warp_specialized


def tma_fits(x_int8: torch.Tensor, w_int8: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the TMA kernel takes these operands: a Hopper-or-newer GPU (or the interpreter), descriptors in this
    Triton, 16-byte aligned base addresses and row strides for x, w and the output."""
    if TensorDescriptor is None:
        return False
    if not INTERPRETED and not (x_int8.is_cuda and _capability(x_int8.device.index or 0)[0] >= 9):
        return False
    out_row_bytes = w_int8.shape[0] * out_dtype.itemsize  # no tensor made per call: this runs before every GEMM
    return (x_int8.data_ptr() % 16 == 0 and w_int8.data_ptr() % 16 == 0 and x_int8.stride(0) % 16 == 0
            and w_int8.stride(0) % 16 == 0 and out_row_bytes % 16 == 0)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_INTERPRETER_TILE = (32, 32, 32, 4, 4, 1)


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    # grouped order: GROUP_M row tiles share each column tile while it is in L2
    group = tile // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * tiles_n)) % group_size
    pid_n = (tile % (GROUP_M * tiles_n)) // group_size
    return pid_m, pid_n


@triton.jit
def _int8_gemm_rescale_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _pointer_tile_sums(x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_wn, 0, tl.cdiv(K, BLOCK_K),
                             BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    _pointer_rescale_store(acc, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, rows, cols, M, N, stride_om, HAS_BIAS)


@triton.jit
def _int8_gemm_rescale_residual_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, residual_ptr, M, N, K,
    stride_xm, stride_wn, stride_om, stride_rm,
    HAS_BIAS: tl.constexpr, ROUND_TO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
):
    # the pointer kernel with the gated residual in its epilogue (_gated_residual)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _pointer_tile_sums(x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_wn, 0, tl.cdiv(K, BLOCK_K),
                             BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    y = _pointer_rescaled(acc, x_scale_ptr, w_scale_ptr, bias_ptr, rows, cols, M, N, HAS_BIAS)
    y = _gated_residual(y, gate_ptr, residual_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_rm, ROUND_TO,
                        BLOCK_M, BLOCK_N)
    _pointer_store(y, out_ptr, rows, cols, M, N, stride_om)


@triton.jit
def _pointer_tile_sums(x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_wn, first_step, end_step,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The int32 sums of one output tile over K steps [first_step, end_step), operands loaded through pointers."""
    ks = tl.arange(0, BLOCK_K)
    # out-of-range rows / columns read a valid row (the last) and are masked at the store: loads stay unmasked
    rows_in = tl.minimum(rows, M - 1).to(tl.int64)
    cols_in = tl.minimum(cols, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_in[:, None] * stride_xm + first_step * BLOCK_K + ks[None, :]
    # (BLOCK_K, BLOCK_N) view of the (N, K) weight
    w_ptrs = w_ptr + cols_in[None, :] * stride_wn + first_step * BLOCK_K + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(first_step, end_step):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=ks[None, :] < left, other=0)
            b = tl.load(w_ptrs, mask=ks[:, None] < left, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


# Whether _as_output rounds a bf16 product on its float32 bits: Triton's interpreter truncates float32 -> bf16 casts
# (the GPU's cast rounds to nearest even), which would make the interpreter's outputs wrong by a step
_BF16_BY_BITS = tl.constexpr(INTERPRETED)


@triton.jit
def _as_output(y, ROUND_TO: tl.constexpr):
    """Products ``y`` (float32) rounded to ROUND_TO (the output's dtype), to nearest even, and widened again: the
    value the unfused graph's GEMM writes in 16 bits and its next kernel computes with, so that the fused gated add
    gives the unfused one's output."""
    if _BF16_BY_BITS and ROUND_TO == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16  # to nearest, ties to even
        rounded = bits.to(tl.float32, bitcast=True)
    else:
        rounded = y.to(ROUND_TO).to(tl.float32)
    return rounded


@triton.jit
def _gated_residual(y, gate_ptr, residual_ptr, first_row, first_col, M, N, stride_rm, ROUND_TO: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``residual + gate * y`` in float32 for the pointer kernel's tile of products ``y`` (float32) from (first_row,
    first_col), ``y`` rounded as the output first (``_as_output``); the caller rounds the sum once."""
    y = _as_output(y, ROUND_TO)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    inside = (first_row + rows < M)[:, None] & (first_col + cols < N)[None, :]
    gate = tl.load(gate_ptr + first_col + cols, mask=first_col + cols < N, other=0.0).to(tl.float32)
    # one 64-bit address per tile and 32-bit offsets within it (fewer registers); masks constant along the row (not
    # clamped indices), so that the loads stay vectorized where N allows
    tile = residual_ptr + first_row.to(tl.int64) * stride_rm + first_col
    residual = tl.load(tile + rows[:, None] * stride_rm + cols[None, :], mask=inside, other=0.0)
    return residual.to(tl.float32) + gate[None, :] * y


@triton.jit
def _pointer_rescale_store(acc, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, rows, cols, M, N, stride_om,
                           HAS_BIAS: tl.constexpr):
    """Sums times the rows' and columns' scales (+ bias), stored to the rows and columns given (masked at M, N)."""
    y = _pointer_rescaled(acc, x_scale_ptr, w_scale_ptr, bias_ptr, rows, cols, M, N, HAS_BIAS)
    _pointer_store(y, out_ptr, rows, cols, M, N, stride_om)


@triton.jit
def _pointer_rescaled(acc, x_scale_ptr, w_scale_ptr, bias_ptr, rows, cols, M, N, HAS_BIAS: tl.constexpr):
    """Sums times the rows' and columns' scales (+ bias), in float32."""
    rows_in = tl.minimum(rows, M - 1).to(tl.int64)
    cols_in = tl.minimum(cols, N - 1).to(tl.int64)
    x_scale = tl.load(x_scale_ptr + rows_in)
    w_scale = tl.load(w_scale_ptr + cols_in)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    return y


@triton.jit
def _pointer_store(y, out_ptr, rows, cols, M, N, stride_om):
    """A float32 tile rounded to the output's dtype, stored to the rows and columns given (masked at M, N)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _int8_gemm_split_tail_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, partial_ptr, arrivals_ptr, M, N, K,
    stride_xm, stride_wn, stride_om, first_tile, splits,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, CHUNK_N: tl.constexpr,
):
    # The tiles from first_tile on (the persistent kernel's last, partial wave), each split along K into `splits`
    # programs. Each program stores its int32 partial sums; the last of a tile's programs to arrive (a counter per
    # tile) adds them up, in integers (exact, in any order), and runs the epilogue in column chunks (the whole tile
    # and a second one in registers would spill).
    unit = tl.program_id(0)
    slot = unit // splits
    part = unit % splits
    pid_m, pid_n = _tile_coords(first_tile + slot, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)  # split as evenly as the steps allow: no split is left without one
    acc = _pointer_tile_sums(x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_wn, part * steps // splits,
                             (part + 1) * steps // splits, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = partial_ptr + slot.to(tl.int64) * splits * BLOCK_M * BLOCK_N
    tl.store(tile_partials + part * BLOCK_M * BLOCK_N + local, acc)
    tl.debug_barrier()  # every thread's partial stored before the release below publishes them
    if tl.atomic_add(arrivals_ptr + slot, 1, sem="acq_rel") == splits - 1:
        chunk = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, CHUNK_N)[None, :]
        for first_col in tl.static_range(0, BLOCK_N, CHUNK_N):
            sums = tl.zeros((BLOCK_M, CHUNK_N), dtype=tl.int32)
            for other in range(0, splits):
                # .cg: read through L2, where the other programs' stores are (never this SM's L1)
                sums += tl.load(tile_partials + other * BLOCK_M * BLOCK_N + first_col + chunk, cache_modifier=".cg")
            _pointer_rescale_store(sums, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, rows,
                                   pid_n * BLOCK_N + first_col + tl.arange(0, CHUNK_N), M, N, stride_om, HAS_BIAS)


@triton.jit
def _tile_sums(x_desc, w_desc, pid_m, pid_n, k_steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """One output tile's int32 sums, operands through TMA descriptors (which zero-fill reads past M, N and K)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(k_steps):
        a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
    return acc


@triton.jit
def _tile_sums_halves(x_desc, w_desc, pid_m, pid_n, k_steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """``_tile_sums`` in two accumulators of half the tile's columns each (``w_desc``'s block half the tile's weight
    rows), for an epilogue that takes one half after the other. Why not one accumulator cut in two: Triton 3.6's
    warp-specialized partitioning refuses the reshape and split that would cut it (Triton 3.9 takes them)."""
    left = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.int32)
    right = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.int32)
    for k in range(k_steps):
        a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        b_left = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        b_right = w_desc.load([pid_n * BLOCK_N + BLOCK_N // 2, k * BLOCK_K])
        left = tl.dot(a, b_left.T, left, out_dtype=tl.int32)
        right = tl.dot(a, b_right.T, right, out_dtype=tl.int32)
    return left, right


@triton.jit
def _rescale_store(acc, out_desc, x_scale_ptr, w_scale_ptr, bias_ptr, pid_m, pid_n, M, N, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's sums times the rows' and columns' scales (+ bias), stored through the output descriptor (clipped at
    M and N)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], y.to(out_desc.dtype))


@triton.jit
def _residual_halves_store(left, right, out_desc, res_desc, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, pid_m,
                           pid_n, M, N, HAS_BIAS: tl.constexpr, ROUND_TO: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, out_ptr, residual_ptr, stride_rm, IO: tl.constexpr):
    """The persistent kernels' epilogue with the gated residual, for a tile's two column halves
    (``_tile_sums_halves``), one after the other; the residual's half tiles come through ``res_desc``, the output's
    leave through ``out_desc`` (both with blocks of half a tile). ``IO`` (a ``RESIDUAL_WS_IO`` value) moves the
    residual's load and / or the output's store to pointers (``residual_ptr`` with row stride ``stride_rm``,
    ``out_ptr`` with row stride N)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
    _residual_half_store(left, out_desc, res_desc, x_scale, w_scale_ptr, bias_ptr, gate_ptr, pid_m * BLOCK_M,
                         pid_n * BLOCK_N, M, N, HAS_BIAS, ROUND_TO, BLOCK_M, BLOCK_N // 2, out_ptr, residual_ptr,
                         stride_rm, IO)
    _residual_half_store(right, out_desc, res_desc, x_scale, w_scale_ptr, bias_ptr, gate_ptr, pid_m * BLOCK_M,
                         pid_n * BLOCK_N + BLOCK_N // 2, M, N, HAS_BIAS, ROUND_TO, BLOCK_M, BLOCK_N // 2, out_ptr,
                         residual_ptr, stride_rm, IO)


# ``IO`` of the residual epilogue: how the residual comes in and the output goes out (TMA or pointers)
_IO_TMA = tl.constexpr(0)
_IO_POINTER_STORE = tl.constexpr(1)
_IO_POINTER_LOAD = tl.constexpr(2)
_IO_POINTERS = tl.constexpr(3)


@triton.jit
def _residual_half_store(acc, out_desc, res_desc, x_scale, w_scale_ptr, bias_ptr, gate_ptr, first_row, first_col, M,
                         N, HAS_BIAS: tl.constexpr, ROUND_TO: tl.constexpr, BLOCK_M: tl.constexpr,
                         HALF_N: tl.constexpr, out_ptr, residual_ptr, stride_rm, IO: tl.constexpr):
    cols = first_col + tl.arange(0, HALF_N)
    w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    gate = tl.load(gate_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rows = first_row + tl.arange(0, BLOCK_M)
    inside = (rows < M)[:, None] & (cols < N)[None, :]
    if IO == _IO_POINTER_LOAD or IO == _IO_POINTERS:
        residual = tl.load(residual_ptr + rows.to(tl.int64)[:, None] * stride_rm + cols[None, :], mask=inside,
                           other=0.0).to(tl.float32)
    else:
        # the residual through TMA (shared memory, read in the accumulator's layout): loaded through pointers, its
        # change of layout spilled 2-3 KB of registers per thread in the warp-specialized kernel's sm_90 lowering
        residual = res_desc.load([first_row, first_col]).to(tl.float32)
    out = (residual + gate[None, :] * _as_output(y, ROUND_TO)).to(out_desc.dtype)
    if IO == _IO_POINTER_STORE or IO == _IO_POINTERS:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out, mask=inside)
    else:
        out_desc.store([first_row, first_col], out)


@triton.jit
def _int8_gemm_rescale_tma_kernel(
    x_desc, w_desc, out_desc, x_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
):
    _tma_tiles(x_desc, w_desc, out_desc, out_desc, x_scale_ptr, w_scale_ptr, bias_ptr, x_scale_ptr, M, N, K,
               HAS_BIAS, False, None, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PROGRAMS)


@triton.jit
def _int8_gemm_rescale_residual_tma_kernel(
    x_desc, w_desc, out_desc, res_desc, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, ROUND_TO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
):
    # w_desc, out_desc and res_desc have blocks of half the tile's columns (_tile_sums_halves)
    _tma_tiles(x_desc, w_desc, out_desc, res_desc, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, M, N, K,
               HAS_BIAS, True, ROUND_TO, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PROGRAMS)


@triton.jit
def _tma_tiles(x_desc, w_desc, out_desc, res_desc, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, M, N, K,
               HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND_TO: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr):
    """The persistent TMA kernels' program: its share of the output tiles, one after another."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    # the epilogue recomputes its tile's coordinates from its own counter: with the loops flattened, the compiler
    # can then issue the next tile's loads before this tile's stores (no dependence through pid_m / pid_n)
    epilogue_tile = tl.program_id(0) - PROGRAMS
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        if HAS_RESIDUAL:
            left, right = _tile_sums_halves(x_desc, w_desc, pid_m, pid_n, k_steps, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc = _tile_sums(x_desc, w_desc, pid_m, pid_n, k_steps, BLOCK_M, BLOCK_N, BLOCK_K)
        epilogue_tile += PROGRAMS
        pid_m, pid_n = _tile_coords(epilogue_tile, tiles_m, tiles_n, GROUP_M)
        if HAS_RESIDUAL:
            _residual_halves_store(left, right, out_desc, res_desc, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr,
                                   pid_m, pid_n, M, N, HAS_BIAS, ROUND_TO, BLOCK_M, BLOCK_N, x_scale_ptr,
                                   x_scale_ptr, 0, _IO_TMA)
        else:
            _rescale_store(acc, out_desc, x_scale_ptr, w_scale_ptr, bias_ptr, pid_m, pid_n, M, N, HAS_BIAS, BLOCK_M,
                           BLOCK_N)


@triton.jit
def _int8_gemm_rescale_ws_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_xm, stride_wn, tiles,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
):
    _ws_tiles(x_ptr, w_ptr, out_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, x_scale_ptr, M, N, K, stride_xm,
              stride_wn, 0, tiles, HAS_BIAS, False, None, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PROGRAMS, _IO_TMA)


@triton.jit
def _int8_gemm_rescale_residual_ws_kernel(
    x_ptr, w_ptr, out_ptr, residual_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, M, N, K, stride_xm, stride_wn,
    stride_rm, tiles, HAS_BIAS: tl.constexpr, ROUND_TO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, IO: tl.constexpr,
):
    _ws_tiles(x_ptr, w_ptr, out_ptr, residual_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, M, N, K, stride_xm,
              stride_wn, stride_rm, tiles, HAS_BIAS, True, ROUND_TO, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PROGRAMS, IO)


@triton.jit
def _ws_tiles(x_ptr, w_ptr, out_ptr, residual_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, M, N, K, stride_xm,
              stride_wn, stride_rm, tiles, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND_TO: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              PROGRAMS: tl.constexpr, IO: tl.constexpr):
    # The persistent TMA kernel's arithmetic, warp specialized: a producer partition issues the TMA loads into a ring
    # of shared-memory stages while two consumer warp groups (half the tile's rows each) multiply and run the
    # epilogue, so loads for the next tile start while this one's epilogue runs without the software pipeline's
    # register cost. The descriptors are built on the device, because Triton's Hopper partitioning rewrites them to
    # the consumers' half tiles (host-built ones keep the whole tile and fail to lower). It computes the first
    # `tiles` output tiles (all of them, or all but a last partial wave that the split-tail kernel takes). With the
    # gated residual, each tile is computed and stored in two column halves (_tile_sums_halves).
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    TILE_N: tl.constexpr = BLOCK_N // 2 if HAS_RESIDUAL else BLOCK_N
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[TILE_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, TILE_N])
    if HAS_RESIDUAL:
        res_desc = tl.make_tensor_descriptor(residual_ptr, shape=[M, N], strides=[stride_rm, 1],
                                             block_shape=[BLOCK_M, TILE_N])
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, warp_specialize=True):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        if HAS_RESIDUAL:
            left, right = _tile_sums_halves(x_desc, w_desc, pid_m, pid_n, k_steps, BLOCK_M, BLOCK_N, BLOCK_K)
            _residual_halves_store(left, right, out_desc, res_desc, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr,
                                   pid_m, pid_n, M, N, HAS_BIAS, ROUND_TO, BLOCK_M, BLOCK_N, out_ptr, residual_ptr,
                                   stride_rm, IO)
        else:
            acc = _tile_sums(x_desc, w_desc, pid_m, pid_n, k_steps, BLOCK_M, BLOCK_N, BLOCK_K)
            _rescale_store(acc, out_desc, x_scale_ptr, w_scale_ptr, bias_ptr, pid_m, pid_n, M, N, HAS_BIAS, BLOCK_M,
                           BLOCK_N)


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for kernels that build TMA descriptors on the device (128 bytes per descriptor and program),
    from torch's caching allocator: inside a CUDA graph capture it comes from the graph's pool."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    # Triton keeps its allocator in a ContextVar, unset in every new thread (a server's workers too): set ours there
    # unless the caller set one.
    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def _persistent_programs(x_int8, m: int, n: int, block_m: int, block_n: int) -> int:
    """One program per SM (4 in the interpreter, so that a test's programs walk several tiles), at most one a tile."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return min(tiles, 4 if INTERPRETED else _sm_count(x_int8.device.index or 0))


def split_tail_plan(tiles: int, programs: int, k_steps: int, enabled: bool | None = None) -> tuple[int, int]:
    """(tiles the persistent kernel computes whole, K splits of each remaining tile): with ``enabled`` (default
    ``SPLIT_TAIL``), a last wave that fills at most half the programs is split along K so that it fills them (at
    most ``TAIL_MAX_SPLITS`` ways, each split at least one K step); else (tiles, 1)."""
    tail = tiles % programs
    if not (SPLIT_TAIL if enabled is None else enabled) or tiles <= programs or tail == 0:
        return tiles, 1
    splits = min(programs // tail, TAIL_MAX_SPLITS, k_steps)
    return (tiles - tail, splits) if splits >= 2 else (tiles, 1)


def ws_plan(x_int8: torch.Tensor, w_int8: torch.Tensor, tile: tuple,
            split_tail: bool | None = None) -> tuple[int, int, int, int]:
    """(programs, tiles, tiles computed whole, K splits of the rest) of the warp-specialized kernel on these
    operands with ``tile`` (a WS_CONFIGS value); ``split_tail`` as ``split_tail_plan``'s ``enabled``."""
    block_m, block_n, block_k = tile[:3]
    (m, k), n = x_int8.shape, w_int8.shape[0]
    programs = _persistent_programs(x_int8, m, n, block_m, block_n)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return (programs, tiles, *split_tail_plan(tiles, programs, triton.cdiv(k, block_k), split_tail))


# the 16-bit (or float32) output dtype the gated residual's epilogue rounds the product to first
_ROUND_TO = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _residual_operands(gate: torch.Tensor | None, residual: torch.Tensor | None, m: int, n: int,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gate as (N,), residual as (M, N) with unit column stride) as the kernels take them, or None without them."""
    if gate is None and residual is None:
        return None
    if gate is None or residual is None:
        raise ValueError("int8_mm_rescale takes the gated residual's gate and residual together, or neither")
    if tuple(residual.shape) != (m, n) or gate.numel() != n:
        raise ValueError(f"int8_mm_rescale's gated residual needs a residual of the output's shape {(m, n)} and one "
                         f"gate value per output column ({n}); got residual {tuple(residual.shape)}, gate "
                         f"{tuple(gate.shape)}")
    if residual.dtype != out_dtype or out_dtype not in _ROUND_TO:
        raise ValueError(f"int8_mm_rescale's residual must have the output's dtype, 16-bit or float32 (residual "
                         f"{residual.dtype}, output {out_dtype})")
    # the kernels read residual rows through a row stride, the gate as one contiguous vector (both no-copy views
    # for the graph pass's operands: a contiguous hidden state, one row of the modulation's output)
    return gate.reshape(-1).contiguous(), residual if residual.stride(1) == 1 else residual.contiguous()


def _tma_aligned(t: torch.Tensor) -> bool:
    """Whether TMA can read the 2-D tensor ``t``: a 16-byte aligned start and row stride."""
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def _launch_ws(x_int8, w_int8, out, x_scale, w_scale, bias, tile, gated=None) -> None:
    block_m, block_n, block_k, group_m, warps, stages = tile
    m, k = x_int8.shape
    n = w_int8.shape[0]
    # gated: (gate, residual) from _residual_operands, or None. A call with them keeps its last wave whole: the
    # split-tail kernel's epilogue has no residual (SPLIT_TAIL is off, measured slower), as with the switch off
    programs, tiles, whole, splits = ws_plan(x_int8, w_int8, tile, split_tail=False if gated is not None else None)
    if not INTERPRETED:
        _ensure_scratch_allocator()
    bias_arg = bias if bias is not None else out
    operands = (x_int8, w_int8, out, x_scale.reshape(-1), w_scale.reshape(-1), bias_arg)
    tiling = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, PROGRAMS=programs,
                  num_warps=warps, num_stages=stages)
    if gated is not None:
        if RESIDUAL_WS_IO not in (0, 1, 2, 3):
            raise ValueError(f"int8_gemm_triton.RESIDUAL_WS_IO={RESIDUAL_WS_IO!r}: use 0 (residual and output through "
                             "TMA), 1 (output through pointers), 2 (residual through pointers) or 3 (both)")
        gate, rows = gated
        _launcher(_int8_gemm_rescale_residual_ws_kernel, x_int8.device)[(programs,)](
            x_int8, w_int8, out, rows, *operands[3:], gate, m, n, k, x_int8.stride(0), w_int8.stride(0),
            rows.stride(0), whole, HAS_BIAS=bias is not None, ROUND_TO=_ROUND_TO[rows.dtype], IO=RESIDUAL_WS_IO,
            **tiling)
        return
    _launcher(_int8_gemm_rescale_ws_kernel, x_int8.device)[(programs,)](
        *operands, m, n, k, x_int8.stride(0), w_int8.stride(0), whole, HAS_BIAS=bias is not None, **tiling)
    if whole == tiles:
        return
    units = (tiles - whole) * splits
    # per call, not cached: a buffer shared between calls on two streams would mix their partials; the arrival
    # counters start at zero (a memset), the partials need none (every one is written before it is read)
    partials = torch.empty(units * block_m * block_n, dtype=torch.int32, device=x_int8.device)
    arrivals = torch.zeros(tiles - whole, dtype=torch.int32, device=x_int8.device)
    tail_warps, tail_stages = TAIL_LAUNCH if not INTERPRETED else (4, 1)
    _launcher(_int8_gemm_split_tail_kernel, x_int8.device)[(units,)](
        x_int8, w_int8, out, x_scale.reshape(-1), w_scale.reshape(-1), bias_arg, partials, arrivals, m, n, k,
        x_int8.stride(0), w_int8.stride(0), out.stride(0), whole, splits,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        # the interpreter's 32-column tile in two chunks, so that a test walks the chunk loop as a GPU's 4 do
        EVEN_K=k % block_k == 0, CHUNK_N=block_n // 2 if INTERPRETED else min(block_n, 64), num_warps=tail_warps,
        num_stages=tail_stages)


def _launch_tma(x_int8, w_int8, out, x_scale, w_scale, bias, tile, gated=None) -> None:
    block_m, block_n, block_k, group_m, warps, stages = tile
    m, k = x_int8.shape
    n = w_int8.shape[0]
    programs = _persistent_programs(x_int8, m, n, block_m, block_n)
    scales = (x_scale.reshape(-1), w_scale.reshape(-1), bias if bias is not None else out)
    tiling = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, PROGRAMS=programs,
                  num_warps=warps, num_stages=stages)
    x_desc = TensorDescriptor.from_tensor(x_int8, [block_m, block_k])
    if gated is not None:  # each tile in two column halves (_tile_sums_halves): half-width blocks
        gate, rows = gated
        half = block_n // 2
        _launcher(_int8_gemm_rescale_residual_tma_kernel, x_int8.device)[(programs,)](
            x_desc, TensorDescriptor.from_tensor(w_int8, [half, block_k]),
            TensorDescriptor.from_tensor(out, [block_m, half]), TensorDescriptor.from_tensor(rows, [block_m, half]),
            *scales, gate, m, n, k, HAS_BIAS=bias is not None, ROUND_TO=_ROUND_TO[rows.dtype], **tiling)
        return
    _launcher(_int8_gemm_rescale_tma_kernel, x_int8.device)[(programs,)](
        x_desc, TensorDescriptor.from_tensor(w_int8, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]), *scales, m, n, k, HAS_BIAS=bias is not None, **tiling)


def int8_mm_rescale(x_int8: torch.Tensor, w_int8: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, config: str | None = None,
                    gate: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``(x_int8 @ w_int8.T) * x_scale * w_scale (+ bias)`` in ``out_dtype``, the int32 sums never leaving the chip;
    ``config`` names a tile of CONFIGS, TMA_CONFIGS or WS_CONFIGS (default: ``pick_config`` for the row count, the
    TMA kernel where ``PERSISTENT_TMA`` is set and ``tma_fits``, warp specialized on Hopper where ``WARP_SPECIALIZE``
    is set). With ``gate`` (N values) and ``residual`` ((M, N), ``out_dtype``): ``residual + gate * product``, the
    product rounded to ``out_dtype`` first and the sum computed in float32 and rounded once (a new tensor; the
    residual is only read)."""
    m, k = x_int8.shape
    n = w_int8.shape[0]
    if x_int8.stride(1) != 1 or w_int8.stride(1) != 1:
        raise ValueError("int8_mm_rescale needs row-major operands (x: (M, K), w: (N, K), stride 1 along K)")
    gated = _residual_operands(gate, residual, m, n, out_dtype)
    if config is None:
        config = pick_config(m, PERSISTENT_TMA and tma_fits(x_int8, w_int8, out_dtype), _warp_specialized_here(x_int8)
                             and (gated is None or RESIDUAL_WARP_SPECIALIZED))
    elif gated is not None and config in WS_CONFIGS and not RESIDUAL_WARP_SPECIALIZED:
        # the warp-specialized kernel's residual twin wrote wrong values on an H100: the TMA kernel's twin instead
        twin = config.replace("ws_", "tma_", 1)
        config = twin if twin in TMA_CONFIGS else "tma_128x256x128"
    if (config in TMA_CONFIGS or config in WS_CONFIGS) and not tma_fits(x_int8, w_int8, out_dtype):
        raise ValueError(f"config={config!r}: these operands cannot use TMA (needs a Hopper-or-newer GPU and 16-byte "
                         "aligned rows: K a multiple of 16, N of 8); use a config without 'tma_' or 'ws_'")
    # the interpreter's float32 -> bf16 cast does not round to nearest even: it stores fp32 and torch casts
    out = torch.empty((m, n), dtype=torch.float32 if INTERPRETED else out_dtype, device=x_int8.device)
    for tiles, launch in ((TMA_CONFIGS, _launch_tma), (WS_CONFIGS, _launch_ws)):
        if config in tiles:
            if gated is not None and not _tma_aligned(gated[1]):  # the persistent kernels read it through TMA
                gated = (gated[0], gated[1].clone(memory_format=torch.contiguous_format))
            with _on_device(x_int8):
                launch(x_int8, w_int8, out, x_scale, w_scale, bias, _INTERPRETER_TILE if INTERPRETED else tiles[config],
                       gated=gated)
            return out.to(out_dtype)
    block_m, block_n, block_k, group_m, warps, stages = _INTERPRETER_TILE if INTERPRETED else CONFIGS[config]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    operands = (x_int8, w_int8, out, x_scale.reshape(-1), w_scale.reshape(-1), bias if bias is not None else out)
    tiling = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, EVEN_K=k % block_k == 0,
                  num_warps=warps, num_stages=stages)
    with _on_device(x_int8):
        if gated is not None:
            gate, rows = gated
            _launcher(_int8_gemm_rescale_residual_kernel, x_int8.device)[grid](
                *operands, gate, rows, m, n, k, x_int8.stride(0), w_int8.stride(0), out.stride(0), rows.stride(0),
                HAS_BIAS=bias is not None, ROUND_TO=_ROUND_TO[out_dtype], **tiling)
        else:
            _launcher(_int8_gemm_rescale_kernel, x_int8.device)[grid](
                *operands, m, n, k, x_int8.stride(0), w_int8.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                **tiling)
    return out.to(out_dtype)


# ------------------------------------------------------------------ int8-weight matrix-vector product (GEMV)
@triton.jit
def _int8_gemv_kernel(x_ptr, w_ptr, w_scale_ptr, out_ptr, rows, n, k, stride_x, stride_out,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, j] = sum_i x[m, i] w[j, i] * w_scale[j] for a few rows of 16-bit x: each program reads BLOCK_N rows
    of the int8 weight once, whole (the bytes that bound the product), for every row of x."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in tl.range(0, k, BLOCK_K):
        i = first + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * k + i[None, :],
                    mask=(cols < n)[:, None] & (i < k)[None, :], other=0).to(tl.float32)  # (N, K) tile
        x = tl.load(x_ptr + m[:, None] * stride_x + i[None, :], mask=(m < rows)[:, None] & (i < k)[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    scale = tl.load(w_scale_ptr + cols, mask=cols < n, other=0.0)
    tl.store(out_ptr + m[:, None] * stride_out + cols[None, :], (acc * scale[None, :]).to(out_ptr.dtype.element_ty),
             mask=(m < rows)[:, None] & (cols < n)[None, :])


@triton.jit
def _int8_gemv_dot_kernel(x_ptr, w_ptr, w_scale_ptr, out_ptr, rows, n, k, stride_x, stride_w, stride_out,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          EVEN_K: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    """The same product on the tensor cores, transposed (out^T = w x^T): BLOCK_N weight rows are the MMA's rows, x's
    rows padded to BLOCK_M (16) its columns; the int8 weight tile is widened to x's dtype in registers (integers up
    to 127 are exact in bf16 and fp16). Why: loads that feed ``tl.dot`` are software-pipelined (several tiles in
    flight per program), which the reduction kernel's are not, and a GEMV is bound by the weight bytes in flight."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    cols_in = tl.minimum(cols, n - 1).to(tl.int64)  # out-of-range weight rows read the last one, masked at the store
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for first in range(0, k, BLOCK_K):
        i = first + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_ptr + cols_in[:, None] * stride_w + i[None, :])
        else:
            w = tl.load(w_ptr + cols_in[:, None] * stride_w + i[None, :], mask=(i < k)[None, :], other=0)
        x = tl.load(x_ptr + m[:, None] * stride_x + i[None, :], mask=(m < rows)[:, None] & (i < k)[None, :],
                    other=0.0)
        if FLOAT32_DOT:  # float32 x, or the interpreter (its bf16 dot is wrong): exact products in float32
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    scale = tl.load(w_scale_ptr + cols, mask=cols < n, other=0.0)
    tl.store(out_ptr + m[None, :] * stride_out + cols[:, None], (acc * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=(m < rows)[None, :] & (cols < n)[:, None])


GEMV_BLOCK_N = 16  # weight rows per program: FLUX's 9,216-18,432 output channels give 576-1,152 programs
# The tensor-core GEMV's tiles (BLOCK_N weight rows, BLOCK_K, warps, stages); x's rows are padded to 16. 64 rows make
# the MMA Hopper's warp-group m64n16k16; 32 take the older m16n8k16.
GEMV_DOT_TILES = {"dot_64x256": (64, 256, 4, 4), "dot_32x256": (32, 256, 4, 4), "dot_64x128": (64, 128, 4, 4),
                  "dot_128x128": (128, 128, 4, 4)}
# Which GEMV kernel ``int8_gemv`` launches: a tile of the tensor-core kernel, or "reduce" (the broadcast product
# summed in registers, the first one built: 0.43-0.53x cuBLAS's bf16 GEMV on an H100, its loads not pipelined).
# dot_32x256 by the per-kernel figures, each replayed from a CUDA graph over weight copies larger than L2, on an H200
# (benchmarks/results/bench_fp8_gemm_h200_gemv_20261206.json): 1.29x cuBLAS's bf16 GEMV at FLUX's 1 x 3072 x 18432
# (25.2 against 32.5 us) and 1.25x at 9216 outputs (16.0 against 20.0); dot_64x256 0.96x / 0.86x, "reduce" 0.56x /
# 0.60x. Twice as many programs as dot_64x256 keep more weight loads in flight.
GEMV_KERNEL = "dot_32x256"
GEMV_KERNELS = (*GEMV_DOT_TILES, "reduce")


def gemv_tiles(rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the reduction kernel for ``rows`` rows of x: the broadcast product holds BLOCK_M x 16 x
    BLOCK_K float32 values per program, kept at 4,096 (32 per thread at 4 warps)."""
    block_m = max(1, triton.next_power_of_2(rows))
    return block_m, max(16, 4096 // (block_m * GEMV_BLOCK_N))


def int8_gemv(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
    """x (rows, K) 16-bit with stride(-1) == 1, rows up to 16; w_int8 (N, K) contiguous; w_scale (1, N) fp32 ->
    (rows, N) in x's dtype. ``kernel``: one of GEMV_KERNELS (default GEMV_KERNEL)."""
    kernel = GEMV_KERNEL if kernel is None else kernel
    if kernel not in GEMV_KERNELS:
        raise ValueError(f"kernel={kernel!r} is not a GEMV kernel; use one of {GEMV_KERNELS}")
    rows, k = x.shape
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"int8_gemv takes up to {GEMV_MAX_ROWS} rows of x, got {rows}; use int8_mm_rescale (quantize "
                         "x first) or the layer's dequantized path for more")
    n = w_int8.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    with _on_device(x):
        if kernel in GEMV_DOT_TILES:
            block_n, block_k, warps, stages = GEMV_DOT_TILES[kernel]
            _launcher(_int8_gemv_dot_kernel, x.device)[(triton.cdiv(n, block_n),)](
                x, w_int8, w_scale, out, rows, n, k, x.stride(0), w_int8.stride(0), out.stride(0),
                BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                # float32 x multiplies in float32 (tl.dot would round it to tf32), as the interpreter does
                FLOAT32_DOT=INTERPRETED or x.dtype == torch.float32, num_warps=warps, num_stages=stages)
        else:
            block_m, block_k = gemv_tiles(rows)
            _launcher(_int8_gemv_kernel, x.device)[(triton.cdiv(n, GEMV_BLOCK_N),)](
                x, w_int8, w_scale, out, rows, n, k, x.stride(0), out.stride(0),
                BLOCK_M=block_m, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=block_k, num_warps=4)
    return out
