"""accelerate() and restore(): resolve the adapter, validate everything, then apply passes in a fixed order."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .ar_bridge.text_encoder import TextEncoderPass
from .cache import CachePass
from .compiler import CompilePass
from .config import AccelConfig
from .diffusers_compat import DiffusersCompatPass
from .errors import AccelError
from .kernels.attention import AttentionPass
from .kernels.fuse_qkv import FuseQkvPass
from .kernels.fused_pass import KernelsPass
from .kernels.quant import QuantPass
from .lora import LoraPass
from .offload import OffloadPass
from .parallel.cfg import CfgParallelPass
from .parallel.sequence import SequenceParallelPass
from .parallel.tp import TensorParallelPass
from .parallel.vae import VaeParallelPass
from .pass_base import AccelPass, PassContext
from .pipelines import adapter_for
from .state import AccelState
from .stats import StatsPass
from .vae import VaePass

logger = logging.getLogger(__name__)

# The fixed order of the architecture: fuse q/k/v -> quantize -> attention -> tensor parallel -> sequence parallel ->
# CFG parallel -> cache -> offload -> compile. Each later pass sees the modules the earlier ones produced
# (compile must see the final forward; offload must move quantized weights, not the originals; quant must see the
# fused q/k/v linear, so that one activation is quantized once).
PASSES: tuple[AccelPass, ...] = (
    StatsPass(),
    LoraPass(),
    FuseQkvPass(),
    QuantPass(),
    KernelsPass(),
    AttentionPass(),
    TensorParallelPass(),
    SequenceParallelPass(),
    CfgParallelPass(),
    VaeParallelPass(),
    VaePass(),
    TextEncoderPass(),
    CachePass(),
    OffloadPass(),
    CompilePass(),
    DiffusersCompatPass(),  # last: its guards on pipe.to / save_pretrained must not stop the passes above
)


def _resolve_device(pipe: Any, adapter: Any, config: AccelConfig) -> torch.device:
    if config.device is not None:
        try:
            device = torch.device(config.device)
        except (RuntimeError, TypeError) as exc:
            raise AccelError(f"device={config.device!r} is not a valid torch device ({exc}); use e.g. 'cuda'.")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise AccelError(f"device={config.device!r} was asked for but torch sees no CUDA GPU; use device='cpu'.")
        return device
    if config.offload is not None and torch.cuda.is_available():
        return torch.device("cuda")  # offload keeps weights on the host and computes on the GPU
    for _, transformer in adapter.transformers_of(pipe):  # the first denoiser the pipeline holds
        for param in transformer.parameters():
            return param.device
    return torch.device("cpu")


def _modules_of(pipe: Any) -> dict[str, torch.nn.Module]:
    """The pipeline's model components (transformer, VAE, text encoders ...) by name."""
    return {name: m for name, m in getattr(pipe, "components", {}).items() if isinstance(m, torch.nn.Module)}


def _check_shared_modules(pipe: Any) -> None:
    """Refuse a pipeline whose modules another accelerated pipeline holds (``FluxPipeline(**pipe.components)``):
    the patches live on the modules, so two sets of them would stack on one transformer."""
    modules = sorted(_modules_of(pipe).items(), key=lambda item: not item[0].startswith("transformer"))
    for name, module in modules:  # the transformer first: it is what users think of as shared
        owner = AccelState.owner_of(module)
        if owner is not None:
            raise AccelError(
                f"the {name} of this {type(pipe).__name__} is shared with another pipeline that omni_accel has "
                f"accelerated ({owner.pipeline_class_name}, e.g. built with {type(pipe).__name__}(**pipe.components)): "
                "a module carries one acceleration at a time. Call the accelerated pipeline instead (it is the same "
                "model), or omni_accel.restore() the other pipeline first."
            )


