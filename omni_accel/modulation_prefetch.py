"""The AdaLN modulation linears of every block, computed ahead on a second CUDA stream.

Why: a DiT block's shift / scale / gate come from ``linear(silu(temb))``, a GEMV that reads a whole weight matrix for
one token per sample (FLUX.1: 76 of them per forward, 6.4 GB of weights, about 3 ms of a 125 ms bf16 step on an H100).
They depend on the timestep embedding only, which exists before the first block runs. Computed on a second stream
as soon as ``temb`` is known, these memory-bound GEMVs can run beside the blocks' compute-bound GEMMs and attention
instead of between them.

How: the family adapter names the module that produces ``temb`` and the modulation linears (``ModulationPrefetch``
in pipelines/base.py). A hook on the embedding module enqueues, on a side stream, ``F.linear(silu(temb))`` for every
named linear in execution order, each followed by an event. Each linear becomes a ``PrefetchedLinear`` (the same
parameters; the class swapped back by the undo), whose forward is the custom op ``omni_accel::prefetched_linear``:
the current stream waits on that linear's event and takes its output. The op stays opaque to the compiled blocks,
so one graph still serves every block of a list (it finds its output by the weight's address).

Safety: the op computes the linear itself when nothing was prefetched for it, when the input's shape or dtype differ
from the prefetched one, and -- checked once per linear, outside CUDA-graph capture -- when its input is not
``silu(temb)`` (a model variant that feeds a block another embedding); that linear is then never prefetched again
and a warning names it. The same ``F.linear`` on the input the uncompiled block computes (eager's silu; a compiled
block's own silu may round a value to the neighbouring 16-bit number), so the output of the uncompiled model.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch
from diffusers.hooks import ModelHook

from . import cuda_graphs
from .hooks import add_hook

logger = logging.getLogger(__name__)

# Where the compile pass prefetches the family's modulation linears on a second stream: "graphs" (inside the
# whole-forward CUDA graph: compile="max", and compile=True with 8-bit linears on a GPU), "always" (on any GPU
# forward; measured no faster without the graph, compiler._prefetches_modulation) or "off"; benchmarks' A/B rows
# set it.
MODULATION_PREFETCH = "graphs"
WHERE = ("graphs", "always", "off")  # its values (the compile pass refuses others)


@dataclass
class _Slot:
    out: torch.Tensor
    event: object  # torch.cuda.Event, or None off a GPU
    activation: torch.Tensor  # the input the output was computed from
    owner: int = 0  # the handle of the stream that enqueued it (0 off a GPU)


_ONE_ULP = 2.0 ** -7  # of a bfloat16 value, relative
_lock = threading.Lock()
_slots: dict[int, _Slot] = {}  # weight address -> this forward's prefetched output, until taken
_verified: set[int] = set()  # weight addresses whose block input was seen to equal the prefetched one
_refused: set[int] = set()  # ... and those whose block input differed: computed in place from then on
# stream handle -> the side stream of the forwards enqueued on that stream: one each, so that another thread's forward
# (on its own stream) never puts work on a side stream that a capture has joined
_side_streams: dict[int, object] = {}
_forked_in_capture: set[int] = set()  # handles of capturing streams whose side stream took work of the capture


def _side_stream(main):
    with _lock:
        if main.cuda_stream not in _side_streams:
            _side_streams[main.cuda_stream] = torch.cuda.Stream(device=main.device)
        return _side_streams[main.cuda_stream]


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _take(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """This forward's prefetched output for the linear of ``weight`` if it may stand in for ``linear(x)``."""
    key = weight.data_ptr()
    with _lock:
        slot = _slots.pop(key, None)
    if slot is None or key in _refused:
        return None
    if slot.event is not None:
        torch.cuda.current_stream(x.device).wait_event(slot.event)
    same_kind = x.shape == slot.activation.shape and x.dtype == slot.activation.dtype
    if same_kind and (key in _verified or _capturing(x)):  # inside a capture: compared on a call outside one
        return slot.out
    # inductor's silu may round a value to the neighbouring 16-bit number where eager's does not: equal up to that
    if not (same_kind and torch.allclose(x, slot.activation, rtol=_ONE_ULP, atol=_ONE_ULP * 1e-3)):
        _refused.add(key)
        logger.warning("omni_accel: a modulation linear (weight %s) was called with an input other than "
                       "silu(temb); it is computed in the block from now on", tuple(weight.shape))
        return None
    _verified.add(key)
    return slot.out


