"""The quant pass: ``accelerate(pipe, quant="fp8" | "fp8_weight_only", quant_config={...})``.

Every ``nn.Linear`` inside the adapter's repeated blocks becomes an ``Fp8Linear`` (kernels/fp8.py), except those
matching the family's skip list (``ModelAdapter.quant_skip``: the per-sample modulation linears by default) or the
user's ``quant_config["skip"]`` patterns, and (for W8A8) those whose shape the FP8 GEMM cannot take. Embedders and the final
layer live outside the blocks and are never quantized. Module replacement (the way torchao and diffusers'
quantizers do it) rather than a hook: the bf16 weight must leave the GPU for the memory saving to be real.
restore() puts the original modules back; on a GPU their weights wait in host memory meanwhile.
"""

from __future__ import annotations

import fnmatch
import logging

import torch

from ..errors import AccelError
from ..lora import quant_target_name
from ..pass_base import AccelPass, PassContext
from .fp8 import Fp8Linear, fp8_alignment_problem, fp8_matmul_support

logger = logging.getLogger(__name__)

MODES = {"fp8": "w8a8", "fp8_weight_only": "weight_only"}
QUANT_CONFIG_KEYS = ("skip", "measure_error")


def _skip_patterns(ctx: PassContext) -> tuple[str, ...]:
    user = (ctx.config.quant_config or {}).get("skip", ())
    return tuple(ctx.adapter.quant_skip) + tuple(user)


def _plan(ctx: PassContext, transformer) -> tuple[list[tuple[str, torch.nn.Linear]], dict[str, str]]:
    """(linears to quantize, {skipped name: reason}) for one transformer, names relative to it."""
    patterns = _skip_patterns(ctx)
    chosen, skipped = [], {}
    for block_name, block in ctx.adapter.blocks_of(transformer):
        for rel, module in block.named_modules():
            if not isinstance(module, torch.nn.Linear) or not rel:
                continue
            name = f"{block_name}.{rel}"
            target = quant_target_name(name)  # a LoRA wrapper's base layer answers to the wrapper's name
            if target is None:
                continue  # the LoRA matrices stay in the pipeline's dtype beside the FP8 base
            hit = next((p for p in patterns if fnmatch.fnmatchcase(target, p)), None)
            if hit is not None:
                skipped[name] = f"skip pattern {hit!r}"
            elif ctx.config.quant == "fp8" and (problem := fp8_alignment_problem(module)) is not None:
                skipped[name] = problem
            else:
                chosen.append((name, module))
    return chosen, skipped


def _check_quant_config(config) -> None:
    qc = config.quant_config or {}
    unknown = sorted(set(qc) - set(QUANT_CONFIG_KEYS))
    if unknown:
        raise AccelError(f"quant_config has unknown keys {unknown}; known keys: {list(QUANT_CONFIG_KEYS)}.")
    skip = qc.get("skip", ())
    if isinstance(skip, str) or not all(isinstance(p, str) for p in skip):
        raise AccelError(
            f"quant_config['skip']={skip!r} must be a list of module-name patterns, e.g. ['*.ff.net.2'] "
            "(fnmatch patterns matched against names like 'transformer_blocks.3.ff.net.2')."
        )
    if not isinstance(qc.get("measure_error", False), bool):
        raise AccelError(f"quant_config['measure_error']={qc['measure_error']!r} must be True or False.")


