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
    """The adapter of a diffusers pipeline, found by its transformer's class (or a base class of it)."""
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise AccelError(
            f"accelerate() needs a diffusers pipeline (a DiffusionPipeline), got {type(pipe).__name__}. "
            "Load one with diffusers.DiffusionPipeline.from_pretrained(PATH) and pass it."
        )
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise AccelError(
            f"{type(pipe).__name__} has no transformer component (UNet pipelines are not supported). "
            f"omni_accel accelerates DiT pipelines of these families: {', '.join(supported_families())}."
        )
    class_names = [cls.__name__ for cls in type(transformer).__mro__]
    for adapter in _load_all().values():
        if any(name in adapter.transformer_classes for name in class_names):
            return adapter
    raise AccelError(
        f"{type(pipe).__name__} with transformer {type(transformer).__name__} is not supported. "
        f"Supported families: {', '.join(supported_families())}. "
        f"To add one, write an adapter as described in {ADDING_A_MODEL_DOC}."
    )
