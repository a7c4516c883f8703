"""Tensor parallelism: column/row split of the attention and MLP linears of the DiT blocks.

The plan is the model's own ``_tp_plan`` class attribute from diffusers (model knowledge stays there, or in the
adapter as ``extra["tp_plan"]`` for families diffusers has none for), applied with diffusers' plan resolution and
torch's ``parallelize_module`` (ColwiseParallel / RowwiseParallel, and diffusers' packed variants for fused
projections). Why not ``diffusers.hooks.tensor_parallel.apply_tensor_parallel`` itself: it refuses CPU meshes, and
CI runs TP on CPU with gloo; we call the same building blocks on our own tp DeviceMesh.
Attention heads must divide by tp (refused with the reason otherwise: padding heads would change the numerics of
the QK-norms and the output projection's reduction is simplest exact without it). Adapter fields beyond the plan:
``extra["tp_heads"]`` (attention modules whose processor reshapes by ``attn.heads``: set to the local count) and
``extra["tp_norms_across_heads"]`` (RMSNorms over all heads, Wan's qk-norm: sum of squares all-reduced over tp);
``extra["tp_refused"]`` refuses tp for a family with the reason given there.
"""

from __future__ import annotations

import torch

from diffusers.hooks import ModelHook

from ..errors import AccelError
from ..hooks import add_hook
from ..pass_base import AccelPass, PassContext
from .sequence import heads_of, mesh_for


def tp_plan_of(adapter, transformer) -> dict | None:
    return adapter.extra.get("tp_plan") or getattr(type(transformer), "_tp_plan", None)


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _expand(transformer, patterns) -> list[tuple[str, torch.nn.Module, str]]:
    """(block path, block, relative path) for every module a ``_tp_plan``-style glob names, in plan order.

    diffusers' format: one ``*`` over a ModuleList. Unlike diffusers' ``_resolve_tp_plan``, a block without the
    submodule is skipped (SD3's last block is context_pre_only: no ``attn.to_add_out``, no ``ff_context``) and so is
    a list the model does not have (Z-Image's optional ``siglip_refiner``).
    """
    out = []
    for pattern in patterns:
        if "*" not in pattern:
            if _has(transformer, pattern):
                out.append(("", transformer, pattern))
            continue
        prefix, _, suffix = pattern.partition("*")
        prefix, suffix = prefix.strip("."), suffix.strip(".")
        container = transformer.get_submodule(prefix) if _has(transformer, prefix) else None
        if not isinstance(container, torch.nn.ModuleList):
            continue
        for i, block in enumerate(container):
            if _has(block, suffix):
                out.append((f"{prefix}.{i}", block, suffix))
    return out


def _resolved(transformer, plan: dict) -> list[tuple[torch.nn.Module, dict]]:
    """The plan grouped per block, ``[(block, {relative path: style})]`` (one parallelize_module call each)."""
    groups: dict[int, tuple[torch.nn.Module, dict]] = {}
    for pattern, style in plan.items():
        for _, block, rel in _expand(transformer, [pattern]):
            groups.setdefault(id(block), (block, {}))[1][rel] = style
    return list(groups.values())


def _explicit(transformer, plan: dict) -> dict:
    """The plan with every glob written out (for diffusers' divisibility check, which needs every path to exist)."""
    out = {}
    for pattern, style in plan.items():
        for path, _, rel in _expand(transformer, [pattern]):
            out[f"{path}.{rel}" if path else rel] = style
    return out


def _targets(transformer, plan: dict) -> list[torch.nn.Module]:
    return [block.get_submodule(path) for block, relative in _resolved(transformer, plan) for path in relative]


class _AcrossHeadsRMSNorm(ModelHook):
    """An RMSNorm over all heads (Wan's qk-norm: ``norm_q`` over inner_dim, before the head split) on a rank that
    holds ``1/tp`` of the heads: the sum of squares is all-reduced over the tp group, the weight is this rank's slice
    (the column split gives each rank a contiguous range of heads). Exact up to float rounding."""

    def __init__(self, group, full_dim: int, weight: torch.Tensor | None, eps: float):
        super().__init__()
        self.group, self.full_dim, self.weight, self.eps = group, full_dim, weight, eps

    def new_forward(self, module, x):
        import torch.distributed as dist

        sq = x.float().pow(2).sum(-1, keepdim=True)
        dist.all_reduce(sq, group=self.group)
        y = (x.float() * torch.rsqrt(sq / self.full_dim + self.eps)).to(x.dtype)
        return y * self.weight if self.weight is not None else y


