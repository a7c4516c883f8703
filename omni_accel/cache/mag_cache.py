"""cache="mag_cache": MagCache (Ma et al., 2025) through diffusers' own ``MagCacheConfig`` / ``enable_cache``.

MagCache skips the whole block stack on a step (returning its input plus the previous step's residual) while the
accumulated error ``sum |1 - prod(mag_ratio)|`` stays under ``threshold``, at most ``max_skip_steps`` steps in a
row, never in the first ``retention_ratio`` of the steps. The per-step magnitude ratios are model dependent:
``cache_config={"mag_ratios": [...]}`` gives them; without them the first pipeline call runs diffusers' calibration
(``MagCacheConfig(calibrate=True)``: nothing skipped, so that call's output is the plain one) and the ratios it
reports -- averaged over the CFG branches, which diffusers calibrates separately -- are used from the next call
on (``report()["cache"]["mag_ratios"]`` shows them for reuse).

diffusers counts the steps of a call itself, so its config must hold the call's step count: at every call start the
count is read from the call (``num_inference_steps``, or the length of ``sigmas`` / ``timesteps``, or the
pipeline's default) and the cache re-enabled when it changed (diffusers interpolates the ratios to it).

Families: every one whose block classes diffusers registers for its block caches (FLUX.1, FLUX.2, Qwen-Image, SD3,
Wan, Z-Image in diffusers 0.42). Refused, with the reason: pipelines with two transformers (Wan 2.2 A14B: diffusers
counts every call of a transformer as a step, while each expert runs only part of the steps), transformers without
diffusers' cache mixin or with unregistered blocks, parallel degrees (not tested together), compile (CachePass).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import logging

import torch

from ..errors import AccelError
from ..hooks import CallbackHook, add_hook
from ..pass_base import PassContext
from .base import CacheBackend

logger = logging.getLogger(__name__)

# diffusers' MagCacheConfig defaults (diffusers/hooks/mag_cache.py)
DEFAULTS = {"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": None}
_RESULTS_PREFIX = "MagCache Calibration Results:"  # what diffusers logs at the end of a calibration run
_DIFFUSERS_LOGGER = "diffusers.hooks.mag_cache"


def hooked_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks diffusers' apply_mag_cache hooks: every block of the child ModuleLists it knows by name."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [block for name, child in transformer.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList) for block in child]


def _unsupported(transformer: torch.nn.Module) -> str | None:
    """Why diffusers' MagCache cannot run on this transformer, or None."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    if not hasattr(transformer, "enable_cache"):
        return f"{type(transformer).__name__} has no diffusers cache support (CacheMixin)"
    if getattr(transformer, "is_cache_enabled", False):
        return f"{type(transformer).__name__} already has a diffusers cache enabled; disable_cache() it first"
    blocks = hooked_blocks(transformer)
    if not blocks:
        return f"diffusers finds no transformer block list in {type(transformer).__name__}"
    for cls in dict.fromkeys(type(b) for b in blocks):
        try:
            TransformerBlockRegistry.get(cls)
        except ValueError:
            return f"diffusers' block caches do not know {cls.__name__} (no TransformerBlockRegistry entry)"
    return None


def call_steps(pipe, call_kwargs: dict) -> int:
    """The step count of a pipeline call: num_inference_steps, else len(sigmas / timesteps), else the default."""
    for key in ("sigmas", "timesteps"):
        if call_kwargs.get(key) is not None:
            return len(call_kwargs[key])
    if call_kwargs.get("num_inference_steps") is not None:
        return int(call_kwargs["num_inference_steps"])
    cls = getattr(type(pipe), "_omni_accel_original_class", type(pipe))
    return int(inspect.signature(cls.__call__).parameters["num_inference_steps"].default)


