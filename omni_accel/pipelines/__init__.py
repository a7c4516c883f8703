"""Model adapters, one module per family, and the lookup from a pipeline to its adapter."""

from __future__ import annotations

import importlib

from ..errors import AccelError
from .base import CacheRegion, CfgStyle, ModelAdapter, SequenceInput, TeaCacheSpec

__all__ = [
    "ModelAdapter",
    "SequenceInput",
    "TeaCacheSpec",
    "CacheRegion",
    "CfgStyle",
    "FAMILY_MODULES",
    "adapter_for",
    "get_adapter",
    "supported_families",
]

# family name -> module in this package that defines ADAPTER
FAMILY_MODULES = {
    "flux": "flux",
    "flux2": "flux2",
    "qwen_image": "qwen_image",
    "wan": "wan",
    "sd3": "sd3",
    "z_image": "z_image",
}

ADDING_A_MODEL_DOC = "docs/adding_a_model.md"

_ADAPTERS: dict[str, ModelAdapter] = {}


def _load_all() -> dict[str, ModelAdapter]:
    if not _ADAPTERS:
        for family, module_name in FAMILY_MODULES.items():
            module = importlib.import_module(f"{__name__}.{module_name}")
            _ADAPTERS[family] = module.ADAPTER
    return _ADAPTERS


def supported_families() -> list[str]:
    return list(_load_all())


def get_adapter(family: str) -> ModelAdapter:
    adapters = _load_all()
    if family not in adapters:
        raise AccelError(f"family={family!r} is not known. Known families: {', '.join(adapters)}.")
    return adapters[family]


def adapter_for(pipe) -> ModelAdapter:
    """The adapter of a diffusers pipeline, found by the class (or a base class) of whichever denoiser it holds:
    Wan 2.2 built with ``transformer=None, transformer_2=...`` resolves through ``transformer_2``."""
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise AccelError(
            f"accelerate() needs a diffusers pipeline (a DiffusionPipeline), got {type(pipe).__name__}. "
            "Load one with diffusers.DiffusionPipeline.from_pretrained(PATH) and pass it."
        )
    adapters = _load_all()
    for adapter in adapters.values():
        for name in adapter.transformer_names:
            module = getattr(pipe, name, None)
            if module is not None and any(c.__name__ in adapter.transformer_classes for c in type(module).__mro__):
                return adapter
    cls, families = type(pipe).__name__, ", ".join(adapters)
    transformers = [(name, m) for name, m in getattr(pipe, "components", {}).items()
                    if "transformer" in name and m is not None]
    if transformers:
        name, module = transformers[0]
        raise AccelError(
            f"{cls} with {name} {type(module).__name__} is not supported. Supported families: {families}. "
            f"To add one, write an adapter as described in {ADDING_A_MODEL_DOC}."
        )
    if getattr(pipe, "unet", None) is not None:
        raise AccelError(
            f"{cls} is a UNet pipeline (unet: {type(pipe.unet).__name__}); omni_accel accelerates DiT pipelines "
            f"(a transformer denoiser) of these families: {families}."
        )
    raise AccelError(
        f"{cls} has no denoiser to accelerate (no transformer component is set); omni_accel accelerates DiT "
        f"pipelines of these families: {families}."
    )
