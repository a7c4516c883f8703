"""CUDA graphs of a whole transformer forward, for ``compile="max"``: one capture per input signature, replayed.

Why the whole forward and not each block: every instance of a block type shares one compiled region, and
inductor's regional CUDA graphs then hand the same static output buffer to every block, so block 2 overwrote
block 1's output while the residual stream still held it (H200, 2026-12-03). One graph over the transformer
forward has one set of static inputs and outputs, and the outputs are cloned out of the graph's pool before they
are returned, so nothing the pipeline holds can be overwritten by the next replay.

What a replay bakes in: every Python decision inside the forward (hooks on blocks, non-tensor arguments, the
weights' addresses). So the compile pass installs this only where the forward is pure -- no cache, offload or
parallel pass inside it -- and the signature of a call (tensor shapes/dtypes/strides, every non-tensor argument)
selects the graph. Weights moved or replaced (``.to()``, ``load_state_dict`` into new tensors) change their
addresses; the graphs are then dropped and captured again.

Kernels a graph cannot hold (a package launching on the legacy default stream, which the capture never sees) go
through ``run_outside_graph``: the capture is then a chain of graphs sharing one memory pool, and those calls run
from Python between their replays -- one launch per stretch of the forward instead of one per kernel.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
from typing import Any, Callable, Hashable, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

MAX_GRAPHS = 8  # signatures per transformer; a pipeline has 1-2 (CFG branches with different text lengths)

# Whether the weight check walks a cached module list (below) or parameters() + buffers() on every call, as it did
# first; benchmarks' A/B rows set it.
CACHED_MODULE_WALK = True

# How many submodules have been set anywhere in the process (torch's global module-registration hook): the cached
# module lists of graphed forwards are walked again only when it moved.
_MODULE_SETS = [0]


def _count_module_set(module, name, submodule):
    _MODULE_SETS[0] += 1


@functools.cache
def _watch_module_sets() -> None:
    torch.nn.modules.module.register_module_module_registration_hook(_count_module_set)


class GraphBackend(Protocol):
    """How to capture and replay: CUDA in production, a re-running stand-in in the CPU tests."""

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        """Capture ``fn`` (which reads the static inputs); return its static outputs and the replay function."""


class CudaGraphBackend:
    def __init__(self, device: torch.device):
        self.device = device

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        # One warm-up on a side stream first, as torch's docs ask: lazy per-stream state (cuBLAS workspaces,
        # cuDNN plans) must not be initialised inside the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return _SegmentedCapture(self.device).record(fn)


class _SegmentedCapture:
    """One capture of ``fn`` as a chain of CUDA graphs sharing one memory pool, split where ``fn`` calls
    ``run_outside_graph``: those calls run from Python between the graphs' replays. Without such a call it is one
    graph, as ``torch.cuda.graph`` would record (same pool, same synchronisation before the capture)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.steps: list[Callable[[], Any]] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def record(self, fn: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        with torch.cuda.stream(self.stream):
            self._begin()
            _ACTIVE.capture = self
            try:
                outputs = fn()
            finally:
                _ACTIVE.capture = None
                self._end()
        return outputs, self.replay

    def replay(self) -> None:
        for step in self.steps:
            step()

    def host_step(self, call: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], shape: tuple[int, ...],
                  dtype: torch.dtype, writes_out: bool = False) -> torch.Tensor:
        self._end()
        # The step holds unowned aliases: the graphs' pool may hand the inputs' memory to later segments once the
        # forward drops them (they are read here before those segments run), and the output's memory belongs to
        # the forward that reads it. Owned references would keep every attention call's q, k, v alive: 40 GB for
        # a Wan 81-frame forward.
        inputs = tuple(_unowned(t) for t in args)
        self._begin()
        static_out = torch.empty(shape, dtype=dtype, device=self.device)  # a pool block, no kernel
        target = _unowned(static_out)
        if writes_out:  # the call writes the buffer the next graph reads: no copy of its result
            self.steps.append(lambda: call(*inputs, out=target))
        else:
            self.steps.append(lambda: target.copy_(call(*inputs)))
        return static_out

    def _begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a server thread doing unrelated CUDA work must not invalidate this capture
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def _end(self) -> None:
        graph, self.graph = self.graph, None
        if graph is not None:
            for join in SEGMENT_END_JOINS:  # a capture may not end with work forked off to another stream
                join(self.stream)
            graph.capture_end()
            self.steps.append(graph.replay)


