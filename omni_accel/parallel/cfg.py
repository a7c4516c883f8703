"""CFG parallelism: the two branches of true CFG (two transformer forwards per step) run on two ranks at once.

Every rank runs the whole pipeline call; a hook around each transformer counts the forwards of a step: the
conditional forward (even) and the unconditional one (odd). CFG rank 0 computes the conditional branch and
returns it; CFG rank 1 returns a placeholder for it, computes the unconditional branch at the second forward, and
then the two ranks exchange their results (all_gather over the CFG group): rank 1 fills the placeholder in place
(the pipeline holds it, or a view of it) and both return the same unconditional prediction. So both ranks end the
step with bitwise the same pair, the pipeline combines them as usual, and every rank produces the same image.
The placeholder needs the output's shape: the first step of each new input shape runs both branches on every rank
(no speed-up for that one step) and remembers the shape.

Why our own and not diffusers': diffusers has no CFG-parallel hook for stock pipelines (its pipelines call the
transformer twice from their own loop), so the split has to happen at the transformer boundary.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AccelError
from ..hooks import add_hook
from ..pass_base import AccelPass, PassContext
from diffusers.hooks import ModelHook


def cfg_style(adapter, pipe) -> dict:
    """The effective CFG style of this pipeline: the adapter's, overridden per pipeline class in extra."""
    style = {"cfg": adapter.cfg, "cfg_scale_arg": adapter.cfg_scale_arg,
             "cfg_threshold": adapter.extra.get("cfg_threshold", 1.0),
             "negative_prompt_arg": adapter.negative_prompt_arg,
             "needs_negative": adapter.extra.get("cfg_needs_negative", True)}
    style.update(adapter.extra.get("cfg_by_pipeline", {}).get(type(pipe).__name__, {}))
    cls_name = getattr(type(pipe), "_omni_accel_original_class", type(pipe)).__name__
    style.update(adapter.extra.get("cfg_by_pipeline", {}).get(cls_name, {}))
    return style


def _default(pipe, name: str):
    try:
        p = inspect.signature(type(pipe).__call__).parameters.get(name)
    except (TypeError, ValueError):
        return None
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def _output_tensor(output) -> tuple[torch.Tensor, Any]:
    """(the prediction tensor, a function that rebuilds an output of the same structure around a tensor)."""
    if isinstance(output, torch.Tensor):
        return output, lambda t: t
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        rest = tuple(output[1:])
        return output[0], lambda t: type(output)((t,) + rest)
    sample = getattr(output, "sample", None)
    if isinstance(sample, torch.Tensor):
        cls = type(output)
        return sample, lambda t: cls(sample=t)
    raise AccelError(f"cfg_parallel: transformer output of type {type(output).__name__} is not supported.")


class _CfgState:
    def __init__(self):
        self.active = False
        self.calls = 0
        self.pending: torch.Tensor | None = None  # rank 0: cond result; rank 1: placeholder to fill
        self.known = None  # (shape, dtype, device, rebuild) of this step's output, None = run the step unsplit
        self.shapes: dict = {}  # input signature -> (output shape, dtype)


def _signature(args, kwargs) -> tuple:
    sig = []
    for v in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if isinstance(v, torch.Tensor):
            sig.append((tuple(v.shape), v.dtype))
    return tuple(sig)


