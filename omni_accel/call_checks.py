"""Checks of a pipeline call's arguments, run by the call hook (stats.py) before an accelerated pipeline starts.

Bad values (no denoising steps, an image side the VAE cannot encode) raise AccelError naming the value and the fix
instead of failing deep inside the pipeline; settings that run but are very likely not what the caller meant (true
CFG without a negative prompt, the built-in model off its trained size) log a warning once per accelerate().
"""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any

from .errors import AccelError

@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.__call__)


def call_arguments(cls: type, pipe: Any, args: tuple, kwargs: dict) -> dict:
    """Every argument of ``cls.__call__`` for this call, by name, the pipeline's defaults filled in; {} when the
    arguments do not bind (the pipeline's own call then raises its TypeError)."""
    try:
        bound = _signature(cls).bind(pipe, *args, **kwargs)
    except TypeError:
        return {}
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(_signature(cls).parameters)), None)  # self
    for name, param in _signature(cls).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_call(pipe: Any, state: Any, cls: type, arguments: dict, given: dict) -> None:
    """Raise AccelError for argument values the pipeline cannot run; warn (once) for ones it silently ignores.
    ``arguments``: every argument, defaults filled in; ``given``: the keyword arguments of the call itself."""
    name = cls.__name__
    steps = arguments.get("num_inference_steps")
    if steps is not None and (not _is_int(steps) or steps < 1):
        raise AccelError(f"num_inference_steps={steps!r} is invalid: {name} needs a positive whole number of "
                         "denoising steps, e.g. num_inference_steps=20.")
    multiple = state.adapter.size_multiple(pipe)
    for side in ("height", "width"):
        value = arguments.get(side)
        if value is None:
            continue
        if not _is_int(value):
            raise AccelError(f"{side}={value!r} is invalid: {name} needs a whole number of pixels, e.g. "
                             f"{side}={multiple * 8}.")
        if value < multiple:
            raise AccelError(f"{side}={value} is too small: {name} needs at least {multiple} pixels per side (sides "
                             f"are multiples of {multiple}: the VAE's down-sampling x 2x2 patches).")
    _warn_true_cfg_without_negative(pipe, state, cls, arguments, given)
    from .builtin import off_trained_size

    state.warn_once(off_trained_size(pipe, arguments.get("height"), arguments.get("width")))


def _warn_true_cfg_without_negative(pipe: Any, state: Any, cls: type, arguments: dict, given: dict) -> None:
    """A CFG scale the caller set explicitly that the pipeline ignores for want of a negative prompt."""
    from .parallel.cfg import cfg_style

    style = cfg_style(state.adapter, pipe)
    scale_arg, negative = style["cfg_scale_arg"], style["negative_prompt_arg"]
    scale = given.get(scale_arg) if scale_arg else None
    if (not style["needs_negative"] or not negative or not isinstance(scale, numbers.Real)
            or scale <= style["cfg_threshold"]):
        return
    if arguments.get(negative) is None and arguments.get(negative + "_embeds") is None:
        state.warn_once(f"{scale_arg}={scale} has no effect without {negative}: {cls.__name__} runs true CFG only "
                        f"with {negative}=... (or {negative}_embeds); pass {negative}='' for an empty negative "
                        f"prompt, or leave {scale_arg} out.")
