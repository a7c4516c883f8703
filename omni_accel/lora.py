"""LoRA adapters on accelerated pipelines, through diffusers' own loader (PEFT format).

omni_accel writes no LoRA layer: ``pipe.load_lora_weights`` / ``set_adapters`` / ``enable_lora_hotswap`` put peft's
layers into the transformer, and the passes meet them as modules:

- **before** ``accelerate()``: the passes see peft's wrappers. The quant pass quantizes each wrapper's
  ``base_layer`` and leaves the LoRA matrices in the pipeline's dtype, so the delta runs in bf16 beside the FP8 base
  (``quant_target_name``); compile traces the wrapped forwards.
- **after** ``accelerate()``: a call that changes the module tree (``load_lora_weights`` without ``hotswap=True``,
  ``unload_lora_weights``, ``delete_adapters``, ``fuse_lora``, ``unfuse_lora``) restores the pipeline, runs, and
  accelerates it again with the same config: every pass sees the new tree (a compiled pipeline compiles again once).
  ``load_lora_weights(..., hotswap=True)`` copies the new weights into the loaded adapter's tensors in place, so
  compiled graphs stay valid: with ``enable_lora_hotswap(target_rank=R)`` called before the first adapter, every
  adapter of rank <= R swaps in without a recompile, and ``set_lora_scale`` changes the scale in place too.
- refused with the reason (at ``accelerate()`` and before a load): tensor parallelism (it shards ``nn.Linear``
  weights; a LoRA wrapper is not one), ``fuse_qkv`` (it concatenates the q/k/v weights and would drop their
  deltas), and the text-encoder pass over a text encoder that carries an adapter (the engine would not apply it).
  With sequence / CFG parallelism every rank loads the same adapter: the loads are collective like every call.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from .errors import AccelError
from .pass_base import AccelPass, PassContext

logger = logging.getLogger(__name__)

# Pipeline methods that add or remove peft layers (or fold them into the base weights).
RESTRUCTURING = ("load_lora_weights", "unload_lora_weights", "delete_adapters", "fuse_lora", "unfuse_lora")


def adapters_of(pipe: Any) -> dict[str, list[str]]:
    """{component name: adapter names} for every component that carries a peft adapter."""
    out = {}
    for name, component in getattr(pipe, "components", {}).items():
        config = getattr(component, "peft_config", None)
        if isinstance(component, torch.nn.Module) and config:
            out[name] = sorted(config)
    return out


def lora_refusal(pipe: Any, config: Any, text_encoder_lora: bool | None = None) -> str | None:
    """Why the acceleration ``config`` cannot serve a pipeline with LoRA adapters, or None when it can."""
    if config.tp > 1:
        return (f"tp={config.tp} shards nn.Linear weights and a LoRA layer wraps them; use sp / cfg_parallel with "
                "LoRA adapters, or fuse the adapter first (pipe.fuse_lora(); pipe.unload_lora_weights())")
    if config.fuse_qkv:
        return ("fuse_qkv=True concatenates the q/k/v weights and would drop their LoRA deltas; use "
                "fuse_qkv=False with LoRA adapters")
    if text_encoder_lora is None:
        text_encoder_lora = any(name.startswith("text_encoder") for name in adapters_of(pipe))
    if config.text_encoder is not None and text_encoder_lora:
        return (f"text_encoder={config.text_encoder!r} runs the text encoder on an engine that would ignore the "
                "adapter loaded into it; load LoRA weights into the transformer only, or drop text_encoder")
    return None


def quant_target_name(name: str) -> str | None:
    """The name a linear answers to for the quant pass's skip patterns: a peft wrapper's ``base_layer`` answers to
    the wrapper's name; the LoRA matrices themselves (``lora_A`` / ``lora_B`` ...) are never quantized (None)."""
    parts = name.split(".")
    if any(part.startswith("lora_") for part in parts):
        return None
    return name.removesuffix(".base_layer")


# LoRA layer -> {adapter: the scaling its last hotswap load set}: a hotswap fills the scaling of the new adapter's
# alpha / rank but leaves the layer's lora_alpha / r those of the first adapter loaded into that name.
_HOTSWAP_SCALINGS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _lora_layers(pipe: Any, adapter_name: str) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for _, c in _lora_components(pipe) for m in c.modules()
            if isinstance(m, LoraLayer) and adapter_name in m.scaling]