_ACTIVE = threading.local()  # the segmented capture running on this thread, if any
# Called with the capturing stream before each graph of a capture ends: whoever forks work onto another stream during
# a capture (modulation_prefetch.py) joins it back there, and waits on nothing of this graph in the next one.
SEGMENT_END_JOINS: list[Callable[[torch.cuda.Stream], None]] = []


def run_outside_graph(call: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], shape: tuple[int, ...],
                      dtype: torch.dtype, writes_out: bool = False) -> torch.Tensor:
    """``call(*args)`` now; or, while a whole-forward CUDA graph is being captured on this thread, a break in it: the
    graph so far ends here, ``call`` runs from Python between that graph's replay and the next one's, and the
    returned tensor (``shape``, ``dtype``, contiguous: what ``call`` returns) is where its result is copied for the
    next graph to read. ``writes_out``: ``call`` takes ``out=`` (None: it allocates) and writes its result there,
    so a replay hands it that tensor and copies nothing (a FLUX step's 57 attention outputs: 1.6 GB copied).

    For kernels a graph cannot hold: a package that launches them on the legacy default stream instead of the
    current one (SageAttention's CUDA kernels do) runs them at capture time and leaves them out of the graph, so a
    replay would return the attention of the captured inputs instead of the current ones."""
    capture = getattr(_ACTIVE, "capture", None)
    if capture is None:
        return call(*args, out=None) if writes_out else call(*args)
    return capture.host_step(call, args, shape, dtype, writes_out)


