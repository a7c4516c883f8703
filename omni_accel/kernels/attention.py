"""Attention backend pass: pick the fastest correct attention kernel and route the transformer's attention to it.

Two routes, by what the backend is:
- SDPA's own kernels (cuDNN, FA2, mem-efficient, math) reach every family through a hook that enters
  ``torch.nn.attention.sdpa_kernel`` around the transformer forward. We don't use diffusers' ``_native_cudnn``
  backend for this: it copies q/k/v to contiguous before SDPA, measured 5 % slower per FLUX step on an H200.
- Other kernels (flash-attn, FA3, Sage, flex, xformers) go through diffusers' dispatcher
  (``set_attention_backend``), so only families whose processors use the dispatcher can take them.

Why cuDNN first on Hopper: measured at FLUX 1024² shapes on an H200, SDPA's cuDNN kernel runs at 637 TFLOP/s
against 331 for FA2. (torch 2.11 already prefers cuDNN there; ``auto`` pins it so older torch builds get it too.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from diffusers.hooks import ModelHook
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..deps import installed, missing_message
from ..errors import AccelError
from ..hooks import add_hook
from ..pass_base import AccelPass, PassContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    name: str  # our name
    dispatcher: str  # diffusers AttentionBackendName value
    sdpa: SDPBackend | None  # the SDPA kernel it is, for families outside the dispatcher; None = not SDPA
    needs_cuda: bool
    package: str | None = None  # import name that must be installed
    note: str = ""


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("sdpa", "native", None, False, note="PyTorch SDPA, its own kernel choice"),
        Backend("cudnn", "_native_cudnn", SDPBackend.CUDNN_ATTENTION, True, note="SDPA cuDNN kernel (Hopper)"),
        Backend("sdpa_flash", "_native_flash", SDPBackend.FLASH_ATTENTION, True, note="SDPA's FlashAttention-2"),
        Backend("efficient", "_native_efficient", SDPBackend.EFFICIENT_ATTENTION, True, note="SDPA mem-efficient"),
        Backend("math", "_native_math", SDPBackend.MATH, False, note="SDPA math reference"),
        Backend("flash_attn", "flash", None, True, "flash_attn", note="flash-attn package (FA2)"),
        Backend("fa3", "_flash_3", None, True, "flash_attn_interface", note="FlashAttention-3 (Hopper)"),
        Backend("sage", "sage", None, True, "sageattention", note="SageAttention (lossy int8 QK)"),
        Backend("flex", "flex", None, False, note="torch flex_attention"),
        Backend("xformers", "xformers", None, True, "xformers", note="xformers memory-efficient attention"),
        Backend("fp8", "", None, True, "triton",
                note="omni_accel's 8-bit flash attention: int8 QK^T, e4m3 PV (Triton; lossy)"),
    )
}
ALIASES = {"native": "sdpa", "flash": "flash_attn", "flash3": "fa3", "sageattention": "sage"}


def _installed(package: str | None) -> bool:
    return package is None or installed(package)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backend names that can run on ``device`` with what is installed (``auto`` is always accepted too)."""
    device = torch.device(device)

    def runs_here(b: Backend) -> bool:
        if b.name == "fp8":
            return _fp8_refusal(device) is None
        return device.type == "cuda" or not b.needs_cuda

    return [b.name for b in BACKENDS.values() if _installed(b.package) and runs_here(b)]


def _cudnn_sdpa_usable(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 9 and torch.backends.cudnn.is_available()


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """Turn a user's name (or ``auto``) into a backend that runs here; raise AccelError with the choices."""
    if name == "auto":
        if _installed("flash_attn_interface") and device.type == "cuda" and dtype != torch.float32:
            return BACKENDS["fa3"]
        if _cudnn_sdpa_usable(device, dtype):
            return BACKENDS["cudnn"]
        return BACKENDS["sdpa"]
    key = ALIASES.get(name, name)
    if key not in BACKENDS:
        raise AccelError(
            f"attention={name!r} is not a known backend. Available here: auto, "
            f"{', '.join(available_backends(device))} (all known: {', '.join(BACKENDS)})."
        )
    backend = BACKENDS[key]
    if backend.name == "fp8":
        return _check_fp8(device)
    if backend.needs_cuda and device.type != "cuda":
        raise AccelError(
            f"attention={name!r} needs a CUDA GPU but the pipeline runs on {device}; use attention='auto' or 'sdpa'."
        )
    if not _installed(backend.package):
        raise AccelError(missing_message(backend.package, f"attention={name!r}", "use attention='auto'"))
    return backend


def _fp8_refusal(device: torch.device) -> str | None:
    """Why attention='fp8' cannot run on ``device``, or None. The capability is read only where torch sees CUDA:
    ``available_backends("cuda")`` also lists what a GPU would take on machines without one."""
    from . import fused

    if not _installed("triton"):
        return missing_message("triton", "attention='fp8'", "use attention='auto'")
    if device.type != "cuda" and not fused.interpreted():  # the interpreter runs it on CPU tensors (CI)
        return (f"attention='fp8' needs a CUDA GPU with FP8 tensor cores but the pipeline runs on {device}; "
                "use attention='auto'.")
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"attention='fp8' needs FP8 tensor cores (compute capability 8.9 or newer); this GPU has "
                f"{major}.{minor}. Use attention='auto'.")
    return None


