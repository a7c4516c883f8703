"""FlashAttention-4 (the ``flash-attn-4`` package, CuTe DSL) as a 16-bit attention kernel: ``attention="fa4"``, and
``attention="auto"``'s choice for long sequences on Hopper and newer.

Why: measured (``benchmarks/bench_attention.py``, docs/kernels.md), FA4's Hopper kernel is 1.18x faster than cuDNN's
SDPA at Wan's 81-frame shape (32,760 tokens, 40 heads x 128; an H200 and an H100 alike) and 1.07-1.17x from 9,360
to 17,160 tokens (an H100); at 4.4-4.6k tokens it was slower on an H200 (0.48 vs 0.44 ms at FLUX's shape) and on an
H100 slower at Qwen-Image's (0.47 vs 0.41) but faster at FLUX's (0.42 vs 0.46). So ``auto`` keeps cuDNN and sends
only calls with at least ``AUTO_MIN_TOKENS`` keys to FA4; ``attention="fa4"`` sends every call it can serve. Inside
the models, on an H100: Wan at 81 frames 1.12x per step in the int8 stack (the attention the only change), about
1.09-1.10x in bf16 (against a cuDNN row that also kept older switches).

``TIMED_MIN_TOKENS`` (off) makes auto's route take calls from that many keys and time FA4 against SDPA on each
shape's first call below ``AUTO_MIN_TOKENS`` (``faster_kernel``), the faster serving the shape from then on. Measured
inside the models it bought nothing: on the models' own activations the two kernels tied at image lengths (FLUX 0.408
against 0.413 ms per call on an H200, 0.423 against 0.421 on an H100; Qwen-Image 0.391 against 0.390), and a shape
given to SDPA runs it from Python inside the op, which cost the compiled bf16 Qwen-Image forward, whose host work
nearly fills its GPU time, 23 % (185 against 151 ms per forward, one H100). It stays a switch for A/B runs.

How it reaches the model: the same route as FP8 attention (``fp8_attention.route_transformer``): the processors'
module-global ``dispatch_attention_fn`` is wrapped, and calls this kernel can serve (``eligible``) go to the custom
op ``omni_accel::fa4_attention``, opaque to inductor like SDPA; every other call goes to the original dispatcher.
The op's fake implementation gives compiled blocks the output's shape without running the kernel. The package is
imported on the first real call only: importing it loads the CuTe DSL compiler (seconds).

A call FA4 cannot serve at run time (an import that fails although the package is found -- a missing CuTe DSL
runtime, say -- or a shape its kernels reject) is computed by SDPA inside the same op, logged once per shape and
listed by ``refused_shapes()``, so a model never fails for one attention call; the shape goes straight to SDPA from
then on.

Under a whole-forward CUDA graph (``compile="max"``, and the 8-bit stacks' default graph) the op runs between the
graph's segments (``cuda_graphs.run_outside_graph``), as SageAttention's does: FA4's launches inside a capture have
not been verified on a GPU (it launches on the current stream, so they may well be capturable), and a call it
serves is long (a Wan 81-frame self-attention takes 33 ms), so a segment boundary per call costs little.
``IN_GRAPH`` captures the kernel inside the graph instead; it is the A side of a benchmark row until a GPU run
shows it replays the current inputs' attention and gains time. Between segments the kernel writes its result
straight into the buffer the next segment reads (FA4's ``out=``), so a replay copies nothing.

The Hopper tile: FA4 picks 128 query rows x 128 keys at head dim 128. Calls with at least ``LONG_TILE_MIN_KEYS``
keys (q / k and v head dims of 128, no grouped keys) ask for ``LONG_TILE`` instead, 192 x 128 over three consumer
warp groups: measured on an H100 at Wan's 81 frames (32,760 keys) 32.2 against 34.2 ms per call, and 1.2 % (bf16)
and 2.4 % (int8 stack) off a step, one round each; around 17k keys it won once (16,896: 5.1 against 5.4 ms) and
lost once (17,160: 9.7 against 9.0), near the measurement's noise, so the threshold sits between those and Wan's
length, where it is unmeasured. A tile FA4 fails on falls back to FA4's own for that shape. ``TILE`` overrides the
rule (an A/B switch); ``TILE_CANDIDATES`` are the feasible tiles the benchmarks sweep
(``benchmarks/bench_attention.py --fa4-tiles``).
"""

