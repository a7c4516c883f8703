"""Triton kernel behind omni_accel/kernels/fp8_attention.py: flash attention with 8-bit operands.

Imported only when the FP8 attention path runs (triton is optional). One program owns BLOCK_M queries of one
(batch, head) and streams the keys in BLOCK_N tiles with the online softmax. S = Q K^T: int8 with per-token scales
(``QK_INT8``, int32 accumulator; with ``K_BLOCK`` K's scales are per block of keys, one scalar per tile) or e4m3 with
per-head scales (fp32 accumulator). P = exp2(S - running max); with
``PV_FP8`` it is rounded to e4m3 (scaled by P_SCALE first, so small probabilities stay out of e4m3's subnormals) and
O += P V runs in e4m3, else in V's 16-bit dtype; fp32 accumulator either way, one rescale by the V scale and the
softmax sum at the end. Hopper's 8-bit MMAs want both operands K-major: Q and K have the head dim contiguous, and an
e4m3 V comes transposed (tokens contiguous) from the quantization step.

Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (how CI tests it), with one fixed small tile.

``_int8_attention_tma_kernel`` is the same arithmetic (int8 Q K^T with per-token Q and per-block K scales, e4m3 P V)
in FlashAttention-3's shape as far as Triton goes: Q, K and V tiles arrive by TMA (descriptors built on the device,
one per (batch, head)), and with ``WARP_SPECIALIZE`` the key loop is split into a producer partition that issues the
loads and consumer warp groups that multiply and run the softmax. ``launch(..., design=...)`` picks it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

P_SCALE = 256.0  # P in [0, 1] -> [0, 256]: e4m3 is normal down to 2^-6, so p >= 2^-14 keeps 3 mantissa bits

_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm, bn, w, s in ((128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 4, 3), (64, 128, 4, 3), (128, 256, 8, 2))
]


@triton.jit
def _softmax_step(s, m_i, l_i, acc):
    """One key tile of the online softmax in base 2: the tile's probabilities, the new running max, and the running
    sum and output accumulator rescaled to it."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def _fp8_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    seq_q, seq_k, n_heads, qk_scale,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
    QK_INT8: tl.constexpr, PV_FP8: tl.constexpr, P_MULT: tl.constexpr, K_BLOCK: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)

    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + dims[None, :],
                mask=rows[:, None] < seq_q, other=0.0)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    # softmax in base 2: exp(x) = exp2(x * log2(e)); the dequantization scales fold into the same factor
    if QK_INT8:  # one scale per token: per query row here, per key column in the loop
        row_scale = qk_scale * tl.load(q_scale_ptr + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    else:  # one scale per (batch, head)
        row_scale = tl.zeros([BLOCK_M], tl.float32) + qk_scale * tl.load(q_scale_ptr + bh) * tl.load(k_scale_ptr + bh)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, seq_k, BLOCK_N):
        keys = start_n + cols
        if EVEN_K:
            k = tl.load(k_base + keys[None, :] * stride_ks + dims[:, None])
            v = tl.load(v_base + keys[:, None] * stride_vs + dims[None, :] * stride_vd)
        else:
            k = tl.load(k_base + keys[None, :] * stride_ks + dims[:, None], mask=keys[None, :] < seq_k, other=0.0)
            v = tl.load(v_base + keys[:, None] * stride_vs + dims[None, :] * stride_vd, mask=keys[:, None] < seq_k,
                        other=0.0)
        if QK_INT8 and K_BLOCK:  # one K scale for the whole tile (BLOCK_N divides K_BLOCK): a scalar
            tile_scale = tl.load(k_scale_ptr + bh * tl.cdiv(seq_k, K_BLOCK) + start_n // K_BLOCK)
            s = tl.dot(q, k).to(tl.float32) * (row_scale * tile_scale)[:, None]
        elif QK_INT8:
            col_scale = tl.load(k_scale_ptr + bh * seq_k + keys, mask=keys < seq_k, other=0.0)
            s = tl.dot(q, k).to(tl.float32) * row_scale[:, None] * col_scale[None, :]
        else:
            s = tl.dot(q, k) * row_scale[:, None]
        if not EVEN_K:
            s = tl.where(keys[None, :] < seq_k, s, float("-inf"))
        p, m_new, l_i, acc = _softmax_step(s, m_i, l_i, acc)
        if PV_FP8:
            acc = tl.dot((p * P_MULT).to(tl.float8e4nv), v, acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    if PV_FP8:
        out = acc * (tl.load(v_scale_ptr + bh) / P_MULT) / l_i[:, None]
    else:
        out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < seq_q)


@triton.jit
def _int8_attention_tma_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    seq_q, seq_k, n_heads, qk_scale,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
    P_MULT: tl.constexpr, K_BLOCK: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, STAGES: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    # one descriptor set per (batch, head): the tokens of a head are rows strided by the other heads
    q_desc = tl.make_tensor_descriptor(q_ptr + b * stride_qb + h * stride_qh, shape=[seq_q, HEAD_DIM],
                                       strides=[stride_qs, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(k_ptr + b * stride_kb + h * stride_kh, shape=[seq_k, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM])
    # V is stored transposed (tokens contiguous): e4m3 MMAs take both operands K-major
    v_desc = tl.make_tensor_descriptor(v_ptr + b * stride_vb + h * stride_vh, shape=[HEAD_DIM, seq_k],
                                       strides=[stride_vd, 1], block_shape=[HEAD_DIM, BLOCK_N])
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = q_desc.load([start_m * BLOCK_M, 0])
    row_scale = qk_scale * tl.load(q_scale_ptr + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    k_scales = k_scale_ptr + bh * tl.cdiv(seq_k, K_BLOCK)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in tl.range(0, seq_k, BLOCK_N, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([start_n, 0])
        s = tl.dot(q, k.T).to(tl.float32) * (row_scale * tl.load(k_scales + start_n // K_BLOCK))[:, None]
        if not EVEN_K:  # TMA fills the keys past the end with zeros; their scores must not count
            s = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] < seq_k, s, float("-inf"))
        p, m_new, l_i, acc = _softmax_step(s, m_i, l_i, acc)
        v = v_desc.load([0, start_n])
        acc = tl.dot((p * P_MULT).to(tl.float8e4nv), v.T, acc)
        m_i = m_new
    out = acc * (tl.load(v_scale_ptr + bh) / P_MULT) / l_i[:, None]
    dims = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < seq_q)


# (BLOCK_M, BLOCK_N, warps, stages) tried by the TMA kernel's autotuner (BLOCK_N divides K_BLOCK_TILES), without
# and with warp specialization: those that lower for sm_90 without spills. On an H100 64x128 with 4 warps and 3
# stages was the fastest at FLUX's and Wan's shapes (0.412 / 34.2 ms per call). Warp specialized, Triton 3.6 splits
# the 4-warp tiles into a producer and consumer warp groups, which ran at half the speed, and leaves the 8-warp tiles
# whole (benchmarks/results/bench_attention_h100_tma_tiles_20261207.json). OMNI_ACCEL_TMA_ATTENTION_CONFIGS and
# OMNI_ACCEL_TMA_ATTENTION_CONFIGS_WS ("bm,bn,warps,stages;...") replace the lists (for tuning runs).
_TMA_CONFIGS = {False: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 3)],
                True: [(64, 128, 4, 3), (64, 128, 4, 2), (128, 128, 8, 2), (128, 128, 8, 3)]}


def tile_name(tile: tuple[int, int, int, int]) -> str:
    """(BLOCK_M, BLOCK_N, warps, stages) -> "128x128w8s2", the name benchmarks give a tile."""
    return "{}x{}w{}s{}".format(*tile)


DESIGNS = ("pointer", "tma", "tma_ws")

_KEY = ["seq_q", "seq_k", "HEAD_DIM", "EVEN_K", "QK_INT8", "PV_FP8", "K_BLOCK"]
_autotuned = triton.autotune(configs=_CONFIGS, key=_KEY)(_fp8_attention_kernel)
# block-scaled K (fp8_attention.K_BLOCKS): only the tiles that lie inside one block of 128 keys
K_BLOCK_TILES = 128
_autotuned_k_blocks = triton.autotune(configs=[c for c in _CONFIGS if K_BLOCK_TILES % c.kwargs["BLOCK_N"] == 0],
                                      key=_KEY)(_fp8_attention_kernel)


_tma_autotuned: dict = {}


def _tma_kernel(warp_specialize: bool):
    if warp_specialize not in _tma_autotuned:
        variable = "OMNI_ACCEL_TMA_ATTENTION_CONFIGS" + ("_WS" if warp_specialize else "")
        chosen = os.environ.get(variable, "").strip()
        tiles = [_checked_tile(entry, variable) for entry in chosen.split(";") if entry.strip()] if chosen else \
            _TMA_CONFIGS[warp_specialize]
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": st}, num_warps=w, num_stages=st)
                   for bm, bn, w, st in tiles]
        _tma_autotuned[warp_specialize] = triton.autotune(
            configs=configs, key=["seq_q", "seq_k", "HEAD_DIM", "EVEN_K", "K_BLOCK", "WARP_SPECIALIZE"]
        )(_int8_attention_tma_kernel)
    return _tma_autotuned[warp_specialize]


def _checked_tile(tile, source: str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) from a tuple or a "bm,bn,warps,stages" string, refused unless each key tile
    lies inside one block of K scales (BLOCK_N divides K_BLOCK_TILES), which the kernel's scale lookup and its
    masking of keys past the end (decided per 128 keys) rely on."""
    try:
        values = tuple(int(x) for x in (tile.split(",") if isinstance(tile, str) else tile))
    except (TypeError, ValueError):
        values = ()
    if len(values) != 4 or min(values) < 1 or K_BLOCK_TILES % values[1]:
        raise ValueError(f"{source}: tile {tile!r} is not BLOCK_M,BLOCK_N,warps,stages with BLOCK_N dividing "
                         f"{K_BLOCK_TILES}; e.g. 64,128,4,3")
    return values  # type: ignore[return-value]


def tma_ready(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the TMA kernel cannot take these operands (None if it can): TMA wants 16-byte aligned bases and row
    strides, and the head dim contiguous (V's tokens contiguous)."""
    for name, t, inner in (("q", q, 3), ("k", k, 3), ("v", v, 2)):
        if t.stride(inner) != 1:
            return f"{name} is not contiguous along dim {inner}"
        row_stride = t.stride(2 if inner == 3 else 3) * t.element_size()
        if row_stride % 16 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 or \
                (t.stride(1) * t.element_size()) % 16:
            return f"{name}'s base or strides are not 16-byte aligned (strides {tuple(t.stride())})"
    return None


def _launch_tma(q, k, v, q_scale, k_scale, v_scale, sm_scale, out, k_block: int, warp_specialize: bool,
                interpreted: bool, tile: tuple[int, int, int, int] | None) -> torch.Tensor:
    from .int8_gemm_triton import _ensure_scratch_allocator

    if k_block % K_BLOCK_TILES:
        raise ValueError(f"the TMA attention kernel needs K scales per block of a multiple of {K_BLOCK_TILES} keys, "
                         f"got k_block={k_block}")
    reason = tma_ready(q, k, v)
    if reason is not None:
        raise ValueError(f"the TMA attention kernel cannot read these operands: {reason}")
    if not interpreted:
        _ensure_scratch_allocator()
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    args = (q, k, v, out, q_scale, k_scale, v_scale, seq_q, seq_k, heads, sm_scale * 1.4426950408889634,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(3), out.stride(0), out.stride(1), out.stride(2))
    flags = dict(HEAD_DIM=head_dim, P_MULT=P_SCALE, K_BLOCK=k_block, WARP_SPECIALIZE=warp_specialize)
    if interpreted:
        block = 16
        grid = (triton.cdiv(seq_q, block), batch * heads)
        _int8_attention_tma_kernel[grid](*args, BLOCK_M=block, BLOCK_N=block, EVEN_K=seq_k % block == 0, STAGES=1,
                                         **flags)
        return out

    def grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads)

    # every tile's BLOCK_N divides K_BLOCK_TILES (_checked_tile), so whole blocks of keys mean whole tiles
    flags["EVEN_K"] = seq_k % K_BLOCK_TILES == 0
    if tile is not None:  # one tile, no autotuning (benchmarks time each tile this way)
        block_m, block_n, warps, stages = _checked_tile(tile, "tile")
        _int8_attention_tma_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=warps,
                                         num_stages=stages, **flags)
        return out
    _tma_kernel(warp_specialize)[grid](*args, **flags)
    return out


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
           v_scale: torch.Tensor, sm_scale: float, out: torch.Tensor, qk_int8: bool, pv_fp8: bool,
           interpreted: bool, k_block: int = 0, design: str = "pointer",
           tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q, k: (B, H, S, D) views with D contiguous (e4m3, or int8 with per-token scales (B, H, S); with
    ``k_block``, K's scales are per block of that many keys (B, H, ceil(S / k_block)));
    v: (B, H, S_k, D) view, any strides (e4m3 with S_k contiguous when ``pv_fp8``, else 16-bit);
    out: (B, S, H, D) with D contiguous, written in place and returned. ``design`` "tma" / "tma_ws" runs the TMA
    kernel (int8 Q K^T with block-scaled K and e4m3 P V only; "tma_ws" warp specialized); ``tile`` (BLOCK_M,
    BLOCK_N, warps, stages) runs it with that tile instead of autotuning."""
    if design not in DESIGNS:
        raise ValueError(f"design={design!r} is not known; use one of {', '.join(DESIGNS)}")
    if design != "pointer":
        if not (qk_int8 and pv_fp8 and k_block):
            raise ValueError(f"design={design!r} runs int8 Q K^T with per-block K scales and e4m3 P V only (mode "
                             "'int8_block_fp8')")
        return _launch_tma(q, k, v, q_scale, k_scale, v_scale, sm_scale, out, k_block, design == "tma_ws",
                           interpreted, tile)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    args = (q, k, v, out, q_scale, k_scale, v_scale, seq_q, seq_k, heads, sm_scale * 1.4426950408889634,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), v.stride(3), out.stride(0), out.stride(1), out.stride(2))
    if k_block and (not qk_int8 or k_block % K_BLOCK_TILES):
        raise ValueError(f"k_block={k_block} needs int8 Q K^T and a multiple of {K_BLOCK_TILES} (the key tiles' "
                         "widths must divide it)")
    flags = dict(HEAD_DIM=head_dim, QK_INT8=qk_int8, PV_FP8=pv_fp8, P_MULT=P_SCALE, K_BLOCK=k_block)
    if interpreted:  # one small tile: the interpreter's cost grows with the tile, and autotuning would run it 5x
        block = 16
        grid = (triton.cdiv(seq_q, block), batch * heads)
        _fp8_attention_kernel[grid](*args, BLOCK_M=block, BLOCK_N=block, EVEN_K=seq_k % block == 0, **flags)
        return out

    def grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads)

    # EVEN_K for the largest tile tried: 4608 = 18 x 256 covers FLUX 1024², one mask-free path for every config
    (_autotuned_k_blocks if k_block else _autotuned)[grid](*args, EVEN_K=seq_k % 256 == 0, **flags)
    return out
