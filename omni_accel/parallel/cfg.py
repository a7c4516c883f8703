"""CFG parallelism: the two branches of classifier-free guidance run on two ranks at once.

True CFG (two transformer forwards per step: Qwen-Image, Wan, FLUX.2 Klein).
Every rank runs the whole pipeline call; a hook around each transformer counts the forwards of a step: the
conditional forward (even) and the unconditional one (odd). CFG rank 0 computes the conditional branch and
returns it; CFG rank 1 returns a placeholder for it, computes the unconditional branch at the second forward, and
then the two ranks exchange their results (all_gather over the CFG group): rank 1 fills the placeholder in place
(the pipeline holds it, or a view of it) and both return the same unconditional prediction. So both ranks end the
step with bitwise the same pair, the pipeline combines them as usual, and every rank produces the same image.
The placeholder needs the output's shape: the first step of each new input shape runs both branches on every rank
(no speed-up for that one step) and remembers the shape.

Batched CFG (one forward on a doubled batch per step: SD3, Z-Image). The pipeline concatenates the two branches
along the batch (2B samples) and calls the transformer once. A hook on the transformer gives CFG rank c the c-th
half of every batch-carrying argument (tensors whose first dimension is 2B, per-sample lists of length 2B), runs
the forward on B samples, and all-gathers the halves back into the 2B-sample output, so both ranks return bitwise
the same prediction and the pipeline splits it into its two branches as usual. The call's own batch B (prompts x
num_images_per_prompt) says whether a forward is doubled; a forward that is not (SD3.5's skip-layer-guidance
forward, Z-Image's steps after cfg_truncation) runs whole on every rank.

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
    # batched-CFG pipelines build the negative half themselves (an absent negative prompt encodes "")
    style = {"cfg": adapter.cfg, "cfg_scale_arg": adapter.cfg_scale_arg,
             "cfg_threshold": adapter.extra.get("cfg_threshold", 1.0),
             "negative_prompt_arg": adapter.negative_prompt_arg,
             "needs_negative": adapter.extra.get("cfg_needs_negative", adapter.cfg == "true_cfg")}
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


# -- batched CFG: one forward on [branch 0; branch 1] ---------------------------------------------------------
def call_batch(pipe, kwargs: dict) -> int:
    """Samples of one CFG branch in this call: prompts (or prompt embeddings) x num_images_per_prompt."""
    prompt = kwargs.get("prompt")
    if isinstance(prompt, str):
        prompts = 1
    elif isinstance(prompt, (list, tuple)):
        prompts = len(prompt)
    else:
        embeds = kwargs.get("prompt_embeds")
        if isinstance(embeds, torch.Tensor):
            prompts = embeds.shape[0]
        elif isinstance(embeds, (list, tuple)):
            prompts = len(embeds)
        else:
            raise AccelError(
                f"cfg_parallel=2: cannot tell the batch size of this {type(pipe).__name__} call (no prompt=... and "
                "no prompt_embeds=...); pass the prompt by keyword."
            )
    per_prompt = kwargs.get("num_images_per_prompt") or _default(pipe, "num_images_per_prompt") or 1
    return prompts * int(per_prompt)


def _batch_of(value) -> int | None:
    """Leading batch of a tensor, or the length of a per-sample list of tensors / lists; None otherwise."""
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        return value.shape[0]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (torch.Tensor, list)) for v in value):
        return len(value)
    return None


def _take_half(value, half: int, index: int, per_sample_lists: bool):
    """The ``index``-th half of every part of ``value`` that carries the doubled batch: tensors whose first dim is
    2 x half (also inside dicts, lists and tuples: ControlNet residuals, IP-Adapter embeddings) and, for
    transformers that take per-sample lists (Z-Image), lists of 2 x half samples. Everything else unchanged."""
    doubled = 2 * half
    if isinstance(value, torch.Tensor):
        return value.narrow(0, index * half, half) if value.ndim and value.shape[0] == doubled else value
    if isinstance(value, (list, tuple)):
        if per_sample_lists and len(value) == doubled:
            return type(value)(value[index * half:(index + 1) * half])
        return type(value)(_take_half(v, half, index, per_sample_lists) for v in value)
    if isinstance(value, dict):
        return {k: _take_half(v, half, index, per_sample_lists) for k, v in value.items()}
    return value


def _join_halves(value, group):
    """All-gather the two halves over the CFG group: the doubled-batch value, identical on both ranks."""
    if isinstance(value, torch.Tensor):
        mine = value.contiguous()
        bufs = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(bufs, mine, group=group)
        return torch.cat(bufs, dim=0)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        if len({tuple(v.shape) for v in value}) != 1:  # the same on both ranks: raised on both, no collective
            raise AccelError("cfg_parallel=2 (batched CFG): the per-sample outputs differ in shape; drop "
                             "cfg_parallel for this call.")
        return type(value)(_join_halves(torch.stack(list(value)), group).unbind(0))
    raise AccelError(f"cfg_parallel=2 (batched CFG): transformer output of type {type(value).__name__} is not "
                     "supported; drop cfg_parallel.")


def _join_output(output, group):
    """The transformer output -- a tensor, a ``(sample, ...)`` tuple or an object with ``.sample`` -- with its
    sample joined over the CFG group."""
    if isinstance(output, tuple) and output:
        return (_join_halves(output[0], group),) + tuple(output[1:])
    sample = getattr(output, "sample", None)
    if sample is not None:
        return type(output)(sample=_join_halves(sample, group))
    return _join_halves(output, group)


class _BatchedState:
    def __init__(self):
        self.active = False
        self.half: int | None = None  # samples per CFG branch in the current call


class _BatchedCfgHook(ModelHook):
    """On each transformer: a forward on a doubled batch runs this CFG rank's half, then the halves are joined."""

    def __init__(self, state: _BatchedState, mesh, acc_state):
        super().__init__()
        self.s, self.mesh, self.acc = state, mesh, acc_state
        self.parameters: list[str] | None = None  # the forward's parameter names, in order

    def _latent(self, module, args, kwargs):
        """The first batch-carrying argument in signature order: the latent input (a tensor, or Z-Image's list)."""
        if self.parameters is None:
            self.parameters = list(inspect.signature(type(module).forward).parameters)[1:]  # without self
        named = dict(zip(self.parameters, args), **kwargs)
        return next((named[p] for p in self.parameters if _batch_of(named.get(p)) is not None), None)

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        s = self.s
        if not s.active:
            return forward(*args, **kwargs)
        latent = self._latent(module, args, kwargs)
        if _batch_of(latent) != 2 * s.half:  # not a CFG forward (SD3.5 skip-layer guidance, Z-Image truncation)
            self.acc.count("cfg_parallel.unsplit_forwards")
            return forward(*args, **kwargs)
        me, lists = self.mesh.cfg_rank, not isinstance(latent, torch.Tensor)
        args = tuple(_take_half(a, s.half, me, lists) for a in args)
        kwargs = {k: _take_half(v, s.half, me, lists) for k, v in kwargs.items()}
        out = _join_output(forward(*args, **kwargs), self.mesh.group("cfg"))
        self.acc.count("cfg_parallel.split_steps")
        return out


