"""SageAttention's operand preparation in four Triton kernels (``sage_attention.PREP_KERNELS``).

The package's Hopper attention kernel takes int8 Q and K with per-thread scales, K minus its token mean, and V in
e4m3 with a scale per channel, transposed and reordered for the FP8 MMA (``sage_attention.quantize_queries`` /
``quantize_keys`` / ``quantize_values`` spell the layouts out in PyTorch). Traced into the compiled graph, inductor
turns those expressions into about 10 ms of kernels per FLUX step, more than the 4 ms the attention kernel saves
against cuDNN (docs/kernels.md, "SageAttention"). Here K and V are read twice, Q once:

- ``_kv_partials_kernel``: per 128 tokens and head, K's column sums and V's column maxima of |v| (the two
  reductions over all tokens that K's smoothing and V's scales need), written as partials;
- ``_queries_kernel``: per 16 queries and head, the per-thread scales (queries t and t + 8 share one) and int8 Q;
- (K's mean and V's inverse scales finished from the partials by PyTorch: batch x heads x D values)
- ``_keys_kernel``: per 128 keys and head, K minus its mean, the per-thread-group scales (keys 8 i + 2 t + e share
  thread t's) and int8 K;
- ``_values_kernel``: per 128 keys and head, V scaled to e4m3 per channel, its keys reordered within each 16 as the
  FP8 MMA reads them, stored transposed.

The roundings are the package's: half away from zero for int8, scale = amax / 127 + 1e-7 (correctly rounded
division, as PyTorch's). K's mean is taken and
subtracted in float32 (the PyTorch expression rounds it to the input's 16 bits), so an int8 value may differ by one
where the two fall on either side of a rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .epilogue_triton import _as_16_bit, _normed_rows, _rotary_tile, _rotated
from .fused_triton import INTERPRETED, _launcher, _on_device
# the Hopper kernel's tiles and V's e4m3 range, as the PyTorch expressions use them; the key tile is also the token
# chunk of the partial reductions
from .sage_attention import _WARP_QUERIES, KEY_TILE, QUERY_TILE, V_FP8_MAX, padded_count


@triton.jit
def _round_to_int8(x):
    """Half away from zero, then the truncating cast (the package's rounding)."""
    return (x + tl.where(x >= 0, 0.5, -0.5)).to(tl.int8)


@triton.jit
def _program_tile(heads, TOKENS: tl.constexpr, D: tl.constexpr):
    """This program's (batch * heads index, batch, head, token rows, head-dim columns): axis 0 walks batch x heads,
    axis 1 tiles of TOKENS tokens."""
    bh = tl.program_id(0)
    # 64-bit offsets: a fused q / k / v view at 720p, batch 2, passes 2^31 across the batch, and a token times its
    # stride (3 x 5,120 in Wan's fused view) does from about 140,000 tokens
    b = (bh // heads).to(tl.int64)
    rows = (tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    return bh, b, bh % heads, rows, tl.arange(0, D)


@triton.jit
def _kv_partials_kernel(k_ptr, v_ptr, k_sum_ptr, v_amax_ptr, n, heads, chunks, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh,
                        TOKENS: tl.constexpr, D: tl.constexpr, SUB: tl.constexpr = 128, STAGES: tl.constexpr = 1,
                        HAS_K: tl.constexpr = True):
    """Per TOKENS tokens and head: K's column sums and V's column maxima, read SUB tokens at a time (a loop the
    compiler may pipeline over STAGES; SUB == TOKENS reads the tile at once). Without HAS_K, V's maxima only (K's
    sums came from the kernel that computed K)."""
    bh, b, h, _, cols = _program_tile(heads, TOKENS, D)
    chunk = tl.program_id(1)
    k_sum = tl.zeros((D,), tl.float32)
    v_amax = tl.zeros((D,), tl.float32)
    for start in tl.range(0, TOKENS, SUB, num_stages=STAGES):
        rows = (chunk * TOKENS + start + tl.arange(0, SUB)).to(tl.int64)
        inside = (rows < n)[:, None]
        if HAS_K:
            k = tl.load(k_ptr + b * k_sb + h * k_sh + rows[:, None] * k_sn + cols[None, :], mask=inside, other=0.0)
            k_sum += tl.sum(k.to(tl.float32), axis=0)
        v = tl.load(v_ptr + b * v_sb + h * v_sh + rows[:, None] * v_sn + cols[None, :], mask=inside, other=0.0)
        v_amax = tl.maximum(v_amax, tl.max(tl.abs(v.to(tl.float32)), axis=0))
    out = (bh * chunks + chunk) * D + cols
    if HAS_K:
        tl.store(k_sum_ptr + out, k_sum)
    tl.store(v_amax_ptr + out, v_amax)


@triton.jit
def _quantized_queries(x, D: tl.constexpr):
    """16 queries (16, D) float32 -> (int8 values, the 8 per-thread scales: queries t and t + 8 share one)."""
    pair_amax = tl.max(tl.max(tl.reshape(tl.abs(x), (2, 8, D)), axis=2), axis=0)  # (8,): queries t and t + 8
    scale = tl.math.div_rn(pair_amax, tl.full((8,), 127.0, tl.float32)) + 1e-7
    row_scale = tl.reshape(tl.broadcast_to(scale[None, :], (2, 8)), (16,))
    return _round_to_int8(tl.math.div_rn(x, row_scale[:, None])), scale


@triton.jit
def _queries_kernel(q_ptr, q8_ptr, scale_ptr, n, heads, groups, q_sb, q_sn, q_sh, o_sb, o_sn, o_sh,
                    D: tl.constexpr):
    bh, b, h, rows, cols = _program_tile(heads, 16, D)  # 16 queries
    group = tl.program_id(1)
    x = tl.load(q_ptr + b * q_sb + h * q_sh + rows[:, None] * q_sn + cols[None, :], mask=(rows < n)[:, None],
                other=0.0).to(tl.float32)
    q8, scale = _quantized_queries(x, D)
    tl.store(q8_ptr + b * o_sb + h * o_sh + rows[:, None] * o_sn + cols[None, :], q8, mask=(rows < n)[:, None])
    tl.store(scale_ptr + (bh * groups + group) * 8 + tl.arange(0, 8), scale)


@triton.jit
def _normed_tokens(src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, c, s, b, h, position, ok,
                   seq, stride_src, first_col, stride_src2, first_col2, tokens_a, eps, TOKENS: tl.constexpr,
                   D: tl.constexpr, HAS_BIAS: tl.constexpr, TWO: tl.constexpr, BF16: tl.constexpr,
                   BIT_ROUND: tl.constexpr):
    """What qk_norm_rope's 16-bit output holds for head ``h`` of sample ``b`` at ``position`` (TOKENS x 1; ``c``,
    ``s`` the rotary tables there): the projection's columns RMS-normalized, rotated and rounded to 16 bits, in
    float32; zero where not ``ok``."""
    y = _normed_rows(src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, b, position, h, ok, seq, stride_src,
                     first_col, stride_src2, first_col2, tokens_a, eps, D, HAS_BIAS, TWO)
    # BIT_ROUND (the interpreter): the bf16 rounding done on the bits, as its own float32 -> bf16 cast truncates
    return tl.where(ok, _as_16_bit(_rotated(y, c, s, TOKENS, D), BF16, BIT_ROUND), 0.0)


@triton.jit
def _head_group_tile(heads, TOKENS: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr):
    """This program's (sample, first head, token rows (int64)): axis 0 walks samples x groups of HEADS_PER_PROGRAM
    heads, axis 1 tiles of TOKENS tokens."""
    groups = heads // HEADS_PER_PROGRAM
    b = (tl.program_id(0) // groups).to(tl.int64)
    rows = (tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    return b, (tl.program_id(0) % groups) * HEADS_PER_PROGRAM, rows


@triton.jit
def _normed_queries_kernel(src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, cos_ptr, sin_ptr, q8_ptr, scale_ptr,
                           seq, heads, groups, stride_src, first_col, stride_src2, first_col2, tokens_a, eps,
                           D: tl.constexpr, HAS_BIAS: tl.constexpr, TWO: tl.constexpr, BF16: tl.constexpr,
                           BIT_ROUND: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr = 1):
    """``_queries_kernel`` on Q computed here from the fused projection (qk_norm_rope's rows), never stored in 16
    bits: per 16 queries and HEADS_PER_PROGRAM heads; int8 Q (batch, seq, heads, D) contiguous."""
    b, first_head, rows = _head_group_tile(heads, 16, HEADS_PER_PROGRAM)
    group = tl.program_id(1)
    ok = (rows < seq)[:, None]
    c, s = _rotary_tile(cos_ptr, sin_ptr, rows[:, None], ok, D)
    cols = tl.arange(0, D)[None, :]
    for i in range(HEADS_PER_PROGRAM):
        h = first_head + i
        x = _normed_tokens(src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, c, s, b, h, rows[:, None], ok, seq,
                           stride_src, first_col, stride_src2, first_col2, tokens_a, eps, 16, D, HAS_BIAS, TWO,
                           BF16, BIT_ROUND)
        q8, scale = _quantized_queries(x, D)
        tl.store(q8_ptr + ((b * seq + rows[:, None]) * heads + h) * D + cols, q8, mask=ok)
        tl.store(scale_ptr + ((b * heads + h) * groups + group) * 8 + tl.arange(0, 8), scale)


@triton.jit
def _normed_keys_kernel(src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, cos_ptr, sin_ptr, k_ptr, k_sum_ptr,
                        seq, heads, chunks, stride_src, first_col, stride_src2, first_col2, tokens_a, eps,
                        TOKENS: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, TWO: tl.constexpr,
                        BF16: tl.constexpr, BIT_ROUND: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr = 1):
    """K computed from the fused projection (qk_norm_rope's 16-bit rows), stored (batch, seq, heads, D) for the keys
    kernel, with its column sums per TOKENS tokens and head (the partials of K's mean): K is not read back for them.
    Per TOKENS tokens and HEADS_PER_PROGRAM heads."""
    b, first_head, rows = _head_group_tile(heads, TOKENS, HEADS_PER_PROGRAM)
    chunk = tl.program_id(1)
    ok = (rows < seq)[:, None]
    c, s = _rotary_tile(cos_ptr, sin_ptr, rows[:, None], ok, D)
    cols = tl.arange(0, D)
    for i in range(HEADS_PER_PROGRAM):
        h = first_head + i
        x = _normed_tokens(src_ptr, bias_ptr, w_ptr, src2_ptr, bias2_ptr, w2_ptr, c, s, b, h, rows[:, None], ok, seq,
                           stride_src, first_col, stride_src2, first_col2, tokens_a, eps, TOKENS, D, HAS_BIAS, TWO,
                           BF16, BIT_ROUND)
        tl.store(k_ptr + ((b * seq + rows[:, None]) * heads + h) * D + cols[None, :], x.to(k_ptr.dtype.element_ty),
                 mask=ok)
        tl.store(k_sum_ptr + ((b * heads + h) * chunks + chunk) * D + cols, tl.sum(x, axis=0))


@triton.jit
def _keys_kernel(k_ptr, mean_ptr, k8_ptr, scale_ptr, n, heads, tiles, k_sb, k_sn, k_sh, o_sb, o_sn, o_sh,
                 D: tl.constexpr):
    bh, b, h, rows, cols = _program_tile(heads, 128, D)  # 128 keys
    tile = tl.program_id(1)
    mean = tl.load(mean_ptr + bh * D + cols)
    inside = (rows < n)[:, None]
    x = tl.load(k_ptr + b * k_sb + h * k_sh + rows[:, None] * k_sn + cols[None, :], mask=inside, other=0.0)
    x = tl.where(inside, x.to(tl.float32) - mean[None, :], 0.0)  # padded keys stay zero, as the package pads after
    # key 8 i + 2 t + e (i < 16, t < 4, e < 2) belongs to thread t's group
    group_amax = tl.max(tl.max(tl.max(tl.reshape(tl.abs(x), (16, 4, 2, D)), axis=3), axis=2), axis=0)  # (4,)
    scale = tl.math.div_rn(group_amax, tl.full((4,), 127.0, tl.float32)) + 1e-7
    row_scale = tl.reshape(tl.broadcast_to(scale[None, :, None], (16, 4, 2)), (128,))
    k8 = _round_to_int8(tl.math.div_rn(x, row_scale[:, None]))
    tl.store(k8_ptr + b * o_sb + h * o_sh + rows[:, None] * o_sn + cols[None, :], k8, mask=inside)
    tl.store(scale_ptr + (bh * tiles + tile) * 4 + tl.arange(0, 4), scale)


@triton.jit
def _values_kernel(v_ptr, inverse_ptr, v8_ptr, n, heads, v_sb, v_sn, v_sh, o_sb, o_sd, o_sh, D: tl.constexpr):
    bh, b, h, rows, cols = _program_tile(heads, 128, D)  # 128 keys
    inverse = tl.load(inverse_ptr + bh * D + cols)
    x = tl.load(v_ptr + b * v_sb + h * v_sh + rows[:, None] * v_sn + cols[None, :], mask=(rows < n)[:, None],
                other=0.0).to(tl.float32) * inverse[None, :]
    # within each 16 keys, key 8 b + 2 a + c moves to 4 a + 2 b + c (the FP8 MMA's operand order)
    x = tl.reshape(tl.permute(tl.reshape(x, (8, 2, 4, 2, D)), (0, 2, 1, 3, 4)), (128, D))
    v8 = tl.trans(x.to(v8_ptr.dtype.element_ty))  # (D, 128): keys along the output's contiguous dim
    tl.store(v8_ptr + b * o_sb + h * o_sh + cols[:, None] * o_sd + rows[None, :], v8)


# Launch settings of the four kernels: warps per program, and the partial-reduction kernel's sub-tile (tokens read per
# loop step of its 128-token chunk) and pipeline stages. The defaults read the chunk in one step, as the kernels timed
# on an H200 did (5.1 ms per FLUX step for the four, about twice what their bytes need: docs/kernels.md,
# "SageAttention"); the others are for benchmarks' A/B rows (32-token steps over 3 stages were slower on Wan 81
# frames, bench_peers_h100_wan81_prepk_sub32_20261206.json). A sub-tile changes the order of K's
# float32 sums, so K's mean may differ in its last bits (and with it an int8 K value at a rounding boundary).
PREP_WARPS = {"kv_partials": 8, "queries": 2, "keys": 8, "values": 8, "normed_queries": 2, "normed_keys": 4}
KV_SUBTILE, KV_STAGES = 128, 1


def quantize(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q8, q_scale, k8, k_scale, v8, v_scale) as ``sage_attention.quantize_queries(query)``, ``quantize_keys(key)``
    and ``quantize_values(value)`` return them; inputs (batch, tokens, heads, D) 16-bit with D a power of two and
    stride 1 along D, the same batch, heads and D, any token counts."""
    b, nq, h, d = query.shape
    nk = key.shape[1]
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        raise ValueError("sage_prep_triton.quantize needs stride 1 along the head dim; pass .contiguous() tensors")
    device = query.device
    chunks = triton.cdiv(nk, KEY_TILE)
    k_sum = torch.empty(b, h, chunks, d, dtype=torch.float32, device=device)
    v_amax = torch.empty(b, h, chunks, d, dtype=torch.float32, device=device)
    q8, q_scale, q_groups = _query_outputs(b, nq, h, d, device)
    ks, vs = key.stride(), value.stride()
    with _on_device(query):
        _launcher(_kv_partials_kernel, device)[(b * h, chunks)](
            key, value, k_sum, v_amax, nk, h, chunks, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
            TOKENS=KEY_TILE, D=d, SUB=KV_SUBTILE, STAGES=KV_STAGES, num_warps=PREP_WARPS["kv_partials"])
        _launcher(_queries_kernel, device)[(b * h, q_groups)](
            query, q8, q_scale, nq, h, q_groups, *query.stride()[:3], *q8.stride()[:3], D=d,
            num_warps=PREP_WARPS["queries"])
        return (q8, q_scale, *_keys_and_values(key, value, k_sum, v_amax))


def _query_outputs(b: int, nq: int, h: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """int8 Q, its scales (batch, heads, 8 per 16 queries of the padded tokens) and the number of 16-query groups."""
    q_groups = padded_count(nq, QUERY_TILE) // _WARP_QUERIES
    return (torch.empty(b, nq, h, d, dtype=torch.int8, device=device),
            torch.empty(b, h, q_groups * 8, dtype=torch.float32, device=device), q_groups)


def _keys_and_values(key: torch.Tensor, value: torch.Tensor, k_sum: torch.Tensor,
                     v_amax: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(k8, k_scale, v8, v_scale) from K's column sums (batch, heads, chunks, D) and V's column maxima (batch, heads,
    128-key chunks, D) per chunk of tokens: the partials finished once per (batch, head) by PyTorch (b x h x D
    values), with the reference's own expressions for V's inverse scale, so every tile loads D floats."""
    b, nk, h, d = key.shape
    device = key.device
    chunks = triton.cdiv(nk, KEY_TILE)
    k8 = torch.empty(b, nk, h, d, dtype=torch.int8, device=device)
    k_scale = torch.empty(b, h, chunks * 4, dtype=torch.float32, device=device)
    # the interpreter's float32 -> e4m3 cast loses the rounding carry (124 -> 64): there the kernel writes float32
    # and torch rounds it, as the GPU's cvt.rn.satfinite does
    v8 = torch.empty(b, d, h, chunks * KEY_TILE, dtype=torch.float32 if INTERPRETED else torch.float8_e4m3fn,
                     device=device)
    mean = k_sum.sum(dim=2) / nk
    amax = v_amax.amax(dim=2)
    inverse = torch.where(amax > 0, V_FP8_MAX / amax, 0.0)
    ks, vs = key.stride(), value.stride()
    _launcher(_keys_kernel, device)[(b * h, chunks)](
        key, mean, k8, k_scale, nk, h, chunks, ks[0], ks[1], ks[2], *k8.stride()[:3], D=d,
        num_warps=PREP_WARPS["keys"])
    _launcher(_values_kernel, device)[(b * h, chunks)](
        value, inverse, v8, nk, h, vs[0], vs[1], vs[2], v8.stride(0), v8.stride(1), v8.stride(2), D=d,
        num_warps=PREP_WARPS["values"])
    return k8, k_scale, v8.to(torch.float8_e4m3fn), amax / V_FP8_MAX


# Tokens per program of the normed-keys kernel: each writes one partial column sum per 32 keys and head (the normed
# rows of 32 keys x 128 in registers with the rotary's swap, without spills at 4 warps).
NORMED_KEY_TOKENS = 32
# Heads per program of the two normed kernels (the largest of 8, 4, 2, 1 up to it that divides the heads): a program
# then loads its tokens' rotary rows once for all of them. One head per program: Q 2.2 and K 2.4 ms per FLUX step on an
# H100 (bench_peers_h100_flux_bias_sage_20261206.json); 8 heads: 3.4 and 2.3 ms, 4 heads: 2.9 and 2.3 ms
# (bench_peers_h100_flux_fromnorms_20261206.json): the loop over heads serializes a program's loads, and the rotary
# rows were not what bound it.
NORMED_HEADS_PER_PROGRAM = 1


def _heads_per_program(heads: int) -> int:
    return next(n for n in (8, 4, 2, 1) if n <= NORMED_HEADS_PER_PROGRAM and heads % n == 0)


def quantize_normed(queries: tuple, keys: tuple, heads: int, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    tokens_a: int, dtype: torch.dtype, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``quantize(q, k, value)`` where q and k are what ``epilogue_triton.qk_norm_rope`` would return in ``dtype``
    for ``queries`` / ``keys`` = (src, bias, first column, norm weight, src2, bias2, first column 2, weight2; the
    second stream's four None / 0 without one), viewed as (batch, seq, heads, D) like ``value``. Q is quantized from
    registers (never written in 16 bits); K is written once, with its column sums, and read once by the keys
    kernel."""
    b, seq, h, d = value.shape
    if h != heads or seq != cos.shape[0] or value.stride(-1) != 1:
        raise ValueError(f"sage_prep_triton.quantize_normed: value {tuple(value.shape)} (stride 1 along D) must hold "
                         f"{heads} heads of the {cos.shape[0]} positions of the rotary tables")
    device = value.device
    q8, q_scale, q_groups = _query_outputs(b, seq, h, d, device)
    key_chunks = triton.cdiv(seq, NORMED_KEY_TOKENS)
    k_sum = torch.empty(b, h, key_chunks, d, dtype=torch.float32, device=device)
    key = torch.empty(b, seq, h, d, dtype=torch.float32 if INTERPRETED else dtype, device=device)  # as v8 above
    chunks = triton.cdiv(seq, KEY_TILE)
    v_amax = torch.empty(b, h, chunks, d, dtype=torch.float32, device=device)
    vs = value.stride()
    per_program = _heads_per_program(h)
    head_groups = b * h // per_program
    with _on_device(value):
        for kernel, parts, grid, outputs, extra in (
                (_normed_queries_kernel, queries, (head_groups, q_groups), (q8, q_scale),
                 {"num_warps": PREP_WARPS["normed_queries"]}),
                (_normed_keys_kernel, keys, (head_groups, key_chunks), (key, k_sum),
                 {"TOKENS": NORMED_KEY_TOKENS, "num_warps": PREP_WARPS["normed_keys"]})):
            src, bias, first_col, weight, src2, bias2, first_col2, weight2 = parts
            second = src2 is not None
            _launcher(kernel, device)[grid](
                src, bias if bias is not None else src, weight, src2 if second else src,
                bias2 if bias2 is not None else src, weight2 if second else weight, cos, sin, *outputs, seq, h,
                grid[1], src.stride(0), first_col, src2.stride(0) if second else 0, first_col2, tokens_a, float(eps),
                D=d, HAS_BIAS=bias is not None, TWO=second, BF16=dtype == torch.bfloat16, BIT_ROUND=INTERPRETED,
                HEADS_PER_PROGRAM=per_program, **extra)
        _launcher(_kv_partials_kernel, device)[(b * h, chunks)](
            value, value, v_amax, v_amax, seq, h, chunks, 0, 0, 0, vs[0], vs[1], vs[2], TOKENS=KEY_TILE, D=d,
            SUB=KV_SUBTILE, STAGES=KV_STAGES, HAS_K=False, num_warps=PREP_WARPS["kv_partials"])
        return (q8, q_scale, *_keys_and_values(key.to(dtype), value, k_sum, v_amax))
