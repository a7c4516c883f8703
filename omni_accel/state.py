"""``pipe.omni_accel``: what was applied, how to undo it, and what each call cost."""

from __future__ import annotations

import copy
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import AccelConfig
from .errors import AccelError, copy_refusal
from .hooks import Stopwatch
from .pipelines.base import ModelAdapter

logger = logging.getLogger("omni_accel")


@dataclass
class AppliedPass:
    name: str
    details: dict
    undo: Callable[[], None] = field(repr=False)


@dataclass
class CallStats:
    """One pipeline call. Counters are filled by passes through ``AccelState.count``."""

    transformer_forwards: int = 0
    text_encoding_s: float = 0.0
    denoising_s: float = 0.0
    vae_decode_s: float = 0.0
    total_s: float = 0.0
    peak_gpu_mem_gib: float | None = None
    counters: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {
            "transformer_forwards": self.transformer_forwards,
            "time_s": {
                "text_encoding": round(self.text_encoding_s, 6),
                "denoising": round(self.denoising_s, 6),
                "vae_decode": round(self.vae_decode_s, 6),
                "total": round(self.total_s, 6),
            },
            "peak_gpu_mem_gib": self.peak_gpu_mem_gib,
        }
        out.update(copy.deepcopy(self.counters))
        return out