from __future__ import annotations

import inspect
import logging
import statistics
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cuda_graphs import run_outside_graph
from ..deps import installed, missing_message
from . import timing

logger = logging.getLogger(__name__)

PACKAGE = "flash_attn.cute"  # what flash-attn-4 installs (flash_attn is a namespace package there)
KERNEL_NAME = "FlashAttention-4"  # how reports and logs name it
MIN_CAPABILITY = (9, 0)  # measured on Hopper; FA4's own kernels also cover Blackwell
MAX_HEAD_DIM = 256  # FA4's Hopper kernels: head dims 8..256, multiples of 8
DTYPES = (torch.bfloat16, torch.float16)
# Keys per call from which auto prefers FA4 to cuDNN: FA4 won at every length measured from 9,360 keys up
# (1.07-1.18x), and at 4,352-4,608 the two kernels took turns (GPU and length); 8,192 lies between, unmeasured.
AUTO_MIN_TOKENS = 8192
# None (the default): auto's FA4 route starts at AUTO_MIN_TOKENS. A key count: the route starts there and, below
# AUTO_MIN_TOKENS, times FA4 against SDPA (the kernel auto pinned: cuDNN) on each shape's first call, keeping the
# faster (faster_kernel). Measured no gain at image lengths (the module's docstring), so off.
TIMED_MIN_TOKENS: int | None = None
# The timing: rounds alternating the two kernels (so clock and power drift hit both), calls per round, median per
# call. 35 calls of each at the first call of a shape: 30-40 ms at FLUX's length.
TIMED_ROUNDS = 7
TIMED_CALLS = 5
# SDPA must beat FA4 by this fraction to take a shape: CUDA events time the GPU only, and SDPA from inside the op costs
# host time that FA4's call does not add (a host-bound forward paid for a 0.3 % kernel win, the docstring above).
TIMED_SDPA_MARGIN = 0.03
# Whether a captured forward holds FA4's kernel (True) or runs it between graph segments (False, the default: above).
IN_GRAPH = False
# FA4's Hopper forward tile for every call: (tile_m, tile_n, P.V from registers, intra-warpgroup overlap); None:
# the rule below. Other architectures ignore the tile.
TILE: tuple[int, int, bool, bool] | None = None
# From this many keys, head dim 128, no grouped keys: 192 x 128 without the overlap (above); else FA4's own choice.
LONG_TILE = (192, 128, True, False)
LONG_TILE_MIN_KEYS = 24576
# Feasible Hopper tiles at head dim 128 (two consumer warp groups of 64 rows, or three without the overlap, within
# the register and shared-memory budgets), FA4's default first: what the benchmarks sweep.
TILE_CANDIDATES: tuple[tuple[int, int, bool, bool], ...] = (
    (128, 128, True, True), (128, 144, True, True), (128, 160, True, True), (128, 176, True, True),
    (128, 192, True, True), (128, 176, True, False), (192, 128, True, False), (192, 112, True, False))


def tile_for(keys: int, head_dim: int, value_head_dim: int | None = None,
             grouped: bool = False) -> tuple[int, int, bool, bool] | None:
    """The tile a call with ``keys`` keys asks FA4 for (None: FA4's own choice): ``TILE`` where set, else
    ``LONG_TILE`` for the measured case only -- q / k and v head dims of 128, as many key heads as query heads."""
    if TILE is not None:
        return TILE
    measured = head_dim == 128 and value_head_dim in (None, 128) and not grouped
    return LONG_TILE if measured and keys >= LONG_TILE_MIN_KEYS else None


def tile_keywords(tile: tuple[int, int, bool, bool]) -> dict:
    """``tile`` as the keywords FA4's internal forward takes."""
    return dict(tile_mn=tile[:2], mma_pv_is_rs=tile[2], intra_wg_overlap=tile[3])


def tile_name(tile: tuple[int, int, bool, bool]) -> str:
    """``128x176``, with ``_pvsmem`` when P.V reads P from shared memory and ``_nooverlap`` without the overlap."""
    tile_m, tile_n, pv_in_registers, overlap = tile
    return f"{tile_m}x{tile_n}{'' if pv_in_registers else '_pvsmem'}{'' if overlap else '_nooverlap'}"


