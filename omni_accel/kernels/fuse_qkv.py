"""The fuse_qkv pass: ``accelerate(pipe, fuse_qkv=True)`` computes q, k and v with one GEMM per stream.

How: diffusers' own extension point, ``AttentionModuleMixin.fuse_projections()``: it builds ``to_qkv`` (self-attention),
``to_kv`` (cross-attention) and ``to_added_qkv`` / ``to_added_kv`` (the text stream of dual-stream blocks) from the
concatenated weights, and the attention processors of the families whose adapter sets ``fuse_qkv`` read the
``fused_projections`` flag and call them instead of the separate linears. One wide GEMM (N = 3 x hidden) instead of
three reads the activation once, launches one kernel, and under ``quant="fp8"`` quantizes the activation once.

Why the separate linears leave the module tree while fused: diffusers keeps them beside the fused copy, which would
hold every q/k/v weight twice on the GPU, and later passes (quant, offload) would process both. The undo rebuilds
them from the fused weight's rows -- a copy of the same numbers -- so restore() needs no host copy.
"""

from __future__ import annotations

import logging

import torch
from diffusers.models.attention import AttentionModuleMixin

from ..errors import AccelError
from ..pass_base import AccelPass, PassContext

logger = logging.getLogger(__name__)

# fused linear diffusers creates -> the separate linears it concatenates, in row order
FUSED_FROM = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "to_added_kv": ("add_k_proj", "add_v_proj"),
}


def _fusable_attention(ctx: PassContext, transformer) -> list[tuple[str, torch.nn.Module]]:
    """(dotted name, attention module) of every attention inside the blocks that diffusers can fuse."""
    found = []
    for block_name, block in ctx.adapter.blocks_of(transformer):
        for rel, module in block.named_modules():
            if isinstance(module, AttentionModuleMixin) and getattr(module, "_supports_qkv_fusion", False):
                found.append((f"{block_name}.{rel}", module))
    return found


def _projections(attn: torch.nn.Module) -> dict[str, torch.nn.Module]:
    names = {n for parts in FUSED_FROM.values() for n in parts}
    return {n: getattr(attn, n) for n in sorted(names) if getattr(attn, n, None) is not None}


class FuseQkvPass(AccelPass):
    name = "fuse_qkv"

    def wanted(self, config) -> bool:
        return config.fuse_qkv

    def check(self, ctx: PassContext) -> None:
        from ..pipelines import get_adapter, supported_families

        if not ctx.adapter.fuse_qkv:
            able = [f for f in supported_families() if get_adapter(f).fuse_qkv]
            raise AccelError(
                f"fuse_qkv=True does not reach {ctx.adapter.family}: its attention processors compute q, k and v with "
                f"separate linears and do not read diffusers' fused_projections flag. Families it works for: "
                f"{', '.join(able)}. Use fuse_qkv=False."
            )
        if ctx.config.tp > 1:
            raise AccelError(
                f"fuse_qkv=True cannot be combined with tp={ctx.config.tp}: tensor parallelism splits to_q / to_k / "
                "to_v column-wise by name, and a fused to_qkv would need its q, k and v parts split separately. "
                "Drop fuse_qkv or tp."
            )
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            attentions = _fusable_attention(ctx, transformer)
            if not attentions:
                raise AccelError(f"fuse_qkv=True: the {name} has no attention module that diffusers can fuse; "
                                 "use fuse_qkv=False.")
            for attn_name, attn in attentions:
                for proj_name, proj in _projections(attn).items():
                    if type(proj) is not torch.nn.Linear:
                        raise AccelError(
                            f"fuse_qkv=True needs plain nn.Linear projections, but {name}.{attn_name}.{proj_name} is "
                            f"a {type(proj).__name__} (a LoRA adapter or a quantized layer): fusing would drop it. "
                            "Merge adapters first (pipe.fuse_lora()) or use fuse_qkv=False."
                        )

    def apply(self, ctx: PassContext) -> None:
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            undos, already = [], 0
            try:
                for _, attn in _fusable_attention(ctx, transformer):
                    if getattr(attn, "fused_projections", False):
                        already += 1  # fused by the user: theirs to keep, not ours to undo
                        continue
                    undos.append(_fuse(attn))
            except BaseException:
                for undo in reversed(undos):
                    undo()
                raise

            def undo_all(undos=undos) -> None:
                for undo in reversed(undos):
                    undo()

            ctx.state.record("fuse_qkv", undo_all, component=name, fused=len(undos), already_fused=already)
            logger.info("omni_accel: %s: fused q/k/v projections of %d attention modules", name, len(undos))


def _fuse(attn: torch.nn.Module):
    """Fuse one attention module through diffusers; detach the separate linears; return the undo."""
    order = list(attn._modules)  # restored as it was: state_dict() keys keep their order
    attn.fuse_projections()
    fused = {f: parts for f, parts in FUSED_FROM.items() if f in attn._modules}
    # the separate linears leave the module: their weights are freed now and rebuilt from the fused rows on undo
    detached = {}
    for parts in fused.values():
        for part in parts:
            linear = attn._modules.pop(part)
            detached[part] = (linear, [(p, p.shape) for p in linear.parameters(recurse=False)])
            for p in linear.parameters(recurse=False):
                p.data = p.data.new_empty(0)

    def undo() -> None:
        for fused_name, parts in fused.items():
            layer = attn._modules[fused_name]
            row = 0
            for part in parts:
                linear, params = detached[part]
                rows = linear.out_features
                for p, shape in params:
                    source = layer.weight if p is linear.weight else layer.bias
                    p.data = source.data[row:row + rows].clone().reshape(shape)
                row += rows
        attn.unfuse_projections()
        modules = dict(attn._modules, **{part: linear for part, (linear, _) in detached.items()})
        attn._modules.clear()
        attn._modules.update({name: modules[name] for name in order})

    return undo
