"""CPU offload, through diffusers' own machinery (made undoable and reported).

- ``offload="model"``: each component moves to the GPU when it runs and back after (diffusers'
  ``enable_model_cpu_offload``). Peak memory = the largest component plus activations.
- ``offload="block"``: every component is group-offloaded block by block from pinned CPU memory, the next block
  prefetched on a side CUDA stream while the current one computes (diffusers' ``apply_group_offloading``).
  Peak memory = a couple of blocks plus activations; speed is bounded by host-to-device bandwidth.
"""

from __future__ import annotations

import logging

import torch
from diffusers.hooks import HookRegistry, apply_group_offloading

from .errors import AccelError
from .pass_base import AccelPass, PassContext

logger = logging.getLogger(__name__)

_GROUP_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


class OffloadPass(AccelPass):
    name = "offload"

    def wanted(self, config) -> bool:
        return config.offload is not None

    def check(self, ctx: PassContext) -> None:
        for name, module in _modules(ctx.pipe).items():
            if hasattr(module, "_hf_hook") or getattr(module, "_diffusers_hook", None) is not None and any(
                h in module._diffusers_hook.hooks for h in _GROUP_HOOKS
            ):
                raise AccelError(
                    f"offload={ctx.config.offload!r}: component '{name}' is already offloaded by diffusers/accelerate; "
                    "call pipe.remove_all_hooks() (or load the pipeline fresh) before accelerate(offload=...)."
                )
        if ctx.device.type == "cpu":
            logger.warning("omni_accel: offload=%r on a CPU-only run moves nothing (weights already live in host "
                           "memory); it pays on a GPU.", ctx.config.offload)

    def apply(self, ctx: PassContext) -> None:
        pipe = ctx.pipe
        homes = {name: next(m.parameters(), torch.empty(0)).device for name, m in _modules(pipe).items()}
        if ctx.config.offload == "model":
            pipe.enable_model_cpu_offload(device=ctx.device)

            def undo() -> None:
                pipe.remove_all_hooks()
                for name, module in _modules(pipe).items():
                    module.to(homes[name])

            ctx.state.record("offload", undo, mode="model", onload_device=str(ctx.device))
            return

        use_stream = ctx.device.type == "cuda"
        for name, module in _modules(pipe).items():
            module.to("cpu")
            apply_group_offloading(
                module, onload_device=ctx.device, offload_device=torch.device("cpu"), offload_type="block_level",
                num_blocks_per_group=1, use_stream=use_stream, non_blocking=use_stream,
            )

            def undo(module=module, home=homes[name]) -> None:
                registry = HookRegistry.check_if_exists_or_initialize(module)
                for hook_name in _GROUP_HOOKS:
                    registry.remove_hook(hook_name, recurse=True)
                module.to(home)

            ctx.state.record("offload", undo, mode="block", component=name, onload_device=str(ctx.device),
                             prefetch_stream=use_stream)