def _build_config(config: AccelConfig | None, knobs: dict) -> AccelConfig:
    if config is None:
        return AccelConfig(**knobs)
    if not isinstance(config, AccelConfig):
        raise AccelError(f"config={config!r} must be an omni_accel.AccelConfig (or leave it out and pass keywords).")
    defaults = AccelConfig()
    overrides = {k: v for k, v in knobs.items() if v != getattr(defaults, k)}
    return config.replace(**overrides) if overrides else config


def accelerate(
    pipe: Any,
    *,
    sp: int = 1,
    ulysses: int | None = None,
    ring: int | None = None,
    cfg_parallel: int = 1,
    tp: int = 1,
    vae_parallel: int = 1,
    cache: str | None = None,
    cache_config: dict | None = None,
    offload: str | None = None,
    quant: str | None = None,
    quant_config: dict | None = None,
    attention: str = "auto",
    compile: bool | str = False,
    text_encoder: str | None = None,
    kernels: bool = False,
    fuse_qkv: bool = False,
    vae_tiling: bool = False,
    vae_slicing: bool = False,
    device: str | None = None,
    config: AccelConfig | None = None,
) -> Any:
    """Patch a diffusers pipeline in place and return the same object.

    Every argument is validated -- against the values, the pipeline and the machine -- before the first patch,
    so a bad call leaves ``pipe`` exactly as it was. ``omni_accel.restore(pipe)`` undoes everything;
    ``pipe.omni_accel.report()`` says what was applied and what the last call cost.
    Keywords override the fields of ``config`` when both are given.
    """
    knobs = dict(
        sp=sp, ulysses=ulysses, ring=ring, cfg_parallel=cfg_parallel, tp=tp, vae_parallel=vae_parallel,
        cache=cache, cache_config=cache_config, offload=offload, quant=quant, quant_config=quant_config,
        attention=attention,
        compile=compile, text_encoder=text_encoder, kernels=kernels, fuse_qkv=fuse_qkv, vae_tiling=vae_tiling,
        vae_slicing=vae_slicing, device=device,
    )
    cfg = _build_config(config, knobs).validate()
    adapter = adapter_for(pipe)
    if "omni_accel" in vars(pipe):
        raise AccelError(
            "this pipeline is already accelerated; call omni_accel.restore(pipe) first, then accelerate() "
            "again with the new settings."
        )
    _check_shared_modules(pipe)
    ctx = PassContext(pipe=pipe, adapter=adapter, config=cfg, device=_resolve_device(pipe, adapter, cfg))
    wanted = [p for p in PASSES if p.wanted(cfg)]
    for p in wanted:  # validation of every pass before any pass touches the pipeline
        p.check(ctx)

    ctx.state = AccelState(pipe, adapter, cfg, ctx.device)
    object.__setattr__(pipe, "omni_accel", ctx.state)
    ctx.state.claim_modules(_modules_of(pipe))
    try:
        for p in wanted:
            t0 = time.perf_counter()
            p.apply(ctx)
            ctx.state.setup_seconds[p.name] = round(time.perf_counter() - t0, 4)
    except BaseException:
        logger.error("omni_accel: a pass failed while patching; undoing the passes already applied")
        restore(pipe)
        raise
    logger.info("omni_accel: %r", ctx.state)
    return pipe


def restore(pipe: Any) -> Any:
    """Remove every omni_accel patch from ``pipe`` (last applied first) and return it."""
    state = vars(pipe).get("omni_accel")
    if state is None:
        raise AccelError("restore() was given a pipeline that omni_accel has not accelerated; nothing to undo.")
    errors = []
    for applied in reversed(state.applied):
        try:
            applied.undo()
        except Exception as exc:  # keep undoing the rest; report all at the end
            errors.append(f"{applied.name}: {exc!r}")
    state.applied.clear()
    state.release_modules()
    object.__delattr__(pipe, "omni_accel")
    if errors:
        raise AccelError("restore() could not undo every patch: " + "; ".join(errors))
    return pipe
