"""SageAttention (the ``sageattention`` package) behind one custom op: ``attention="sage"``.

SageAttention 2 multiplies Q K^T in int8 (K smoothed by its token mean, scales per thread group) and P V in FP8 with
fp32 accumulation (Hopper). Measured on an H200 beside int8 linears: the attention's kernel time per FLUX step 19.1
against cuDNN's 24.3 ms, per Wan-81-frame step 1,057 against 1,513 ms; on the built-in model its images stay
within 46.8 dB of bf16 over 16 held-out captions (none of 100 captions below 33 dB; docs/fp8.md).

Why an op of our own instead of diffusers' ``sage`` dispatcher backend: ``sageattn`` is Python around CUDA and
Triton kernels that dynamo cannot trace, so every attention call broke the compiled block in two (27-48 ms of idle
GPU per FLUX forward, measured). As the custom op ``omni_accel::sage_attention`` it is opaque to inductor like
SDPA, reached through the same route as FlashAttention-4 (``fp8_attention.route_transformer``). Calls it cannot
serve (a mask, causal, dropout, fp32, head dims over 128, grouped heads) go to the original dispatcher; a call the
package fails on is computed by SDPA inside the op, logged once per shape (``refused_shapes()``).

CUDA graphs: the package launches its CUDA kernels (the attention itself, V's FP8 transposition) on the legacy
default stream, not the current one. A CUDA graph captured on its own stream therefore runs them once at capture
and leaves them out: every replay would hand back the attention of the captured inputs (and a benchmark replaying
the same inputs would not see it). So the op runs outside the graph: under the whole-forward CUDA graph
(``compile="max"``, and ``compile=True`` with ``quant="fp8"`` or ``"int8"``) the capture is cut into one graph per
stretch between attention calls (``cuda_graphs.run_outside_graph``), and the
call runs on the default stream, ordered with the caller's (``on_default_stream``).

With sequence parallelism the pass keeps diffusers' ``sage`` backend: the ring / Ulysses paths need the
dispatcher's own kernels.

``attention="auto"`` sends the int8 stack's calls with at least ``AUTO_MIN_TOKENS`` keys here on Hopper (video
self-attention), and keeps cuDNN for shorter ones, where the operands' preparation costs more than the attention
kernel saves (the package's own and, since, the in-graph one below: FLUX 92.3 against 88.9 ms with cuDNN).

Q, K and V quantized in the compiled graph (``PREP_IN_GRAPH``, on: 5 ms per FLUX step less than the package's own
preparation on an H100): the route computes the
package's operands with torch operations (``quantize_queries`` / ``quantize_keys`` / ``quantize_values``, the same
layouts and roundings: Q and K equal its per-thread Triton kernels' bit for bit), so inductor fuses them into the
kernels that produce q, k and v, and ``omni_accel::sage_attention_quantized`` runs only the package's Hopper kernel
(off the GPU: the float32 attention of its operands).

K's smoothing (``SMOOTH_KEYS_IN_GRAPH``, off: timed on Wan 81 frames, no gain): SageAttention subtracts K's mean
over the tokens before quantizing K (softmax ignores a vector added to every key, so the result is unchanged) in two
eager kernels of its own, 1.6 + 2.2 ms per FLUX step on an H100 (a mean and a bf16 subtraction over every key). With the
switch on, the route subtracts the mean in the compiled block instead, in float32 where inductor fuses it with the
kernels that produce K, and the op calls the package's Hopper kernel entry with its smoothing off. On Wan 81 frames
(int8 stack, auto's route, one H100, one process) it took the package's two kernels away (23 ms less elementwise time
per forward) but the compiled K kernels grew by 10 ms and the attention by 7: 4,041 ms per step in a loop with
either (benchmarks/results/bench_peers_h100_wan81_int8_keysmooth_20261205.json), so it stays off.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os

import torch

from ..cuda_graphs import run_outside_graph
from ..deps import INSTALL, installed
from .fa4_attention import (_REFUSED_LOCK, _hopper, attention_output_like, attention_output_shape, call_or_sdpa,
                            count_served, listed_shapes)

logger = logging.getLogger(__name__)

PACKAGE = "sageattention"
MAX_HEAD_DIM = 128  # the package pads smaller heads to 64 or 128 and refuses larger ones
DTYPES = (torch.bfloat16, torch.float16)

_REFUSED: dict[tuple, str] = {}  # (q shape, k shape, v shape, dtype) -> why the package failed there
KERNEL_NAME = "SageAttention"  # how reports and logs name it
# Whether the route subtracts K's token mean in the compiled graph and the op skips SageAttention's own (above).
SMOOTH_KEYS_IN_GRAPH = False
_HOPPER_ENTRY = "sageattn_qk_int8_pv_fp8_cuda_sm90"  # the function sageattn itself calls on Hopper


# Keys per call from which attention="auto" sends the int8 stack's calls to SageAttention (cuDNN below). Measured on
# an H100 with int8 linears, compile=True: FLUX (4,608 keys) 100.2 against cuDNN's 93.4 ms per step, Wan 81 frames
# (32,760) 4.04 against 4.72 s. Its kernel's gain grows with the keys (quadratic) and its preparation with the tokens
# (linear), which puts the break-even near 15k keys at these head counts (docs/kernels.md).
AUTO_MIN_TOKENS = 16384


def auto_refusal(capability: tuple[int, int] | None) -> str | None:
    """Why auto cannot route long sequences to SageAttention here (None: it can): the package's Hopper kernel is the
    one measured."""
    if capability is None:
        return "no CUDA GPU to read the compute capability of"
    if capability[0] != 9:
        return f"SageAttention was measured on Hopper (sm_90) only; this GPU is sm_{capability[0]}{capability[1]}"
    if not installed(PACKAGE):
        return f"{PACKAGE} is not installed; {INSTALL[PACKAGE]}"
    if not hopper_kernel_built():
        return (f"the installed {PACKAGE} has no Hopper kernel (its _qattn_sm90 extension: PyPI's sageattention 1.x "
                f"ships none, and a build on another GPU leaves it out); {INSTALL[PACKAGE]}")
    return None


def hopper_kernel_built() -> bool:
    """Whether the installed package holds SageAttention 2's Hopper extension (``_qattn_sm90``), the kernel the
    quantized route calls; found by its file, without importing the package (which takes seconds)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):  # ValueError: a stand-in module without a spec (tests)
        return False
    folders = (spec.submodule_search_locations or ()) if spec is not None else ()
    return any(glob.glob(os.path.join(folder, "_qattn_sm90*")) for folder in folders)


