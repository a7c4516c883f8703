"""The quant pass: ``accelerate(pipe, quant="fp8" | "fp8_weight_only" | "int8", quant_config={...})``.

Every ``nn.Linear`` inside the adapter's repeated blocks becomes an ``Fp8Linear`` (kernels/fp8.py) or, for
``"int8"``, an ``Int8Linear`` (kernels/int8.py), except those matching the family's skip list
(``ModelAdapter.quant_skip``: the per-sample modulation linears by default) or the user's ``quant_config["skip"]``
patterns, and (for W8A8) those whose shape the FP8 / int8 GEMM cannot take. Embedders and the final
layer live outside the blocks and are never quantized. Module replacement (the way torchao and diffusers'
quantizers do it) rather than a hook: the bf16 weight must leave the GPU for the memory saving to be real.
restore() puts the original modules back; on a GPU their weights wait in host memory meanwhile.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
from typing import NamedTuple

import torch

from diffusers.hooks import ModelHook

from ..deps import installed, missing_message
from ..errors import AccelError
from ..hooks import add_hook
from ..lora import quant_target_name
from ..pass_base import AccelPass, PassContext
from .cudnn_fp8_attention import AttentionScales
from .fp8 import FP8_MAX, STATIC_MARGIN, Fp8Linear, fp8_alignment_problem, fp8_matmul_support
from .int8 import (INT8_GEMMS, Int8Linear, Int8WeightOnlyLinear, int8_alignment_problem, int8_matmul_support,
                   resolve_int8_gemm)
from .qlinear import QuantizedLinear

logger = logging.getLogger(__name__)

MODES = {"fp8": "w8a8", "fp8_weight_only": "weight_only", "int8": "int8"}
# the W8A8 modes: (can this device multiply them, why a layer's shape cannot be multiplied, the format's name,
# GPU architectures)
_W8A8 = {"fp8": (fp8_matmul_support, fp8_alignment_problem, "FP8", "Ada, Hopper, Blackwell"),
         "int8": (int8_matmul_support, int8_alignment_problem, "int8", "Turing or newer")}
QUANT_CONFIG_KEYS = ("skip", "measure_error", "activations", "scales", "attention_scales", "fast_accum", "modulation",
                     "int8_gemm")
# The family's per-sample AdaLN modulation linears (ModelAdapter.quant_skip): kept in the model dtype ("bf16", the
# default), or int8 weights with 16-bit activations ("int8": half the bytes of their matrix-vector products).
MODULATION_MODES = ("bf16", "int8")
ACTIVATION_MODES = ("dynamic", "static")
# FP8 attention's q / k / v scales beside static linears: per call (default) or calibrated with the linears. Per call
# is the default because calibrated attention scales lowered the built-in model's worst held-out image from 30.4 to
# 24.7 dB (benchmarks/results/fp8_quality_attention_scales.json), for 3-4 ms of a FLUX step's kernel time on an H200
# (benchmarks/results/bench_peers_h200_flux_fastaccum_20261204.json).
ATTENTION_SCALE_MODES = ("static", "dynamic")
# FP8 GEMMs without fp32 promotion of the partial sums (what torchao's float8 inference does too): on an H200 the
# FLUX-shaped FP8 GEMMs took 7 % less time with the output error unchanged (rel. err vs bf16 0.01859 with, 0.0186
# without; benchmarks/results/bench_peers_h200_flux_fastaccum_20261204.json). quant_config={"fast_accum": False}
# keeps the promotion.
DEFAULT_FAST_ACCUM = True
DEFAULT_ATTENTION_SCALES = "dynamic"


def _skip_patterns(ctx: PassContext) -> tuple[str, ...]:
    user = (ctx.config.quant_config or {}).get("skip", ())
    return tuple(ctx.adapter.quant_skip) + tuple(user)


class _Plan(NamedTuple):
    """One transformer's linears, names relative to it."""

    chosen: list[tuple[str, torch.nn.Linear]]  # to quantize in the ``quant`` mode
    skipped: dict[str, str]  # name -> why it stays as it is
    # the family's modulation linears that ``quant_config={"modulation": "int8"}`` turns into int8 weight-only layers
    # (those the user's own skip patterns name stay skipped)
    modulation: list[tuple[str, torch.nn.Linear]]


