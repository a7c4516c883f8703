"""Always-on instrumentation: brackets each pipeline call, checks its arguments (call_checks.py) and times its
stages for ``report()``.

Stage times: text encoding = time inside ``pipe.encode_prompt``; VAE decode = time inside ``vae.decode``;
denoising = the rest of the call (latent preparation, the transformer loop, the scheduler).
"""

from __future__ import annotations

import functools

from .call_checks import call_arguments, check_call
from .errors import copy_refusal
from .hooks import CallbackHook, add_hook, wrap_method
from .pass_base import AccelPass, PassContext

_SUBCLASSES: dict[type, type] = {}


def _instrumented_class(cls: type) -> type:
    """A subclass of the pipeline's class, with the same name, whose ``__call__`` is bracketed.

    ``pipe(...)`` looks ``__call__`` up on the type, so an instance attribute cannot intercept it; swapping the
    instance's class to a thin subclass can, and swapping it back undoes it exactly.
    """
    if cls not in _SUBCLASSES:

        @functools.wraps(cls.__call__)  # keep the pipeline's call signature visible to inspect()
        def __call__(self, *args, **kwargs):
            state = self.__dict__.get("omni_accel")
            if state is None or state.in_call:
                return cls.__call__(self, *args, **kwargs)
            arguments = call_arguments(cls, self, args, kwargs)
            check_call(self, state, cls, arguments, kwargs)  # AccelError before anything runs
            state.begin_call(args, kwargs, arguments)
            raised = False
            try:
                return cls.__call__(self, *args, **kwargs)
            except BaseException:
                raised = True
                raise
            finally:
                state.end_call(raised=raised)

        def __reduce_ex__(self, protocol):
            raise copy_refusal(f"an accelerated {cls.__name__}")

        def __deepcopy__(self, memo):  # a copy would share the modules' patches, and restore() on it undo ours
            raise copy_refusal(f"an accelerated {cls.__name__}", "deep-copied")

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                       "__reduce_ex__": __reduce_ex__, "__deepcopy__": __deepcopy__,
                                                       "_omni_accel_original_class": cls})
    return _SUBCLASSES[cls]


def _timed(watch):
    def make(original):
        @functools.wraps(original)
        def timed(*args, **kwargs):
            if watch._started is not None:  # nested call (e.g. encode_prompt calling itself): time once
                return original(*args, **kwargs)
            watch.start()
            try:
                return original(*args, **kwargs)
            finally:
                watch.stop()

        return timed

    return make


class StatsPass(AccelPass):
    name = "stats"

    def wanted(self, config) -> bool:
        return True

    def apply(self, ctx: PassContext) -> None:
        pipe, state = ctx.pipe, ctx.state
        original = type(pipe)
        pipe.__class__ = _instrumented_class(original)

        def unswap() -> None:
            pipe.__class__ = original

        state.record("stats", unswap, hidden=True)

        if hasattr(pipe, "encode_prompt"):
            state.record("stats", wrap_method(pipe, "encode_prompt", _timed(state.encode_watch)), hidden=True)
        vae = getattr(pipe, ctx.adapter.vae_name, None)
        if vae is not None and hasattr(vae, "decode"):
            state.record("stats", wrap_method(vae, "decode", _timed(state.decode_watch)), hidden=True)
        for name, transformer in ctx.adapter.transformers_of(pipe):
            hook = CallbackHook(before=state.count_transformer_forward)
            state.record("stats", add_hook(transformer, f"count.{name}", hook), hidden=True)