def route_implementation(device: torch.device) -> str:
    """The route for ``attention="sage"`` on ``device``: "sage" (Q, K and V quantized in the compiled graph for the
    package's Hopper kernel, ``PREP_IN_GRAPH``; off the GPU the operands' float32 attention stands in), or
    "sage_package" (the package's own ``sageattn``, which picks its kernels for the GPU) on a GPU without that kernel
    -- an Ampere or Ada card, or a build without sm_90 -- where the quantized operands would have no kernel to run
    on and be attended in float32 by PyTorch."""
    if device.type != "cuda":
        return "sage"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] == 9 and hopper_kernel_built():
        return "sage"
    return "sage_package"


def refused_shapes() -> dict[str, str]:
    """The call shapes SageAttention failed on in this process (SDPA computed them), with the reason."""
    return listed_shapes(_REFUSED)


def eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask, dropout_p: float,
             is_causal: bool, min_tokens: int = 0) -> bool:
    """Whether the op serves this dispatcher call (diffusers' layout: batch, tokens, heads, head dim), with at least
    ``min_tokens`` keys (auto's long-sequence route)."""
    return (attn_mask is None and not is_causal and not dropout_p and query.ndim == 4
            and query.dtype in DTYPES and key.dtype == value.dtype == query.dtype
            and query.shape[-1] == key.shape[-1] == value.shape[-1] <= MAX_HEAD_DIM
            and query.shape[2] == key.shape[2] == value.shape[2] and key.shape[1] >= min_tokens)