def unavailable_reason(device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """Why FA4 cannot run on ``device``, or None when it can. ``capability`` defaults to the device's (tests fake
    it)."""
    if not installed(PACKAGE):
        return missing_message("flash_attn.cute", "attention='fa4'", "use attention='auto'")
    if device.type != "cuda":
        return f"attention='fa4' needs a CUDA GPU but the pipeline runs on {device}; use attention='auto'."
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        return (f"attention='fa4' needs a GPU with compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                f"newer (Hopper, Blackwell); this GPU has {capability[0]}.{capability[1]}. Use attention='auto'.")
    return None


def eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask, dropout_p: float,
             is_causal: bool, min_tokens: int = 0) -> bool:
    """Whether the FA4 kernel serves this dispatcher call (diffusers' layout: batch, tokens, heads, head dim)."""
    head_dim = query.shape[-1]
    return (attn_mask is None and not is_causal and not dropout_p and query.ndim == 4
            and query.dtype in DTYPES and key.dtype == value.dtype == query.dtype
            and head_dim == key.shape[-1] and head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0
            and value.shape[-1] <= MAX_HEAD_DIM and value.shape[-1] % 8 == 0
            and query.shape[2] % key.shape[2] == 0 and key.shape[1] >= min_tokens)


_REFUSED: dict[tuple, str] = {}  # (q shape, k shape, v shape, dtype) -> why FA4 failed there
_REFUSED_LOCK = threading.Lock()
# kernel name -> calls its package computed in this process (counted where the op runs from Python: eager, compiled
# blocks, between graph segments; a kernel captured inside a CUDA graph counts once, at the capture)
_SERVED: dict[str, int] = {}


def count_served(kernel: str) -> None:
    with _REFUSED_LOCK:
        _SERVED[kernel] = _SERVED.get(kernel, 0) + 1


def served_calls(kernel: str) -> int:
    """How many calls the packaged ``kernel`` ("FlashAttention-4", "SageAttention") computed in this process."""
    return _SERVED.get(kernel, 0)


def listed_shapes(refused: dict) -> dict[str, str]:
    """A routed kernel's ``refused`` shapes (``call_or_sdpa``), printable: {shape: why}."""
    with _REFUSED_LOCK:
        return {str(key): why for key, why in refused.items()}


def refused_shapes() -> dict[str, str]:
    """The call shapes FA4 failed on in this process (SDPA computed them), with the reason."""
    return listed_shapes(_REFUSED)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         scale=scale, enable_gqa=query.shape[2] != key.shape[2])
    return out.transpose(1, 2).contiguous()  # the fake implementation's layout: (batch, tokens, heads, dim)


def call_or_sdpa(kernel: str, refused: dict, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float | None, call, count: bool = True) -> torch.Tensor:
    """``call()`` (a packaged kernel on q, k, v), or SDPA where it failed: a failure is logged once per shape and kept
    in ``refused`` (shape -> why), and that shape goes straight to SDPA from then on. Shared by the routed kernels
    (FlashAttention-4 here, SageAttention in sage_attention.py). ``count``: whether a served call counts in
    ``served_calls`` (a timing call does not)."""
    shape = _shape_key(query, key, value)
    if shape in refused:
        return _sdpa(query, key, value, scale)
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 -- any failure of the package costs this shape the fast kernel only
        why = f"{type(exc).__name__}: {exc}"[:300]
        with _REFUSED_LOCK:
            refused[shape] = why
        logger.warning("omni_accel: %s failed for q %s, k %s (%s); SDPA computes this shape from now on", kernel,
                       shape[0], shape[1], why)
        return _sdpa(query, key, value, scale)
    if count:
        count_served(kernel)
    return out


