"""Sleep / wake: give a loaded model's memory back while it is idle, and take it again without reloading.

    report = omni_accel.sleep(pipe)        # {"released_bytes": ..., "where": "pinned_cpu" | "disk", ...}
    omni_accel.is_sleeping(pipe)           # True
    omni_accel.wake_up(pipe)               # the same tensors back; the next call gives the same output

Level 1 (vLLM's level of the same name): the weights leave the device, nothing is discarded.

- Tensors on a GPU go to **pinned host memory** (``parameter.data`` swapped, so every ``nn.Parameter`` object,
  module, hook, compiled graph and LoRA layer stays the same object; waking copies them back to the device).
- A pipeline that lives on the CPU has no faster memory to free, so its tensors are **spilled to a file** (one
  ``torch.save`` in ``spill_dir``, the temp folder by default) and their memory freed (RSS falls); waking reads them back.
- AR engines go through vLLM's own ``LLM.sleep(level)`` / ``LLM.wake_up()`` (on a GPU the engine must have been
  started with ``enable_sleep_mode=True``; vLLM's CPU worker ignores sleep, so a CPU engine keeps its memory).

What survives: the pipeline object and its scheduler, every pass omni_accel applied (regional compile keeps its
graphs: the tensors come back with the same shape, dtype and device, so no guard fails), loaded LoRA adapters.
Not allowed while a call runs. A sleeping pipeline must be woken before it is called again.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .errors import AccelError

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1,)


class WeightStore:
    """The parameters and buffers of ``modules`` moved off their device and back, the tensor objects kept."""

    def __init__(self, modules: list[torch.nn.Module], spill_dir: str | None = None):
        seen: set[int] = set()
        self.tensors: list[torch.Tensor] = []
        for module in modules:
            for t in list(module.parameters()) + list(module.buffers()):
                if id(t) not in seen and t.numel():
                    seen.add(id(t))
                    self.tensors.append(t)
        self.devices = [t.device for t in self.tensors]
        self.on_accelerator = any(d.type != "cpu" for d in self.devices)
        self.spill_dir = spill_dir
        self.spill_path: str | None = None
        self.pinned: list[torch.Tensor | None] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, d in zip(self.tensors, self.devices)
                   if d.type != "cpu" or not self.on_accelerator)

    def release(self) -> str:
        """Move the tensors out; returns where they went ("pinned_cpu" or "disk")."""
        import torch  # imported here: `import omni_accel` (which exports sleep) stays without torch

        if self.on_accelerator:
            pin = torch.cuda.is_available()
            for t, device in zip(self.tensors, self.devices):
                if device.type == "cpu":
                    self.pinned.append(None)  # already in host memory (offloaded modules): stays
                    continue
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t.data)
                self.pinned.append(host)
                t.data = host
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return "pinned_cpu"
        fd, self.spill_path = tempfile.mkstemp(prefix="omni_accel_sleep_", suffix=".pt", dir=self.spill_dir)
        os.close(fd)
        torch.save([t.data for t in self.tensors], self.spill_path)
        for t in self.tensors:
            t.data = torch.empty(0, dtype=t.dtype)
        _return_freed_heap()
        return "disk"

    def restore(self) -> None:
        import torch  # imported here: `import omni_accel` (which exports sleep) stays without torch

        if self.spill_path is not None:
            saved = torch.load(self.spill_path, weights_only=True)
            for t, data in zip(self.tensors, saved):
                t.data = data
            os.remove(self.spill_path)
            self.spill_path = None
            return
        for t, host, device in zip(self.tensors, self.pinned, self.devices):
            if host is not None:
                t.data = host.to(device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.pinned = []


def _return_freed_heap() -> None:
    """glibc keeps freed small and medium blocks in its heap (RSS unchanged); malloc_trim gives them to the OS."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): the memory is reused by the process instead
        pass


class _Asleep:
    def __init__(self, store: WeightStore, engines: list, level: int):
        self.store, self.engines, self.level = store, engines, level


_ASLEEP: "weakref.WeakKeyDictionary[Any, _Asleep]" = weakref.WeakKeyDictionary()


def sleep_parts(target: Any) -> tuple[list[torch.nn.Module], list]:
    """(torch modules, vLLM engines) of ``target``: a diffusers pipeline (its components, and the engine of the
    text-encoder pass), an object with its own ``sleep_parts()`` (the speech pipeline), or a module."""
    import torch  # imported here: `import omni_accel` (which exports sleep) stays without torch

    if hasattr(target, "sleep_parts"):
        return target.sleep_parts()
    if isinstance(target, torch.nn.Module):
        return [target], []
    components = getattr(target, "components", None)
    if not isinstance(components, dict):
        raise AccelError(f"sleep() takes a diffusers pipeline, a speech pipeline or a torch module; got "
                         f"{type(target).__name__}.")
    modules = [c for c in components.values() if isinstance(c, torch.nn.Module)]
    engines = []
    state = vars(target).get("omni_accel")
    encoder = getattr(state, "text_encoder_engine", None)
    engine = getattr(encoder, "engine", None)
    if engine is not None:
        if hasattr(engine, "llm"):
            engines.append(engine)
        elif isinstance(getattr(engine, "model", None), torch.nn.Module):
            modules.append(engine.model)
    return modules, engines


def is_sleeping(target: Any) -> bool:
    return target in _ASLEEP


def sleep(target: Any, level: int = 1, spill_dir: str | None = None) -> dict:
    """Put ``target`` to sleep (see the module docstring); returns what was released and how long it took."""
    if level not in SLEEP_LEVELS:
        raise AccelError(f"sleep level={level!r} is not supported; use level=1 (weights to host memory, or to a "
                         "file for a CPU pipeline, and back on wake_up()).")
    if is_sleeping(target):
        raise AccelError("this model is already asleep; call omni_accel.wake_up() first.")
    state = vars(target).get("omni_accel") if hasattr(target, "__dict__") else None
    if state is not None and state.in_call:
        raise AccelError("sleep() during a pipeline call; wait for the call to finish.")
    t0 = time.perf_counter()
    modules, engines = sleep_parts(target)
    store = WeightStore(modules, spill_dir)
    released = store.nbytes
    where = store.release()
    slept = []
    try:
        for engine in engines:
            engine.sleep(level)
            slept.append(engine)
    except BaseException:
        for engine in slept:
            engine.wake_up()
        store.restore()
        raise
    _ASLEEP[target] = _Asleep(store, engines, level)
    seconds = time.perf_counter() - t0
    logger.info("omni_accel: asleep (level %d): %d tensor bytes to %s, %d engine(s), %.3f s", level, released, where,
                len(engines), seconds)
    return {"level": level, "released_bytes": released, "tensors": len(store.tensors), "where": where,
            "engines": len(engines), "seconds": round(seconds, 6)}


def wake_up(target: Any) -> dict:
    """Bring a sleeping ``target`` back (a no-op report when it is awake)."""
    asleep = _ASLEEP.get(target)
    if asleep is None:
        return {"was_sleeping": False, "seconds": 0.0}
    t0 = time.perf_counter()
    asleep.store.restore()
    for engine in asleep.engines:
        engine.wake_up()
    del _ASLEEP[target]
    seconds = time.perf_counter() - t0
    logger.info("omni_accel: awake in %.3f s", seconds)
    return {"was_sleeping": True, "seconds": round(seconds, 6)}
