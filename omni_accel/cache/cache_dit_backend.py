"""cache="cache_dit" / "fb_cache": delegate to cache-dit (DBCache Fn/Bn, TaylorSeer, SCM step masks).

Named ``cache_dit_backend`` so it does not shadow the ``cache_dit`` package.

How it is wired:
* cache-dit's own BlockAdapter registry describes the pipeline (Wan 2.2's two transformers included), except
  where the adapter asks for one unified block list (``extra["cache_dit_unify"]``, FLUX.1): then a custom
  ``BlockAdapter`` puts every block of the declared lists in one cached list (the other lists are mocked empty) --
  cache-dit's own FLUX adapter does the same but through a copied transformer forward (FluxPatchFunctor), which
  this project avoids; diffusers >= 0.36 single-stream FLUX blocks take and return (text, image) like the
  dual-stream ones, so no patch is needed.
* cache-dit patches ``type(pipe).__call__`` (to open its cache contexts per call) and sets class attributes, so the
  pipeline first gets a private same-named subclass; ``disable_cache`` and swapping the class back undo it all.
* Fn/Bn defaults are clamped to the real block counts (cache-dit's default Fn=8 fails on shorter models);
  explicit values larger than a block list are refused.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..errors import AccelError
from ..hooks import CallbackHook, add_hook
from ..pass_base import PassContext
from .base import CacheBackend

logger = logging.getLogger(__name__)

# Defaults chosen on the built-in model (benchmarks/bench_cache.py, docs/caching.md): Fn=1 Bn=0, rdt 0.24,
# 2 warm-up steps; cache_dit adds TaylorSeer order 1, fb_cache is plain first-block residual reuse.
DEFAULTS = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "residual_diff_threshold": 0.24,
    "max_warmup_steps": 2,
    "taylorseer": True,
    "taylorseer_order": 1,
}
FB_DEFAULTS = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "residual_diff_threshold": 0.24,
    "max_warmup_steps": 2,
    "taylorseer": False,
    "taylorseer_order": 1,
}


class _quiet:
    """cache-dit logs every step of its setup at INFO; keep that at WARNING while we call it."""

    def __enter__(self):
        self._levels = {}
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("cache_dit"):
                lg = logging.getLogger(name)
                self._levels[name] = lg.level
                lg.setLevel(max(lg.level, logging.WARNING))

    def __exit__(self, *exc):
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


def _disable(target, forwards) -> None:
    import cache_dit

    for t, had, fwd, order in forwards:
        if hasattr(t, "_original_forward"):
            del t._original_forward
            if had:
                object.__setattr__(t, "forward", fwd)
            elif "forward" in vars(t):
                del t.forward
    with _quiet():
        cache_dit.disable_cache(target)
    for t, _, _, order in forwards:
        # cache-dit swaps block lists in and out with unittest.mock.patch.object on every forward; restoring a
        # submodule re-inserts it at the end of _modules, which reorders named_children() (diffusers'
        # FirstBlockCache / MagCache pick head and tail blocks by that order): put the order back
        mods = t._modules
        t._modules = type(mods)([(k, mods[k]) for k in order if k in mods] +
                                [(k, v) for k, v in mods.items() if k not in order])


def _dbcache_fields() -> dict:
    import cache_dit

    return {f.name: f.default for f in dataclasses.fields(cache_dit.DBCacheConfig) if f.name != "cache_type"}


class CacheDitBackend(CacheBackend):
    name = "cache_dit"
    preset = DEFAULTS
    requires = "cache_dit"

    @property
    def options(self) -> dict:  # every DBCacheConfig field, our defaults on top, and the calibrator switches
        opts = _dbcache_fields()
        opts.update(self.preset)
        opts["scm"] = None  # "slow" | "medium" | "fast" | "ultra": cache_dit.steps_mask(...) for num_inference_steps
        return opts

    # -- what cache-dit will see ------------------------------------------------------------------------
    def _unified_lists(self, ctx: PassContext) -> tuple[str, ...]:
        return tuple(ctx.adapter.extra.get("cache_dit_unify", ()))

    def _block_lists(self, ctx: PassContext) -> list[tuple[str, int]]:
        """(name, length) of every block list cache-dit will cache, over all transformers."""
        from cache_dit.caching.block_adapters import BlockAdapterRegister

        out = []
        unify = self._unified_lists(ctx)
        if unify:
            for tname, t in ctx.adapter.transformers_of(ctx.pipe):
                out.append((f"{tname}.{'+'.join(unify)}", sum(len(getattr(t, b)) for b in unify)))
            return out
        adapter = BlockAdapterRegister.get_adapter(ctx.pipe, skip_post_init=True)
        if adapter is None:
            raise AccelError(
                f"cache={self.name!r}: cache-dit has no block adapter for {type(ctx.pipe).__name__}; use "
                "cache='tea_cache'."
            )
        blocks = adapter.blocks if isinstance(adapter.blocks, (list, tuple)) else [adapter.blocks]
        for i, b in enumerate(blocks):
            out.append((f"blocks[{i}]", len(b)))
        return out

    def resolve(self, ctx: PassContext) -> dict:
        opts = super().resolve(ctx)
        given = ctx.config.cache_config or {}
        counts = self._block_lists(ctx)
        shortest = min(n for _, n in counts)
        for key in ("Fn_compute_blocks", "Bn_compute_blocks"):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise AccelError(f"cache_config {key}={v!r} must be an integer >= 0.")
        fn, bn = opts["Fn_compute_blocks"], opts["Bn_compute_blocks"]
        if fn + bn > shortest:
            if "Fn_compute_blocks" in given or "Bn_compute_blocks" in given:
                raise AccelError(
                    f"cache_config Fn_compute_blocks={fn} + Bn_compute_blocks={bn} exceeds the {shortest} blocks of "
                    f"the shortest cached block list ({', '.join(f'{n}: {c}' for n, c in counts)}); lower them."
                )
            fn = max(1, min(fn, shortest))
            bn = max(0, min(bn, shortest - fn))
            opts["Fn_compute_blocks"], opts["Bn_compute_blocks"] = fn, bn
        if opts["scm"] is not None:
            if opts["scm"] not in ("slow", "medium", "fast", "ultra"):
                raise AccelError(f"cache_config scm={opts['scm']!r} is not known. Use one of: 'slow', 'medium', "
                                 "'fast', 'ultra' (or pass steps_computation_mask=[1, 0, ...]).")
            if not isinstance(opts["num_inference_steps"], int):
                raise AccelError("cache_config scm=... needs num_inference_steps=<the steps you will call with>.")
        return opts

    def check(self, ctx: PassContext, opts: dict) -> None:
        c = ctx.config
        if c.sequence_degree > 1:
            # cache-dit runs the blocks from its own wrapper and subtracts the wrapper's input from the output of
            # its first Fn blocks / the last blocks; our sp splits the sequence in the first block's hook and
            # gathers it in the last block's, so those residuals mix full and sharded tensors (and a reused step
            # would skip the gather). cache-dit only knows how to re-shard for diffusers' own CP hooks.
            raise AccelError(
                f"cache={self.name!r} with sp={c.sequence_degree} (ulysses={c.ulysses_degree}, ring={c.ring_degree}) "
                "is not supported: cache-dit compares residuals across the blocks where sequence parallelism "
                "splits and gathers the tokens. Use cache='tea_cache' with sp (same decisions on every rank, "
                "tested), or cache-dit with tp only."
            )
        if c.cfg_parallel > 1:
            # cache-dit counts the forwards of a step to tell its CFG branches apart and all-reduces its metric
            # over the whole world; under cfg_parallel each rank runs the blocks of one branch only.
            raise AccelError(
                f"cache={self.name!r} with cfg_parallel={c.cfg_parallel} is not supported: cache-dit tracks both "
                "CFG branches in one process and reduces its metric over all ranks, while each CFG rank runs one "
                "branch. Use cache='tea_cache' with cfg_parallel (per-branch decisions, tested)."
            )

    def _configs(self, opts: dict):
        import cache_dit

        fields = _dbcache_fields()
        kw = {k: v for k, v in opts.items() if k in fields}
        if opts["scm"] is not None and kw.get("steps_computation_mask") is None:
            kw["steps_computation_mask"] = cache_dit.steps_mask(total_steps=opts["num_inference_steps"],
                                                                mask_policy=opts["scm"])
        cache_config = cache_dit.DBCacheConfig(**kw)
        calibrator = None
        if opts["taylorseer"]:
            # the encoder (text) stream gets no calibrator: SD3's last block returns no text stream, where
            # cache-dit's encoder TaylorSeer asserts; on the other families the text stream after the cached
            # region is discarded or only feeds the next region, and plain residual reuse serves it
            calibrator = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=int(opts["taylorseer_order"]),
                                                              enable_encoder_calibrator=False)
        return cache_config, calibrator

    def apply(self, ctx: PassContext, opts: dict):
        import cache_dit
        from cache_dit import BlockAdapter, ForwardPattern

        pipe = ctx.pipe
        original_class = type(pipe)
        # a private subclass: cache-dit patches the class's __call__ and class attributes
        private = type(original_class.__name__, (original_class,), {"__module__": original_class.__module__})
        pipe.__class__ = private
        cache_config, calibrator = self._configs(opts)
        unify = self._unified_lists(ctx)
        target = pipe
        # the transformers' own forward attributes (diffusers' hook registry installs a functools.partial, which
        # cache-dit's disable_cache cannot re-bind): put back by us before disable_cache runs
        forwards = [(t, "forward" in vars(t), vars(t).get("forward"), list(t._modules))
                    for _, t in ctx.adapter.transformers_of(pipe)]
        try:
            if unify:
                transformers = [t for _, t in ctx.adapter.transformers_of(pipe)]
                blocks = [torch.nn.ModuleList([b for name in unify for b in getattr(t, name)]) for t in transformers]
                target = BlockAdapter(
                    pipe=pipe,
                    transformer=transformers if len(transformers) > 1 else transformers[0],
                    blocks=blocks if len(blocks) > 1 else blocks[0],
                    blocks_name=[unify[0]] * len(blocks) if len(blocks) > 1 else unify[0],
                    dummy_blocks_names=[list(unify[1:])] * len(blocks) if len(blocks) > 1 else list(unify[1:]),
                    forward_pattern=ForwardPattern.Pattern_1,
                    check_forward_pattern=False,
                    has_separate_cfg=ctx.adapter.cfg == "true_cfg",
                )
            with _quiet():
                cache_dit.enable_cache(target, cache_config=cache_config, calibrator_config=calibrator)
        except BaseException:
            try:
                _disable(target, forwards)
            finally:
                pipe.__class__ = original_class
            raise
        removers = []
        for tname, t in ctx.adapter.transformers_of(pipe):
            for bname, block in ctx.adapter.blocks_of(t):
                hook = CallbackHook(before=lambda: ctx.state.count("cache.block_forwards"))
                removers.append(add_hook(block, f"cache_dit.count.{tname}.{bname}", hook))

        def summary() -> dict:  # report()["cache"]: cache-dit keeps its step decisions to itself
            last = ctx.state.last_call
            return {"backend": self.name,
                    "block_forwards": last.counters.get("cache.block_forwards", 0) if last is not None else 0}

        ctx.state.report_sections["cache"] = summary

        def undo() -> None:
            ctx.state.report_sections.pop("cache", None)
            for remove in reversed(removers):
                remove()
            try:
                _disable(target, forwards)
            finally:
                pipe.__class__ = original_class

        details = {
            "backend": self.name,
            "cache_config": cache_config.strify(),
            "calibrator": calibrator.strify() if calibrator is not None else None,
            "Fn_compute_blocks": cache_config.Fn_compute_blocks,
            "Bn_compute_blocks": cache_config.Bn_compute_blocks,
            "residual_diff_threshold": cache_config.residual_diff_threshold,
            "block_lists": [n for n, _ in self._block_lists(ctx)],
        }
        return undo, details, None


class FbCacheBackend(CacheDitBackend):
    """First-block cache (ParaAttention's FBCache) as a cache-dit preset: Fn=1, Bn=0, no calibrator."""

    name = "fb_cache"
    preset = FB_DEFAULTS