def _shape_key(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple:
    return tuple(query.shape), tuple(key.shape), tuple(value.shape), str(query.dtype).replace("torch.", "")


def _hopper(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is on a Hopper GPU (shared with sage_attention.py)."""
    return tensor.is_cuda and torch.cuda.get_device_capability(tensor.device)[0] == 9


_INTERNAL_KEYWORDS = ("out", "tile_mn", "mma_pv_is_rs", "intra_wg_overlap")
_TAKES_KEYWORDS: dict = {}  # FA4's internal forward -> whether it takes _INTERNAL_KEYWORDS (read once)


def _internal_forward(interface):
    """FA4's internal forward where it takes an output buffer and a tile (4.0.0b40 does; older releases had other
    keywords), else None: such a release is called through its public function."""
    forward = getattr(interface, "_flash_attn_fwd", None)
    if forward is None:
        return None
    if forward not in _TAKES_KEYWORDS:
        try:
            _TAKES_KEYWORDS[forward] = set(_INTERNAL_KEYWORDS) <= set(inspect.signature(forward).parameters)
        except (TypeError, ValueError):  # no signature to read
            _TAKES_KEYWORDS[forward] = False
    return forward if _TAKES_KEYWORDS[forward] else None


_TILE_FAILED: dict[tuple, str] = {}  # (q shape, k shape, v shape, tile) -> why FA4 failed with that tile


def _fa4_call(query, key, value, scale, out=None):
    """FA4's forward into ``out`` (None: a new tensor), on Hopper with ``tile_for``'s tile. A tile FA4 fails on is
    dropped for that shape (logged once) and the call made with FA4's own tile, so a tile never costs a shape the
    kernel. A release without the internal entry gets the public function (FA4's tile) and a copy."""
    from flash_attn.cute import interface

    forward = _internal_forward(interface)
    if forward is None:
        result = interface.flash_attn_func(query, key, value, softmax_scale=scale, causal=False)
        result = result[0] if isinstance(result, tuple) else result  # some versions return (out, lse)
        return result if out is None else out.copy_(result)
    asked = tile_for(key.shape[1], query.shape[-1], value.shape[-1], key.shape[2] != query.shape[2])
    attempt = (tuple(query.shape), tuple(key.shape), tuple(value.shape), asked)
    if asked is not None and _hopper(query) and attempt not in _TILE_FAILED:  # FA4 applies a tile on any GPU
        try:
            return forward(query, key, value, softmax_scale=scale, causal=False, out=out, **tile_keywords(asked))[0]
        except Exception as exc:  # noqa: BLE001 -- the tile, not the kernel, failed: FA4's own tile follows
            with _REFUSED_LOCK:
                _TILE_FAILED[attempt] = f"{type(exc).__name__}: {exc}"[:300]
            logger.warning("omni_accel: FlashAttention-4 failed with the %s tile for q %s, k %s (%s); its own tile "
                           "serves this shape from now on", tile_name(asked), attempt[0], attempt[1],
                           _TILE_FAILED[attempt])
    return forward(query, key, value, softmax_scale=scale, causal=False, out=out)[0]


@dataclass(frozen=True)
class TimedChoice:
    """What the first call of a shape measured: the kernel that serves the shape, and each kernel's median ms per call
    (FA4's None where it failed on the shape)."""

    kernel: str  # "fa4" or "sdpa"
    fa4_ms: float | None
    sdpa_ms: float

    def describe(self) -> str:
        fa4 = "failed" if self.fa4_ms is None else f"{self.fa4_ms:.3f} ms"
        return f"{self.kernel} (fa4 {fa4}, sdpa {self.sdpa_ms:.3f} ms per call)"


_CHOICES: dict[tuple, TimedChoice] = {}  # (q shape, k shape, v shape, dtype, device) -> the timed choice
_TIMING_LOCK = threading.Lock()  # one timing at a time: two would share the GPU and spoil each other's figures


def reset_timed_choices() -> None:
    """Forget every timed choice (the next call of each shape times again): for benchmark rows that must each time
    their own shapes, since a choice is otherwise kept for the process."""
    with _REFUSED_LOCK:
        _CHOICES.clear()


def timed_choices() -> dict[str, str]:
    """The shapes auto's route timed in this process, printable: {shape: "fa4 (fa4 0.410 ms, sdpa 0.465 ms ...)"}."""
    with _REFUSED_LOCK:
        return {str(shape): choice.describe() for shape, choice in _CHOICES.items()}


def faster_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> str:
    """"fa4" or "sdpa": which serves this shape, timed on its first call (``TIMED_ROUNDS`` rounds of ``TIMED_CALLS``
    calls each, alternating, on these very tensors; logged once) and remembered for the process. SDPA runs under the
    kernel choice in force, which auto pinned to cuDNN. Nothing is timed while a CUDA graph is being captured (the
    kernels would be recorded, not run): an untimed shape gets FA4 there, a shape timed at an earlier eager call (a
    graphed forward's first call of a signature is eager) its choice. SDPA takes a shape only when it is faster by
    ``TIMED_SDPA_MARGIN``; a tie goes to FA4. One thread times at a time."""
    shape = (*_shape_key(query, key, value), str(query.device))
    choice = _CHOICES.get(shape)
    if choice is not None:
        return choice.kernel
    if _capturing(query):
        return "fa4"
    with _TIMING_LOCK:
        if shape in _CHOICES:  # another thread timed it while this one waited
            return _CHOICES[shape].kernel
        choice = _time_both(query, key, value, scale)
        with _REFUSED_LOCK:
            _CHOICES[shape] = choice
    logger.info("omni_accel: attention='auto' timed q %s, k %s on %s: %s serves it", shape[0], shape[1],
                shape[4], choice.describe())
    return choice.kernel


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _time_both(query, key, value, scale) -> TimedChoice:
    def fa4():
        return call_or_sdpa(KERNEL_NAME, _REFUSED, query, key, value, scale,
                            lambda: _fa4_call(query, key, value, scale), count=False)

    def sdpa():
        return _sdpa(query, key, value, scale)

    fa4()  # the first call compiles FA4's kernel (seconds, once per process) or finds it fails on this shape
    if _shape_key(query, key, value) in _REFUSED:
        return TimedChoice("sdpa", None, _median_ms((sdpa,), TIMED_ROUNDS, TIMED_CALLS, query.device)[0])
    sdpa()
    fa4_ms, sdpa_ms = _median_ms((fa4, sdpa), TIMED_ROUNDS, TIMED_CALLS, query.device)
    return TimedChoice("sdpa" if sdpa_ms < fa4_ms * (1 - TIMED_SDPA_MARGIN) else "fa4", fa4_ms, sdpa_ms)


def _median_ms(calls: tuple, rounds: int, per_round: int, device: torch.device) -> list[float]:
    """Each of ``calls``' median ms per call over ``rounds`` rounds of ``per_round`` calls (kernels.timing: CUDA
    events on a GPU, the wall clock elsewhere)."""
    times = timing.rounds_ms(dict(enumerate(calls)), per_round, rounds, device)
    return [statistics.median(times[i]) / per_round for i in range(len(calls))]


@torch.library.custom_op("omni_accel::fa4_attention", mutates_args=())
def fa4_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                  timed: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v by FA4's kernel; q, k, v are (batch, tokens, heads, head dim), 16-bit, on a GPU.
    ``timed``: the shape is served by whichever of FA4 and SDPA ``faster_kernel`` timed faster (auto's route)."""
    if timed and faster_kernel(query, key, value, scale) == "sdpa":
        return _sdpa(query, key, value, scale)  # under a capture, captured like the dispatcher's own SDPA call

    def call(q, k, v, out=None):
        result = call_or_sdpa(KERNEL_NAME, _REFUSED, q, k, v, scale, lambda: _fa4_call(q, k, v, scale, out))
        return result if out is None or result is out else out.copy_(result)  # SDPA computed it: into ``out``

    if IN_GRAPH:
        return call(query, key, value)
    return run_outside_graph(call, (query, key, value), attention_output_shape(query, value), query.dtype,
                             writes_out=True)


def attention_output_shape(query: torch.Tensor, value: torch.Tensor) -> tuple[int, ...]:
    """What the routed attention ops return: (batch, tokens, heads, v's head dim), contiguous."""
    return (*query.shape[:-1], value.shape[-1])


def attention_output_like(query, key, value, scale, timed=False):
    """The routed attention ops' fake implementation (``attention_output_shape``)."""
    return query.new_empty(attention_output_shape(query, value))


fa4_attention.register_fake(attention_output_like)
