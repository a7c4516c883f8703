"""Regional torch.compile: compile each repeated transformer block, not the whole model.

Why regional: the blocks of a DiT are one module repeated 20-60 times, so dynamo traces one graph per block type
and reuses it for every instance -- a cold start of seconds instead of minutes, with nearly the speed of
whole-model compile. ``compile="max"`` adds inductor's autotuning and, on CUDA, CUDA graphs (static shapes).
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
        return {"mode": "max-autotune" if device.type == "cuda" else "max-autotune-no-cudagraphs", "dynamic": False}
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
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            blocks = ctx.adapter.blocks_of(transformer)
            for _, block in blocks:
                block.compile(**options)

            def undo(blocks=blocks) -> None:
                for _, block in blocks:
                    block._compiled_call_impl = None  # what nn.Module.compile() set; None = eager again

            ctx.state.record("compile", undo, component=name, blocks=len(blocks), **options)
        logger.info("omni_accel: regional compile of %s", [n for n, _ in ctx.adapter.transformers_of(ctx.pipe)])
