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
import json
import logging
import os

import torch

from diffusers.hooks import ModelHook

from ..errors import AccelError
from ..hooks import add_hook
from ..lora import quant_target_name
from ..pass_base import AccelPass, PassContext
from .fp8 import FP8_MAX, STATIC_MARGIN, Fp8Linear, fp8_alignment_problem, fp8_matmul_support

logger = logging.getLogger(__name__)

MODES = {"fp8": "w8a8", "fp8_weight_only": "weight_only"}
QUANT_CONFIG_KEYS = ("skip", "measure_error", "activations", "scales")
ACTIVATION_MODES = ("dynamic", "static")


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
    activations = qc.get("activations", "dynamic")
    if activations not in ACTIVATION_MODES:
        raise AccelError(
            f"quant_config['activations']={activations!r} is not known; use 'dynamic' (a scale per token, computed "
            "at run time) or 'static' (a calibrated scale per layer)."
        )
    if activations == "static" and config.quant != "fp8":
        raise AccelError(
            f"quant_config['activations']='static' needs quant='fp8': quant={config.quant!r} keeps activations in "
            "bf16, so there is nothing to scale. Use quant='fp8', or drop 'activations'."
        )
    if "scales" in qc:
        if activations != "static":
            raise AccelError("quant_config['scales'] was given without quant_config['activations']='static'; add "
                             "it, or drop 'scales'.")
        _load_scales(qc["scales"])  # readable, and a mapping of names to positive numbers


def _load_scales(source) -> dict[str, float]:
    """Static activation scales from a dict or the JSON file ``save_activation_scales`` wrote."""
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise AccelError(f"quant_config['scales']={str(source)!r} could not be read ({exc}); pass the JSON file "
                             "that omni_accel.kernels.quant.save_activation_scales wrote.") from None
        data = data.get("scales", data) if isinstance(data, dict) else data
    else:
        data = source
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        for k, v in data.items()
    ):
        raise AccelError("quant_config['scales'] must map layer names (e.g. 'transformer.transformer_blocks.0.attn."
                         "to_q') to positive scales, as save_activation_scales writes them.")
    return {k: float(v) for k, v in data.items()}


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
        scales = (cfg.quant_config or {}).get("scales")
        if scales is not None:
            wanted = {f"{tname}.{name}" for tname, t in ctx.adapter.transformers_of(ctx.pipe)
                      for name, _ in _plan(ctx, t)[0]}
            missing = sorted(wanted - set(_load_scales(scales)))
            if missing:
                raise AccelError(
                    f"quant_config['scales'] has no scale for {len(missing)} of the {len(wanted)} layers to quantize "
                    f"(first: {missing[0]!r}); it was saved from another model or another skip list. Calibrate "
                    "again (quant_config={'activations': 'static'} without 'scales'), or drop 'scales'."
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
        if (ctx.config.quant_config or {}).get("activations") == "static":
            _start_static_activations(ctx)

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


def _fp8_layers(quantized: dict) -> dict[str, Fp8Linear]:
    return {f"{tname}.{name}": m for tname, t in quantized.items() for name, m in t.named_modules()
            if isinstance(m, Fp8Linear)}


def _start_static_activations(ctx: PassContext) -> None:
    """Static scales from ``quant_config['scales']``, or observe during the first pipeline call and freeze at the
    start of the next one (so the calibration sees every denoising step of a real call)."""
    state = ctx.state
    layers = _fp8_layers(state.quantized)
    given = (ctx.config.quant_config or {}).get("scales")
    if given is not None:
        scales = _load_scales(given)
        for name, layer in layers.items():
            layer.set_static_scale(scales[name])
    else:
        for layer in layers.values():
            layer.observe()
        for tname, transformer in state.quantized.items():
            undo = add_hook(transformer, f"fp8_observe.{tname}", _EagerWhileObserving(list(layers.values())))
            state.record("quant", undo, hidden=True)

        def freeze_after_first_call() -> None:
            if state.calls >= 1 and any(m.activations == "observing" for m in layers.values()):
                freeze_activation_scales_of(state)

        state.on_call_start(freeze_after_first_call)
    state.report_sections["fp8_activations"] = lambda: _activation_report(layers)


class _EagerWhileObserving(ModelHook):
    """Runs the transformer's compiled blocks eagerly while its FP8 layers observe (torch.compiler's "force_eager"
    stance): the observing forward is a one-off, and compiling it too doubled the first call's compile time
    (FLUX on an H200: 27.7 s instead of about 14)."""

    def __init__(self, layers: list[Fp8Linear]):
        super().__init__()
        self.layers = layers
        self.observing = True  # layers never go back to observing once frozen: stop looking after that

    def new_forward(self, module, *args, **kwargs):
        if self.observing:
            self.observing = any(layer.activations == "observing" for layer in self.layers)
        if self.observing:
            with torch.compiler.set_stance("force_eager"):
                return self.fn_ref.original_forward(*args, **kwargs)
        return self.fn_ref.original_forward(*args, **kwargs)


def _activation_report(layers: dict[str, Fp8Linear]) -> dict:
    modes = [m.activations for m in layers.values()]
    return {"static": modes.count("static"), "observing": modes.count("observing"),
            "dynamic": modes.count("dynamic")}


def freeze_activation_scales_of(state) -> dict[str, float]:
    frozen = {}
    for name, layer in _fp8_layers(state.quantized).items():
        if layer.activations == "observing":
            layer.freeze()
        if layer.activations == "static":
            frozen[name] = float(layer.input_scale)
    logger.info("omni_accel: FP8 activation scales frozen for %d layers", len(frozen))
    return frozen


def _state_of(pipe, what: str):
    state = vars(pipe).get("omni_accel")
    if state is None or not state.quantized:
        raise AccelError(f"{what} needs a pipeline accelerated with quant='fp8'.")
    return state


def freeze_activation_scales(pipe) -> dict[str, float]:
    """Freeze the static FP8 activation scales now (``quant_config={"activations": "static"}`` otherwise freezes
    them when the second pipeline call starts). Returns {layer name: scale}. For loops that call the transformer
    directly rather than through the pipeline."""
    return freeze_activation_scales_of(_state_of(pipe, "freeze_activation_scales()"))


def save_activation_scales(pipe, path: str) -> dict[str, float]:
    """Write the frozen static scales to ``path`` (JSON) for ``quant_config={"activations": "static",
    "scales": path}``; freezes them first if they are still being observed."""
    state = _state_of(pipe, "save_activation_scales()")
    scales = freeze_activation_scales_of(state)
    if not scales:
        raise AccelError("save_activation_scales(): no layer has a static scale yet; accelerate with "
                         "quant_config={'activations': 'static'} and run the pipeline once first.")
    with open(path, "w") as f:
        json.dump({"scales": scales, "margin": f"scale = {STATIC_MARGIN:g} x calibrated max |x| / {FP8_MAX:g} (e4m3)"},
                  f, indent=1)
    return scales


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