def smoothed_keys(key: torch.Tensor) -> torch.Tensor:
    """``key`` (batch, tokens, heads, head dim) minus its mean over the tokens, computed in float32: the attention
    output is unchanged (every query's scores shift by one constant), and the int8 rounding of K gets the range."""
    k = key.float()
    return (k - k.mean(dim=1, keepdim=True)).to(key.dtype)


def _sage_call(query, key, value, scale, keys_smoothed):
    import sageattention

    hopper_entry = getattr(sageattention, _HOPPER_ENTRY, None)
    if keys_smoothed and hopper_entry is not None and _hopper(query):
        # sageattn's own Hopper call, without its second smoothing of keys the route has smoothed
        out = hopper_entry(query, key, value, tensor_layout="NHD", is_causal=False, sm_scale=scale,
                           pv_accum_dtype="fp32+fp32", smooth_k=False)
    else:
        out = sageattention.sageattn(query, key, value, tensor_layout="NHD", is_causal=False, sm_scale=scale)
    return out.contiguous()  # padded heads come back as a slice; the fake implementation is contiguous


@torch.library.custom_op("omni_accel::sage_attention", mutates_args=(), schema=(
    "(Tensor query, Tensor key, Tensor value, float? scale, bool keys_smoothed=False) -> Tensor"))
def sage_attention(query, key, value, scale, keys_smoothed=False):
    """softmax(q k^T * scale) v by SageAttention; q, k, v are (batch, tokens, heads, head dim), 16-bit, on a GPU.
    ``keys_smoothed``: K's token mean is subtracted already (``smoothed_keys``)."""

    def call(q, k, v):
        return on_default_stream(q.device, lambda: call_or_sdpa(
            KERNEL_NAME, _REFUSED, q, k, v, scale, lambda: _sage_call(q, k, v, scale, keys_smoothed)))

    return run_outside_graph(call, (query, key, value), attention_output_shape(query, value), query.dtype)


def on_default_stream(device: torch.device, call, allocates: bool = True):
    """``call()`` with the device's default stream current, ordered after and before the caller's stream: the
    package launches its CUDA kernels on the legacy default stream whatever stream is current, and its Triton
    kernels on the current one, so on any other stream the two would race (and the caller's stream would not
    wait for the attention). ``allocates``: ``call`` returns a tensor it allocated (not a buffer it was given)."""
    if device.type != "cuda":
        return call()
    current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if current == default:
        return call()
    default.wait_stream(current)
    with torch.cuda.stream(default):
        out = call()
    current.wait_stream(default)
    if allocates:
        out.record_stream(current)  # allocated on the default stream, read on the caller's
    return out


@sage_attention.register_fake
def _(query, key, value, scale, keys_smoothed=False):
    return attention_output_like(query, key, value, scale)


# ------------------------------------------------------------------- Q, K and V quantized in the compiled graph
# Whether the route quantizes Q, K and V for the package's Hopper kernel in the compiled graph, where inductor fuses
# the quantization into the kernels that produce them, and the op runs only the attention kernel (else the op calls
# ``sageattn``, whose preparation kernels cost more than its attention kernel saves at FLUX's 4,608 keys). FLUX with
# int8 linears and attention="sage" on an H100: 101.1 -> 96.0 ms per step, the op's output 2e-4 from sageattn's on the
# same inputs (benchmarks/results/bench_peers_h100_flux_newkernels_ab2_20261205.json,
# check_sage_graphs_h100_prepared_20261205.json).
PREP_IN_GRAPH = True
QUERY_TILE, KEY_TILE = 64, 128  # the Hopper kernel's query and key tiles (its CTA_Q and CTA_K)
_WARP_QUERIES = 16  # the queries of one warp of the kernel's query tile
INT8_MAX = 127.0
V_FP8_MAX = 448.0  # V is scaled per channel to e4m3's largest value
_KERNEL_OP = "qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf"  # in the package's sageattention_sm90 namespace
_PER_THREAD = 3  # the kernel's code for per-thread Q / K scales (sageattn's default on Hopper)
_NO_KERNEL = ("prepared", "no Hopper kernel")  # refused_shapes()'s entry once the op found no kernel to call


