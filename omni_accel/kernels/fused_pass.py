"""The kernels pass: ``accelerate(pipe, kernels=True)`` computes the adapter's declared norm modules with the fused
kernels of kernels/fused.py.

Where: ``ModelAdapter.kernels`` lists module paths (per block list, or on the transformer). How: a diffusers
``ModelHook`` on each such module whose ``new_forward`` produces the module's own outputs, from the module's own
parameters and submodules, with one fused kernel for the norm + modulate (the AdaLN linear on the embedding stays
the module's torch linear, so a quantized or sharded linear is used as installed). That is a kernel for a layer
type, not a copied model forward: the layer types below are diffusers' / torch's shared building blocks, matched by
exact type (a subclass may change forward, so it is left alone).

    AdaLayerNormZero          (x, emb) -> (LN(x)*(1+scale)+shift, gate_msa, shift_mlp, scale_mlp, gate_mlp)
    AdaLayerNormZeroSingle    (x, emb) -> (LN(x)*(1+scale)+shift, gate)
    AdaLayerNormContinuous    (x, cond) -> LN(x)*(1+scale)+shift
    torch.nn.RMSNorm / diffusers RMSNorm   x -> rms_norm(x) * weight   (the Q/K norms; Z-Image's block norms too)

What is not installed, and why: the gated residual adds and the modulate after ``norm2`` are inline in the blocks'
forwards (no module boundary), and RoPE is applied inside the attention processors after the text and image streams
are concatenated -- fusing it with the Q/K norm would mean moving it out of the processor (see docs/kernels.md).

Where the call's device has no Triton path (CPU), the hooks still install and run the eager references, so outputs
can be tested on CPU; the report says which path runs. A family that declares no sites gets a report entry and no
change. Gradients: when autograd needs the module's graph (grad mode on and a parameter or input requires grad) the
hook runs the module's original forward -- the kernels are inference-only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from diffusers.hooks import ModelHook
from diffusers.models import normalization as dnorm

from ..hooks import add_hook
from ..pass_base import AccelPass, PassContext
from . import fused

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- fused forwards
def _adaln_zero(module, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    if module.emb is not None:
        emb = module.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = module.linear(module.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = fused.layernorm_modulate(x, scale_msa, shift_msa, module.norm.eps)
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _adaln_zero_single(module, x, emb=None):
    emb = module.linear(module.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    return fused.layernorm_modulate(x, scale_msa, shift_msa, module.norm.eps), gate_msa


def _adaln_continuous(module, x, conditioning_embedding):
    emb = module.linear(module.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return fused.layernorm_modulate(x, scale, shift, module.norm.eps)


def _torch_rms_norm(module, hidden_states):
    # F.rms_norm: eps None means the dtype's machine epsilon; the output keeps the input dtype
    eps = module.eps if module.eps is not None else torch.finfo(hidden_states.dtype).eps
    return fused.rms_norm(hidden_states, module.weight, eps, hidden_states.dtype)


def _diffusers_rms_norm(module, hidden_states):
    # diffusers' RMSNorm returns the weight's dtype for a half-precision weight, else what type promotion of
    # (input, fp32 rsqrt, weight) gives, and the input dtype without a weight
    weight = module.weight
    if weight is None:
        out_dtype = hidden_states.dtype
    elif weight.dtype in (torch.float16, torch.bfloat16):
        out_dtype = weight.dtype
    else:
        out_dtype = torch.promote_types(torch.promote_types(hidden_states.dtype, torch.float32), weight.dtype)
    return fused.rms_norm(hidden_states, weight, module.eps, out_dtype)


# --------------------------------------------------------------------------------------------- layer types
@dataclass(frozen=True)
class LayerKind:
    name: str  # what the report counts
    kernel: str  # the fused op it runs
    forward: Callable[..., Any]
    problem: Callable[[torch.nn.Module], str | None]  # why this instance cannot take the kernel, or None


def _plain_layer_norm_problem(module) -> str | None:
    norm = getattr(module, "norm", None)
    if type(norm) not in (torch.nn.LayerNorm, dnorm.FP32LayerNorm):
        return f"its norm is {type(norm).__name__}, not a LayerNorm"
    if norm.weight is not None or norm.bias is not None or len(norm.normalized_shape) != 1:
        return "its LayerNorm has an elementwise affine"
    return None


def _rms_norm_problem(module) -> str | None:
    shape = getattr(module, "normalized_shape", None) or getattr(module, "dim", None)
    if shape is None or len(shape) != 1:
        return "it normalises over more than the last dim"
    if getattr(module, "bias", None) is not None:
        return "it has a bias"
    return None


KINDS: dict[type, LayerKind] = {
    dnorm.AdaLayerNormZero: LayerKind("ada_norm_zero", "layernorm_modulate", _adaln_zero, _plain_layer_norm_problem),
    dnorm.AdaLayerNormZeroSingle: LayerKind("ada_norm_zero_single", "layernorm_modulate", _adaln_zero_single,
                                            _plain_layer_norm_problem),
    dnorm.AdaLayerNormContinuous: LayerKind("ada_norm_continuous", "layernorm_modulate", _adaln_continuous,
                                            _plain_layer_norm_problem),
    torch.nn.RMSNorm: LayerKind("rms_norm", "rms_norm", _torch_rms_norm, _rms_norm_problem),
    dnorm.RMSNorm: LayerKind("rms_norm", "rms_norm", _diffusers_rms_norm, _rms_norm_problem),
}


class _FusedForwardHook(ModelHook):
    """Replaces the module's forward by its fused counterpart; the original runs when autograd needs it."""

    def __init__(self, forward: Callable[..., Any]):
        super().__init__()
        self._forward = forward

    def new_forward(self, module, *args, **kwargs):
        if torch.is_grad_enabled() and _needs_grad(module, args, kwargs):
            return self.fn_ref.original_forward(*args, **kwargs)
        return self._forward(module, *args, **kwargs)