def _check_fp8(device: torch.device) -> Backend:
    refusal = _fp8_refusal(device)
    if refusal is not None:
        raise AccelError(refusal)
    return BACKENDS["fp8"]


# Kernels SDPA may fall back to when the chosen one rejects a shape or dtype (e.g. cuDNN and a float mask).
_FALLBACKS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class _SdpaKernelHook(ModelHook):
    """Runs the module's forward inside ``sdpa_kernel`` with ``backend`` first in SDPA's priority order."""

    def __init__(self, backend: SDPBackend):
        super().__init__()
        self.order = [backend] + [b for b in _FALLBACKS if b != backend]

    def new_forward(self, module, *args, **kwargs):
        with sdpa_kernel(self.order, set_priority=True):
            return self.fn_ref.original_forward(*args, **kwargs)


def _attention_processors(transformer) -> list:
    return [m.processor for m in transformer.modules() if hasattr(m, "processor") and m.processor is not None]


class AttentionPass(AccelPass):
    name = "attention"

    def wanted(self, config) -> bool:
        return True

    def _plan(self, ctx: PassContext) -> Backend:
        dtype = ctx.adapter.transformers_of(ctx.pipe)[0][1].dtype  # Wan 2.2 may hold only transformer_2
        backend = resolve_backend(ctx.config.attention, ctx.device, dtype)
        if not ctx.adapter.attention_via_dispatcher and backend.sdpa is None and backend.name != "sdpa":
            # only SDPA kernels reach processors that call F.scaled_dot_product_attention themselves
            usable = [b.name for b in BACKENDS.values() if b.sdpa is not None or b.name == "sdpa"]
            raise AccelError(
                f"attention={ctx.config.attention!r} cannot reach {ctx.adapter.family}: its attention calls PyTorch "
                f"SDPA directly, so only SDPA kernels apply. Use one of: auto, {', '.join(usable)}."
            )
        return backend

    def check(self, ctx: PassContext) -> None:
        backend = self._plan(ctx)
        if backend.name == "fp8" and ctx.config.sequence_degree > 1:
            raise AccelError(
                f"attention='fp8' cannot be combined with sequence parallelism (sp={ctx.config.sp}): the ring and "
                "Ulysses paths need the dispatcher's own kernels. Use attention='auto' with sp, or sp=1."
            )

    def apply(self, ctx: PassContext) -> None:
        backend = self._plan(ctx)
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            if backend.name == "sdpa":
                undo = lambda: None  # noqa: E731 -- default path: nothing to patch
            elif backend.name == "fp8":
                from .fp8_attention import route_transformer

                undo = route_transformer(transformer)
            elif backend.sdpa is not None:
                undo = add_hook(transformer, f"sdpa_kernel.{name}", _SdpaKernelHook(backend.sdpa))
            else:
                undo = _set_dispatcher_backend(transformer, backend.dispatcher)
            ctx.state.record("attention", undo, component=name, backend=backend.name, requested=ctx.config.attention)
        logger.info("omni_accel: attention backend %s (%s)", backend.name, backend.note)


def _set_dispatcher_backend(transformer, dispatcher_name: str):
    """Set every processor's backend; the undo restores each processor's and the registry's previous value.

    diffusers' ``reset_attention_backend`` clears processors to None but leaves the registry's global active
    backend changed, which would leak into other models; so we record and restore both ourselves.
    """
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    processors = [p for p in _attention_processors(transformer) if hasattr(p, "_attention_backend")]
    previous = [p._attention_backend for p in processors]
    previous_active = _AttentionBackendRegistry._active_backend
    transformer.set_attention_backend(dispatcher_name)

    def undo() -> None:
        for processor, value in zip(processors, previous):
            processor._attention_backend = value
        _AttentionBackendRegistry._active_backend = previous_active

    return undo
