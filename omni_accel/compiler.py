"""Regional torch.compile: compile each repeated transformer block, not the whole model.

Why regional: the blocks of a DiT are one module repeated 20-60 times, so dynamo traces one graph per block type
and reuses it for every instance -- a cold start of seconds instead of minutes, with nearly the speed of
whole-model compile. ``compile="max"`` adds inductor's GEMM autotuning (max-autotune); CUDA graphs are left out,
see ``compile_options``.
"""

from __future__ import annotations

import logging
import shutil

import torch

from .errors import AccelError
from .pass_base import AccelPass, PassContext

logger = logging.getLogger(__name__)


def compile_options(mode: bool | str, device: torch.device) -> dict:
    if mode == "max":
        # No CUDA graphs: every instance of a block type replays the *same* regional graph, whose static output
        # buffer the next block's replay overwrites while the residual stream still holds it (measured on an H200,
        # 2026-12-03: "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run").
        return {"mode": "max-autotune-no-cudagraphs", "dynamic": False}
    return {"dynamic": False}


class CompilePass(AccelPass):
    name = "compile"

    def wanted(self, config) -> bool:
        return config.compile is not False

    def check(self, ctx: PassContext) -> None:
        if ctx.device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
            raise AccelError(
                "compile=True on CPU needs a C++ compiler for inductor and none was found on PATH; "
                "install g++ (e.g. apt-get install g++) or use compile=False."
            )
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            if not ctx.adapter.blocks_of(transformer):
                raise AccelError(
                    f"compile={ctx.config.compile!r}: the {name} of this pipeline has none of the block lists "
                    f"{ctx.adapter.block_lists} that the {ctx.adapter.family} adapter declares; use compile=False."
                )

    def apply(self, ctx: PassContext) -> None:
        options = compile_options(ctx.config.compile, ctx.device)
        _raise_recompile_limit(ctx)
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            blocks = ctx.adapter.blocks_of(transformer)
            undos = [_compile_block(block, options) for _, block in blocks]

            def undo(undos=undos) -> None:
                for u in undos:
                    u()

            ctx.state.record("compile", undo, component=name, blocks=len(blocks), **options)
        logger.info("omni_accel: regional compile of %s", [n for n, _ in ctx.adapter.transformers_of(ctx.pipe)])


# Every accelerate(compile=True) on the same block class adds guard entries to the same forward code object (other
# hooks, FP8 modules, shapes); past dynamo's default limit of 8 it silently runs that code eager. Seen on the H200:
# the fifth compiled config of one benchmark process had a 0.2 s "cold start" and eager speed. A process that
# re-accelerates a pipeline a few times must keep compiling, so the limit is raised while a compile pass is applied.
RECOMPILE_LIMIT = 64


def _raise_recompile_limit(ctx: PassContext) -> None:
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo_config, name)
    if before >= RECOMPILE_LIMIT:
        return
    setattr(dynamo_config, name, RECOMPILE_LIMIT)
    ctx.state.record("compile", lambda: setattr(dynamo_config, name, before), hidden=True)


def _compile_block(block: torch.nn.Module, options: dict):
    """Compile ``block``'s own forward, *under* every diffusers hook on it; return the undo.

    Why under the hooks: the passes' hooks make per-step Python decisions (TeaCache computes or replays the block,
    sp splits and gathers, cfg_parallel exchanges). Compiled into the graph they would guard on that state (a
    recompile whenever a step switches between computed and reused) or break it; outside it the compiled region is
    the same pure block forward every step. The innermost link of diffusers' hook chain (``_fn_refs[0]``, the first
    hook registered) holds the block's forward: it is swapped for the compiled one. Without hooks:
    ``nn.Module.compile`` as before.
    """
    registry = getattr(block, "_diffusers_hook", None)
    refs = getattr(registry, "_fn_refs", None)
    if not refs:
        block.compile(**options)

        def undo_plain() -> None:
            block._compiled_call_impl = None  # what nn.Module.compile() set; None = eager again

        return undo_plain
    ref = refs[0]
    attr = "original_forward" if ref.original_forward is not None else "forward"
    eager = getattr(ref, attr)
    setattr(ref, attr, torch.compile(eager, **options))

    def undo_hooked() -> None:
        setattr(ref, attr, eager)

    return undo_hooked