@torch.library.custom_op("omni_accel::prefetched_linear", mutates_args=())
def prefetched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, taken from the side stream where it was computed ahead (see the module doc)."""
    out = _take(x, weight)
    # the output is handed over (popped from the registry), so the graph may reuse its buffer like any op output
    return out if out is not None else torch.nn.functional.linear(x, weight, bias)


@prefetched_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _join_side_stream(capturing: torch.cuda.Stream) -> None:
    """Before a graph of a capture ends (cuda_graphs.SEGMENT_END_JOINS): the capturing stream waits for this device's
    side stream, and the outputs not taken yet need no wait any more -- an event of an ended capture cannot be
    waited on in the next one (a capture breaks into graphs around calls that run outside it, e.g. SageAttention)."""
    handle = getattr(capturing, "cuda_stream", None)
    if handle not in _forked_in_capture:
        return  # nothing of this capture on it (an event recorded outside a capture may not be waited on in one)
    _forked_in_capture.discard(handle)
    capturing.wait_stream(_side_streams[handle])
    with _lock:
        for slot in _slots.values():
            if slot.owner == handle:  # another thread's forward keeps its own waits
                slot.event = None


cuda_graphs.SEGMENT_END_JOINS.append(_join_side_stream)


class PrefetchedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose output was computed ahead (``prefetched_linear``); the class a modulation linear is
    switched to while the prefetch is applied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.omni_accel.prefetched_linear(x, self.weight, self.bias)


class _PrefetchHook(ModelHook):
    """On the embedding module: once it returned ``temb``, enqueue every modulation linear on ``silu(temb)``."""

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        self.linears = linears

    def post_forward(self, module, output):
        if isinstance(output, torch.Tensor):
            prefetch(output, self.linears)
        return output


def prefetch(temb: torch.Tensor, linears: list[torch.nn.Linear]) -> None:
    """Compute ``F.linear(silu(temb))`` of each of ``linears`` -- on a side stream on a GPU, in order, an event after
    each -- and leave the outputs for their ``PrefetchedLinear`` calls."""
    on_gpu, side, owner = temb.is_cuda, None, 0
    if on_gpu:
        main = torch.cuda.current_stream(temb.device)
        side, owner = _side_stream(main), main.cuda_stream
        # temb is ready, and the previous forward's readers of these outputs are queued. Nothing else allocates on
        # the side stream, and it always waits here first: outputs freed after their main-stream readers go back
        # to its pool, where only the next forward's GEMVs, queued after those readers, can take them.
        side.wait_stream(main)
        if torch.cuda.is_current_stream_capturing():
            _forked_in_capture.add(owner)
    slots = {}
    with torch.cuda.stream(side) if on_gpu else contextlib.nullcontext():
        activations: dict[torch.dtype, torch.Tensor] = {}
        for linear in linears:
            if linear.weight.data_ptr() in _refused:
                continue
            x = modulation_input(temb, linear, activations)
            out = torch.nn.functional.linear(x, linear.weight, linear.bias)
            event = None
            if on_gpu:
                event = torch.cuda.Event()
                event.record(side)
            slots[linear.weight.data_ptr()] = _Slot(out, event, x, owner)
    with _lock:
        _slots.update(slots)


def modulation_input(temb: torch.Tensor, linear: torch.nn.Linear,
                     by_dtype: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """``silu(temb)`` in the dtype of ``linear``'s weight (AdaLayerNormContinuous casts it to the hidden dtype),
    computed once per dtype into ``by_dtype``."""
    dtype = linear.weight.dtype
    if dtype not in by_dtype:
        by_dtype[dtype] = torch.nn.functional.silu(temb).to(dtype)
    return by_dtype[dtype]


def modulation_linears(transformer: torch.nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, torch.nn.Linear]]:
    """The plain ``nn.Linear`` modules of ``transformer`` named by the fnmatch ``patterns``, in registration order
    (the order the forward runs them). Others (quantized, LoRA-wrapped, sharded) are left to compute themselves."""
    return [(name, module) for name, module in transformer.named_modules()
            if type(module) is torch.nn.Linear and any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def use_modulation_prefetch(transformer: torch.nn.Module, spec) -> tuple[int, Callable[[], None]]:
    """Prefetch the modulation linears that ``spec`` (pipelines/base.py's ``ModulationPrefetch``) names in
    ``transformer``. Returns how many and the undo; (0, no-op) when the embedding module or the linears are absent."""
    served = serve_linears(transformer, spec) if spec is not None else None
    if served is None:
        return 0, lambda: None
    embedding, linears, unserve = served
    remove_hook = add_hook(embedding, "modulation_prefetch", _PrefetchHook(linears))

    def undo() -> None:
        remove_hook()
        unserve()

    return len(linears), undo


def serve_linears(transformer: torch.nn.Module, spec) -> tuple[torch.nn.Module, list[torch.nn.Linear],
                                                                  Callable[[], None]] | None:
    """The embedding module and the modulation linears that ``spec`` names in ``transformer``, the linears switched
    to ``PrefetchedLinear`` (outputs from the slots), and the undo (plain linears again, their slots and checks
    forgotten); None when the embedding module or the linears are absent. The prefetch and the modulation table
    (modulation_table.py) both fill the slots."""
    try:
        embedding = transformer.get_submodule(spec.embedding)
    except AttributeError:
        return None
    linears = [linear for _, linear in modulation_linears(transformer, spec.linears)]
    if not linears:
        return None
    for linear in linears:
        linear.__class__ = PrefetchedLinear

    def unserve() -> None:
        with _lock:
            for linear in linears:
                linear.__class__ = torch.nn.Linear
                key = linear.weight.data_ptr()
                _slots.pop(key, None)
                _verified.discard(key)
                _refused.discard(key)

    return embedding, linears, unserve