def _plan(ctx: PassContext, transformer) -> _Plan:
    patterns = _skip_patterns(ctx)
    family = set(ctx.adapter.quant_skip)
    user = tuple((ctx.config.quant_config or {}).get("skip", ()))
    int8_modulation = (ctx.config.quant_config or {}).get("modulation", "bf16") == "int8"
    chosen, skipped, modulation = [], {}, []
    for block_name, block in ctx.adapter.blocks_of(transformer):
        for rel, module in block.named_modules():
            if not isinstance(module, torch.nn.Linear) or not rel:
                continue
            name = f"{block_name}.{rel}"
            target = quant_target_name(name)  # a LoRA wrapper's base layer answers to the wrapper's name
            if target is None:
                continue  # the LoRA matrices stay in the pipeline's dtype beside the FP8 base
            hit = next((p for p in patterns if fnmatch.fnmatchcase(target, p)), None)
            if (int8_modulation and hit in family
                    and not any(fnmatch.fnmatchcase(target, p) for p in user)):
                modulation.append((name, module))
            elif hit is not None:
                skipped[name] = f"skip pattern {hit!r}"
            elif ctx.config.quant in _W8A8 and (problem := _W8A8[ctx.config.quant][1](module)) is not None:
                skipped[name] = problem
            else:
                chosen.append((name, module))
    return _Plan(chosen, skipped, modulation)


def check_quant_config(config) -> None:
    """Refuse a bad ``quant_config`` (keys, values, their combinations with ``quant``) with the fix; needs no model,
    so the command line runs it before loading one."""
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
    if not isinstance(qc.get("fast_accum", DEFAULT_FAST_ACCUM), bool):
        raise AccelError(f"quant_config['fast_accum']={qc['fast_accum']!r} must be True or False.")
    if qc.get("fast_accum") and config.quant != "fp8":
        runs = ("int8 GEMMs, which accumulate exactly in int32 and have" if config.quant == "int8"
                else "bf16 GEMMs, which have")
        raise AccelError(
            f"quant_config['fast_accum']=True needs quant='fp8': quant={config.quant!r} runs {runs} no FP8 "
            "accumulation to speed up. Use quant='fp8', or drop 'fast_accum'.")
    activations = qc.get("activations", "dynamic")
    if activations not in ACTIVATION_MODES:
        raise AccelError(
            f"quant_config['activations']={activations!r} is not known; use 'dynamic' (a scale per token, computed "
            "at run time) or 'static' (a calibrated scale per layer)."
        )
    if activations == "static" and config.quant == "int8":
        raise AccelError(
            "quant_config['activations']='static' is not offered with quant='int8': int8 has no exponent, so one "
            "scale per layer rounds a token with small values coarsely (on the built-in model it lowered the worst "
            "image from 43.3 to 28.9 dB). Drop 'activations' (a scale per token), or use quant='fp8' for static "
            "scales.")
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
    attention_scales = qc.get("attention_scales", DEFAULT_ATTENTION_SCALES)
    if attention_scales not in ATTENTION_SCALE_MODES:
        raise AccelError(
            f"quant_config['attention_scales']={attention_scales!r} is not known; use 'static' (FP8 attention's q / k "
            "/ v scales calibrated with the linears') or 'dynamic' (computed per call).")
    modulation = qc.get("modulation", "bf16")
    if modulation not in MODULATION_MODES:
        raise AccelError(
            f"quant_config['modulation']={modulation!r} is not known; use 'bf16' (the AdaLN modulation linears as "
            "they are, the default) or 'int8' (their weights in int8, activations in 16 bits).")
    int8_gemm = qc.get("int8_gemm", "auto")
    if int8_gemm not in INT8_GEMMS:
        raise AccelError(
            f"quant_config['int8_gemm']={int8_gemm!r} is not known; use 'auto' (the default: 'triton' on a CUDA GPU "
            "with Triton installed, else 'cublas'), 'triton' (omni_accel's int8 GEMM with the rescale in its "
            "epilogue) or 'cublas' (torch._int_mm).")
    if "int8_gemm" in qc and config.quant != "int8":
        raise AccelError(f"quant_config['int8_gemm'] applies to quant='int8' only (quant={config.quant!r}); set "
                         "quant='int8', or drop 'int8_gemm'.")
    if int8_gemm == "triton" and not installed("triton"):
        raise AccelError(missing_message("triton", "quant_config['int8_gemm']='triton'",
                                         "use quant_config['int8_gemm']='cublas'"))
    if "attention_scales" in qc and activations != "static":
        raise AccelError("quant_config['attention_scales'] only applies with quant_config['activations']='static' "
                         "(dynamic activations keep per-call attention scales); add it, or drop 'attention_scales'.")