class TensorParallelPass(AccelPass):
    name = "tensor_parallel"

    def wanted(self, config) -> bool:
        return config.tp > 1

    def check(self, ctx: PassContext) -> None:
        tp = ctx.config.tp
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            plan = tp_plan_of(ctx.adapter, transformer)
            refused = ctx.adapter.extra.get("tp_refused")
            if refused:
                raise AccelError(f"tp={tp} is not supported for {ctx.adapter.family}: {refused}")
            if not plan:
                raise AccelError(
                    f"tp={tp}: {type(transformer).__name__} ({ctx.adapter.family}) has no tensor-parallel plan "
                    "(no diffusers `_tp_plan`, no adapter extra['tp_plan']); use sp (sequence parallelism) instead."
                )
            heads = heads_of(transformer)
            if heads is not None and heads % tp:
                raise AccelError(
                    f"tp={tp} does not divide the {heads} attention heads of the {name}: every rank must hold whole "
                    f"heads. Choose tp among the divisors of {heads}, or use sp/ring for the remaining degree."
                )
            try:
                from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

                resolve_tp_shard_specs(transformer, _explicit(transformer, plan), tp)
            except ValueError as exc:
                raise AccelError(f"tp={tp}: the {name}'s linears do not split evenly: {exc}") from None
        mesh_for(ctx)

    def apply(self, ctx: PassContext) -> None:
        from diffusers.hooks.tensor_parallel import _styles
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = mesh_for(ctx)
        ctx.state.mesh = mesh
        device_mesh = mesh.tp_device_mesh()
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            plan = tp_plan_of(ctx.adapter, transformer)
            targets = _targets(transformer, plan)
            saved = []
            for m in targets:  # what restore() brings back: the full weights (kept on the host) and no hooks
                params = {k: (p, p.data.device, p.data.to("cpu", copy=True) if p.is_cuda else None)
                          for k, p in m._parameters.items() if p is not None}
                saved.append((m, params, set(m._forward_pre_hooks), set(m._forward_hooks)))
            for block, relative in _resolved(transformer, plan):
                parallelize_module(block, device_mesh, _styles(relative))
            self._local_heads(ctx, transformer, mesh)
            self._norms_across_heads(ctx, transformer, mesh)
            for _, params, _, _ in saved:  # the GPU copies of the full weights are replaced by shards: free them
                for p, _, host in params.values():
                    if host is not None:
                        p.data = torch.empty(0, device=p.device, dtype=p.dtype)

            def undo(saved=saved) -> None:
                for m, params, pre, post in saved:
                    for k, (p, device, host) in params.items():
                        if host is not None:
                            p.data = host.to(device)
                        m._parameters[k] = p
                    for hid in [h for h in m._forward_pre_hooks if h not in pre]:
                        del m._forward_pre_hooks[hid]
                        m._forward_pre_hooks_with_kwargs.pop(hid, None)
                    for hid in [h for h in m._forward_hooks if h not in post]:
                        del m._forward_hooks[hid]
                        m._forward_hooks_with_kwargs.pop(hid, None)
                        m._forward_hooks_always_called.pop(hid, None)

            ctx.state.record("tensor_parallel", undo, component=name, tp=mesh.tp, linears=len(targets))

    @staticmethod
    def _local_heads(ctx: PassContext, transformer, mesh) -> None:
        """Attention modules whose processor reshapes by ``attn.heads`` (not by head_dim, as FLUX's does) get the
        local head count: the column split leaves ``heads / tp`` heads on each rank (``extra["tp_heads"]``)."""
        for _, attn, rel in _expand(transformer, ctx.adapter.extra.get("tp_heads", ())):
            module = attn.get_submodule(rel)
            full = module.heads

            def undo(module=module, full=full) -> None:
                module.heads = full

            module.heads = full // mesh.tp
            ctx.state.record("tensor_parallel", undo, hidden=True)

    @staticmethod
    def _norms_across_heads(ctx: PassContext, transformer, mesh) -> None:
        """RMSNorms over the concatenated heads (``extra["tp_norms_across_heads"]``): reduced over the tp group."""
        for _, block, rel in _expand(transformer, ctx.adapter.extra.get("tp_norms_across_heads", ())):
            norm = block.get_submodule(rel)
            full = norm.weight.shape[0] if getattr(norm, "weight", None) is not None else int(norm.normalized_shape[0])
            local = full // mesh.tp
            weight = None
            if getattr(norm, "weight", None) is not None:
                weight = norm.weight.detach().narrow(0, mesh.tp_rank * local, local)
            eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
            hook = _AcrossHeadsRMSNorm(mesh.group("tp"), full, weight, eps)
            ctx.state.record("tensor_parallel", add_hook(norm, "tp.norm_across_heads", hook), hidden=True)