# -- the pass --------------------------------------------------------------------------------------------------
def _refuse_non_cfg_call(style: dict, pipe, kwargs: dict) -> None:
    """AccelError when this call runs no CFG (scale at or below the threshold, or no negative prompt where the
    pipeline needs one). Every rank sees the same kwargs: raised on every rank, before any collective."""
    scale_arg = style["cfg_scale_arg"]
    scale = kwargs.get(scale_arg, _default(pipe, scale_arg)) if scale_arg else None
    if scale is None or scale <= style["cfg_threshold"]:
        what = "true CFG" if style["cfg"] == "true_cfg" else "CFG (the batch is not doubled)"
        raise AccelError(
            f"cfg_parallel=2 but this call does not run {what}: {scale_arg}={scale!r} must be > "
            f"{style['cfg_threshold']}; pass it, or accelerate without cfg_parallel."
        )
    neg = style["negative_prompt_arg"]
    if style["needs_negative"] and neg and kwargs.get(neg) is None and kwargs.get(neg + "_embeds") is None:
        raise AccelError(
            f"cfg_parallel=2 but this call has no {neg}: {type(pipe).__name__} runs the negative branch "
            f"only with {neg}=... (or {neg}_embeds); pass one, or accelerate without cfg_parallel."
        )


class CfgParallelPass(AccelPass):
    name = "cfg_parallel"

    def wanted(self, config) -> bool:
        return config.cfg_parallel > 1

    def check(self, ctx: PassContext) -> None:
        from .sequence import mesh_for

        if ctx.config.cfg_parallel != 2:
            raise AccelError(f"cfg_parallel={ctx.config.cfg_parallel}: CFG has two branches; use cfg_parallel=2.")
        style = cfg_style(ctx.adapter, ctx.pipe)
        if style["cfg"] not in ("true_cfg", "batched_cfg"):
            what = {"distilled": "is guidance-distilled (one forward per step, no negative branch)"}.get(
                style["cfg"], f"has CFG style {style['cfg']!r}")
            raise AccelError(
                f"cfg_parallel=2 needs a pipeline that runs CFG (two branches per step), and "
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
        style = cfg_style(ctx.adapter, ctx.pipe)
        pipe, acc = ctx.pipe, ctx.state
        batched = style["cfg"] == "batched_cfg"
        # a cache decision under batched CFG covers both halves of the one forward: every rank must agree on it
        acc.mesh = mesh.with_branch_over_cfg() if batched else mesh
        state = _BatchedState() if batched else _CfgState()

        def on_call() -> None:
            state.active = False  # until this call is known to run CFG
            _refuse_non_cfg_call(style, pipe, acc.call_kwargs)
            if acc.call_args:
                raise AccelError("cfg_parallel=2: pass the pipeline arguments by keyword (prompt=..., ...).")
            if batched:
                state.half = call_batch(pipe, acc.call_kwargs)
            else:
                state.calls, state.pending = 0, None
            state.active = True

        acc.on_call_start(on_call)

        def off() -> None:
            acc._call_start_hooks.remove(on_call)

        acc.record("cfg_parallel", off, hidden=True)
        for name, transformer in ctx.adapter.transformers_of(pipe):
            hook = _BatchedCfgHook(state, mesh, acc) if batched else _CfgHook(state, mesh, acc)
            acc.record("cfg_parallel", add_hook(transformer, "cfg_parallel", hook), component=name,
                       cfg_rank=mesh.cfg_rank, style=style["cfg"])