def _needs_grad(module, args, kwargs) -> bool:
    if any(p.requires_grad for p in module.parameters()):
        return True
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))


# ------------------------------------------------------------------------------------------------ planning
@dataclass
class Plan:
    targets: list[tuple[str, torch.nn.Module, LayerKind]]
    skipped: dict[str, str]  # present but not taken: name -> reason
    absent: int  # declared paths with no module there


def _resolve(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    module = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module if isinstance(module, torch.nn.Module) else None


def plan_for(adapter, transformer) -> Plan:
    """Every declared module of ``transformer`` with the kernel it takes, or why not."""
    plan = Plan([], {}, 0)
    seen: set[int] = set()
    for site in adapter.kernels:
        if site.blocks:
            roots = [(f"{site.blocks}.{i}.", b) for i, b in enumerate(getattr(transformer, site.blocks, None) or ())]
        else:
            roots = [("", transformer)]
        for prefix, root in roots:
            for path in site.paths:
                name, module = prefix + path, _resolve(root, path)
                if module is None:
                    plan.absent += 1
                    continue
                if id(module) in seen:  # a module reachable by two declared paths gets one hook
                    continue
                seen.add(id(module))
                kind = KINDS.get(type(module))
                problem = (f"{type(module).__name__} has no fused kernel" if kind is None
                           else kind.problem(module))
                if problem is not None:
                    plan.skipped[name] = problem
                else:
                    plan.targets.append((name, module, kind))
    return plan


class KernelsPass(AccelPass):
    name = "kernels"

    def wanted(self, config) -> bool:
        return bool(config.kernels)

    def check(self, ctx: PassContext) -> None:
        fused.uses_triton(ctx.device)  # a forced 'triton' backend that cannot run here raises AccelError now
        for _, transformer in ctx.adapter.transformers_of(ctx.pipe):
            plan_for(ctx.adapter, transformer)

    def apply(self, ctx: PassContext) -> None:
        triton = fused.uses_triton(ctx.device)
        if not ctx.adapter.kernels:
            logger.warning("omni_accel: kernels=True but %s declares no kernel sites; nothing changed",
                           ctx.adapter.family)
            ctx.state.record("kernels", lambda: None, installed={},
                             note=f"{ctx.adapter.family} declares no fused-kernel sites; nothing changed")
            return
        if not triton:
            logger.info("omni_accel: kernels on %s: Triton is not used there, the eager PyTorch references run",
                        ctx.device)
        note = None
        if ctx.config.compile and triton:
            # measured on an H200 (benchmarks/results/bench_transformer_h200_fp8_kernels.json): FLUX 1024²
            # auto+compile 134.5 ms/step, kernels+auto+compile 158.1 -- the custom ops are opaque to Inductor and
            # cut the fusions it makes around the norms. Installed anyway (the user asked), with a warning.
            note = "with compile=True these kernels measured slower (FLUX, H200: 158 vs 134 ms/step); drop kernels"
            logger.warning("omni_accel: kernels=True with compile=True: %s", note)
        for tname, transformer in ctx.adapter.transformers_of(ctx.pipe):
            plan = plan_for(ctx.adapter, transformer)
            counts: dict[str, int] = {}
            for name, module, kind in plan.targets:
                ctx.state.record("kernels", add_hook(module, "kernels", _FusedForwardHook(kind.forward)), hidden=True)
                counts[kind.name] = counts.get(kind.name, 0) + 1
            ctx.state.record(
                "kernels", lambda: None, component=tname, path="triton" if triton else "eager",
                installed=counts, modules=len(plan.targets), skipped=plan.skipped,
                **({"note": note} if note else {}),
            )
            logger.info("omni_accel: fused kernels on %s.%s: %s (%s path)", ctx.adapter.family, tname, counts,
                        "triton" if triton else "eager")
