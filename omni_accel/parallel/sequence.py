"""The sequence-parallel pass (sp / ulysses / ring): shards the token sequence at block-list boundaries.

For each ``SequenceRegion`` of the adapter: a hook on the first block splits the stream inputs (image tokens, text
tokens, a joint sequence) into this rank's shard; a hook on every block splits the values the transformer computed
once for all blocks (rotary tables -- a [text, image] table is split part by part, so it matches the processor's
cat([text shard, image shard]) --, masks); a hook on the last block all-gathers the outputs, so everything outside
the region (embedders, norm_out, proj_out, the scheduler) runs on full tensors, identically on every rank.
Inside the region the processors' ``dispatch_attention_fn`` (or ``F.scaled_dot_product_attention`` for processors
that call it directly) is routed to Ulysses / ring / USP attention. Shards may have any length (the first
``L % sp`` ranks get one token more): no padding of the model's input, no constraint on text length or resolution.

Why hooks on blocks and not diffusers' ``_cp_plan``: diffusers splits with equal chunks (the sequence must divide
the degree) and at the transformer input, which for several families (Z-Image padding, Qwen's txt_seq_lens) is
before sequence-global operations; block boundaries are where every family is purely token-wise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import AccelError
from ..hooks import CallbackHook, add_hook
from ..pass_base import AccelPass, PassContext
from ..pipelines.base import SequenceRegion, ShardArg
from .attention import SequenceContext, sequence_parallel_attention
from .mesh import gather_uneven, get_mesh, split_sizes
from diffusers.hooks import ModelHook

_CONTEXTS: list[SequenceContext] = []  # the contexts of accelerated pipelines in this process


def _current() -> SequenceContext | None:
    for ctx in _CONTEXTS:
        if ctx.active:
            return ctx
    return None


# -- attention routing ---------------------------------------------------------------------------------------
def _make_dispatch(original):
    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        ctx = _current()
        if ctx is None:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=backend,
                            parallel_config=parallel_config)
        if is_causal or dropout_p:
            raise AccelError("sequence parallelism supports non-causal attention without dropout only.")

        def inner(q, k, v, mask):
            return original(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
                            attention_kwargs=attention_kwargs, backend=backend)

        ctx.inside = True
        ctx.calls += 1
        try:
            return sequence_parallel_attention(query, key, value, attn_mask, inner, scale, ctx)
        finally:
            ctx.inside = False
            ctx.slot += 1

    dispatch_attention_fn._omni_accel_original = original
    return dispatch_attention_fn


_ORIGINAL_SDPA = F.scaled_dot_product_attention


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    ctx = _current()
    if ctx is None:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    if is_causal or dropout_p:
        raise AccelError("sequence parallelism supports non-causal attention without dropout only.")

    def inner(q, k, v, mask):  # (B, S, H, D) <-> SDPA's (B, H, S, D)
        return _ORIGINAL_SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                              scale=scale, enable_gqa=enable_gqa).transpose(1, 2)

    ctx.inside = True
    ctx.calls += 1
    try:
        out = sequence_parallel_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                          attn_mask, inner, scale, ctx)
    finally:
        ctx.inside = False
        ctx.slot += 1
    return out.transpose(1, 2)


# -- splitting and gathering ---------------------------------------------------------------------------------
@dataclass
class RegionState:
    name: str = ""  # the block list
    lengths: dict = field(default_factory=dict)  # stream -> full length
    sizes: dict = field(default_factory=dict)  # stream -> per-shard lengths


def _shard(x: torch.Tensor, dim: int, sizes: list[int], index: int) -> torch.Tensor:
    start = sum(sizes[:index])
    return x.narrow(dim, start, sizes[index])


def _get(args, kwargs, spec: ShardArg):
    if spec.name in kwargs:
        return kwargs[spec.name], ("kw", spec.name)
    if spec.position is not None and spec.position < len(args):
        return args[spec.position], ("pos", spec.position)
    return None, None


def _set(args, kwargs, where, value):
    if where[0] == "kw":
        kwargs[where[1]] = value
    else:
        args = list(args)
        args[where[1]] = value
        args = tuple(args)
    return args, kwargs


def _map_tensors(value, spec: ShardArg, fn):
    if isinstance(value, (tuple, list)):
        items = list(value)
        for i, item in enumerate(items):
            if isinstance(item, torch.Tensor) and (spec.item is None or spec.item == i):
                items[i] = fn(item)
        return type(value)(items)
    if isinstance(value, torch.Tensor):
        return fn(value)
    return value


class _RegionHook(ModelHook):
    """On one block of a region: split the region's inputs (first block), per-block values (every block), gather
    the outputs (last block)."""

    def __init__(self, ctx: SequenceContext, region: SequenceRegion, first: bool, last: bool):
        super().__init__()
        self.ctx, self.region, self.first, self.last = ctx, region, first, last

    def _split(self, value, spec: ShardArg, state: RegionState):
        n, me = self.ctx.mesh.sp, self.ctx.mesh.sp_rank

        def one(x: torch.Tensor) -> torch.Tensor:
            if spec.ndim is not None and x.ndim != spec.ndim:
                return x
            dim = spec.dim if spec.dim >= 0 else x.ndim + spec.dim
            if spec.order:
                parts, start = [], 0
                for stream in spec.order:
                    length = state.lengths[stream]
                    parts.append(_shard(x.narrow(dim, start, length), dim, state.sizes[stream], me))
                    start += length
                if start != x.shape[dim]:
                    raise AccelError(f"sequence parallelism: {spec.name} has {x.shape[dim]} positions on dim {dim}, "
                                     f"the streams {spec.order} have {start} tokens.")
                return torch.cat(parts, dim=dim)
            if spec.stream not in state.lengths:
                state.lengths[spec.stream] = x.shape[dim]
                state.sizes[spec.stream] = split_sizes(x.shape[dim], n)
            if x.shape[dim] != state.lengths[spec.stream]:
                raise AccelError(f"sequence parallelism: {spec.name} has {x.shape[dim]} tokens on dim {dim}, the "
                                 f"{spec.stream} stream has {state.lengths[spec.stream]}.")
            return _shard(x, dim, state.sizes[spec.stream], me)

        return _map_tensors(value, spec, one)

    def pre_forward(self, module, *args, **kwargs):
        ctx = self.ctx
        if self.first:
            ctx.region = RegionState(name=self.region.block_list)
        ctx.slot = 0
        state = ctx.region
        if state is None:  # the first block did not run through our hook (should not happen): run unsplit
            return args, kwargs
        # streams first (they define the lengths), then the tables that follow them
        specs = sorted(self.region.args, key=lambda s: bool(s.order))
        for spec in specs:
            if not (self.first or spec.every_block):
                continue
            value, where = _get(args, kwargs, spec)
            if value is None:
                continue
            args, kwargs = _set(args, kwargs, where, self._split(value, spec, state))
        return args, kwargs

    def post_forward(self, module, output):
        if not self.last or self.ctx.region is None:
            return output
        state, ctx = self.ctx.region, self.ctx
        ctx.region = None
        group = ctx.mesh.sequence_group

        def gather(x, stream):
            if stream is None or not isinstance(x, torch.Tensor):
                return x
            return gather_uneven(x, 1, state.sizes[stream], group)

        if isinstance(output, torch.Tensor):
            return gather(output, self.region.outputs[0])
        if isinstance(output, (tuple, list)):
            items = [gather(x, self.region.outputs[i] if i < len(self.region.outputs) else None)
                     for i, x in enumerate(output)]
            return type(output)(items)
        raise AccelError(f"sequence parallelism: block output of type {type(output).__name__} is not supported.")


def _patch_global(module_name: str, attr: str, value) -> callable:
    mod = sys.modules[module_name]
    old = getattr(mod, attr)
    setattr(mod, attr, value)

    def undo() -> None:
        setattr(mod, attr, old)

    return undo


def heads_of(transformer) -> int | None:
    cfg = getattr(transformer, "config", {})
    for key in ("num_attention_heads", "n_heads", "num_heads"):
        value = cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)
        if value:
            return int(value)
    return None


class SequenceParallelPass(AccelPass):
    name = "sequence_parallel"

    def wanted(self, config) -> bool:
        return config.sequence_degree > 1

    def check(self, ctx: PassContext) -> None:
        adapter, cfg = ctx.adapter, ctx.config
        if not adapter.sequence_parallel:
            raise AccelError(
                f"sp={cfg.sequence_degree}: the {adapter.family} adapter declares no sequence-parallel plan "
                "(SequenceRegion) yet; run without sp."
            )
        for name, transformer in adapter.transformers_of(ctx.pipe):
            heads = heads_of(transformer)
            if heads is None:
                continue
            local = heads // cfg.tp if heads % cfg.tp == 0 else heads
            if local % cfg.ulysses_degree:
                raise AccelError(
                    f"ulysses={cfg.ulysses_degree} does not divide the {local} attention heads of the {name}"
                    + (f" per tp rank (tp={cfg.tp})" if cfg.tp > 1 else "")
                    + f"; choose ulysses among the divisors of {local} and use ring for the rest, e.g. "
                    f"ulysses=1, ring={cfg.sequence_degree}."
                )
            if not adapter.blocks_of(transformer):
                raise AccelError(f"sp: the {name} has none of the block lists {adapter.block_lists}.")
        mesh_for(ctx)  # degrees vs world size: raises on every rank alike

    def apply(self, ctx: PassContext) -> None:
        mesh = mesh_for(ctx)
        sctx = SequenceContext(mesh)
        _CONTEXTS.append(sctx)
        ctx.state.record("sequence_parallel", lambda: _CONTEXTS.remove(sctx), hidden=True)
        ctx.state.mesh = mesh
        patched_modules = set()
        for tname, transformer in ctx.adapter.transformers_of(ctx.pipe):
            reset = CallbackHook(before=sctx.reset)
            ctx.state.record("sequence_parallel", add_hook(transformer, "sp.reset", reset), hidden=True)
            modules = {type(transformer).__module__}
            for m in transformer.modules():
                proc = getattr(m, "processor", None)
                if proc is not None:
                    modules.add(type(proc).__module__)
            patched_modules |= modules
            regions = 0
            for region in ctx.adapter.sequence_parallel:
                blocks = list(getattr(transformer, region.block_list, None) or ())
                for i, block in enumerate(blocks):
                    hook = _RegionHook(sctx, region, first=i == 0, last=i == len(blocks) - 1)
                    ctx.state.record("sequence_parallel", add_hook(block, "sp.region", hook), hidden=True)
                    for sub in region.local_attention:
                        target = block.get_submodule(sub) if _has_sub(block, sub) else None
                        if target is not None:
                            local = CallbackHook(before=lambda: _enter_local(sctx), after=lambda _o: _exit_local(sctx))
                            ctx.state.record("sequence_parallel", add_hook(target, "sp.local", local), hidden=True)
                regions += bool(blocks)
            ctx.state.record("sequence_parallel", lambda: None, component=tname, ulysses=mesh.ulysses,
                             ring=mesh.ring, regions=regions)
        for module_name in sorted(patched_modules):
            mod = sys.modules.get(module_name)
            current = getattr(mod, "dispatch_attention_fn", None)
            if current is not None and not hasattr(current, "_omni_accel_original"):
                ctx.state.record("sequence_parallel", _patch_global(module_name, "dispatch_attention_fn",
                                                                    _make_dispatch(current)), hidden=True)
        if not ctx.adapter.attention_via_dispatcher and F.scaled_dot_product_attention is _ORIGINAL_SDPA:
            ctx.state.record("sequence_parallel", _patch_global("torch.nn.functional", "scaled_dot_product_attention",
                                                                _sdpa), hidden=True)


def _has_sub(block, name: str) -> bool:
    try:
        block.get_submodule(name)
        return True
    except AttributeError:
        return False


def _enter_local(sctx: SequenceContext) -> None:
    sctx.local_depth += 1


def _exit_local(sctx: SequenceContext) -> None:
    sctx.local_depth = max(0, sctx.local_depth - 1)


def mesh_for(ctx: PassContext):
    """The process mesh of this accelerate() call (shared by every parallel pass)."""
    c = ctx.config
    return get_mesh(cfg=c.cfg_parallel, ring=c.ring_degree, ulysses=c.ulysses_degree, tp=c.tp,
                    device=ctx.device if ctx.device.type == "cuda" else torch.device("cpu"))