class _CfgHook(ModelHook):
    def __init__(self, state: _CfgState, mesh, acc_state):
        super().__init__()
        self.s, self.mesh, self.acc = state, mesh, acc_state

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        s = self.s
        if not s.active:
            return forward(*args, **kwargs)
        branch = s.calls % 2  # 0 = conditional, 1 = unconditional
        s.calls += 1
        me = self.mesh.cfg_rank
        sig = _signature(args, kwargs)
        if branch == 0:
            s.known = s.shapes.get(sig)  # decided once per step, so both forwards of a step agree
        if s.known is None:  # first step of this shape: both branches here, learn the output's shape and structure
            out = forward(*args, **kwargs)
            tensor, rebuild = _output_tensor(out)
            s.shapes.setdefault(sig, (tuple(tensor.shape), tensor.dtype, tensor.device, rebuild))
            self.acc.count("cfg_parallel.unsplit_forwards")
            return out
        shape, dtype, device, rebuild = s.known
        if branch == 0:
            if me == 0:
                out = forward(*args, **kwargs)
                s.pending, _ = _output_tensor(out)
                return out
            s.pending = torch.empty(shape, dtype=dtype, device=device)  # filled at the second forward
            return rebuild(s.pending)
        # second forward of the step: rank 1 computes its branch, then the two ranks exchange
        if me == 1:
            mine, _ = _output_tensor(forward(*args, **kwargs))
        else:
            mine = s.pending
        mine = mine.contiguous()
        bufs = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(bufs, mine, group=self.mesh.group("cfg"))
        cond, uncond = bufs
        if me == 1:
            s.pending.copy_(cond)
        s.pending = None
        self.acc.count("cfg_parallel.split_steps")
        return rebuild(uncond)


class CfgParallelPass(AccelPass):
    name = "cfg_parallel"

    def wanted(self, config) -> bool:
        return config.cfg_parallel > 1

    def check(self, ctx: PassContext) -> None:
        from .sequence import mesh_for

        if ctx.config.cfg_parallel != 2:
            raise AccelError(f"cfg_parallel={ctx.config.cfg_parallel}: true CFG has two branches; use cfg_parallel=2.")
        style = cfg_style(ctx.adapter, ctx.pipe)
        if style["cfg"] != "true_cfg":
            what = {"batched_cfg": "runs CFG as one forward on a doubled batch",
                    "distilled": "is guidance-distilled (one forward per step, no negative branch)"}.get(
                style["cfg"], f"has CFG style {style['cfg']!r}")
            raise AccelError(
                f"cfg_parallel=2 needs a pipeline that runs true CFG as two transformer forwards per step, and "
                f"{type(ctx.pipe).__name__} ({ctx.adapter.family}) {what}; drop cfg_parallel and use sp instead."
            )
        flag = style.get("disabled_by_config")
        if flag and getattr(getattr(ctx.pipe, "config", {}), flag, None):
            raise AccelError(f"cfg_parallel=2: this {type(ctx.pipe).__name__} has {flag}=True, so it runs one "
                             "forward per step; drop cfg_parallel.")
        mesh_for(ctx)

    def apply(self, ctx: PassContext) -> None:
        from .sequence import mesh_for

        mesh = mesh_for(ctx)
        ctx.state.mesh = mesh
        state = _CfgState()
        style = cfg_style(ctx.adapter, ctx.pipe)
        pipe, acc = ctx.pipe, ctx.state

        def on_call() -> None:
            state.active = False  # until this call is known to run true CFG
            kwargs = acc.call_kwargs
            scale_arg = style["cfg_scale_arg"]
            scale = kwargs.get(scale_arg, _default(pipe, scale_arg)) if scale_arg else None
            if scale is None or scale <= style["cfg_threshold"]:
                raise AccelError(
                    f"cfg_parallel=2 but this call does not run true CFG: {scale_arg}={scale!r} must be > "
                    f"{style['cfg_threshold']}; pass it, or accelerate without cfg_parallel."
                )
            neg = style["negative_prompt_arg"]
            if style["needs_negative"] and neg and kwargs.get(neg) is None and \
                    kwargs.get(neg + "_embeds") is None:
                raise AccelError(
                    f"cfg_parallel=2 but this call has no {neg}: {type(pipe).__name__} runs the negative branch "
                    f"only with {neg}=... (or {neg}_embeds); pass one, or accelerate without cfg_parallel."
                )
            if acc.call_args:
                raise AccelError("cfg_parallel=2: pass the pipeline arguments by keyword (prompt=..., ...).")
            state.active, state.calls, state.pending = True, 0, None

        acc.on_call_start(on_call)

        def off() -> None:
            acc._call_start_hooks.remove(on_call)

        acc.record("cfg_parallel", off, hidden=True)
        for name, transformer in ctx.adapter.transformers_of(pipe):
            acc.record("cfg_parallel", add_hook(transformer, "cfg_parallel", _CfgHook(state, mesh, acc)),
                       component=name, cfg_rank=mesh.cfg_rank)
