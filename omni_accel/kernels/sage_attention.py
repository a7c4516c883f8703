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
self-attention), and keeps cuDNN for shorter ones, where the package's preparation kernels cost more than its
attention kernel saves.

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

import torch

from ..cuda_graphs import run_outside_graph
from ..deps import installed
from .fa4_attention import attention_output_like, attention_output_shape, call_or_sdpa, listed_shapes

PACKAGE = "sageattention"
MAX_HEAD_DIM = 128  # the package pads smaller heads to 64 or 128 and refuses larger ones
DTYPES = (torch.bfloat16, torch.float16)

_REFUSED: dict[tuple, str] = {}  # (q shape, k shape, v shape, dtype) -> why the package failed there
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
    if not installed(PACKAGE):
        return f"{PACKAGE} is not installed"
    if capability is None:
        return "no CUDA GPU to read the compute capability of"
    if capability[0] != 9:
        return f"SageAttention was measured on Hopper (sm_90) only; this GPU is sm_{capability[0]}{capability[1]}"
    return None


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


def _hopper(query: torch.Tensor) -> bool:
    return query.is_cuda and torch.cuda.get_device_capability(query.device)[0] == 9


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
            "SageAttention", _REFUSED, q, k, v, scale, lambda: _sage_call(q, k, v, scale, keys_smoothed)))

    return run_outside_graph(call, (query, key, value), attention_output_shape(query, value), query.dtype)


def on_default_stream(device: torch.device, call):
    """``call()`` with the device's default stream current, ordered after and before the caller's stream: the
    package launches its CUDA kernels on the legacy default stream whatever stream is current, and its Triton
    kernels on the current one, so on any other stream the two would race (and the caller's stream would not
    wait for the attention)."""
    if device.type != "cuda":
        return call()
    current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if current == default:
        return call()
    default.wait_stream(current)
    with torch.cuda.stream(default):
        out = call()
    current.wait_stream(default)
    out.record_stream(current)  # allocated on the default stream, read on the caller's
    return out


@sage_attention.register_fake
def _(query, key, value, scale, keys_smoothed=False):
    return attention_output_like(query, key, value, scale)