class _CalibrationLog(logging.Handler):
    """Collects the ratios diffusers logs at the end of each calibrated CFG branch."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.runs: list[list[float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_RESULTS_PREFIX):
            self.runs.append([float(v) for v in ast.literal_eval(message[len(_RESULTS_PREFIX):].strip())])


class _MagCache:
    """The diffusers cache on one transformer, re-enabled per call as the step count or the mode changes."""

    def __init__(self, ctx: PassContext, transformer: torch.nn.Module, options: dict):
        self.ctx, self.transformer, self.options = ctx, transformer, options
        self.ratios: list[float] | None = list(options["mag_ratios"]) if options["mag_ratios"] is not None else None
        self.calibrated_from: int | None = None  # steps of the call that calibrated the ratios
        self.enabled_for: tuple | None = None  # (steps, calibrating) of the config now enabled
        self._capture: tuple | None = None

    def config(self, steps: int, calibrating: bool):
        from diffusers import MagCacheConfig

        if calibrating:
            return MagCacheConfig(calibrate=True, num_inference_steps=steps)
        return MagCacheConfig(threshold=self.options["threshold"], max_skip_steps=self.options["max_skip_steps"],
                              retention_ratio=self.options["retention_ratio"], num_inference_steps=steps,
                              mag_ratios=list(self.ratios))

    def enable(self, steps: int, calibrating: bool) -> None:
        if self.enabled_for == (steps, calibrating):
            return
        self.disable()
        # the class's method: accelerate() guards the instance's enable_cache against users stacking a second cache
        type(self.transformer).enable_cache(self.transformer, self.config(steps, calibrating))
        self.enabled_for = (steps, calibrating)

    def disable(self) -> None:
        if self.enabled_for is not None:
            self.transformer.disable_cache()
            self.enabled_for = None

    def on_call_start(self) -> None:
        from diffusers.hooks import HookRegistry

        steps = call_steps(self.ctx.pipe, self.ctx.state.call_kwargs)
        calibrating = self.ratios is None
        self.enable(steps, calibrating)
        HookRegistry.check_if_exists_or_initialize(self.transformer).reset_stateful_hooks()  # a clean run
        if calibrating:  # diffusers logs the ratios (and prints them: kept off the user's stdout)
            handler, source = _CalibrationLog(), logging.getLogger(_DIFFUSERS_LOGGER)
            saved = (source.level, source.propagate)
            source.setLevel(logging.INFO)
            source.propagate = False
            source.addHandler(handler)
            quiet = contextlib.redirect_stdout(io.StringIO())
            quiet.__enter__()
            self._capture = (handler, source, saved, quiet, steps)

    def on_call_end(self) -> None:
        if self._capture is None:
            return
        handler, source, (level, propagate), quiet, steps = self._capture
        self._capture = None
        quiet.__exit__(None, None, None)
        source.removeHandler(handler)
        source.setLevel(level)
        source.propagate = propagate
        runs = [r for r in handler.runs if len(r) == steps]
        if runs:  # one list per CFG branch: their mean serves both (diffusers takes one list)
            self.ratios = [round(sum(v) / len(v), 5) for v in zip(*runs)]
            self.calibrated_from = steps
            logger.info("mag_cache: calibrated on a %d-step call: mag_ratios=%s", steps, self.ratios)
        else:
            logger.warning("mag_cache: the calibration call ended without diffusers' ratios (interrupted?); the next "
                           "call calibrates again.")


class MagCacheBackend(CacheBackend):
    name = "mag_cache"
    options = DEFAULTS

    def resolve(self, ctx: PassContext) -> dict:
        opts = super().resolve(ctx)
        for key in ("threshold", "retention_ratio"):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (key == "retention_ratio" and v > 1):
                bound = "in [0, 1]" if key == "retention_ratio" else ">= 0"
                raise AccelError(f"cache_config {key}={v!r} must be a number {bound}.")
        v = opts["max_skip_steps"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise AccelError(f"cache_config max_skip_steps={v!r} must be an integer >= 1.")
        r = opts["mag_ratios"]
        if r is not None and (not isinstance(r, (list, tuple)) or not r
                              or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in r)):
            raise AccelError(f"cache_config mag_ratios={r!r} must be a list of numbers, one per step (or leave it out "
                             "to calibrate on the first call).")
        return opts

    def check(self, ctx: PassContext, opts: dict) -> None:
        c = ctx.config
        degrees = {"sp": c.sequence_degree, "cfg_parallel": c.cfg_parallel, "tp": c.tp}
        used = {k: v for k, v in degrees.items() if v > 1}
        if used:
            raise AccelError(
                f"cache='mag_cache' with {', '.join(f'{k}={v}' for k, v in used.items())} is not supported: diffusers' "
                "MagCache keeps one residual per transformer in one process and is not tested under parallelism. "
                "Use cache='tea_cache' (tested with sp, ring, cfg_parallel and tp).")
        transformers = ctx.adapter.transformers_of(ctx.pipe)
        if len(transformers) != 1:
            raise AccelError(
                f"cache='mag_cache' on {type(ctx.pipe).__name__} with {len(transformers)} transformers "
                f"({', '.join(n for n, _ in transformers)}) is not supported: diffusers' MagCache counts every call of "
                "a transformer as one step, while each expert runs only part of the steps. Use cache='tea_cache' "
                "(per-expert state) or cache='cache_dit'.")
        reason = _unsupported(transformers[0][1])
        if reason:
            raise AccelError(f"cache='mag_cache' is not available for family {ctx.adapter.family!r}: {reason}. "
                             "Use cache='tea_cache' or cache='cache_dit'.")

    def apply(self, ctx: PassContext, opts: dict):
        name, transformer = ctx.adapter.transformers_of(ctx.pipe)[0]
        cache = _MagCache(ctx, transformer, opts)
        # counters first, so diffusers' hooks (registered later) wrap them: a skipped block is not counted
        removers = [add_hook(block, f"mag_cache.count.{name}.{i}",
                             CallbackHook(before=lambda: ctx.state.count("cache.block_forwards")))
                    for i, block in enumerate(hooked_blocks(transformer))]
        ctx.state.on_call_start(cache.on_call_start)
        ctx.state.on_call_end(cache.on_call_end)

        def summary() -> dict:
            last = ctx.state.last_call
            return {"backend": self.name, "mag_ratios": cache.ratios, "calibrated_from_steps": cache.calibrated_from,
                    "block_forwards": last.counters.get("cache.block_forwards", 0) if last is not None else 0}

        ctx.state.report_sections["cache"] = summary

        def undo() -> None:
            ctx.state.report_sections.pop("cache", None)
            ctx.state.remove_call_hooks(cache.on_call_start, cache.on_call_end)
            cache.disable()
            for remove in reversed(removers):
                remove()

        details = {"backend": self.name, "transformer": name, "blocks": len(removers),
                   **{k: opts[k] for k in ("threshold", "max_skip_steps", "retention_ratio")},
                   "mag_ratios": "given" if opts["mag_ratios"] is not None else "calibrated on the first call"}
        return undo, details, None
