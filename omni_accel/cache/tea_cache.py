"""TeaCache (Liu et al., CVPR 2025) as hooks on module boundaries -- no copied model forward.

Per transformer forward:
  1. the first block of the first cache region (``adapter.teacache.regions``) gets the modulated input: the
     ``teacache.modulated_input`` module is called *ahead* on that block's own arguments (it is a norm inside the
     block, so the value is exactly what the block computes; cost: one norm per step), or -- for modules that run
     before the blocks (Wan's condition embedder) -- its output is captured by a forward hook;
  2. decision: ``rel = mean|m - m_prev| / mean|m_prev|`` (mean over every element, i.e. the whole batch),
     ``acc += max(poly(rel), 0)`` with ``poly`` the per-model rescale polynomial (np.poly1d order, highest power
     first); reuse when ``acc < threshold``, else compute and reset ``acc`` to 0. The first ``warmup_steps`` and
     last ``final_steps`` steps, and any step without a full residual cached, are computed;
  3. compute: every block runs; at the first block of each region its inputs are recorded, at the last block the
     residual (output - input) per returned stream; reuse: every block returns its inputs in its own output format
     (``CacheRegion.outputs``) and the last block of each region adds the cached residual. Glue code between
     regions (FLUX.2 concatenates text and image) still runs and is linear, so per-region residuals equal the
     whole-stack residual.

State: one per (transformer, CFG branch). The branch is the index of the forward within the step (true CFG calls
the transformer twice per step: branch 0 = cond, 1 = uncond; batched CFG: one forward, one state). The step is
told apart by the scheduler's step index (a host int -- no device read), falling back to the timestep value.
Everything is reset at the start of each pipeline call. Per step, the decision reads one boolean from the device
(the branch in Python needs it); the accumulator and polynomial stay on the device. Under sequence / CFG
parallelism the two means are averaged over the ranks of the CFG branch first (``AccelState.all_reduce_mean``,
group "branch" = sp x tp), so every rank that runs the branch takes the same decision; under cfg_parallel each CFG
rank decides its own branch from that branch's metric, as a single process does.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from diffusers.hooks import ModelHook

from ..errors import AccelError
from ..hooks import CallbackHook, add_hook
from ..pass_base import PassContext
from .base import CacheBackend, load_profile, resolve_module

logger = logging.getLogger(__name__)

IDENTITY = (1.0, 0.0)  # poly1d([1, 0])(x) = x: the rescale used when a family has no fitted coefficients

# Default threshold per family when cache_config gives none (and no profile). FLUX / Qwen-Image: the published
# polynomials' usual "about 2x" setting; families with the identity rescale: a rel-L1 budget.
DEFAULT_THRESHOLD = 0.4

_SIGNATURES: dict[type, inspect.Signature] = {}


def _bind(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """The arguments of a block call by parameter name (positional calls included)."""
    cls = type(module)
    sig = _SIGNATURES.get(cls)
    if sig is None:
        sig = _SIGNATURES[cls] = inspect.signature(cls.forward)
    bound = sig.bind(module, *args, **kwargs).arguments
    out = {}
    for name, value in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _first_tensor(value: Any, index: int) -> torch.Tensor:
    if isinstance(value, (tuple, list)):
        value = value[index]
    if hasattr(value, "sample") and not isinstance(value, torch.Tensor):
        value = value.sample
    if not isinstance(value, torch.Tensor):
        raise AccelError(f"tea_cache: the modulated-input module returned {type(value).__name__}, not a tensor.")
    return value


def horner(coefficients: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """np.poly1d(coefficients)(x) on the device (highest power first)."""
    y = torch.zeros_like(x)
    for c in coefficients:
        y = y * x + c
    return y


class _BranchState:
    def __init__(self):
        self.prev: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None
        self.inputs: dict[int, dict[str, Any]] = {}
        self.residuals: dict[int, dict[str, torch.Tensor | None]] = {}
        self.none_outputs: dict[int, set] = {}
        self.prev_out: torch.Tensor | None = None  # calibration only
        self.last_rel_in: float | None = None


class _TransformerCache:
    """Hooks and per-branch states of one transformer (Wan 2.2 has two)."""

    def __init__(self, name: str, transformer: torch.nn.Module, regions: list[tuple[Any, list]]):
        self.name = name
        self.transformer = transformer
        self.regions = regions  # [(CacheRegion, [block modules])]
        self.states: dict[int, _BranchState] = {}
        self.branch = 0
        self.current: _BranchState | None = None
        self.mode: str | None = None  # None = not deciding (outside a pipeline call): run blocks plainly
        self.captured: torch.Tensor | None = None

    def reset(self) -> None:
        self.states.clear()
        self.current = None
        self.mode = None
        self.captured = None


class TeaCacheController:
    @property
    def pipe(self):  # through the context: a deep-copied module's hooks must not drag a copy of the pipeline along
        return self.ctx.pipe

    def __init__(self, ctx: PassContext, options: dict, coefficients: tuple, threshold: float):
        self.ctx = ctx
        self.spec = ctx.adapter.teacache
        self.options = options
        self.coefficients = tuple(float(c) for c in coefficients)
        self.threshold = float(threshold)
        self.warmup = int(options["warmup_steps"])
        self.final = int(options["final_steps"])
        self.caches: dict[str, _TransformerCache] = {}
        self._coef_t: dict[tuple, torch.Tensor] = {}
        # calibration: when a list, every forward appends {transformer, branch, step, rel_in, rel_out}
        self.recorder: list | None = None
        self.reset()

    # -- per call ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.step_key: Any = object()
        self.step_index = -1
        self.total_steps: int | None = None
        self.forwards_in_step: dict[str, int] = {}
        # per (transformer, branch): one letter per step of this call, C computed, R reused, - not run here
        self.trace: dict[tuple[str, int], list[str]] = {}
        for tc in self.caches.values():
            tc.reset()

    def _step_marker(self, tc: _TransformerCache, bound: dict) -> Any:
        sched = getattr(self.pipe, "scheduler", None)
        if sched is not None and hasattr(sched, "_step_index"):
            return ("sched", sched._step_index)  # host int (None before the first scheduler.step)
        t = bound.get("timestep", bound.get("t"))
        if isinstance(t, torch.Tensor):
            return ("t", float(t.reshape(-1)[0]))  # one host read; only for pipelines without a scheduler index
        return ("t", t)

    def _total(self) -> int:
        n = getattr(self.pipe, "_num_timesteps", None)
        if isinstance(n, int) and n > 0:
            return n
        sched = getattr(self.pipe, "scheduler", None)
        ts = getattr(sched, "timesteps", None)
        order = getattr(sched, "order", 1) or 1
        return len(ts) // order if ts is not None else 10**9

    def on_transformer_forward(self, tc: _TransformerCache, args: tuple, kwargs: dict) -> None:
        if not self.ctx.state.in_call:
            tc.mode = None
            return
        bound = _bind(tc.transformer, args, kwargs)
        key = self._step_marker(tc, bound)
        if key != self.step_key:
            self.step_key = key
            self.step_index += 1
            self.forwards_in_step = {}
            if self.step_index == 0:
                self.total_steps = self._total()
        branch = self.forwards_in_step.get(tc.name, 0)
        self.forwards_in_step[tc.name] = branch + 1
        tc.branch = branch
        tc.current = tc.states.setdefault(branch, _BranchState())
        tc.mode = "deciding"
        tc.captured = None

    # -- the decision -----------------------------------------------------------------------------------
    def modulated_input(self, tc: _TransformerCache, block: torch.nn.Module, bound: dict) -> torch.Tensor:
        spec = self.spec
        if not spec.modulated_args and not spec.modulated_kwargs:
            if tc.captured is None:
                raise AccelError(
                    f"tea_cache: {spec.modulated_input} did not run before the first block of {tc.name}; the "
                    "adapter must declare modulated_args to call it ahead."
                )
            return tc.captured
        module = resolve_module(tc.transformer, spec.modulated_input)
        m_args = [bound[a] for a in spec.modulated_args]
        m_kwargs = {k: bound[a] for k, a in spec.modulated_kwargs}
        m = _first_tensor(module(*m_args, **m_kwargs), spec.output_index)
        if spec.modulation:
            mod = resolve_module(tc.transformer, spec.modulation)(bound[spec.modulation_arg])
            chunks = mod.chunk(spec.modulation_chunks, dim=-1)
            shift, scale = chunks[0], chunks[1]
            while shift.ndim < m.ndim:
                shift, scale = shift.unsqueeze(1), scale.unsqueeze(1)
            m = m * (1 + scale) + shift
        return m

    def decide(self, tc: _TransformerCache, m: torch.Tensor) -> bool:
        st = tc.current
        step, total = self.step_index, self.total_steps or 10**9
        ready = len(st.residuals) == len(tc.regions)
        force = (
            st.prev is None or not ready or st.prev.shape != m.shape or step < self.warmup
            or step >= total - self.final or self.threshold <= 0
        )
        reuse = False
        if self.recorder is not None:
            st.last_rel_in = None
            if st.prev is not None and st.prev.shape == m.shape:
                prev = st.prev.float()
                st.last_rel_in = float((m.float() - prev).abs().mean() / (prev.abs().mean() + 1e-8))
        if not force:
            prev = st.prev
            means = torch.stack([(m - prev).abs().mean(), prev.abs().mean()]).float()
            # Identical decision on every rank of this CFG branch (sp x tp ranks must all skip or all compute, or
            # the computing ones wait in a collective). Not over the CFG group: under cfg_parallel each CFG rank
            # runs one branch and decides it from that branch's own metric, exactly as one process does.
            # The blocks' inputs are full (the cache hooks sit outside the sp split), so the means agree already;
            # the reduction guards against rank-dependent rounding.
            means = self.ctx.state.all_reduce_mean(means, group="branch")
            rel = means[0] / (means[1] + 1e-8)
            key = (rel.device, rel.dtype)
            coef = self._coef_t.get(key)
            if coef is None:
                coef = self._coef_t[key] = torch.tensor(self.coefficients, device=rel.device, dtype=torch.float64)
            acc = (st.acc if st.acc is not None else torch.zeros((), device=rel.device, dtype=torch.float64))
            acc = acc + horner(coef, rel.double()).clamp_min(0)
            reuse = bool(acc < self.threshold)  # the one device->host read per step
            st.acc = acc if reuse else None
        else:
            st.acc = None
        st.prev = m.detach()
        return reuse

    def count(self, tc: _TransformerCache, reuse: bool) -> None:
        what = "reused" if reuse else "computed"
        self.ctx.state.count(f"cache.{what}")
        self.ctx.state.count(f"cache.{what}.{tc.name}.branch{tc.branch}")
        self._mark(tc, "R" if reuse else "C")

    def _mark(self, tc: _TransformerCache, letter: str) -> None:
        steps = self.trace.setdefault((tc.name, tc.branch), [])
        steps.extend("-" * (self.step_index - len(steps)))  # steps this branch did not run at all
        steps.append(letter)

    def summary(self) -> dict:
        """report()["cache"]: per transformer and CFG branch, what this process computed / reused in the last call.

        Branch names: "cond" / "uncond" when a step runs two forwards (true CFG: the pipelines call the
        conditional prediction first), "all" when it runs one (no CFG, or batched CFG: both halves in one
        forward). Under cfg_parallel every rank sees both forwards of a step but runs the blocks of one branch
        only ("rank_branch"); the other branch's forwards count as "other_rank" (its blocks ran on the other CFG
        rank); the first step of a new shape runs both branches on every rank (cfg_parallel.unsplit_forwards).
        """
        counters = self.ctx.state.last_call.counters if self.ctx.state.last_call is not None else {}
        mesh = self.ctx.state.mesh
        out: dict[str, Any] = {"backend": "tea_cache", "computed": counters.get("cache.computed", 0),
                               "reused": counters.get("cache.reused", 0),
                               "block_forwards": counters.get("cache.block_forwards", 0), "branches": {}}
        for tname in self.caches:
            found = sorted({int(k.rsplit(".branch", 1)[1]) for k in counters
                            if ".branch" in k and k.rsplit(".branch", 1)[0].endswith(f".{tname}")})
            names = {0: "cond", 1: "uncond"} if len(found) > 1 or 1 in found else {0: "all"}
            per = {}
            for b in found:
                per[names.get(b, f"branch{b}")] = {
                    "computed": counters.get(f"cache.computed.{tname}.branch{b}", 0),
                    "reused": counters.get(f"cache.reused.{tname}.branch{b}", 0),
                    "other_rank": counters.get(f"cache.other_rank.{tname}.branch{b}", 0),
                    "steps": "".join(self.trace.get((tname, b), [])),
                }
            out["branches"][tname] = per
        if mesh is not None:
            out["decision_ranks"] = list(mesh.group_ranks("branch"))  # ranks that take the same decisions
            from ..parallel.cfg import cfg_style  # the cfg_parallel pass's own reading of the pipeline's CFG

            if mesh.cfg > 1 and cfg_style(self.ctx.adapter, self.ctx.pipe)["cfg"] == "batched_cfg":
                # batched CFG: each CFG rank runs one half of the doubled batch; both halves decide together
                out["rank_branch"] = f"batch_half{mesh.cfg_rank}"
            elif mesh.cfg > 1:
                out["rank_branch"] = "cond" if mesh.cfg_rank == 0 else "uncond"
        return out


class _BlockHook(ModelHook):
    """On every block of a cache region: run it, or return its inputs (+ the residual at the region's end)."""

    def __init__(self, controller: TeaCacheController, tc: _TransformerCache, region_index: int, outputs: tuple,
                 first: bool, last: bool, decider: bool):
        super().__init__()
        self.controller, self.tc = controller, tc
        self.region_index, self.outputs = region_index, outputs
        self.first, self.last, self.decider = first, last, decider

    def new_forward(self, module, *args, **kwargs):
        tc = self.tc
        if tc.mode is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        bound = _bind(module, args, kwargs)
        if self.decider:
            reuse = self.controller.decide(tc, self.controller.modulated_input(tc, module, bound))
            tc.mode = "reuse" if reuse else "compute"
            self.controller.count(tc, reuse)
        st, r = tc.current, self.region_index
        if tc.mode == "reuse":
            values = [bound.get(name) for name in self.outputs]
            if self.last:
                res, nones = st.residuals[r], st.none_outputs[r]
                values = [None if name in nones else (v + res[name] if res.get(name) is not None else v)
                          for name, v in zip(self.outputs, values)]
            return values[0] if len(values) == 1 else tuple(values)
        # compute (also "deciding" when the region's first block is not the decider: cannot happen, regions
        # run in order and the decider is the first block of the first region)
        if self.first:
            st.inputs[r] = {name: bound.get(name) for name in self.outputs}
        out = self.fn_ref.original_forward(*args, **kwargs)
        self.controller.ctx.state.count("cache.block_forwards")
        if self.last:
            outs = (out,) if len(self.outputs) == 1 else tuple(out)
            inputs = st.inputs.pop(r, {})
            res, nones = {}, set()
            for name, o in zip(self.outputs, outs):
                i = inputs.get(name)
                if o is None:
                    nones.add(name)
                elif isinstance(o, torch.Tensor) and isinstance(i, torch.Tensor) and i.shape == o.shape:
                    res[name] = o - i
                else:  # a stream whose shape changes inside the region cannot be replayed from a residual
                    st.residuals.pop(r, None)
                    return out
            st.residuals[r], st.none_outputs[r] = res, nones
        return out


class _TransformerHook(ModelHook):
    def __init__(self, controller: TeaCacheController, tc: _TransformerCache):
        super().__init__()
        self.controller, self.tc = controller, tc

    def pre_forward(self, module, *args, **kwargs):
        self.controller.on_transformer_forward(self.tc, args, kwargs)
        return args, kwargs

    def post_forward(self, module, output):
        tc, rec = self.tc, self.controller.recorder
        if tc.mode == "deciding":  # the blocks did not run in this process (cfg_parallel: the other rank's branch)
            self.controller.ctx.state.count(f"cache.other_rank.{tc.name}.branch{tc.branch}")
            self.controller._mark(tc, "-")
        if rec is not None and tc.current is not None and tc.mode is not None:
            st = tc.current
            o = _first_tensor(output, 0).detach().float()
            rel_out = None
            if st.prev_out is not None and st.prev_out.shape == o.shape:
                rel_out = float((o - st.prev_out).abs().mean() / (st.prev_out.abs().mean() + 1e-8))
            rec.append({"transformer": tc.name, "branch": tc.branch, "step": self.controller.step_index,
                        "rel_in": st.last_rel_in, "rel_out": rel_out, "reused": tc.mode == "reuse"})
            st.prev_out = o
        tc.mode = None
        return output


def published_for(adapter, pipe):
    """The adapter's published polynomial (``TeaCacheSpec.published``) for this pipeline's transformer, or None.
    Checkpoints sharing one config are told apart by their folder name; when it does not say, the first is used
    and a warning names the others."""
    spec = adapter.teacache
    transformers = adapter.transformers_of(pipe)
    if spec is None or not spec.published or not transformers:
        return None
    config = transformers[0][1].config
    fits = [p for p in spec.published if all(config.get(k) == v for k, v in p.config)
            and (len(transformers) == 1 or not p.single_transformer)]
    if len(fits) <= 1:
        return fits[0] if fits else None
    names = " ".join(str(x).lower() for x in (getattr(getattr(pipe, "config", None), "_name_or_path", ""),
                                               config.get("_name_or_path", "")))
    named = [p for p in fits if p.name_hint and p.name_hint in names]
    if len(named) == 1:
        return named[0]
    logger.warning("tea_cache: the checkpoint's name does not say which of %s it is; using %s's coefficients (pass "
                   "cache_config={'coefficients': [...]} for another).", ", ".join(p.model for p in fits), fits[0].model)
    return fits[0]


def _builtin_profile(pipe) -> str | None:
    """The name of the shipped profile of the project's own model this pipeline was loaded from, if any (the image
    model's "builtin", the video model's "builtin_video")."""
    import os

    from ..builtin import builtin_model_path, builtin_video_model_path
    from .base import shipped_profiles

    path = str(getattr(getattr(pipe, "config", None), "_name_or_path", "") or "")
    if not path:
        return None
    for folder, name in ((builtin_model_path(), "builtin"), (builtin_video_model_path(), "builtin_video")):
        if os.path.realpath(path) == os.path.realpath(folder) and name in shipped_profiles():
            return name
    return None


def _profile_steps_check(state, profile: dict, name: Any):
    """A call-start check: warn (once per step count) when a call runs another number of steps than the profile
    was calibrated at -- its threshold's measured quality holds for that step count only."""
    calibrated = int(profile["steps"])
    shown = name if isinstance(name, str) else "given as a dict"

    def check() -> None:
        steps = state.call_arguments.get("num_inference_steps")
        if isinstance(steps, int) and steps != calibrated:
            state.warn_once(
                f"tea_cache profile {shown!r} was calibrated at {calibrated} steps and this call runs {steps}: its "
                f"quality ({profile.get('criterion', 'mean')} PSNR {profile.get('target_psnr', '?')} dB) was "
                f"measured at {calibrated} steps only. Call with num_inference_steps={calibrated}, or calibrate at "
                f"{steps} (omni-accel calibrate --steps {steps})."
            )

    return check


class TeaCacheBackend(CacheBackend):
    name = "tea_cache"
    options = {
        "threshold": None,  # None: the profile's, else DEFAULT_THRESHOLD
        "coefficients": None,  # None: the profile's, else the adapter's published ones, else identity (warning)
        "profile": None,  # path / shipped name / dict from omni_accel.cache.calibrate
        "warmup_steps": 1,
        "final_steps": 1,
    }

    def resolve(self, ctx: PassContext) -> dict:
        opts = super().resolve(ctx)
        for key in ("warmup_steps", "final_steps"):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise AccelError(f"cache_config {key}={v!r} must be an integer >= 0.")
        if opts["threshold"] is not None and (isinstance(opts["threshold"], bool)
                                              or not isinstance(opts["threshold"], (int, float))
                                              or opts["threshold"] < 0):
            raise AccelError(f"cache_config threshold={opts['threshold']!r} must be a number >= 0 (0 = never reuse).")
        if opts["coefficients"] is not None:
            c = opts["coefficients"]
            if not isinstance(c, (list, tuple)) or not c or not all(isinstance(x, (int, float)) for x in c):
                raise AccelError(f"cache_config coefficients={c!r} must be a list of numbers, highest power first.")
        return opts

    def settings(self, ctx: PassContext, opts: dict) -> tuple[tuple, float, str, dict, dict | None, str | None]:
        """(coefficients, threshold, where they came from, the warm-up / final steps that source asks for, the
        profile used and its name) -- the profile for the step-count check of each call."""
        profile = load_profile(opts["profile"]) if opts["profile"] is not None else None
        profile_name = opts["profile"] if profile is not None else None
        if profile is None and opts["coefficients"] is None and (shipped := _builtin_profile(ctx.pipe)):
            profile, profile_name = load_profile(shipped), shipped  # the shipped profile of the project's own model
        if profile is not None and profile.get("family") not in (None, ctx.adapter.family):
            raise AccelError(
                f"cache_config profile is for family {profile.get('family')!r}, this pipeline is "
                f"{ctx.adapter.family!r}; calibrate a profile for this model."
            )
        spec = ctx.adapter.teacache
        published = None
        if opts["coefficients"] is not None:
            coef, source = tuple(opts["coefficients"]), "cache_config"
        elif profile is not None:
            coef, source = tuple(profile["coefficients"]), "profile"
        elif (published := published_for(ctx.adapter, ctx.pipe)) is not None:
            coef, source = published.coefficients, f"published ({published.model})"
        elif spec.coefficients:
            coef, source = tuple(spec.coefficients), "published"
        else:
            coef, source = IDENTITY, "identity"
        if opts["threshold"] is not None:
            thr = float(opts["threshold"])
        elif profile is not None:
            thr = float(profile["threshold"])
        else:
            thr = published.threshold if published is not None else DEFAULT_THRESHOLD
        if profile is not None:
            steps = {k: int(profile[k]) for k in ("warmup_steps", "final_steps") if k in profile}
        elif published is not None:
            steps = {"warmup_steps": published.warmup_steps, "final_steps": published.final_steps}
        else:
            steps = {}
        return coef, thr, source, steps, profile, profile_name

    def check(self, ctx: PassContext, opts: dict) -> None:
        spec = ctx.adapter.teacache
        if spec is None:
            raise AccelError(f"cache='tea_cache' has no TeaCache description for family {ctx.adapter.family!r}.")
        self.settings(ctx, opts)
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            resolve_module(transformer, spec.modulated_input)
            if spec.modulation:
                resolve_module(transformer, spec.modulation)
            for region in self._regions(ctx.adapter):
                if not list(getattr(transformer, region.block_list, None) or ()):
                    if region is self._regions(ctx.adapter)[0]:
                        raise AccelError(f"tea_cache: {name}.{region.block_list} is empty; nothing to cache.")

    @staticmethod
    def _regions(adapter):
        from ..pipelines.base import CacheRegion

        spec = adapter.teacache
        return list(spec.regions) or [CacheRegion(b, ("encoder_hidden_states", "hidden_states"))
                                      for b in adapter.block_lists]

    def apply(self, ctx: PassContext, opts: dict):
        coef, thr, source, steps, profile, profile_name = self.settings(ctx, opts)
        given = ctx.config.cache_config or {}  # the profile's / publication's warm-up and final steps unless given
        opts = dict(opts, **{k: v for k, v in steps.items() if k not in given})
        if source != "profile":
            profile = None  # coefficients given explicitly: the profile's step count says nothing about them
        if source == "identity":
            logger.warning(
                "tea_cache: family %r has no fitted rescale coefficients; using the identity rescale (the "
                "accumulated quantity is the raw relative L1 change). Calibrate a profile for this model "
                "(omni_accel.cache.calibrate / `omni-accel calibrate`) for a threshold with a known quality.",
                ctx.adapter.family,
            )
        controller = TeaCacheController(ctx, opts, coef, thr)
        removers = []
        spec = ctx.adapter.teacache
        for tname, transformer in ctx.adapter.transformers_of(ctx.pipe):
            regions = []
            for region in self._regions(ctx.adapter):
                blocks = list(getattr(transformer, region.block_list, None) or ())
                if blocks:
                    regions.append((region, blocks))
            tc = _TransformerCache(tname, transformer, regions)
            controller.caches[tname] = tc
            removers.append(add_hook(transformer, f"tea_cache.{tname}", _TransformerHook(controller, tc)))
            if not spec.modulated_args and not spec.modulated_kwargs:
                module = resolve_module(transformer, spec.modulated_input)

                def capture(output, tc=tc):
                    if tc.mode is not None:
                        tc.captured = _first_tensor(output, spec.output_index)

                removers.append(add_hook(module, f"tea_cache.capture.{tname}", CallbackHook(after=capture)))
            for ri, (region, blocks) in enumerate(regions):
                for bi, block in enumerate(blocks):
                    hook = _BlockHook(controller, tc, ri, tuple(region.outputs), first=bi == 0,
                                      last=bi == len(blocks) - 1, decider=ri == 0 and bi == 0)
                    removers.append(add_hook(block, f"tea_cache.{tname}.{region.block_list}.{bi}", hook))
        ctx.state.on_call_start(controller.reset)
        checks = [controller.reset]
        if profile is not None and profile.get("steps"):
            checks.append(_profile_steps_check(ctx.state, profile, profile_name))
            ctx.state.on_call_start(checks[-1])
        ctx.state.report_sections["cache"] = controller.summary

        def undo() -> None:
            ctx.state.report_sections.pop("cache", None)
            for remove in reversed(removers):
                remove()
            ctx.state.remove_call_hooks(*checks)

        details = {
            "backend": "tea_cache",
            "threshold": thr,
            "coefficients": list(coef),
            "coefficients_source": source,
            "warmup_steps": opts["warmup_steps"],
            "final_steps": opts["final_steps"],
            "regions": [r.block_list for r in self._regions(ctx.adapter)],
            "modulated_input": spec.modulated_input,
        }
        if profile_name is not None and not isinstance(profile_name, dict):
            details["profile"] = str(profile_name)  # given, or the shipped profile of the project's own model
        return undo, details, controller
