"""Small helpers over diffusers' hook registry, so every pass hooks module boundaries the same way.

All our hooks are named ``omni_accel.<what>`` so ``restore`` can remove exactly ours and leave a user's own.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any, Callable

import torch
from diffusers.hooks import HookRegistry, ModelHook

from .errors import copy_refusal

PREFIX = "omni_accel."


def add_hook(module: torch.nn.Module, name: str, hook: ModelHook) -> Callable[[], None]:
    """Register ``hook`` on ``module`` under ``omni_accel.<name>``; return the function that removes it."""
    full_name = PREFIX + name
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(hook, full_name)

    def remove() -> None:
        registry.remove_hook(full_name, recurse=False)

    return remove


class CallbackHook(ModelHook):
    """Calls ``before()`` ahead of the forward and ``after(output)`` once it returns; the output is unchanged."""

    def __init__(self, before: Callable[[], Any] | None = None, after: Callable[[Any], None] | None = None):
        super().__init__()
        self._before = before
        self._after = after

    def pre_forward(self, module, *args, **kwargs):
        if self._before is not None:
            self._before()
        return args, kwargs

    def post_forward(self, module, output):
        if self._after is not None:
            self._after(output)
        return output


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued GPU work so a host clock reading means something; free on CPU."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


class Stopwatch:
    """Accumulates wall time of a region, synchronising the device at both ends (stage granularity only)."""

    def __init__(self, device_fn: Callable[[], Any]):
        self._device_fn = device_fn
        self.seconds = 0.0
        self._started: float | None = None

    def start(self) -> None:
        synchronize(self._device_fn())
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is not None:
            synchronize(self._device_fn())
            self.seconds += time.perf_counter() - self._started
            self._started = None


def swap_module_global(transformer: torch.nn.Module, attribute: str, registry: dict[str, list],
                       replacement_for: Callable[[Any], Any]) -> tuple[int, Callable[[], None]]:
    """Replace the global ``attribute`` of the Python modules that define ``transformer`` and its attention
    processors with ``replacement_for(current)`` (None: that module is left alone); return how many modules and the
    undo.

    Used where diffusers' processors call a module-level function (``dispatch_attention_fn``, ``apply_rotary_emb``)
    and no hook point exists. A module global is shared by every pipeline of the family in the process, so
    ``registry`` (module name -> [original, transformers using the swap]) makes each swap once and puts the
    original back with the last user's undo."""
    names = {type(transformer).__module__}
    names |= {type(m.processor).__module__ for m in transformer.modules() if getattr(m, "processor", None) is not None}
    swapped = []
    for name in sorted(names):
        module = sys.modules.get(name)
        if name not in registry:
            current = getattr(module, attribute, None)
            replacement = replacement_for(current)
            if replacement is None:
                continue
            registry[name] = [current, 0]
            setattr(module, attribute, replacement)
        registry[name][1] += 1
        swapped.append((name, module))

    def undo() -> None:
        for name, module in swapped:
            entry = registry[name]
            entry[1] -= 1
            if entry[1] == 0:
                setattr(module, attribute, entry[0])
                del registry[name]

    return len(swapped), undo


def wrap_method(obj: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Shadow ``obj.name`` with an instance attribute built from the bound original; return the undo.

    Used where no hook point exists (a pipeline's ``encode_prompt``, a VAE's ``decode``): the instance
    attribute wins over the class's method, and deleting it brings the method back untouched.
    """
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    object.__setattr__(obj, name, MethodWrapper(obj, name, make_wrapper, previous if had_own else None))

    def undo() -> None:
        if had_own:
            object.__setattr__(obj, name, previous)
        else:
            object.__delattr__(obj, name)

    return undo


class MethodWrapper:
    """The instance attribute ``wrap_method`` installs: ``make_wrapper(original)``, where the original is the
    attribute it shadows (or the class's method, bound to ``owner``).

    A deep copy follows its owner: ``copy.deepcopy(pipe.vae).decode`` wraps the *copy's* decode (a closure would
    keep calling the original module). Pickling is refused with the fix: the wrapper belongs to this process.
    """

    def __init__(self, owner: Any, name: str, make_wrapper: Callable[[Callable], Callable], previous: Any = None):
        self._owner, self._name, self._make, self._previous = owner, name, make_wrapper, previous
        original = previous if previous is not None else getattr(type(owner), name).__get__(owner)
        self._call = make_wrapper(original)
        self.__wrapped__ = original  # inspect.signature() and friends see the method's own signature
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "MethodWrapper":
        owner = copy.deepcopy(self._owner, memo)  # the copy under construction (already in memo)
        return MethodWrapper(owner, self._name, self._make, copy.deepcopy(self._previous, memo))

    def __reduce_ex__(self, protocol: Any):
        raise copy_refusal(f"{type(self._owner).__name__} (its {self._name} is wrapped by omni_accel)")

    def __repr__(self) -> str:
        return f"<omni_accel wrapper of {type(self._owner).__name__}.{self._name}>"