class QuantPass(AccelPass):
    name = "quant"

    def wanted(self, config) -> bool:
        return config.quant is not None

    def check(self, ctx: PassContext) -> None:
        cfg = ctx.config
        _check_quant_config(cfg)
        if cfg.tp > 1:
            raise AccelError(
                f"quant={cfg.quant!r} cannot be combined with tp={cfg.tp} yet: tensor parallelism shards nn.Linear "
                "weights and FP8 linears are not shardable modules. Use sp / cfg_parallel with FP8, or drop quant."
            )
        if cfg.quant == "fp8":
            ok, reason = fp8_matmul_support(ctx.device)
            if not ok:
                raise AccelError(
                    f"quant='fp8' needs FP8 matrix multiplication, which is not available here: {reason}. "
                    "Use quant='fp8_weight_only' (e4m3 weights dequantized on the fly: half the weight memory, "
                    "runs anywhere), or run on an FP8-capable GPU (Ada, Hopper, Blackwell)."
                )
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            chosen, skipped = _plan(ctx, transformer)
            # the dtype of the linears themselves: Wan keeps norms / embedders in fp32 beside bf16 blocks
            dtype = chosen[0][1].weight.dtype if chosen else next(transformer.parameters()).dtype
            if cfg.quant == "fp8" and ctx.device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
                raise AccelError(
                    f"quant='fp8' on a GPU needs a bf16 or fp16 {name} (FP8 GEMMs write 16-bit outputs); it is "
                    f"{dtype}. Load the pipeline with torch_dtype=torch.bfloat16."
                )
            if not chosen:
                reasons = sorted(set(skipped.values()))
                raise AccelError(
                    f"quant={cfg.quant!r}: no linear layer of the {name} can be quantized ({len(skipped)} skipped: "
                    f"{'; '.join(reasons[:3])}). Shorten quant_config['skip'], or use quant='fp8_weight_only' "
                    "for layers whose shape the FP8 GEMM cannot take."
                )

    def apply(self, ctx: PassContext) -> None:
        mode = MODES[ctx.config.quant]
        measure = bool((ctx.config.quant_config or {}).get("measure_error", False))
        for tname, transformer in ctx.adapter.transformers_of(ctx.pipe):
            chosen, skipped = _plan(ctx, transformer)
            swapped = []  # (parent, attr, original module, original weight device)
            try:
                for name, linear in chosen:
                    swapped.append(self._swap(transformer, name, linear, mode, measure))
            except BaseException:
                _put_back(swapped)
                raise
            layers = {name: round(transformer.get_submodule(name).weight_rel_err, 6) for name, _ in chosen}
            before = sum(_nbytes(original) for _, _, original, _ in swapped)
            after = sum(_nbytes(transformer.get_submodule(name)) for name, _ in chosen)
            ctx.state.record(
                "quant", lambda s=swapped: _put_back(s), component=tname, mode=ctx.config.quant, layers=len(chosen),
                skipped=skipped, weight_rel_err=layers, weight_rel_err_max=max(layers.values()),
                linear_bytes_before=before, linear_bytes_after=after, measure_error=measure,
            )
            ctx.state.quantized[tname] = transformer
            logger.info("omni_accel: %s: %d linears -> FP8 (%s), %d kept", tname, len(chosen), mode, len(skipped))

    @staticmethod
    def _swap(transformer, name: str, linear: torch.nn.Linear, mode: str, measure: bool):
        parent_name, _, attr = name.rpartition(".")
        parent = transformer.get_submodule(parent_name)
        fp8 = Fp8Linear(linear, mode)
        device = linear.weight.device
        if measure:
            fp8.reference_weight = linear.weight.detach()
        setattr(parent, attr, fp8)
        if device.type == "cuda":  # free the GPU copy: the original waits in host memory for restore()
            for p in linear.parameters(recurse=False):
                p.data = p.data.to("cpu")
        return parent, attr, linear, device


def _nbytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in tensors)


def _put_back(swapped: list) -> None:
    for parent, attr, linear, device in reversed(swapped):
        for p in linear.parameters(recurse=False):
            if p.device != device:
                p.data = p.data.to(device)
        setattr(parent, attr, linear)


def quant_error_report(pipe) -> dict:
    """Per-layer errors of the FP8 linears of an accelerated pipeline: the weight quantization error always, the
    output error on the first call's inputs when ``quant_config={"measure_error": True}`` was given."""
    state = vars(pipe).get("omni_accel")
    if state is None or not state.quantized:
        raise AccelError("quant_error_report() needs a pipeline accelerated with quant='fp8' or 'fp8_weight_only'.")
    out = {}
    for tname, transformer in state.quantized.items():
        for name, module in transformer.named_modules():
            if isinstance(module, Fp8Linear):
                out[f"{tname}.{name}"] = {"weight_rel_err": module.weight_rel_err,
                                          "output_rel_err": module.output_rel_err}
    return out