def _unowned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on ``tensor``'s memory that does not keep it allocated (what inductor's CUDA graph trees use)."""
    storage = tensor.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty((), device=tensor.device, dtype=tensor.dtype).set_(
        alias, tensor.storage_offset(), tensor.shape, tensor.stride())


class _Captured:
    def __init__(self, static_inputs: list, tensor_slots: list[int], outputs: Any, replay: Callable[[], None]):
        self.static_inputs = static_inputs
        self.tensor_slots = tensor_slots
        self.out_leaves, self.out_spec = tree_flatten(outputs)
        self.replay = replay

    def run(self, leaves: list) -> Any:
        for i in self.tensor_slots:
            self.static_inputs[i].copy_(leaves[i])
        self.replay()
        # clone: the next replay rewrites these buffers, and the scheduler still holds this step's output
        fresh = [t.clone() if isinstance(t, torch.Tensor) else t for t in self.out_leaves]
        return tree_unflatten(fresh, self.out_spec)


def on_device(tensor_device: torch.device, device: torch.device) -> bool:
    """Whether a tensor on ``tensor_device`` is on ``device``; ``device`` without an index ("cuda", as a user may pass
    it) stands for any of its type's devices: a tensor's device always has one, so comparing with ``==`` made every
    call of a pipeline accelerated with device="cuda" run without its graph."""
    return tensor_device.type == device.type and device.index in (None, tensor_device.index)


def _leaf_key(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device, leaf.requires_grad)
    hash(leaf)  # TypeError for an unhashable leaf: that call cannot be keyed, so it runs eagerly
    return (type(leaf), leaf)


class GraphedForward:
    """Calls ``forward`` eagerly for the first ``warmup`` calls of a signature, then captures it and replays.

    Calls that cannot be graphed run eagerly: grad mode on, an unhashable argument, a tensor not on the graph's
    device, more than ``MAX_GRAPHS`` signatures, or a forward whose capture failed (e.g. it synchronises).
    """

    def __init__(self, forward: Callable[..., Any], module: torch.nn.Module, device: torch.device,
                 backend: GraphBackend | None = None, warmup: int = 1):
        self.forward = forward
        self.module = module
        self.device = device
        self.backend = backend if backend is not None else CudaGraphBackend(device)
        self.warmup = warmup
        self.graphs: dict[Hashable, _Captured] = {}
        self.warmup_calls: dict[Hashable, int] = {}  # eager calls per signature not yet captured
        self.uncapturable: set[Hashable] = set()
        self.stats = {"replays": 0, "captures": 0, "eager_calls": 0}
        _watch_module_sets()
        self._modules: list[torch.nn.Module] = []
        self._modules_seen_at = -1
        self._weights = self._weight_addresses()
        self._warned_full = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(leaves, spec)
        if key is None or key in self.uncapturable:
            return self._eager(args, kwargs)
        self._drop_if_weights_moved()
        captured = self.graphs.get(key)
        if captured is None:
            seen = self.warmup_calls.get(key, 0)
            if seen < self.warmup or len(self.graphs) >= MAX_GRAPHS:
                self._warn_if_full()
                self.warmup_calls[key] = seen + 1
                return self._eager(args, kwargs)
            captured = self._capture(key, leaves, spec)
            if captured is None:
                return self._eager(args, kwargs)
        self.stats["replays"] += 1
        return captured.run(leaves)

    def reset(self) -> None:
        """Free every graph and its memory pool (restore() and weight moves call this)."""
        self.graphs.clear()
        self.warmup_calls.clear()
        self.uncapturable.clear()

    # -- internals --------------------------------------------------------------------------------------
    def _eager(self, args: tuple, kwargs: dict) -> Any:
        self.stats["eager_calls"] += 1
        return self.forward(*args, **kwargs)

    def _key(self, leaves: list, spec: Any) -> Hashable | None:
        if torch.is_grad_enabled() or torch.is_autocast_enabled(self.device.type):
            return None  # training or autocast: not the static inference forward a graph can stand for
        try:
            parts = tuple(_leaf_key(leaf) for leaf in leaves)
        except TypeError:
            return None
        if any(isinstance(leaf, torch.Tensor) and not on_device(leaf.device, self.device) for leaf in leaves):
            return None
        return (str(spec), parts)

    def _capture(self, key: Hashable, leaves: list, spec: Any) -> _Captured | None:
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        static = list(leaves)
        for i in slots:
            static[i] = leaves[i].clone()
        args, kwargs = tree_unflatten(static, spec)
        try:
            outputs, replay = self.backend.capture(lambda: self.forward(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 -- any capture failure means: this signature stays eager
            logger.warning("omni_accel: CUDA graph capture of %s failed (%s); this input signature runs without "
                           "graphs", type(self.module).__name__, exc)
            self.uncapturable.add(key)
            return None
        out_leaves, _ = tree_flatten(outputs)
        if not any(isinstance(t, torch.Tensor) for t in out_leaves):
            self.uncapturable.add(key)
            return None
        captured = _Captured(static, slots, outputs, replay)
        self.graphs[key] = captured
        self.stats["captures"] += 1
        logger.info("omni_accel: captured a CUDA graph of %s (%d of at most %d signatures)",
                    type(self.module).__name__, len(self.graphs), MAX_GRAPHS)
        return captured

    def _weight_addresses(self) -> tuple[int, ...]:
        """The address of every parameter and buffer, read from each module's own dicts (so a tensor replaced in
        them, even without ``setattr``, shows). Why not ``parameters()`` + ``buffers()``: their recursive walk took
        4-8 ms of host time per call for FLUX's 1,275 modules, in front of every replay (the GPU waited: 6.5 ms per
        FP8 forward on an H200); the module list is cached and walked again only after a submodule was set."""
        if not CACHED_MODULE_WALK:
            return tuple(t.data_ptr() for t in list(self.module.parameters()) + list(self.module.buffers()))
        if self._modules_seen_at != _MODULE_SETS[0]:
            self._modules = list(self.module.modules())
            self._modules_seen_at = _MODULE_SETS[0]
        return tuple(t.data_ptr() for m in self._modules for tensors in (m._parameters, m._buffers)
                     for t in tensors.values() if t is not None)

    def _drop_if_weights_moved(self) -> None:
        now = self._weight_addresses()
        if now != self._weights:
            if self.graphs:
                logger.info("omni_accel: %s's weights moved; its CUDA graphs are captured again",
                            type(self.module).__name__)
            self.reset()
            self._weights = now

    def _warn_if_full(self) -> None:
        if len(self.graphs) >= MAX_GRAPHS and not self._warned_full:
            self._warned_full = True
            logger.warning("omni_accel: %s has %d CUDA graphs, the most kept; new input shapes run without graphs",
                           type(self.module).__name__, MAX_GRAPHS)