class SavedScales(NamedTuple):
    linears: dict[str, float]  # layer name -> activation scale
    attention: dict[str, dict] | None  # attention module name -> AttentionScales.set_static's arguments; None: the
    # file has no attention section (saved before static attention scales existed, or without FP8 attention)


def _is_scale(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _load_scales(source) -> SavedScales:
    """Static activation scales from a dict or the JSON file ``save_activation_scales`` wrote: either its layout
    ({"scales": {layer: scale}, "attention": {module: entry}}, the attention part optional) or {layer: scale}.
    A file is parsed once per version (path, size, modification time): accelerate() asks for it from several checks,
    and a FLUX file with attention scales is megabytes of JSON."""
    if isinstance(source, (str, os.PathLike)):
        try:
            stat = os.stat(source)
        except OSError as exc:
            raise _unreadable(source, exc) from None
        return _load_scales_file(str(source), os.path.abspath(source), stat.st_size, stat.st_mtime_ns)
    return _parse_scales(source)


def _unreadable(source, exc: Exception) -> AccelError:
    return AccelError(f"quant_config['scales']={str(source)!r} could not be read ({exc}); pass the JSON file "
                      "that omni_accel.kernels.quant.save_activation_scales wrote.")


@functools.lru_cache(maxsize=4)
def _load_scales_file(given: str, path: str, size: int, mtime_ns: int) -> SavedScales:
    """``given``: the path as the user wrote it, for the error message."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise _unreadable(given, exc) from None
    return _parse_scales(data)


def _parse_scales(data) -> SavedScales:
    linears, attention = data, None
    if isinstance(data, dict) and isinstance(data.get("scales"), dict):  # the saved file's layout
        linears, attention = data["scales"], data.get("attention")
    if not isinstance(linears, dict) or not all(isinstance(k, str) and _is_scale(v) for k, v in linears.items()):
        raise AccelError("quant_config['scales'] must map layer names (e.g. 'transformer.transformer_blocks.0.attn."
                         "to_q') to positive scales, as save_activation_scales writes them.")
    return SavedScales({k: float(v) for k, v in linears.items()},
                       None if attention is None else _attention_entries(attention))


def _attention_entries(attention) -> dict[str, dict]:
    def bad(name) -> AccelError:
        return AccelError(
            f"quant_config['scales'] has a malformed attention entry {name!r}; each must be {{'q': scale, 'k': scale, "
            "'v': scale, 'k_mean': [[...head dim values] per head]}, as save_activation_scales writes it. Save the "
            "scales again, or delete the file's 'attention' section to keep per-call attention scales.")

    if not isinstance(attention, dict):
        raise bad("attention")
    entries = {}
    for name, entry in attention.items():
        if not (isinstance(entry, dict) and set(entry) == {"q", "k", "v", "k_mean"}
                and all(_is_scale(entry[x]) for x in "qkv")):
            raise bad(name)
        try:
            k_mean = torch.tensor(entry["k_mean"], dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise bad(name) from None
        if k_mean.ndim != 2 or not torch.isfinite(k_mean).all():
            raise bad(name)
        entries[name] = {"descale_q": float(entry["q"]), "descale_k": float(entry["k"]),
                         "descale_v": float(entry["v"]), "k_mean": k_mean}
    return entries


def static_attention_source(config) -> str | None:
    """Where FP8 attention's static scales come from: "calibrate" (the first call, with the linears), "file"
    (quant_config['scales']), or None: per-call scales (dynamic activations, attention_scales='dynamic', or a
    scales file without an attention section)."""
    qc = config.quant_config or {}
    if qc.get("activations") != "static" or qc.get("attention_scales", DEFAULT_ATTENTION_SCALES) != "static":
        return None
    if "scales" not in qc:
        return "calibrate"
    return "file" if _load_scales(qc["scales"]).attention is not None else None


def check_static_attention(ctx: PassContext, cudnn_fp8: bool) -> None:
    """Refuse, before patching, static attention scales that cannot apply: asked for explicitly where attention is
    not cuDNN FP8 (the only implementation with per-tensor scales) or from a file without them, or a file whose
    attention entries name modules this pipeline does not have."""
    from .fp8_attention import attention_modules

    qc = ctx.config.quant_config or {}
    explicit = qc.get("attention_scales") == "static"
    if explicit and not cudnn_fp8:
        raise AccelError(
            "quant_config['attention_scales']='static' needs cuDNN's FP8 attention (attention='fp8', or 'auto' with "
            "quant='fp8' and compile, on a Hopper-or-newer GPU with nvidia-cudnn-frontend installed), which this "
            "pipeline does not run; drop 'attention_scales'.")
    source = static_attention_source(ctx.config)
    if explicit and source is None:
        raise AccelError(
            f"quant_config['attention_scales']='static' but quant_config['scales']={str(qc['scales'])!r} has no "
            "attention section (saved before static attention scales, or without FP8 attention). Calibrate again "
            "(quant_config={'activations': 'static'} without 'scales') and save, or drop 'attention_scales'.")
    if cudnn_fp8 and source == "file":
        names = {f"{tname}.{name}" for tname, t in ctx.adapter.transformers_of(ctx.pipe)
                 for name, _ in attention_modules(t)}
        unknown = sorted(set(_load_scales(qc["scales"]).attention) - names)
        if unknown:
            raise AccelError(
                f"quant_config['scales'] has attention scales for {len(unknown)} modules this pipeline does not have "
                f"(first: {unknown[0]!r}); it was saved from another model. Calibrate again "
                "(quant_config={'activations': 'static'} without 'scales'), or drop 'scales'.")


def start_static_attention(ctx: PassContext, tname: str, transformer: torch.nn.Module) -> None:
    """Give the cuDNN-FP8-routed ``transformer`` its static attention scales when the linears' are static: loaded
    from the scales file (a module it does not name never ran during its calibration and keeps per-call scales), or
    observing the first call beside the linears and frozen with them (``freeze_activation_scales_of``)."""
    from .fp8_attention import attach_attention_scales

    qc = ctx.config.quant_config or {}
    source = static_attention_source(ctx.config)
    if source is None:
        return
    scales, undo = attach_attention_scales(transformer, tname)
    ctx.state.record("attention", undo, hidden=True)
    if source == "file":
        saved = _load_scales(qc["scales"]).attention
        for name, module_scales in scales.items():
            if name in saved:
                module_scales.set_static(**saved[name])
    else:
        for module_scales in scales.values():
            module_scales.observe()
    state = ctx.state
    state.report_sections["fp8_attention_scales"] = lambda: _activation_report(_attention_scales(state.quantized))


class QuantPass(AccelPass):
    name = "quant"

    def wanted(self, config) -> bool:
        return config.quant is not None

    def check(self, ctx: PassContext) -> None:
        cfg = ctx.config
        check_quant_config(cfg)
        if cfg.tp > 1:
            raise AccelError(
                f"quant={cfg.quant!r} cannot be combined with tp={cfg.tp} yet: tensor parallelism shards nn.Linear "
                "weights and quantized linears are not shardable modules. Use sp / cfg_parallel with quant, or "
                "drop quant."
            )
        if cfg.quant in _W8A8:
            support, _, kind, gpus = _W8A8[cfg.quant]
            ok, reason = support(ctx.device)
            if not ok:
                raise AccelError(
                    f"quant={cfg.quant!r} needs {kind} matrix multiplication, which is not available here: {reason}. "
                    "Use quant='fp8_weight_only' (e4m3 weights dequantized on the fly: half the weight memory, "
                    f"runs anywhere), or run on a GPU with {kind} tensor cores ({gpus})."
                )
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            chosen, skipped, _ = _plan(ctx, transformer)
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
                    "for layers whose shape the W8A8 GEMM cannot take."
                )
        scales = (cfg.quant_config or {}).get("scales")
        if scales is not None:
            wanted = {f"{tname}.{name}" for tname, t in ctx.adapter.transformers_of(ctx.pipe)
                      for name, _ in _plan(ctx, t).chosen}
            missing = sorted(wanted - set(_load_scales(scales).linears))
            if missing:
                raise AccelError(
                    f"quant_config['scales'] has no scale for {len(missing)} of the {len(wanted)} layers to quantize "
                    f"(first: {missing[0]!r}); it was saved from another model or another skip list. Calibrate "
                    "again (quant_config={'activations': 'static'} without 'scales'), or drop 'scales'."
                )

    def apply(self, ctx: PassContext) -> None:
        mode = MODES[ctx.config.quant]
        measure = bool((ctx.config.quant_config or {}).get("measure_error", False))
        # weight-only layers run bf16 GEMMs: no FP8 accumulation to speed up, so none is reported either
        fast_accum = mode == "w8a8" and bool((ctx.config.quant_config or {}).get("fast_accum", DEFAULT_FAST_ACCUM))
        int8_gemm = resolve_int8_gemm((ctx.config.quant_config or {}).get("int8_gemm", "auto"), ctx.device)
        for tname, transformer in ctx.adapter.transformers_of(ctx.pipe):
            chosen, skipped, modulation = _plan(ctx, transformer)
            swapped = []  # (parent, attr, original module, original weight device)
            try:
                for name, linear in chosen:
                    quantized = (Int8Linear(linear, int8_gemm) if mode == "int8"
                                 else Fp8Linear(linear, mode, fast_accum=fast_accum))
                    swapped.append(self._swap(transformer, name, linear, quantized, measure))
                for name, linear in modulation:
                    swapped.append(self._swap(transformer, name, linear, Int8WeightOnlyLinear(linear), measure))
            except BaseException:
                _put_back(swapped)
                raise
            layers = {name: round(transformer.get_submodule(name).weight_rel_err, 6) for name, _ in chosen}
            modulation_err = [transformer.get_submodule(name).weight_rel_err for name, _ in modulation]
            before = sum(_nbytes(original) for _, _, original, _ in swapped)
            after = sum(_nbytes(transformer.get_submodule(name)) for name, _ in chosen + modulation)
            ctx.state.record(
                "quant", lambda s=swapped: _put_back(s), component=tname, mode=ctx.config.quant, layers=len(chosen),
                skipped=skipped, weight_rel_err=layers, weight_rel_err_max=max(layers.values()),
                linear_bytes_before=before, linear_bytes_after=after, measure_error=measure, fast_accum=fast_accum,
                modulation_layers=len(modulation), int8_gemm=int8_gemm if mode == "int8" else None,
                modulation_weight_rel_err_max=round(max(modulation_err), 6) if modulation_err else None,
            )
            ctx.state.quantized[tname] = transformer
            logger.info("omni_accel: %s: %d linears -> %s, %d kept", tname, len(chosen), ctx.config.quant,
                        len(skipped))
        if (ctx.config.quant_config or {}).get("activations") == "static":
            _start_static_activations(ctx)

    @staticmethod
    def _swap(transformer, name: str, linear: torch.nn.Linear, quantized: QuantizedLinear, measure: bool):
        parent_name, _, attr = name.rpartition(".")
        parent = transformer.get_submodule(parent_name)
        device = linear.weight.device
        if measure:
            quantized.reference_weight = linear.weight.detach()
        setattr(parent, attr, quantized)
        if device.type == "cuda":  # free the GPU copy: the original waits in host memory for restore()
            for p in linear.parameters(recurse=False):
                p.data = to_host(p.data)
        return parent, attr, linear, device


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in (pageable) host memory, same strides.

    Why not ``t.to("cpu")``: a copy into fresh host memory waits on the page faults of every page it writes, one
    thread at a time -- 1.5 GiB/s on an H200 host, 10-12 s of FLUX's first call for its 21 GiB of bf16 linear weights.
    Touching the pages first with torch's parallel fill, then copying, moved 4 GiB in 0.73 s against 2.60 s (more
    threads did not help the pageable copy; pinned memory took 2.96 s to allocate and fill):
    ``benchmarks/results/bench_first_call_host_copy_h200_20261204.json``. FLUX's quant pass: 12.4 -> 4.4 s."""
    host = torch.empty_like(t, device="cpu")
    host.zero_()
    return host.copy_(t)


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
        scales = _load_scales(given).linears
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


def _activation_report(layers: dict) -> dict:
    modes = [m.activations for m in layers.values()]
    return {"static": modes.count("static"), "observing": modes.count("observing"),
            "dynamic": modes.count("dynamic")}


def _attention_scales(quantized: dict) -> dict[str, AttentionScales]:
    return {m.name: m for t in quantized.values() for m in t.modules() if isinstance(m, AttentionScales)}


def freeze_activation_scales_of(state) -> dict[str, float]:
    """Freeze the observing linears and attention modules; {layer name: scale} of the static linears."""
    frozen = {}
    for name, layer in _fp8_layers(state.quantized).items():
        if layer.activations == "observing":
            layer.freeze()
        if layer.activations == "static":
            frozen[name] = float(layer.input_scale)
    attention = _attention_scales(state.quantized)
    for module_scales in attention.values():
        if module_scales.activations == "observing":
            module_scales.freeze()
    static_attention = sum(m.activations == "static" for m in attention.values())
    logger.info("omni_accel: FP8 activation scales frozen for %d layers and %d attention modules", len(frozen),
                static_attention)
    return frozen


def _state_of(pipe, what: str):
    state = vars(pipe).get("omni_accel")
    if state is None or not state.quantized:
        raise AccelError(f"{what} needs a pipeline accelerated with quant='fp8'.")
    return state


def freeze_activation_scales(pipe) -> dict[str, float]:
    """Freeze the static FP8 activation scales now (``quant_config={"activations": "static"}`` otherwise freezes
    them when the second pipeline call starts), FP8 attention's with them. Returns {layer name: scale} of the
    linears. For loops that call the transformer directly rather than through the pipeline."""
    return freeze_activation_scales_of(_state_of(pipe, "freeze_activation_scales()"))


def save_activation_scales(pipe, path: str) -> dict[str, float]:
    """Write the frozen static scales to ``path`` (JSON) for ``quant_config={"activations": "static",
    "scales": path}``; freezes them first if they are still being observed. The file holds the linears' scales
    under "scales" and, with FP8 attention, each attention module's q / k / v descales and K mean under
    "attention". Returns the linears' scales."""
    state = _state_of(pipe, "save_activation_scales()")
    scales = freeze_activation_scales_of(state)
    if not scales:
        raise AccelError("save_activation_scales(): no layer has a static scale yet; accelerate with "
                         "quant_config={'activations': 'static'} and run the pipeline once first.")
    payload = {"scales": scales,
               "margin": f"scale = {STATIC_MARGIN:g} x calibrated max |x| / {FP8_MAX:g} (e4m3)"}
    attention = {name: m.state() for name, m in _attention_scales(state.quantized).items()
                 if m.activations == "static"}
    if attention:
        payload["attention"] = attention
    with open(path, "w") as f:
        f.write(_one_line_per_entry(payload))
    return scales


def _one_line_per_entry(payload: dict) -> str:
    """JSON with one line per layer and per attention module: readable, and an attention module's K mean (heads x
    head dim numbers) stays on its line instead of one line per number."""
    lines = []
    for key, value in payload.items():
        if isinstance(value, dict):
            entries = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in value.items())
            lines.append(f" {json.dumps(key)}: {{\n{entries}\n }}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


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
    """Per-layer errors of the quantized linears of an accelerated pipeline: the weight quantization error always,
    the output error on the first call's inputs when ``quant_config={"measure_error": True}`` was given."""
    state = vars(pipe).get("omni_accel")
    if state is None or not state.quantized:
        raise AccelError("quant_error_report() needs a pipeline accelerated with quant='fp8', 'fp8_weight_only' "
                         "or 'int8'.")
    out = {}
    for tname, transformer in state.quantized.items():
        for name, module in transformer.named_modules():
            if isinstance(module, QuantizedLinear):
                out[f"{tname}.{name}"] = {"weight_rel_err": module.weight_rel_err,
                                          "output_rel_err": module.output_rel_err}
    return out