def _remember_hotswap_scalings(pipe: Any, adapter_name: str) -> None:
    for m in _lora_layers(pipe, adapter_name):
        _HOTSWAP_SCALINGS.setdefault(m, {})[adapter_name] = float(m.scaling[adapter_name])


def set_lora_scale(pipe: Any, adapter_name: str, scale: float) -> None:
    """Scale one loaded adapter. Where ``enable_lora_hotswap`` turned the scalings into tensors they are filled in
    place (a compiled graph reads the new value without recompiling); otherwise ``pipe.set_adapters``."""
    layers = _lora_layers(pipe, adapter_name)
    if not layers:
        raise AccelError(f"no adapter named {adapter_name!r} is loaded; loaded: {adapters_of(pipe)}")
    if not all(isinstance(m.scaling[adapter_name], torch.Tensor) for m in layers):
        pipe.set_adapters(adapter_name, adapter_weights=scale)
        return
    for m in layers:
        base = _HOTSWAP_SCALINGS.get(m, {}).get(adapter_name)
        if base is None:
            alpha, rank = m.lora_alpha[adapter_name], m.r[adapter_name]
            base = alpha / (rank ** 0.5 if m.use_rslora.get(adapter_name, False) else rank)
        m.scaling[adapter_name].fill_(scale * base)


def _lora_components(pipe: Any):
    for name in adapters_of(pipe):
        yield name, getattr(pipe, name)


def _reaccelerating(pipe: Any, method: str, original: Callable) -> Callable:
    """``original`` (a pipeline method that restructures the LoRA layers) run on the restored pipeline, which is
    accelerated again afterwards with the same config -- also when the call fails."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if method == "load_lora_weights" and kwargs.get("hotswap"):
            out = original(pipe, *args, **kwargs)  # weights copied into the loaded tensors: the passes stay valid
            _remember_hotswap_scalings(pipe, kwargs.get("adapter_name") or "default_0")
            return out
        from .api import accelerate, restore

        config = pipe.omni_accel.config
        loads_text_encoder = (method == "load_lora_weights" and config.text_encoder is not None
                              and _may_load_text_encoder(pipe, args, kwargs))
        reason = lora_refusal(pipe, config, text_encoder_lora=loads_text_encoder or None)
        if reason is not None:
            raise AccelError(f"pipe.{method}() on a pipeline accelerated with {config.as_dict()}: {reason}.")
        restore(pipe)
        try:
            return original(pipe, *args, **kwargs)
        finally:
            accelerate(pipe, config=config)
            logger.info("omni_accel: pipe.%s() ran on the restored pipeline; accelerated again", method)

    call.__name__ = method
    call.__doc__ = f"{method} on an accelerated pipeline (omni_accel.lora: restore, run, accelerate again)."
    return call


def _may_load_text_encoder(pipe: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a load would put an adapter into a text encoder (only read when the text-encoder pass is on)."""
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path_or_dict")
    try:
        state_dict = source if isinstance(source, dict) else pipe.lora_state_dict(source)
    except Exception:  # noqa: BLE001 -- an unreadable source fails in the load itself, with diffusers' message
        return False
    if isinstance(state_dict, tuple):
        state_dict = state_dict[0]
    return any(str(k).startswith("text_encoder") for k in state_dict)


class LoraPass(AccelPass):
    """Keeps LoRA calls working on an accelerated pipeline (instance attributes over the restructuring methods)
    and refuses the knobs that cannot carry an adapter."""

    name = "lora"

    def wanted(self, config) -> bool:
        return True

    def check(self, ctx: PassContext) -> None:
        if adapters_of(ctx.pipe) and (reason := lora_refusal(ctx.pipe, ctx.config)) is not None:
            raise AccelError(f"this pipeline carries LoRA adapters {adapters_of(ctx.pipe)}: {reason}.")

    def apply(self, ctx: PassContext) -> None:
        pipe = ctx.pipe
        installed = []
        for method in RESTRUCTURING:
            original = getattr(type(pipe), method, None)
            if original is not None and method not in vars(pipe):
                object.__setattr__(pipe, method, _reaccelerating(pipe, method, original))
                installed.append(method)

        def undo() -> None:
            for method in installed:
                vars(pipe).pop(method, None)

        adapters = adapters_of(pipe)
        ctx.state.record("lora", undo, adapters=adapters, hidden=not adapters)
        if installed:
            ctx.state.report_sections["lora"] = lambda: adapters_of(pipe)