def padded_count(tokens: int, multiple: int) -> int:
    """``tokens`` rounded up to a whole number of ``multiple``-token tiles."""
    return -(-tokens // multiple) * multiple


def _padded_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """(batch, tokens, heads, head dim) with zero tokens appended up to a multiple of ``multiple``."""
    pad = -x.shape[1] % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x


def _to_int8(x: torch.Tensor) -> torch.Tensor:
    """The package's rounding: half away from zero (add +-0.5, then the cast truncates)."""
    return (x + torch.where(x >= 0, 0.5, -0.5)).to(torch.int8)


def quantize_queries(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q (batch, tokens, heads, D) -> (int8 of Q's shape, float32 scales (batch, heads, tokens padded to the query
    tile / 2)): the package's per-thread granularity, one scale per pair of queries 8 apart in each warp's 16 (the
    rows one thread of the kernel's MMA holds), amax / 127 + 1e-7."""
    tokens = query.shape[1]
    x = _padded_tokens(query, QUERY_TILE).float()
    b, n, h, d = x.shape
    groups = x.view(b, n // _WARP_QUERIES, 2, 8, h, d)  # query 16 w + 8 j + t: (w, j, t)
    scale = groups.abs().amax(dim=(2, 5)) / INT8_MAX + 1e-7  # (b, n / 16, 8, h)
    q8 = _to_int8(groups / scale[:, :, None, :, :, None]).view(b, n, h, d)[:, :tokens]
    # contiguous: the kernel checks it, and the reshape of the permuted scales is a strided view
    return q8, scale.permute(0, 3, 1, 2).reshape(b, h, n // _WARP_QUERIES * 8).contiguous()


def quantize_keys(key: torch.Tensor, smooth: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """K (batch, tokens, heads, D) -> (int8 of K's shape, float32 scales (batch, heads, tokens padded to the key
    tile / 32)): K minus its token mean (``smooth``; softmax ignores the shift, the int8 range gains), then one scale
    per thread group of each 128-key tile: keys 8 i + 2 t + e (i < 16, e < 2) share thread t's scale."""
    tokens = key.shape[1]
    if smooth:
        key = key - key.mean(dim=1, keepdim=True)
    x = _padded_tokens(key, KEY_TILE).float()
    b, n, h, d = x.shape
    groups = x.view(b, n // KEY_TILE, KEY_TILE // 8, 4, 2, h, d)  # key 128 blk + 8 i + 2 t + e: (blk, i, t, e)
    scale = groups.abs().amax(dim=(2, 4, 6)) / INT8_MAX + 1e-7  # (b, n / 128, 4, h)
    k8 = _to_int8(groups / scale[:, :, None, :, None, :, None]).view(b, n, h, d)[:, :tokens]
    return k8, scale.permute(0, 3, 1, 2).reshape(b, h, n // KEY_TILE * 4).contiguous()


def quantize_values(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V (batch, tokens, heads, D) -> (e4m3 (batch, D, heads, tokens padded to the key tile), float32 scales (batch,
    heads, D)): the package's per-channel FP8 V, transposed for the P . V MMA, each 16 keys reordered so that key
    8 b + 2 a + c sits at 4 a + 2 b + c (the FP8 MMA's operand order), scale = channel amax / 448."""
    x = _padded_tokens(value, KEY_TILE).float()
    b, n, h, d = x.shape
    amax = x.abs().amax(dim=1)  # (b, h, d)
    inverse = torch.where(amax > 0, V_FP8_MAX / amax, 0.0)  # an all-zero channel stays zero (the package: NaN)
    ordered = x.view(b, n // 16, 2, 4, 2, h, d).transpose(2, 3).reshape(b, n, h, d)
    v8 = (ordered * inverse[:, None]).to(torch.float8_e4m3fn).permute(0, 3, 2, 1).contiguous()
    return v8, amax / V_FP8_MAX


def dequantized(q8: torch.Tensor, q_scale: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor, v8: torch.Tensor,
                v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 q, k (smoothed) and v (batch, tokens, heads, D) the quantized operands stand for."""
    b, tokens, h, d = q8.shape
    keys = k8.shape[1]
    qs = q_scale.view(b, h, -1, 1, 8).permute(0, 2, 3, 4, 1).expand(-1, -1, 2, -1, -1).reshape(b, -1, h)
    ks = k_scale.view(b, h, -1, 1, 4, 1).permute(0, 2, 3, 4, 5, 1).expand(-1, -1, KEY_TILE // 8, -1, 2, -1)
    ks = ks.reshape(b, -1, h)
    v = (v8.float() * v_scale.permute(0, 2, 1)[:, :, :, None]).permute(0, 3, 2, 1)  # (b, padded keys, h, d)
    v = v.reshape(b, -1, 4, 2, 2, h, d).transpose(2, 3).reshape(b, -1, h, d)  # the key order undone
    return (q8.float() * qs[:, :tokens, :, None], k8.float() * ks[:, :keys, :, None], v[:, :keys])


def _sm90_kernel():
    """The package's Hopper attention kernel (a torch op the package registers on import), or None."""
    try:
        import sageattention  # noqa: F401 -- registers the sageattention_sm90 ops where they were built
    except ImportError:
        return None
    return getattr(getattr(torch.ops, "sageattention_sm90", None), _KERNEL_OP, None)


def _quantized_call(q8, q_scale, k8, k_scale, v8, v_scale, scale: float, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The attention into ``out`` (q8's shape, ``dtype``, contiguous), or into a new tensor where it is None."""
    kernel = _sm90_kernel() if q8.is_cuda and _hopper(q8) else None
    if kernel is None:  # the operands' own attention in float32 (CPU tests; a GPU the kernel was not built for)
        if q8.is_cuda and not _REFUSED.get(_NO_KERNEL):
            with _REFUSED_LOCK:
                _REFUSED[_NO_KERNEL] = "the package's Hopper kernel (sageattention_sm90) is not available here"
            logger.warning("omni_accel: SageAttention's Hopper kernel is not available on %s; the quantized "
                           "operands' attention is computed in float32 by PyTorch (slow)", q8.device)
        q, k, v = dequantized(q8, q_scale, k8, k_scale, v8, v_scale)
        attention = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                     v.transpose(1, 2), scale=scale)
        attention = attention.transpose(1, 2).to(dtype)
        return attention.contiguous() if out is None else out.copy_(attention)
    if out is None:
        out = torch.empty(q8.shape, dtype=dtype, device=q8.device)
    with torch.cuda.device(q8.device):  # the kernel launches on the current device (sageattn sets it first)
        kernel(q8, k8, v8, out, q_scale, k_scale, v_scale, 0, 0, _PER_THREAD, scale, 0)  # NHD, not causal, no lse
    count_served(KERNEL_NAME)
    return out


@torch.library.custom_op("omni_accel::sage_attention_quantized", mutates_args=(), schema=(
    "(Tensor q8, Tensor q_scale, Tensor k8, Tensor k_scale, Tensor v8, Tensor v_scale, float scale, "
    "ScalarType dtype) -> Tensor"))
def sage_attention_quantized(q8, q_scale, k8, k_scale, v8, v_scale, scale, dtype):
    """softmax(q k^T * scale) v from ``quantize_queries`` / ``quantize_keys`` / ``quantize_values``' operands by the
    package's Hopper kernel, outside any CUDA graph and on the default stream (as ``sage_attention``)."""

    def call(*operands, out=None):
        return on_default_stream(q8.device, lambda: _quantized_call(*operands, scale, dtype, out=out),
                                 allocates=out is None)

    # the kernel takes its output buffer: under a CUDA graph it writes the one the next graph segment reads
    return run_outside_graph(call, (q8, q_scale, k8, k_scale, v8, v_scale), tuple(q8.shape), dtype, writes_out=True)


@sage_attention_quantized.register_fake
def _(q8, q_scale, k8, k_scale, v8, v_scale, scale, dtype):
    return q8.new_empty(q8.shape, dtype=dtype)


# Whether ``prepared_attention`` quantizes Q, K and V with omni_accel's four Triton kernels (sage_prep_triton.py, op
# omni_accel::sage_quantize) instead of tracing the PyTorch expressions into inductor's kernels (about 10 ms per FLUX
# step on an H100). On: on an H200 it made Wan 81 frames 2.6 % faster (1.51x diffusers' best against 1.47x) and tied
# on FLUX (bench_peers_h200_wan81_prep_kernels_20261206.json). Its output is as close to exact attention as the
# package's (0.0388 against 0.0389 from SDPA); it differs from the package's by 0.024 only because it subtracts K's
# mean in float32 where the package rounds it to bf16 (0.0001 from the float32-smoothed PyTorch operands:
# check_sage_graphs_h100_prep_kernels_fixed_20261206.json; docs/kernels.md). Benchmarks' A/B rows set it.
PREP_KERNELS = True


@torch.library.custom_op("omni_accel::sage_quantize", mutates_args=(), schema=(
    "(Tensor query, Tensor key, Tensor value) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def sage_quantize(query, key, value):
    """``quantize_queries(query) + quantize_keys(key) + quantize_values(value)``: on a GPU with e4m3 in Triton in
    sage_prep_triton's kernels (K's mean in float32), elsewhere the PyTorch expressions themselves."""
    if prep_kernels_run_on(query.device):
        from . import sage_prep_triton

        return sage_prep_triton.quantize(*(t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value)))
    return _reference_operands(query, key, value)


def prep_kernels_run_on(device: torch.device) -> bool:
    """Whether sage_prep_triton's kernels can run on ``device``: a CUDA GPU of compute capability 8.9 or newer, where
    Triton casts to e4m3 (V's format; older GPUs, which SageAttention's non-Hopper kernels also serve, take the
    PyTorch expressions)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _reference_operands(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (*quantize_queries(query), *quantize_keys(key), *quantize_values(value))


def _operands_like(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Empty tensors shaped as ``sage_quantize``'s six outputs (its fake implementation)."""
    b, queries, h, d = query.shape
    padded_queries, padded_keys = padded_count(queries, QUERY_TILE), padded_count(key.shape[1], KEY_TILE)
    f32 = torch.float32
    return (query.new_empty(query.shape, dtype=torch.int8),
            query.new_empty((b, h, padded_queries // _WARP_QUERIES * 8), dtype=f32),
            key.new_empty(key.shape, dtype=torch.int8), key.new_empty((b, h, padded_keys // KEY_TILE * 4), dtype=f32),
            value.new_empty((b, d, h, padded_keys), dtype=torch.float8_e4m3fn), value.new_empty((b, h, d), dtype=f32))


sage_quantize.register_fake(_operands_like)


# The arguments of omni_accel::qk_norm_rope that sage_quantize_normed takes once for Q and once for K: the fused
# projection (rows, C), its bias, the first column of the part, the norm's weight, and the same four of a joint
# block's second stream (None / 0 without one)
_NORMED_PART = ("Tensor {p}_src, Tensor? {p}_bias, int {p}_col, Tensor {p}_weight, Tensor? {p}_src2, "
                "Tensor? {p}_bias2, int {p}_col2, Tensor? {p}_weight2")


@torch.library.custom_op("omni_accel::sage_quantize_normed", mutates_args=(), schema=(
    f"({_NORMED_PART.format(p='q')}, {_NORMED_PART.format(p='k')}, int tokens_a, int heads, float eps, Tensor cos, "
    "Tensor sin, ScalarType dtype, Tensor value) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def sage_quantize_normed(q_src, q_bias, q_col, q_weight, q_src2, q_bias2, q_col2, q_weight2, k_src, k_bias, k_col,
                         k_weight, k_src2, k_bias2, k_col2, k_weight2, tokens_a, heads, eps, cos, sin, dtype, value):
    """``sage_quantize(q, k, value)`` where q and k are ``omni_accel::qk_norm_rope``'s outputs (``dtype``) for the
    given parts, viewed as (batch, seq, heads, D): what the compile pass puts in their place (epilogue_fusion.
    SAGE_FROM_NORMS). On a GPU with the preparation kernels, Q is quantized where it is computed and K's column
    sums are taken there (sage_prep_triton.quantize_normed); elsewhere the two ops themselves."""
    queries = (q_src, q_bias, q_col, q_weight, q_src2, q_bias2, q_col2, q_weight2)
    keys = (k_src, k_bias, k_col, k_weight, k_src2, k_bias2, k_col2, k_weight2)
    if prep_kernels_run_on(value.device) and value.stride(-1) == 1:
        from . import sage_prep_triton

        return sage_prep_triton.quantize_normed(queries, keys, heads, eps, cos, sin, tokens_a, dtype, value)
    from . import epilogue_fusion  # noqa: F401 -- registers omni_accel::qk_norm_rope

    normed = []
    for src, bias, col, weight, src2, bias2, col2, weight2 in (queries, keys):
        second = (src2, bias2, col2, weight2, tokens_a) if src2 is not None else ()
        rows = torch.ops.omni_accel.qk_norm_rope(src, bias, col, heads, weight, eps, cos, sin, dtype, False, *second)
        normed.append(rows.view(value.shape[0], -1, heads, rows.shape[-1]))
    return sage_quantize(*normed, value)


@sage_quantize_normed.register_fake
def _(q_src, q_bias, q_col, q_weight, q_src2, q_bias2, q_col2, q_weight2, k_src, k_bias, k_col, k_weight, k_src2,
      k_bias2, k_col2, k_weight2, tokens_a, heads, eps, cos, sin, dtype, value):
    return _operands_like(value.new_empty(value.shape, dtype=dtype), value.new_empty(value.shape, dtype=dtype), value)


def prepared_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scale: float | None) -> torch.Tensor:
    """The route's call with ``PREP_IN_GRAPH``: the quantization traced into the compiled graph, then the kernel.
    Head dims up to 64 or 128 are zero-padded to it, as the package does."""
    d = query.shape[-1]
    padded = 64 if d <= 64 else 128
    if padded != d:
        query, key, value = (torch.nn.functional.pad(t, (0, padded - d)) for t in (query, key, value))
    if PREP_KERNELS:
        q8, q_scale, k8, k_scale, v8, v_scale = sage_quantize(query, key, value)
    else:
        q8, q_scale = quantize_queries(query)
        k8, k_scale = quantize_keys(key)
        v8, v_scale = quantize_values(value)
    out = sage_attention_quantized(q8, q_scale, k8, k_scale, v8, v_scale, scale if scale is not None else d ** -0.5,
                                   query.dtype)
    return out[..., :d] if padded != d else out