class AccelState:
    """Attached to the pipeline as ``pipe.omni_accel`` by ``accelerate`` and removed by ``restore``."""

    # module -> the state whose patches it carries (pipelines built over the same modules share them)
    _owners: "weakref.WeakKeyDictionary[torch.nn.Module, AccelState]" = weakref.WeakKeyDictionary()

    def __init__(self, pipe: Any, adapter: ModelAdapter, config: AccelConfig, device: torch.device):
        self.adapter = adapter
        self.config = config
        self.device = device
        self.applied: list[AppliedPass] = []
        self.calls = 0
        self.last_call: CallStats | None = None
        self._current: CallStats | None = None
        self._call_start_hooks: list[Callable[[], None]] = []
        self._call_end_hooks: list[Callable[[], None]] = []
        self._pipe_class_name = type(pipe).__name__
        self.call_args: tuple = ()
        self.call_kwargs: dict = {}
        self.call_arguments: dict = {}  # every argument of the current call by name, defaults filled in
        self.warned: set[str] = set()
        # The process mesh when a parallel pass is applied (omni_accel.parallel.ParallelMesh), else None.
        # A cache must make identical decisions on every rank: reduce its metric with all_reduce_mean below.
        self.mesh = None
        # Extra top-level report() entries, computed when report() is called (the cache pass adds "cache").
        self.report_sections: dict[str, Callable[[], Any]] = {}
        self.quantized: dict = {}  # transformer name -> module whose linears the quant pass replaced
        # seconds each pass's apply() took inside accelerate(), in order: the setup share of a slow first call
        self.setup_seconds: dict[str, float] = {}
        device_fn = lambda: self.device  # noqa: E731 -- the device may change after offload is applied
        self.encode_watch = Stopwatch(device_fn)
        self.decode_watch = Stopwatch(device_fn)

    @property
    def pipeline_class_name(self) -> str:
        return self._pipe_class_name

    # -- modules this state patches -----------------------------------------------------------------------
    def claim_modules(self, modules: dict) -> None:
        self._claimed = list(modules.values())
        for module in self._claimed:
            AccelState._owners[module] = self

    def release_modules(self) -> None:
        for module in getattr(self, "_claimed", ()):
            if AccelState._owners.get(module) is self:
                del AccelState._owners[module]
        self._claimed = []

    @classmethod
    def owner_of(cls, module: torch.nn.Module) -> "AccelState | None":
        """The state of the accelerated pipeline that holds ``module``, if any."""
        return cls._owners.get(module)

    # -- filled by passes -------------------------------------------------------------------------------
    def record(self, name: str, undo: Callable[[], None], **details: Any) -> None:
        self.applied.append(AppliedPass(name, details, undo))

    def on_call_start(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at the start of every pipeline call (caches reset their state here)."""
        self._call_start_hooks.append(fn)

    def on_call_end(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at the end of every pipeline call, also when the call raised (mag_cache reads its calibration
        here). An AccelError it raises is raised once the call's bookkeeping is done (the modulation table's miss
        check), or logged where the call itself raised."""
        self._call_end_hooks.append(fn)

    def remove_call_hooks(self, *fns: Callable[[], None]) -> None:
        """Forget call-start / call-end hooks (a pass's undo)."""
        for hooks in (self._call_start_hooks, self._call_end_hooks):
            hooks[:] = [h for h in hooks if h not in fns]

    def count(self, key: str, amount: int = 1) -> None:
        """Add to a per-call counter (e.g. "cache.computed"); a no-op outside a call."""
        if self._current is not None:
            self._current.counters[key] = self._current.counters.get(key, 0) + amount

    def count_transformer_forward(self) -> None:
        if self._current is not None:
            self._current.transformer_forwards += 1

    def warn_once(self, message: str | None) -> None:
        """Log ``message`` as a warning the first time it comes up for this accelerated pipeline."""
        if message and message not in self.warned:
            self.warned.add(message)
            logger.warning("omni_accel: %s", message)

    def all_reduce_mean(self, tensor: torch.Tensor, group: str = "world") -> torch.Tensor:
        """Mean of ``tensor`` over the ranks of ``group`` ("world", "sequence", "cfg", ...); the tensor itself
        without parallelism. Caches reduce their change metric with it so every rank skips the same steps."""
        if self.mesh is None:
            return tensor
        return self.mesh.all_reduce_mean(tensor, group)

    @property
    def in_call(self) -> bool:
        return self._current is not None

    # -- call bracketing (driven by the pipeline subclass installed in api.py) ----------------------------
    def begin_call(self, args: tuple = (), kwargs: dict | None = None, arguments: dict | None = None) -> None:
        self.call_args, self.call_kwargs = args, dict(kwargs or {})  # read by call-start hooks (cfg_parallel)
        self.call_arguments = dict(arguments or {})
        self._current = CallStats()
        self.encode_watch.seconds = 0.0
        self.decode_watch.seconds = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            for fn in self._call_start_hooks:
                fn()
        except BaseException:  # a hook refused this call: leave the state outside a call
            self._current = None
            raise
        self._t0 = time.perf_counter()

    def end_call(self, raised: bool = False) -> None:
        """Leave the call: run the call-end hooks, then the bookkeeping, which always leaves the call. An AccelError
        of a hook (the modulation table's miss) is raised after it -- unless the call itself ``raised``, whose
        exception it would hide: then it is logged."""
        stats = self._current
        if stats is None:
            return
        refusal = None
        try:
            for fn in self._call_end_hooks:
                try:
                    fn()
                except AccelError as exc:
                    refusal = refusal or exc
            self.encode_watch.stop()
            self.decode_watch.stop()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                stats.peak_gpu_mem_gib = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            stats.total_s = time.perf_counter() - self._t0
            stats.text_encoding_s = self.encode_watch.seconds
            stats.vae_decode_s = self.decode_watch.seconds
            stats.denoising_s = max(0.0, stats.total_s - stats.text_encoding_s - stats.vae_decode_s)
            self.last_call = stats
        finally:
            self.calls += 1
            self._current = None
        if refusal is not None:
            if raised:
                logger.error("%s", refusal)
            else:
                raise refusal

    # -- what users read --------------------------------------------------------------------------------
    def report(self) -> dict:
        """What was applied (in order, with details) and the stats of the last call."""
        return {
            "family": self.adapter.family,
            "pipeline": self._pipe_class_name,
            "device": str(self.device),
            "config": {k: v for k, v in self.config.as_dict().items()},
            "applied": [
                {"pass": p.name, **copy.deepcopy(p.details)} for p in self.applied if not p.details.get("hidden")
            ],
            "setup_s": dict(self.setup_seconds),
            "calls": self.calls,
            "last_call": self.last_call.as_dict() if self.last_call else None,
            **{name: section() for name, section in self.report_sections.items()},
        }

    # -- copies ------------------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> "AccelState":
        """Shared, not copied: a deep-copied module's hooks keep reporting to this state (a copy of the state
        would carry undo functions that patch the original modules)."""
        return self

    def __reduce_ex__(self, protocol: Any):
        # every module omni_accel hooked refers to its state: pickling one of them ends here, with the fix
        raise copy_refusal(f"a module of an accelerated {self._pipe_class_name} (it carries omni_accel's hooks)")

    def __repr__(self) -> str:
        names = ", ".join(p.name for p in self.applied if not p.details.get("hidden")) or "nothing"
        return f"<omni_accel on {self._pipe_class_name} ({self.adapter.family}): {names}>"
