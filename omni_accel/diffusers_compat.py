"""Living beside diffusers: what diffusers already installed on a pipeline, and the diffusers methods that would
misbehave on an accelerated one.

``check`` refuses a step cache on a transformer that already runs one of diffusers' own (``enable_cache``:
FasterCache, FirstBlockCache, MagCache, ...), and FP8 layers over diffusers' layerwise casting (the weights are
stored in a low-precision dtype already). Diffusers' group / model offloading is the offload pass's to refuse. ``apply`` shadows, on the accelerated pipeline and its transformers,
the diffusers methods that would break it or silently do the wrong thing, with refusals that say what to do
instead:

* after ``quant`` / ``fuse_qkv`` / ``tp`` (the weights are no longer diffusers' own layers): ``save_pretrained``
  (the FP8 / fused / sharded layers cannot be loaded back), a transformer's own ``load_lora_adapter`` (the LoRA's
  target layers are gone: FP8 raises, a fused q/k/v silently ignores the LoRA; the pipeline's
  ``load_lora_weights`` works, through the lora pass, which restores, loads and accelerates again), and
  ``pipe.to(...)`` to another device or dtype (restore() puts the original weights back where they were at
  accelerate() time);
* ``fuse_qkv_projections`` / ``unfuse_qkv_projections`` after ``quant`` or ``fuse_qkv``;
* ``enable_cache`` after ``cache=``.

Everything else diffusers offers keeps working (checked: save_pretrained and load_lora_weights after attention,
compile, cache, kernels, offload, VAE switches); docs/architecture.md lists it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .errors import AccelError
from .hooks import wrap_method
from .pass_base import AccelPass, PassContext

# knob -> (is it set, what the saved weights would be, why a LoRA cannot reach its layers)
_WEIGHT_KNOBS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "quant": (lambda c: c.quant is not None, "quantized layers", "they are quantized layers now"),
    "fuse_qkv": (lambda c: c.fuse_qkv, "fused q/k/v projections", "q, k and v are one fused projection now"),
    "tp": (lambda c: c.tp > 1, "this rank's shards of the weights", "they are split over the tensor-parallel ranks"),
}


def _refusal(message: str) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise AccelError(message)

        return refused

    return make


def _to_target(args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.dtype | None]:
    """The device and dtype a ``pipe.to(...)`` call asks for (DiffusionPipeline.to's argument forms)."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, (str, torch.device, int)):
            device = arg
    return (torch.device(device) if device is not None else None), dtype


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class DiffusersCompatPass(AccelPass):
    name = "diffusers_compat"

    def wanted(self, config) -> bool:
        return True

    def check(self, ctx: PassContext) -> None:
        config = ctx.config
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            theirs = getattr(transformer, "_cache_config", None)
            if config.cache is not None and theirs is not None:
                raise AccelError(
                    f"cache={config.cache!r}: the {name} already runs diffusers' {type(theirs).__name__} "
                    f"({name}.enable_cache()); two step caches on one transformer would skip each other's work. "
                    f"Call pipe.{name}.disable_cache() first, or leave cache= out to keep diffusers' cache."
                )
            if config.quant is not None and _LAYERWISE_CASTING in _diffusers_hooks(transformer):
                raise AccelError(
                    f"quant={config.quant!r}: the {name} stores its weights in a low-precision dtype already "
                    f"(diffusers' {name}.enable_layerwise_casting()); quantized layers cannot be made from them. "
                    "Load the model without layerwise casting to use quant, or leave quant out to keep diffusers' casting."
                )

    def apply(self, ctx: PassContext) -> None:
        pipe, config, state = ctx.pipe, ctx.config, ctx.state
        knobs = [k for k, (is_set, _, _) in _WEIGHT_KNOBS.items() if is_set(config)]
        shown = ", ".join(f"{k}={getattr(config, k)!r}" for k in knobs)
        transformers = ctx.adapter.transformers_of(pipe)

        def guard(obj: Any, method: str, make: Callable[[Callable], Callable], **details: Any) -> None:
            if callable(getattr(obj, method, None)):
                state.record(self.name, wrap_method(obj, method, make), hidden=True, guarded=method, **details)

        if knobs:
            saved = " and ".join(_WEIGHT_KNOBS[k][1] for k in knobs)
            why = "; ".join(_WEIGHT_KNOBS[k][2] for k in knobs)
            save = (f"save_pretrained() after accelerate({shown}) would write {saved}, which diffusers cannot load "
                    "back: call omni_accel.restore(pipe) first, save the plain weights, and accelerate() again after "
                    "loading them (an acceleration is applied after loading, it is not saved).")
            lora = (f"loading a LoRA into the transformer after accelerate({shown}) cannot reach the layers it adapts "
                    f"({why}): use pipe.load_lora_weights(...), which restores, loads and accelerates again, or "
                    "call omni_accel.restore(pipe) first.")
            guard(pipe, "save_pretrained", _refusal(save))
            guard(pipe, "to", self._guarded_to(transformers, shown))
            for name, transformer in transformers:
                guard(transformer, "save_pretrained", _refusal(save), component=name)
                guard(transformer, "load_lora_adapter", _refusal(lora), component=name)
        for name, transformer in transformers:
            if config.quant is not None:
                guard(transformer, "fuse_qkv_projections", _refusal(
                    f"{name}.fuse_qkv_projections() after accelerate(quant={config.quant!r}) cannot fuse "
                    "quantized layers: use accelerate(fuse_qkv=True, quant=...), which fuses before quantizing, or "
                    "fuse before accelerate()."), component=name)
            if config.quant is not None or config.fuse_qkv:
                guard(transformer, "unfuse_qkv_projections", _refusal(
                    f"{name}.unfuse_qkv_projections() after accelerate({shown}) would rebuild projections omni_accel "
                    "replaced; omni_accel.restore(pipe) puts the original ones back."), component=name)
            if config.cache is not None:
                guard(transformer, "enable_cache", _refusal(
                    f"{name}.enable_cache() after accelerate(cache={config.cache!r}) would stack diffusers' step "
                    "cache on omni_accel's: call omni_accel.restore(pipe) first, or keep one of the two."),
                    component=name)

    @staticmethod
    def _guarded_to(transformers: list, shown: str) -> Callable[[Callable], Callable]:
        """``pipe.to`` that refuses a change of device or dtype (the kept originals would not follow)."""

        def make(original: Callable) -> Callable:
            def to(*args: Any, **kwargs: Any) -> Any:
                device, dtype = _to_target(args, kwargs)
                for _, transformer in transformers:
                    first = next(transformer.parameters(), None)
                    if first is None:
                        continue
                    moves = device is not None and not _same_device(device, first.device)
                    casts = dtype is not None and dtype != _compute_dtype(transformer)
                    if moves or casts:
                        raise AccelError(
                            f"pipe.to({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])}) "
                            f"after accelerate({shown}) would move or cast the replaced layers while restore() puts "
                            "the original weights back on the device and dtype they had at accelerate() time: call "
                            "omni_accel.restore(pipe) first, move the pipeline, then accelerate() again.")
                return original(*args, **kwargs)

            return to

        return make


_LAYERWISE_CASTING = "layerwise_casting"  # diffusers.hooks.layerwise_casting's hook name


def _diffusers_hooks(module: torch.nn.Module) -> set[str]:
    """Names of the diffusers hooks registered on ``module`` and its submodules."""
    names: set[str] = set()
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        names.update(getattr(registry, "hooks", {}) or {})
    return names


def _compute_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The dtype the transformer computes in (its first floating-point parameter that is not FP8)."""
    for p in transformer.parameters():
        if p.is_floating_point() and p.element_size() > 1:
            return p.dtype
    return torch.get_default_dtype()
