"""Tensor parallelism: column/row split of the attention and MLP linears of the DiT blocks.

The plan is the model's own ``_tp_plan`` class attribute from diffusers (model knowledge stays there, or in the
adapter as ``extra["tp_plan"]`` for families diffusers has none for), applied with diffusers' plan resolution and
torch's ``parallelize_module`` (ColwiseParallel / RowwiseParallel, and diffusers' packed variants for fused
projections). Why not ``diffusers.hooks.tensor_parallel.apply_tensor_parallel`` itself: it refuses CPU meshes, and
CI runs TP on CPU with gloo; we call the same building blocks on our own tp DeviceMesh.
Attention heads must divide by tp (refused with the reason otherwise: padding heads would change the numerics of
the QK-norms and the output projection's reduction is simplest exact without it).
"""

from __future__ import annotations

import torch

from ..errors import AccelError
from ..pass_base import AccelPass, PassContext
from .sequence import heads_of, mesh_for


def tp_plan_of(adapter, transformer) -> dict | None:
    return adapter.extra.get("tp_plan") or getattr(type(transformer), "_tp_plan", None)


def _targets(transformer, plan: dict) -> list[torch.nn.Module]:
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan

    mods = []
    for block, relative in _resolve_tp_plan(transformer, plan):
        for path in relative:
            mods.append(block.get_submodule(path))
    return mods


class TensorParallelPass(AccelPass):
    name = "tensor_parallel"

    def wanted(self, config) -> bool:
        return config.tp > 1

    def check(self, ctx: PassContext) -> None:
        tp = ctx.config.tp
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            plan = tp_plan_of(ctx.adapter, transformer)
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

                resolve_tp_shard_specs(transformer, plan, tp)
            except ValueError as exc:
                raise AccelError(f"tp={tp}: the {name}'s linears do not split evenly: {exc}") from None
        mesh_for(ctx)

    def apply(self, ctx: PassContext) -> None:
        from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles
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
            for block, relative in _resolve_tp_plan(transformer, plan):
                parallelize_module(block, device_mesh, _styles(relative))
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
