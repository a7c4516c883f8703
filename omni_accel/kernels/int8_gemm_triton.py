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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_triton import INTERPRETED, _launcher, _on_device

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): Hopper tiles (wgmma takes int8 with K = 32 per instruction).
# Measured on an H200 on FLUX.1-dev's block shapes (benchmarks/results/bench_fp8_gemm_h200_int8_20261205.json):
# 128x256x128 is the fastest or within 1 % of it from 4,096 rows up (910-1,063 TOPS); at 512 rows 128x128x128 is 4 %
# ahead. The interpreter (CI) gets small tiles so a test runs in seconds.
CONFIGS = {
    "128x256x128": (128, 256, 128, 8, 8, 3),
    "128x128x128": (128, 128, 128, 8, 4, 4),
    "256x128x128": (256, 128, 128, 8, 8, 3),
    "128x256x64": (128, 256, 64, 8, 8, 4),
}
FEW_ROWS = 1024  # up to this many rows: the smaller tile (more tiles to fill the GPU)


def pick_config(rows: int) -> str:
    return "128x128x128" if rows <= FEW_ROWS else "128x256x128"


_INTERPRETER_TILE = (32, 32, 32, 4, 4, 1)


@triton.jit
def _int8_gemm_rescale_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
):
    # grouped tile order: GROUP_M row tiles share each column tile while it is in L2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # out-of-range rows / columns read a valid row (the last) and are masked at the store: loads stay unmasked
    rows_in = tl.minimum(rows, M - 1).to(tl.int64)
    cols_in = tl.minimum(cols, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_in[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols_in[None, :] * stride_wn + ks[:, None]  # (BLOCK_K, BLOCK_N) view of the (N, K) weight
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
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
    x_scale = tl.load(x_scale_ptr + rows_in)
    w_scale = tl.load(w_scale_ptr + cols_in)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


def int8_mm_rescale(x_int8: torch.Tensor, w_int8: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, config: str | None = None) -> torch.Tensor:
    """``(x_int8 @ w_int8.T) * x_scale * w_scale (+ bias)`` in ``out_dtype``, the int32 sums never leaving the chip;
    ``config`` names a tile of CONFIGS (default: ``pick_config`` for the row count)."""
    m, k = x_int8.shape
    n = w_int8.shape[0]
    if x_int8.stride(1) != 1 or w_int8.stride(1) != 1:
        raise ValueError("int8_mm_rescale needs row-major operands (x: (M, K), w: (N, K), stride 1 along K)")
    tile = CONFIGS[config or pick_config(m)]
    block_m, block_n, block_k, group_m, warps, stages = _INTERPRETER_TILE if INTERPRETED else tile
    # the interpreter's float32 -> bf16 cast does not round to nearest even: it stores fp32 and torch casts
    out = torch.empty((m, n), dtype=torch.float32 if INTERPRETED else out_dtype, device=x_int8.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    with _on_device(x_int8):
        _launcher(_int8_gemm_rescale_kernel, x_int8.device)[grid](
            x_int8, w_int8, out, x_scale.reshape(-1), w_scale.reshape(-1), bias if bias is not None else out, m, n, k,
            x_int8.stride(0), w_int8.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
            EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages)
    return out.to(out_dtype)
