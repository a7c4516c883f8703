"""omni_accel against what users already have, one process, one GPU: diffusers eager, diffusers' best lossless recipe,
whole-model torch.compile, the torchao FP8 per-row path, and omni_accel's bf16 and FP8 stacks.

    # one H200: FLUX.1-dev-shaped 1024², then Wan-2.1-14B-shaped 480x832x81 frames, then Qwen-Image 1024²
    python benchmarks/bench_peers.py --models flux --out benchmarks/results/bench_peers_h200_flux.json --profile \
        --log-clocks
    python benchmarks/bench_peers.py --models wan81,qwen_image --out benchmarks/results/bench_peers_h200_wan.json
    # static q / k / v scales in the FP8 attention against the same stack with per-call ones (~4 min)
    python benchmarks/bench_peers.py --models flux --profile --log-clocks \
        --configs diffusers_best,ours_fp8_fp8attn_mk,ours_fp8_fp8attn_static \
        --out benchmarks/results/bench_peers_h200_flux_fp8attn_static.json
    # int8 W8A8 linears against FP8 ones (same per-token scales, bf16 attention), and torchao's int8 path
    python benchmarks/bench_peers.py --models flux,wan81 --profile --log-clocks \
        --configs diffusers_best,ours_fp8_dynamic_fa_pdl,ours_int8_pdl,ours_int8_pdl_graphs,torchao_int8 \
        --out benchmarks/results/bench_peers_h200_int8.json
    # the same code on tiny random models on the CPU (seconds; what tests/test_bench_smoke.py runs)
    python benchmarks/bench_peers.py --device cpu --tiny --configs diffusers_eager,ours_bf16 --out /tmp/peers.json
    # the README table from a result file
    python benchmarks/bench_peers.py --table-from benchmarks/results/bench_peers_h200_flux.json
    # rewrite README.md's <!-- peers-table: FILES --> blocks from their files (--check: only say if one is stale)
    python benchmarks/bench_peers.py --readme README.md

Every model is a full-size random-weight bf16 transformer built from its config on the GPU (speed does not depend on
the weights' values) inside a real diffusers pipeline object, so ``omni_accel.accelerate`` / ``restore`` run
unchanged; forwards are timed on ``pipe.transformer`` with the same inputs for every config. Configs:

- ``diffusers_eager``: the plain transformer (PyTorch's own SDPA choice);
- ``diffusers_best``: diffusers' documented fastest lossless recipe, ``set_attention_backend("_native_cudnn")`` +
  ``compile_repeated_blocks(fullgraph=True)``;
- ``torch_compile``: ``torch.compile`` of the whole transformer (default mode);
- ``torchao_fp8_rowwise``: torchao ``quantize_(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))``
  + the cuDNN backend + ``compile_repeated_blocks(fullgraph=True)`` (what diffusers' TorchAoConfig and cache-dit's
  float8_per_row quantization do). It changes the weights in place, so it runs last for its model;
- ``torchao_int8``: torchao ``quantize_(Int8DynamicActivationInt8WeightConfig())`` + cuDNN + regional compile, the
  int8 W8A8 peer (in place as well: run it in another invocation than ``torchao_fp8_rowwise``);
- ``ours_*``: ``omni_accel.accelerate`` configs (``OURS`` below), restored between rows.

Per row: median / min ms per forward over ``--iters`` forwards (CUDA events) after warm-up, ms per denoising step,
TFLOP/s from analytic FLOPs, first-call seconds (compile, autotune, graph capture, calibration), peak GPU memory
over the timed forwards, relative L2 error of the output against diffusers eager (bf16), mean SM clock and board
power over the timed forwards (``--log-clocks``), and with ``--profile`` the GPU kernel time of one forward by kind
(GEMM / attention / quantization / other fused / elementwise) plus the idle time (event time minus kernel time).
The JSON is rewritten after every row; rows that would start after ``--time-budget`` seconds are listed as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_transformer import (  # noqa: E402
    ClockLog,
    analytic_flops,
    build_pipeline,
    build_transformer,
    ensure_adapters,
    first_tensor,
    flux_spec,
    forward_with_hooks,
    log,
    make_inputs,
    measure_gemm_tflops,
    qwen_spec,
    sync,
    time_forwards,
    wan_spec,
)
from benchmarks import step_floor  # noqa: E402
from benchmarks.timing import back_to_back_ms, write_result  # noqa: E402
from benchmarks.timing import package_version as _version  # noqa: E402
from omni_accel.deps import installed  # noqa: E402
from omni_accel.errors import AccelError  # noqa: E402
from omni_accel.kernels import fa4_attention, quack_gemm  # noqa: E402 -- the FlashAttention-4 tile rows, quack tiles
from omni_accel.kernels.timing import calls_ms  # noqa: E402


def wan81_spec(tiny: bool) -> dict:
    """Wan-2.1-14B-shaped at 480x832 with 81 frames -> 21 latent frames, 32,760 video tokens: the shape Wan users
    run (the 21-frame spec of bench_transformer.py is a quarter of the tokens and a sixteenth of the attention)."""
    spec = wan_spec(tiny)
    if tiny:
        return {**spec, "model": "wan81"}
    lat_f, lat_h, lat_w = 21, 60, 104
    n_img = lat_f * (lat_h // 2) * (lat_w // 2)
    return {**spec, "model": "wan81", "lat": (lat_f, lat_h, lat_w), "n_img": n_img,
            "shape": f"480x832x81f: 81 frames -> 21 latent frames, {n_img} video + {spec['n_txt']} txt tokens, "
                     "batch 1, CFG (2 forwards/step)"}


def with_blocks(spec: dict, blocks: int) -> dict:
    """The spec with ``blocks`` blocks per stack (FLUX keeps its 1:2 dual : single ratio); 0 = unchanged."""
    if not blocks:
        return spec
    cfg = {**spec["cfg"], "num_layers": blocks}
    if "num_single_layers" in cfg:
        cfg["num_single_layers"] = 2 * blocks
    return {**spec, "cfg": cfg, "shape": f"{spec['shape']}; {blocks} block(s) per stack only"}


SPECS = {"flux": flux_spec, "wan81": wan81_spec, "qwen_image": qwen_spec}
FUSE_QKV_FAMILIES = ("flux", "wan81")  # diffusers' fuse_projections() exists for these processors


# ------------------------------------------------------------------------------------------------ configs
@dataclass
class Row:
    """How to set a config up on (pipe, transformer); ``setup`` returns (forward fn, undo)."""

    name: str
    setup: Callable
    lossless: bool
    destructive: bool = False  # changes the weights in place: runs last for its model
    needs: tuple[str, ...] = ()  # importable packages
    cuda_only: bool = False
    note: str = ""
    calibrates: bool = False  # one observing forward before timing (static FP8 scales)
    probe: bool = False  # an upper-bound instrument, not a stack a user can run: never one of the summary's ratios
    model_output: bool = True  # False: the forward returns no model output (the floor rows): no error is measured
    # compiler.INDUCTOR_OPTIONS for this row: {} = none (the rows measured so far), _MK = multi-kernel (the library's
    # GPU default since those measurements), None = whatever the library's default is
    inductor: dict | None = field(default_factory=dict)
    cuda_graphs: bool = True  # False: OMNI_ACCEL_CUDA_GRAPHS=0 for the row (compile=True with FP8 graphs by default)
    sigmoid_gelu: bool = True  # compiler.SIGMOID_GELU for this row (False: inductor's libdevice tanh, the A side)
    rotary_pair_swap: bool = True  # compiler.ROTARY_PAIR_SWAP (False: diffusers' unbind + stack rotary, the A side)
    joint_streams: bool = True  # compiler.JOINT_STREAMS (False: FLUX's first single block compiles its own graph)
    cached_module_walk: bool = True  # cuda_graphs.CACHED_MODULE_WALK (False: parameters() + buffers() per replay)
    epilogue_fusion: bool = True  # compiler.EPILOGUE_FUSION (False: inductor's own concat + GELU + cast kernel)
    qk_norm_rope: bool = True  # kernels.epilogue_fusion.QK_NORM_ROPE (False: inductor's q / k norm + rotary + cast)
    qk_norm_rope_16: bool = False  # kernels.epilogue_fusion.QK_NORM_ROPE_16 (True: the 16-bit q / k kernel)
    qk_norm_rope_joint: bool = False  # kernels.epilogue_fusion.QK_NORM_ROPE_JOINT (True: dual blocks' q / k too)
    layernorm: bool = True  # kernels.epilogue_fusion.LAYERNORM (False: inductor's AdaLN norm + modulate + cast)
    epilogue_pdl: bool = True  # kernels.epilogue_fusion.PDL (False: the pass's kernels launched without PDL)
    int8_tma: bool = True  # kernels.int8_gemm_triton.PERSISTENT_TMA (False: the pointer int8 GEMM at every size)
    int8_ws: bool = True  # kernels.int8_gemm_triton.WARP_SPECIALIZE (False: the TMA int8 GEMM, not warp specialized)
    int8_epilogue: bool = True  # kernels.epilogue_fusion.INT8 (False: bf16 concat + GELU, then inductor's quantization)
    gelu_int8: bool = True  # kernels.epilogue_fusion.GELU_INT8 (False: inductor's GELU + int8 quantization kernel)
    int8_one_pass: bool = False  # kernels.epilogue_fusion.INT8_ONE_PASS (True: the one-pass concat + GELU + int8)
    layernorm_int8: bool = False  # kernels.epilogue_fusion.LAYERNORM_INT8 (True: the AdaLN norm + int8 kernel)
    sage_keys_in_graph: bool = False  # kernels.sage_attention.SMOOTH_KEYS_IN_GRAPH (True: K's mean in the graph)
    sage_prep_in_graph: bool = False  # kernels.sage_attention.PREP_IN_GRAPH (True: Q / K / V quantized in the graph)
    triton_gemv: bool = False  # kernels.int8.TRITON_GEMV (True: the int8 weight-only layers' GEMV in Triton)
    int8_few_rows_tile: str = "128x128x128"  # kernels.int8_gemm_triton.FEW_ROWS_TILE (int8 GEMM tile, <= 1,024 rows)
    gemv_kernel: str = "reduce"  # kernels.int8_gemm_triton.GEMV_KERNEL (with triton_gemv: the first GEMV kernel)
    sage_prep_kernels: bool = False  # kernels.sage_attention.PREP_KERNELS (True: Q / K / V quantized by Triton kernels)
    int8_gelu_tanh: bool = False  # kernels.epilogue_fusion.INT8_GELU_TANH (True: the int8 epilogues' GELU by tanh)
    int8_reciprocal: bool = False  # kernels.epilogue_fusion.INT8_RECIPROCAL (True: values times the reciprocal scale)
    qk_shared_rotary: bool = False  # kernels.epilogue_triton.QK_SHARED_ROTARY (True: a token's cos / sin loaded once)
    sage_kv_subtile: int = 128  # kernels.sage_prep_triton.KV_SUBTILE (tokens per loop step of the partial reductions)
    sage_kv_stages: int = 1  # kernels.sage_prep_triton.KV_STAGES (that loop's pipeline stages)
    int8_split_tail: bool = False  # kernels.int8_gemm_triton.SPLIT_TAIL (True: a short last wave split along K)
    int8_bias_in_gemm: bool = False  # kernels.int8.BIAS_IN_GEMM (True: the Triton int8 GEMM adds the bias)
    sage_from_norms: bool = False  # kernels.epilogue_fusion.SAGE_FROM_NORMS (True: Q / K quantized from the q / k
    # kernels' inputs)
    sage_normed_heads: int = 1  # kernels.sage_prep_triton.NORMED_HEADS_PER_PROGRAM (with sage_from_norms)
    gelu_gemm: bool = False  # kernels.epilogue_fusion.GELU_GEMM (True: a 16-bit MLP's GELU in cuBLASLt's epilogue)
    # compiler.COMPLEX_ROTARY_PAIR_SWAP (True: Qwen-Image's complex-table rotary in real arithmetic)
    complex_rotary_pair_swap: bool = False
    # kernels.gemm_tuning.TUNED_GEMMS (True: 16-bit linears on the cuBLASLt algorithm timed fastest for the shape)
    tuned_gemm: bool = False
    # modulation_prefetch.MODULATION_PREFETCH: where the AdaLN modulation linears are computed ahead on a second
    # stream ("graphs": inside the whole-forward CUDA graph, "always": any GPU forward, "off")
    modulation_prefetch: str = "off"
    # kernels.epilogue_fusion.GATED_RESIDUAL_INT8 (True: a block's gated residual in the int8 GEMM's epilogue)
    int8_gated_residual: bool = False
    # kernels.int8_gemm_triton.RESIDUAL_WARP_SPECIALIZED / RESIDUAL_WS_IO (the gated residual in the warp-specialized
    # kernel's twin, with its residual / output through TMA or pointers)
    int8_residual_ws: bool = False
    int8_residual_ws_io: int = 0
    # kernels.epilogue_fusion.QK_NORM_ROPE_DIFFUSERS_RMS (True, the default: the q / k kernel also takes diffusers'
    # RMSNorm and tables the graph builds: Qwen-Image's q / k)
    qk_diffusers_rms: bool = True
    # modulation_table.MODULATION_TABLE (True, the library's default since 2026-12-07: the modulation linears computed
    # once per pipeline call; only --schedule-steps runs forwards inside a call, the per-forward timing does not)
    modulation_table: bool = True
    # kernels.epilogue_triton.LAYERNORM_PARTS (True, the default since 2026-12-07: the AdaLN norm + int8 kernel over
    # unpadded parts of the row)
    layernorm_parts: bool = True
    # kernels.fa4_attention.IN_GRAPH (True: FlashAttention-4's kernel captured inside the whole-forward CUDA graph;
    # False, the default: it runs between the graph's segments)
    fa4_in_graph: bool = False
    # kernels.fa4_attention.TILE (FlashAttention-4's Hopper tile, fa4_attention.TILE_CANDIDATES; None: FA4's choice)
    fa4_tile: tuple | None = None
    # kernels.fa4_attention.TIMED_MIN_TOKENS (None, the default: auto's FA4 route from 8,192 keys; a key count: the
    # route from there, timing FA4 against cuDNN per shape below 8,192 keys)
    fa4_timed_min_tokens: int | None = None
    # kernels.gemm_tuning.QUACK_CONFIGS (with tuned_gemm: quack-kernels' GEMMs on these tiles among the candidates)
    quack_configs: tuple = ()


# the library's module switches that rows flip for A/B runs: (module, attribute, Row field)
SWITCHES = (("compiler", "SIGMOID_GELU", "sigmoid_gelu"), ("compiler", "ROTARY_PAIR_SWAP", "rotary_pair_swap"),
            ("compiler", "JOINT_STREAMS", "joint_streams"),
            ("cuda_graphs", "CACHED_MODULE_WALK", "cached_module_walk"),
            ("compiler", "EPILOGUE_FUSION", "epilogue_fusion"),
            ("kernels.epilogue_fusion", "QK_NORM_ROPE", "qk_norm_rope"),
            ("kernels.epilogue_fusion", "QK_NORM_ROPE_16", "qk_norm_rope_16"),
            ("kernels.epilogue_fusion", "QK_NORM_ROPE_JOINT", "qk_norm_rope_joint"),
            ("kernels.epilogue_fusion", "LAYERNORM", "layernorm"),
            ("kernels.epilogue_fusion", "PDL", "epilogue_pdl"),
            ("kernels.int8_gemm_triton", "PERSISTENT_TMA", "int8_tma"),
            ("kernels.int8_gemm_triton", "WARP_SPECIALIZE", "int8_ws"),
            ("kernels.epilogue_fusion", "INT8", "int8_epilogue"),
            ("kernels.epilogue_fusion", "GELU_INT8", "gelu_int8"),
            ("kernels.epilogue_fusion", "INT8_ONE_PASS", "int8_one_pass"),
            ("kernels.epilogue_fusion", "LAYERNORM_INT8", "layernorm_int8"),
            ("kernels.sage_attention", "SMOOTH_KEYS_IN_GRAPH", "sage_keys_in_graph"),
            ("kernels.sage_attention", "PREP_IN_GRAPH", "sage_prep_in_graph"),
            ("kernels.int8", "TRITON_GEMV", "triton_gemv"),
            ("kernels.int8_gemm_triton", "FEW_ROWS_TILE", "int8_few_rows_tile"),
            ("kernels.int8_gemm_triton", "GEMV_KERNEL", "gemv_kernel"),
            ("kernels.sage_attention", "PREP_KERNELS", "sage_prep_kernels"),
            ("kernels.epilogue_fusion", "INT8_GELU_TANH", "int8_gelu_tanh"),
            ("kernels.epilogue_fusion", "INT8_RECIPROCAL", "int8_reciprocal"),
            ("kernels.epilogue_triton", "QK_SHARED_ROTARY", "qk_shared_rotary"),
            ("kernels.sage_prep_triton", "KV_SUBTILE", "sage_kv_subtile"),
            ("kernels.sage_prep_triton", "KV_STAGES", "sage_kv_stages"),
            ("kernels.int8_gemm_triton", "SPLIT_TAIL", "int8_split_tail"),
            ("kernels.int8", "BIAS_IN_GEMM", "int8_bias_in_gemm"),
            ("kernels.epilogue_fusion", "SAGE_FROM_NORMS", "sage_from_norms"),
            ("kernels.sage_prep_triton", "NORMED_HEADS_PER_PROGRAM", "sage_normed_heads"),
            ("kernels.epilogue_fusion", "GELU_GEMM", "gelu_gemm"),
            ("compiler", "COMPLEX_ROTARY_PAIR_SWAP", "complex_rotary_pair_swap"),
            ("kernels.gemm_tuning", "TUNED_GEMMS", "tuned_gemm"),
            ("modulation_prefetch", "MODULATION_PREFETCH", "modulation_prefetch"),
            ("kernels.epilogue_fusion", "GATED_RESIDUAL_INT8", "int8_gated_residual"),
            ("kernels.int8_gemm_triton", "RESIDUAL_WARP_SPECIALIZED", "int8_residual_ws"),
            ("kernels.int8_gemm_triton", "RESIDUAL_WS_IO", "int8_residual_ws_io"),
            ("kernels.epilogue_fusion", "QK_NORM_ROPE_DIFFUSERS_RMS", "qk_diffusers_rms"),
            ("modulation_table", "MODULATION_TABLE", "modulation_table"),
            ("kernels.epilogue_triton", "LAYERNORM_PARTS", "layernorm_parts"),
            ("kernels.fa4_attention", "IN_GRAPH", "fa4_in_graph"),
            ("kernels.fa4_attention", "TILE", "fa4_tile"),
            ("kernels.fa4_attention", "TIMED_MIN_TOKENS", "fa4_timed_min_tokens"),
            ("kernels.gemm_tuning", "QUACK_CONFIGS", "quack_configs"))


@contextlib.contextmanager
def library_switches(row: Row):
    """The library's A/B switches (module flags, and the CUDA-graph variable) as ``row`` asks; put back after.
    Yields {Row field: value} for the result file."""
    from omni_accel import compiler

    modules = {name: importlib.import_module(f"omni_accel.{name}") for name, _, _ in SWITCHES}
    saved = [getattr(modules[name], attribute) for name, attribute, _ in SWITCHES]
    saved_graphs_env = os.environ.get(compiler.CUDA_GRAPHS_ENV)
    for name, attribute, field_name in SWITCHES:
        setattr(modules[name], attribute, getattr(row, field_name))
    if not row.cuda_graphs:
        os.environ[compiler.CUDA_GRAPHS_ENV] = "0"
    try:
        yield {field_name: getattr(row, field_name) for _, _, field_name in SWITCHES}
    finally:
        for (name, attribute, _), value in zip(SWITCHES, saved):
            setattr(modules[name], attribute, value)
        if saved_graphs_env is None:
            os.environ.pop(compiler.CUDA_GRAPHS_ENV, None)
        else:
            os.environ[compiler.CUDA_GRAPHS_ENV] = saved_graphs_env


def _plain(pipe, transformer, inputs, model):
    return (lambda: transformer(**inputs)), (lambda: None)


def _reset_compiled(module: torch.nn.Module) -> None:
    for m in module.modules():
        m._compiled_call_impl = None  # what nn.Module.compile() set


def _cudnn_backend(transformer) -> Callable[[], None]:
    """diffusers' set_attention_backend("_native_cudnn") ("native" on the CPU smoke test: cuDNN is CUDA-only); the
    undo also puts the registry's global active backend back (reset_attention_backend leaves it changed, which
    would leak into the next rows)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    previous = _AttentionBackendRegistry._active_backend
    transformer.set_attention_backend("_native_cudnn" if transformer.device.type == "cuda" else "native")

    def undo() -> None:
        transformer.reset_attention_backend()
        _AttentionBackendRegistry._active_backend = previous

    return undo


def _cudnn_regional_compile(transformer, inputs):
    """diffusers' recipe: the cuDNN attention backend + compile_repeated_blocks(fullgraph=True)."""
    undo_backend = _cudnn_backend(transformer)
    transformer.compile_repeated_blocks(fullgraph=True)

    def undo():
        _reset_compiled(transformer)
        undo_backend()

    return (lambda: transformer(**inputs)), undo


def _diffusers_best(pipe, transformer, inputs, model):
    return _cudnn_regional_compile(transformer, inputs)


def _torch_compile(pipe, transformer, inputs, model):
    compiled = torch.compile(transformer)
    return (lambda: compiled(**inputs)), (lambda: None)


def _torchao_fp8(pipe, transformer, inputs, model):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=bf16_linear)
    return _cudnn_regional_compile(transformer, inputs)


def bf16_linear(module: torch.nn.Module, name: str) -> bool:
    """torchao's filter for the FP8 per-row row: only the bf16 linears. Per-row FP8 refuses other weight dtypes
    (Wan failed with "PerRow quantization only works for bfloat16 precision input weight"), and models keep some
    modules in float32 (Wan's time embedder: the class's _keep_in_fp32_modules, which diffusers' TorchAoConfig leaves
    unquantized as well)."""
    return isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16


def _torchao_int8(pipe, transformer, inputs, model):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    # torchao's int8 path multiplies with torch._int_mm, which refuses 16 rows or fewer: the one-token AdaLN and
    # time / guidance embedding linears stay bf16, as a torchao user must keep them (the whole model failed with
    # "self.size(0) needs to be greater than 16" in bench_peers_h200_flux_int8_20261205.json)
    def many_rows(module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and not any(part in name for part in ("norm", "time", "embedder"))

    quantize_(transformer, Int8DynamicActivationInt8WeightConfig(), filter_fn=many_rows)
    return _cudnn_regional_compile(transformer, inputs)


def _ours(**knobs):
    def setup(pipe, transformer, inputs, model):
        import omni_accel

        kwargs = dict(knobs)
        if kwargs.pop("fuse_if_supported", False) and model in FUSE_QKV_FAMILIES:
            kwargs["fuse_qkv"] = True
        if kwargs.get("attention") == "cudnn" and transformer.device.type != "cuda":
            kwargs["attention"] = "sdpa"  # the CPU smoke test: cuDNN is CUDA-only
        omni_accel.accelerate(pipe, **kwargs)
        return (lambda: pipe.transformer(**inputs)), (lambda: omni_accel.restore(pipe))

    setup.knobs = knobs  # what the row asks accelerate() for (the A/B rows' test reads it)
    return setup


class _RecordedOutputLinear(torch.nn.Linear):
    """The probe rows' modulation linear: returns the output recorded for the benchmark's inputs (``recorded``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recorded


def _frozen_modulation(setup):
    """``setup`` with the family's modulation linears answering from one plain forward's recorded outputs."""
    def frozen(pipe, transformer, inputs, model):
        from omni_accel.modulation_prefetch import modulation_linears
        from omni_accel.pipelines import adapter_for

        spec = adapter_for(pipe).modulation_prefetch
        if spec is None:
            raise RuntimeError(f"{model}: the family names no modulation linears (its adapter's modulation_prefetch); "
                               "the frozen-modulation probe has nothing to measure there")
        outputs = {}
        hooks = [linear.register_forward_hook(lambda m, args, out: outputs.__setitem__(m, out.detach().clone()))
                 for _, linear in modulation_linears(transformer, spec.linears)]
        forward_with_hooks(transformer, inputs, hooks)
        fn, undo = setup(pipe, transformer, inputs, model)
        # looked up again after the setup: the linears it left plain, in the model now (not replaced or wrapped)
        recorded = [linear for _, linear in modulation_linears(transformer, spec.linears) if linear in outputs]
        if not recorded:
            undo()
            raise RuntimeError(f"{model}: the setup left no modulation linear plain (quantized or wrapped): the "
                               "frozen-modulation probe would measure nothing")
        log(f"{model}: {len(recorded)} modulation linears answer from recorded outputs (probe)")
        for linear in recorded:
            linear.register_buffer("recorded", outputs[linear], persistent=False)
            linear.__class__ = _RecordedOutputLinear

        def undo_all() -> None:
            for linear in recorded:
                linear.__class__ = torch.nn.Linear
                del linear._buffers["recorded"]
            undo()

        return fn, undo_all

    return frozen


def _fp8attn(quant_config: dict, compile: bool | str = True):
    """Ours with FP8 linears, FP8 attention and fused q/k/v where the family has it: the FP8 rows' common knobs."""
    return _ours(attention="fp8", quant="fp8", quant_config=quant_config, fuse_if_supported=True, compile=compile)


# Rows named without "_fa" keep the fp32 promotion of FP8 GEMM partial sums (what they measured before fast
# accumulation became the default); "_fa" rows use the default fast accumulation.
_PROMOTED = {"fast_accum": False}
_STATIC = {"activations": "static", **_PROMOTED}
_STATIC_ATTENTION = {"activations": "static", "attention_scales": "static", **_PROMOTED}
# static linears beside FP8 attention with per-call q / k / v scales: what the fp8attn rows measured before static
# attention scales existed (and the A side of ours_fp8_fp8attn_static)
_STATIC_LINEARS = {"activations": "static", "attention_scales": "dynamic", **_PROMOTED}
_MK = {"triton.multi_kernel": 1}
_MK_CD = {"triton.multi_kernel": 1, "coordinate_descent_tuning": True}
# inductor's knobs for the pointwise / reduction kernels that carry the FP8 quantization epilogues (the GEMMs are
# cuBLAS either way): 2-D tiles (the single blocks' concat + quantize reads two sources), and a benchmarked choice
# of block size and warps per pointwise kernel instead of the heuristic one
_MK_ND = {"triton.multi_kernel": 1, "triton.prefer_nd_tiling": True}
_MK_PW = {"triton.multi_kernel": 1, "max_autotune_pointwise": True}
# programmatic dependent launch: each Triton kernel may start while the one before it drains (Hopper+); aimed at the
# 5-9 ms per FLUX forward between ~900 kernels that the CUDA graph did not remove
_MK_PDL = {"triton.multi_kernel": 1, "triton.enable_pdl": True}
# fewer kernels per forward on top of that: independent kernels launched as one (combo kernels: e.g. the dual
# blocks' image- and text-stream epilogues), and inductor's aggressive fusion of nodes that share no loop order
_MK_PDL_COMBO = {**_MK_PDL, "combo_kernels": True}
# bf16 / fp16 arithmetic kept in its own dtype inside Triton kernels instead of upcast to fp32 (fewer conversions in
# the instruction-bound epilogues; the rounding changes)
_MK_PDL_NOUPCAST = {**_MK_PDL, "triton.codegen_upcast_to_fp32": False}
_MK_PDL_AGGRESSIVE = {**_MK_PDL, "aggressive_fusion": True}
_FAST_STATIC = {**_STATIC_ATTENTION, "fast_accum": True}
_FAST_LINEARS = {**_STATIC_LINEARS, "fast_accum": True}


def _int8_sage(name: str, note: str, **switches) -> Row:
    """The int8 + SageAttention stack with the library's defaults (quant='int8', attention='sage', fuse_qkv,
    compile=True), and its A/B rows: ``switches`` are the Row fields that take one default back."""
    return Row(name, _ours(attention="sage", quant="int8", fuse_if_supported=True, compile=True), False,
               inductor=_MK_PDL, needs=("sageattention",), cuda_only=True, note=note, **switches)


def _with_fp8_implementation(implementation: str, setup):
    """``setup`` with attention="fp8" served by ``implementation`` whatever packages are installed (an A/B of the
    FP8 attention kernels inside the model)."""
    def forced(pipe, transformer, inputs, model):
        from omni_accel.kernels import fp8_attention

        with mock.patch.object(fp8_attention, "implementation_for", lambda device: implementation):
            return setup(pipe, transformer, inputs, model)

    return forced


ROWS: dict[str, Row] = {r.name: r for r in (
    Row("diffusers_eager", _plain, True, note="plain diffusers, PyTorch's own SDPA choice"),
    Row("diffusers_best", _diffusers_best, True, note="set_attention_backend('_native_cudnn') + "
        "compile_repeated_blocks(fullgraph=True)"),
    Row("ours_bf16", _ours(attention="auto", compile=True), True, note="accelerate(compile=True)"),
    Row("ours_bf16_mk", _ours(attention="auto", compile=True), True, inductor=_MK,
        note="accelerate(compile=True), inductor multi-kernel (persistent row reductions up to 16k)"),
    Row("ours_bf16_graphs", _ours(attention="auto", compile="max"), True,
        note="accelerate(compile='max'): regional compile + CUDA graph of the whole forward"),
    Row("ours_fp8_dynamic", _ours(attention="cudnn", quant="fp8", quant_config=_PROMOTED, fuse_if_supported=True,
                                  compile=True), False,
        note="quant='fp8' (per-token activation scales), fuse_qkv, bf16 cuDNN attention, compile"),
    Row("ours_fp8_static", _ours(attention="cudnn", quant="fp8", quant_config=_STATIC, fuse_if_supported=True,
                                 compile=True), False, calibrates=True,
        note="quant='fp8' with static (calibrated) activation scales, fuse_qkv, bf16 cuDNN attention, compile"),
    Row("ours_fp8_static_mk", _ours(attention="cudnn", quant="fp8", quant_config=_STATIC, fuse_if_supported=True,
                                    compile=True), False, calibrates=True, inductor=_MK,
        note="ours_fp8_static with inductor multi-kernel"),
    Row("ours_fp8_fp8attn", _fp8attn(_STATIC_LINEARS), False, calibrates=True, cuda_only=True,
        note="static FP8 linears + FP8 attention (cuDNN FP8 SDPA on Hopper), compile"),
    Row("ours_fp8_full", _fp8attn(_STATIC_LINEARS, compile="max"), False, calibrates=True, cuda_only=True,
        note="ours_fp8_fp8attn + CUDA graph of the whole forward (compile='max')"),
    Row("ours_fp8_fp8attn_mk", _fp8attn(_STATIC_LINEARS), False, calibrates=True, inductor=_MK,
        cuda_only=True, note="ours_fp8_fp8attn with inductor multi-kernel"),
    Row("ours_fp8_fp8attn_static", _fp8attn(_STATIC_ATTENTION), False, calibrates=True, inductor=_MK, cuda_only=True,
        note="ours_fp8_fp8attn_mk with static (calibrated) q / k / v scales and K mean in the FP8 attention"),
    Row("ours_fp8_fp8attn_fa", _fp8attn(_FAST_LINEARS), False, calibrates=True, inductor=_MK,
        cuda_only=True, note="ours_fp8_fp8attn_mk with fast FP8 accumulation (the default)"),
    Row("ours_fp8_fp8attn_static_fa", _fp8attn(_FAST_STATIC), False, calibrates=True,
        inductor=_MK, cuda_only=True, note="ours_fp8_fp8attn_static with fast FP8 accumulation"),
    *(Row(f"ours_fp8_fp8attn_static_fa_{tag}", _fp8attn(_FAST_STATIC), False, calibrates=True,
          inductor=options, cuda_only=True, note=f"ours_fp8_fp8attn_static_fa with inductor {options}")
      for tag, options in (("nd", _MK_ND), ("pw", _MK_PW), ("cd", _MK_CD), ("pdl", _MK_PDL),
                             ("combo", _MK_PDL_COMBO), ("aggressive", _MK_PDL_AGGRESSIVE),
                             ("pdl_noupcast", _MK_PDL_NOUPCAST))),
    Row("ours_fp8_fp8attn_static_fa_tanh", _fp8attn(_FAST_STATIC), False, calibrates=True,
        inductor=_MK, cuda_only=True, sigmoid_gelu=False,
        note="ours_fp8_fp8attn_static_fa with the MLP GELU as libdevice tanh (before the sigmoid form)"),
    Row("ours_fp8_fp8attn_fa_tanh", _fp8attn(_FAST_LINEARS), False, calibrates=True, inductor=_MK,
        cuda_only=True, sigmoid_gelu=False,
        note="ours_fp8_fp8attn_fa with the MLP GELU as libdevice tanh (before the sigmoid form)"),
    Row("ours_fp8_fp8attn_fa_pdl", _fp8attn(_FAST_LINEARS), False, calibrates=True, inductor=_MK_PDL,
        cuda_only=True, note="ours_fp8_fp8attn_fa with programmatic dependent launch: the default FP8 stack as "
                             "compile=True runs it on a GPU"),
    Row("ours_fp8_fp8attn_static_fa_pdl_fullwalk", _fp8attn(_FAST_STATIC), False, calibrates=True,
        inductor=_MK_PDL, cuda_only=True, cached_module_walk=False,
        note="ours_fp8_fp8attn_static_fa_pdl with the graph's weight check walking parameters() + buffers() per call"),
    Row("ours_fp8_fp8attn_fa_splitstreams", _fp8attn(_FAST_LINEARS), False, calibrates=True, inductor=_MK,
        cuda_only=True, joint_streams=False,
        note="ours_fp8_fp8attn_fa with FLUX's first single-stream block compiled apart (before the joint views)"),
    Row("ours_fp8_fp8attn_static_fa_splitstreams", _fp8attn(_FAST_STATIC), False, calibrates=True, inductor=_MK,
        cuda_only=True, joint_streams=False,
        note="ours_fp8_fp8attn_static_fa with FLUX's first single-stream block compiled apart"),
    Row("ours_bf16_mk_pdl", _ours(attention="auto", compile=True), True, inductor=_MK_PDL,
        note="ours_bf16_mk with programmatic dependent launch of its Triton kernels"),
    Row("ours_bf16_mk_pdl_graphs", _ours(attention="auto", compile="max"), True, inductor=_MK_PDL,
        note="ours_bf16_mk_pdl + CUDA graph of the whole forward (compile='max'): whether the epilogue kernels' "
             "host-side dispatch is what keeps bf16 from its kernel time"),
    Row("ours_fp8_fp8attn_static_fa_pdl_stackrope", _fp8attn(_FAST_STATIC), False, calibrates=True,
        inductor=_MK_PDL, cuda_only=True, rotary_pair_swap=False,
        note="ours_fp8_fp8attn_static_fa_pdl with diffusers' unbind + stack rotary (before the pair swap)"),
    Row("ours_bf16_mk_pdl_stackrope", _ours(attention="auto", compile=True), True, inductor=_MK_PDL,
        rotary_pair_swap=False, note="ours_bf16_mk_pdl with diffusers' unbind + stack rotary (before the pair swap)"),
    Row("ours_bf16_mk_pdl_combo", _ours(attention="auto", compile=True), True, inductor=_MK_PDL_COMBO,
        note="ours_bf16_mk_pdl with combo kernels"),
    Row("ours_bf16_mk_tanh", _ours(attention="auto", compile=True), True, inductor=_MK, sigmoid_gelu=False,
        note="ours_bf16_mk with the MLP GELU as libdevice tanh (before the sigmoid form)"),
    Row("ours_fp8_fp8attn_fa_graphs", _fp8attn(_FAST_LINEARS, compile="max"), False, calibrates=True,
        inductor=_MK, cuda_only=True, note="ours_fp8_fp8attn_fa + CUDA graph of the whole forward (compile='max')"),
    Row("ours_fp8_fp8attn_static_fa_nographs", _fp8attn(_FAST_STATIC), False, calibrates=True,
        inductor=_MK, cuda_only=True, cuda_graphs=False,
        note="ours_fp8_fp8attn_static_fa without the CUDA graph that compile=True adds to the FP8 stack"),
    Row("ours_fp8_fp8attn_fa_nographs", _fp8attn(_FAST_LINEARS), False, calibrates=True,
        inductor=_MK, cuda_only=True, cuda_graphs=False,
        note="ours_fp8_fp8attn_fa without the CUDA graph that compile=True adds to the FP8 stack"),
    Row("ours_fp8_fa", _ours(attention="cudnn", quant="fp8", quant_config={"activations": "static", "fast_accum": True},
                             fuse_if_supported=True, compile=True), False, calibrates=True, inductor=_MK,
        cuda_only=True, note="static FP8 linears (fast accumulation) + bf16 cuDNN attention, multi-kernel"),
    Row("ours_fp8_fp8attn_mk_cd", _fp8attn(_STATIC_LINEARS), False, calibrates=True,
        inductor=_MK_CD, cuda_only=True,
        note="ours_fp8_fp8attn with inductor multi-kernel and coordinate-descent tuning of its kernels"),
    Row("ours_bf16_mk_cd", _ours(attention="auto", compile=True), True, inductor=_MK_CD,
        note="accelerate(compile=True), inductor multi-kernel and coordinate-descent tuning"),
    Row("ours_fp8_dynamic_fp8attn", _fp8attn(_PROMOTED), False,
        cuda_only=True, note="per-token FP8 linears + FP8 attention, compile"),
    Row("torch_compile", _torch_compile, True, note="torch.compile(transformer), whole model, default mode"),
    Row("torchao_fp8_rowwise", _torchao_fp8, False, destructive=True, needs=("torchao",), cuda_only=True,
        note="torchao Float8DynamicActivationFloat8WeightConfig(PerRow) + cuDNN + compile_repeated_blocks"),
    # int8 W8A8 linears (a scale per token and per output channel) against FP8 ones with the same scales, bf16
    # attention in both: the int8 format is the precise one on the built-in model (linear_formats_study.json)
    Row("ours_int8_pdl", _ours(attention="cudnn", quant="int8", fuse_if_supported=True, compile=True), False,
        inductor=_MK_PDL, int8_tma=False, int8_epilogue=False, cuda_graphs=False,
        note="quant='int8' (per-token activation scales; int8 GEMM 'auto': Triton on GPUs since "
                               "2026-12-05), fuse_qkv, cuDNN attention, compile"),
    Row("ours_int8_pdl_graphs", _ours(attention="cudnn", quant="int8", fuse_if_supported=True, compile="max"), False,
        inductor=_MK_PDL, int8_tma=False, int8_epilogue=False,
        note="ours_int8_pdl + CUDA graph of the whole forward (compile='max', as quant='fp8' gets "
                               "from compile=True)"),
    Row("ours_int8_pdl_triton", _ours(attention="cudnn", quant="int8", quant_config={"int8_gemm": "triton"},
                                      fuse_if_supported=True, compile=True), False, inductor=_MK_PDL, cuda_only=True,
        int8_tma=False, int8_epilogue=False, cuda_graphs=False,
        note="ours_int8_pdl with omni_accel's Triton int8 GEMM (rescale in the epilogue; the default on GPUs since "
             "2026-12-05, when ours_int8_pdl still meant cuBLAS)"),
    Row("ours_int8_pdl_cublas", _ours(attention="cudnn", quant="int8", quant_config={"int8_gemm": "cublas"},
                                      fuse_if_supported=True, compile=True), False, inductor=_MK_PDL,
        int8_tma=False, int8_epilogue=False, cuda_graphs=False,
        note="ours_int8_pdl with cuBLAS's _int_mm (int32 out, rescale in the next kernel)"),
    Row("ours_int8_pdl_tma", _ours(attention="cudnn", quant="int8", fuse_if_supported=True, compile=True), False,
        inductor=_MK_PDL, cuda_only=True, int8_tma=True, int8_ws=False,
        int8_epilogue=False, cuda_graphs=False,
        note="ours_int8_pdl with the persistent TMA kernel for the Triton int8 GEMM"),
    Row("ours_int8_pdl_graphs_tma", _ours(attention="cudnn", quant="int8", fuse_if_supported=True, compile="max"),
        False, inductor=_MK_PDL, cuda_only=True, int8_tma=True, int8_ws=False, int8_epilogue=False,
        note="ours_int8_pdl_graphs with the persistent TMA kernel"),
    Row("ours_int8_pdl_int8epi", _ours(attention="cudnn", quant="int8", fuse_if_supported=True, compile=True), False,
        inductor=_MK_PDL, cuda_only=True, int8_epilogue=True, gelu_int8=False,
        int8_tma=False, cuda_graphs=False,
        note="ours_int8_pdl with the single blocks' concat + GELU + int8 quantization in one kernel"),
    Row("ours_int8_pdl_tma_int8epi", _ours(attention="cudnn", quant="int8", fuse_if_supported=True, compile=True),
        False, inductor=_MK_PDL, cuda_only=True, int8_tma=True, int8_ws=False, int8_epilogue=True, gelu_int8=False,
        cuda_graphs=False,
        note="ours_int8_pdl with both the persistent TMA int8 GEMM and the one-kernel int8 epilogue"),
    Row("ours_int8_pdl_sage_tma_int8epi", _ours(attention="sage", quant="int8", fuse_if_supported=True,
                                                compile=True), False, inductor=_MK_PDL, needs=("sageattention",),
        cuda_only=True, int8_tma=True, int8_ws=False, int8_epilogue=True, gelu_int8=False,
        cuda_graphs=False, note="ours_int8_pdl_sage_tma with the one-kernel int8 epilogue"),
    # attention="cudnn", not auto: auto would give quant="fp8" cuDNN's FP8 attention, and this row is the bf16-attention
    # twin of the int8 rows
    Row("ours_fp8_dynamic_fa_pdl", _ours(attention="cudnn", quant="fp8", fuse_if_supported=True, compile=True),
        False, inductor=_MK_PDL, cuda_only=True,
        note="quant='fp8' with its default linears (per-token scales, fast accumulation, CUDA graph), fuse_qkv, bf16 "
             "cuDNN attention: the FP8 side of the int8 rows"),
    # SageAttention 2 (int8 Q K^T, FP8 P . V; its Hopper kernel is built from source, there is no wheel of it):
    # the 8-bit attention whose arithmetic the formats study puts beside int8 linears
    Row("ours_bf16_mk_pdl_sage", _ours(attention="sage", compile=True), False, inductor=_MK_PDL,
        needs=("sageattention",), cuda_only=True, note="ours_bf16_mk_pdl with attention='sage' (SageAttention)"),
    Row("ours_int8_pdl_sage", _ours(attention="sage", quant="int8", fuse_if_supported=True, compile=True), False,
        inductor=_MK_PDL, needs=("sageattention",), cuda_only=True,
        int8_tma=False, int8_epilogue=False, cuda_graphs=False,
        note="ours_int8_pdl with attention='sage': int8 linears and SageAttention"),
    Row("ours_int8_pdl_triton_sage", _ours(attention="sage", quant="int8", quant_config={"int8_gemm": "triton"},
                                           fuse_if_supported=True, compile=True), False, inductor=_MK_PDL,
        needs=("sageattention",), cuda_only=True, int8_tma=False, int8_epilogue=False, cuda_graphs=False,
        note="ours_int8_pdl_sage with the Triton int8 GEMM"),
    Row("ours_int8_pdl_sage_tma", _ours(attention="sage", quant="int8", fuse_if_supported=True, compile=True), False,
        inductor=_MK_PDL, needs=("sageattention",), cuda_only=True, int8_tma=True, int8_ws=False,
        int8_epilogue=False, cuda_graphs=False,
        note="ours_int8_pdl_sage with the persistent TMA kernel for the int8 GEMM"),
    Row("ours_int8_pdl_sage_graphs_tma", _ours(attention="sage", quant="int8", fuse_if_supported=True, compile="max"),
        False, inductor=_MK_PDL, needs=("sageattention",), cuda_only=True, int8_tma=True, int8_ws=False,
        int8_epilogue=False, note="ours_int8_pdl_sage_tma with a CUDA graph of the whole forward (compile='max')"),
    # the int8 stacks with the library's defaults since 2026-12-05 (compile=True: whole-forward CUDA graph; the
    # persistent TMA int8 GEMM above 1,024 rows; concat + GELU + int8 quantization in one kernel), and A/B rows that
    # take one of those back
    Row("ours_int8", _ours(attention="cudnn", quant="int8", fuse_if_supported=True, compile=True), False,
        inductor=_MK_PDL, note="quant='int8', fuse_qkv, cuDNN attention (auto's choice), compile=True: the library's "
                               "defaults otherwise"),
    Row("ours_int8_fp8attn_tma", _with_fp8_implementation("triton_tma", _ours(
        attention="fp8", quant="int8", fuse_if_supported=True, compile=True)), False, inductor=_MK_PDL, cuda_only=True,
        note="quant='int8' + attention='fp8' on omni_accel's TMA-fed Triton kernel (int8 Q K^T with K per block of "
             "128 keys, e4m3 P V; Q / K / V quantized by inductor-compiled torch ops), fuse_qkv, compile=True"),
    _int8_sage("ours_int8_sage",
               "quant='int8' + attention='sage', fuse_qkv, compile=True: the 8-bit stack that holds the quality bound"),
    Row("ours_int8_auto", _ours(attention="auto", quant="int8", fuse_if_supported=True, compile=True), False,
        inductor=_MK_PDL, cuda_only=True,
        note="quant='int8', attention='auto' (cuDNN on Hopper; SageAttention from 16k keys where installed, else "
             "FlashAttention-4 from 8k keys where flash-attn-4 is), compile=True"),
    _int8_sage("ours_int8_sage_keysmooth",
               "ours_int8_sage with K's token mean subtracted in the compiled graph (SageAttention's own off)",
               sage_keys_in_graph=True),
    _int8_sage("ours_int8_sage_nographs", "ours_int8_sage without the whole-forward CUDA graph", cuda_graphs=False),
    _int8_sage("ours_int8_sage_noint8epi",
               "ours_int8_sage with the bf16 concat + GELU kernel and inductor's quantization after it",
               int8_epilogue=False),
    _int8_sage("ours_int8_sage_pointer", "ours_int8_sage with the pointer int8 GEMM kernel at every size",
               int8_tma=False),
    # the AdaLN modulation linears' weights in int8 (76 matrix-vector products per FLUX step read 6.4 GB in bf16)
    Row("ours_fp8_fp8attn_static_fa_pdl_mod", _fp8attn({**_FAST_STATIC, "modulation": "int8"}), False,
        calibrates=True, inductor=_MK_PDL, cuda_only=True,
        note="ours_fp8_fp8attn_static_fa_pdl with quant_config['modulation']='int8'"),
    Row("ours_int8_pdl_mod", _ours(attention="cudnn", quant="int8", quant_config={"modulation": "int8"},
                                   fuse_if_supported=True, compile=True), False, inductor=_MK_PDL,
        int8_tma=False, int8_epilogue=False, cuda_graphs=False,
        note="ours_int8_pdl with quant_config['modulation']='int8'"),
    Row("torchao_int8", _torchao_int8, False, destructive=True, needs=("torchao",), cuda_only=True,
        note="torchao Int8DynamicActivationInt8WeightConfig + cuDNN + compile_repeated_blocks (run it apart from "
             "torchao_fp8_rowwise: each changes the weights in place)"),
)}


def _switched(base: str, suffix: str, what: str, **switches) -> Row:
    """The row ``base`` with library switches flipped (the other side of an A/B), named and described after it."""
    return replace(ROWS[base], name=f"{base}_{suffix}", note=f"{base} with {what}", **switches)


# A/B rows of the epilogue-fusion graph pass: the stacks above with the pass, one of its parts, or its kernels' PDL off
_FP8_STATIC, _FP8_DEFAULT, _BF16 = "ours_fp8_fp8attn_static_fa_pdl", "ours_fp8_fp8attn_fa_pdl", "ours_bf16_mk_pdl"
ROWS.update((row.name, row) for row in (
    _switched(_BF16, "noepilogue", "inductor's own concat + GELU kernel (before the epilogue-fusion pass)",
              epilogue_fusion=False),
    _switched(_FP8_STATIC, "noepilogue", "inductor's own concat + GELU + cast kernel (before the epilogue-fusion pass)",
              epilogue_fusion=False),
    _switched(_FP8_STATIC, "noqk", "inductor's own q / k RMSNorm + rotary + cast kernel (the graph pass's concat + "
              "GELU kernels kept)", qk_norm_rope=False),
    _switched(_FP8_STATIC, "noln", "inductor's own AdaLN norm + modulate + cast kernels (the graph pass's other "
              "kernels kept)", layernorm=False),
    _switched(_FP8_STATIC, "nokernelpdl", "the graph pass's kernels launched without programmatic dependent launch "
              "(inductor's own kernels keep it)", epilogue_pdl=False),
    _switched(_BF16, "nokernelpdl", "the graph pass's kernels launched without PDL", epilogue_pdl=False),
    _switched(_FP8_DEFAULT, "noepilogue", "inductor's own concat + GELU + cast kernel", epilogue_fusion=False),
    _switched("ours_int8", "tma", "the TMA int8 GEMM without warp specialization", int8_ws=False),
    _switched("ours_int8_auto", "keysmooth", "K's token mean subtracted in the compiled graph for the SageAttention "
              "calls (the package's own smoothing off)", sage_keys_in_graph=True),
    _switched("ours_int8", "nogeluint8", "inductor's GELU + int8 quantization kernel in the dual blocks' feed-forward",
              gelu_int8=False),
    _switched("ours_int8_sage", "tma", "the TMA int8 GEMM without warp specialization", int8_ws=False),
    _switched("ours_int8", "onepass", "the one-pass concat + GELU + int8 kernel (the row in registers)",
              int8_one_pass=True),
    _switched("ours_int8", "lnint8", "AdaLN's norm + modulate + int8 quantization in one kernel (graph pass)",
              layernorm_int8=True),
    _switched("ours_int8", "newepi", "both: the one-pass concat + GELU + int8 kernel and the AdaLN int8 kernel",
              int8_one_pass=True, layernorm_int8=True),
    _switched("ours_int8", "qk16", "the single blocks' q / k RMSNorm + rotary in the graph pass's kernel (bf16 out)",
              qk_norm_rope_16=True),
    _switched(_BF16, "qk16", "the single blocks' q / k RMSNorm + rotary in the graph pass's kernel (bf16 out)",
              qk_norm_rope_16=True),
    _switched("ours_int8", "allnew", "the one-pass concat + GELU + int8, AdaLN int8 and 16-bit q / k kernels (the "
              "dual blocks' too)", int8_one_pass=True, layernorm_int8=True, qk_norm_rope_16=True,
              qk_norm_rope_joint=True),
    _switched("ours_int8", "qk16joint", "the 16-bit q / k kernel in the single and dual blocks",
              qk_norm_rope_16=True, qk_norm_rope_joint=True),
    _switched(_FP8_STATIC, "joint", "the dual blocks' q / k RMSNorm + rotary + cast in the graph pass's kernel too",
              qk_norm_rope_joint=True),
    _switched("ours_int8_sage", "prep", "Q / K / V quantized in the compiled graph, the op runs SageAttention's "
              "Hopper kernel alone", sage_prep_in_graph=True),
    _switched("ours_int8_auto", "prep", "the SageAttention calls' Q / K / V quantized in the compiled graph",
              sage_prep_in_graph=True),
))
ROWS["ours_int8_mod"] = replace(ROWS["ours_int8"], name="ours_int8_mod", setup=_ours(
    attention="cudnn", quant="int8", quant_config={"modulation": "int8"}, fuse_if_supported=True, compile=True),
    note="ours_int8 with quant_config['modulation']='int8' (Inductor's reduction for the modulation GEMVs)")
ROWS["ours_int8_mod_gemv"] = _switched("ours_int8_mod", "gemv", "the modulation GEMVs in omni_accel's Triton kernel",
                                       triton_gemv=True)
ROWS["ours_int8_sage_prep_allnew"] = _switched(
    "ours_int8_sage_prep", "allnew", "the one-pass concat + GELU + int8, AdaLN int8 and 16-bit q / k kernels (the dual "
    "blocks' too)", int8_one_pass=True, layernorm_int8=True, qk_norm_rope_16=True, qk_norm_rope_joint=True)
ROWS["ours_bf16_mk_pdl_qk16joint"] = _switched(
    "ours_bf16_mk_pdl", "qk16joint", "the 16-bit q / k kernel in the single and dual blocks", qk_norm_rope_16=True,
    qk_norm_rope_joint=True)
ROWS["ours_int8_sage_prep_newepi"] = _switched(
    "ours_int8_sage_prep", "newepi", "the one-pass concat + GELU + int8 and the AdaLN int8 kernels",
    int8_one_pass=True, layernorm_int8=True)
# The library's defaults since the A/B rows above were timed (one H100, benchmarks/results/
# bench_peers_h100_flux_newkernels_ab1_20261205.json and ..._ab2_...): the rows that stand for today's stacks take them;
# every row defined before this keeps what it measured.
_NEW_KERNELS = dict(int8_one_pass=True, layernorm_int8=True, qk_norm_rope_16=True, qk_norm_rope_joint=True,
                    sage_prep_in_graph=True)
for _name in ("ours_int8", "ours_int8_auto", "ours_int8_sage", "ours_fp8_fp8attn_static_fa_pdl", "ours_bf16_mk_pdl"):
    ROWS[_name] = replace(ROWS[_name], **_NEW_KERNELS)
# The int8 GEMM's tile for up to 1,024 rows (FLUX's 512-row text stream) became 64x128x128 by its per-shape figures
# (bench_fp8_gemm_h100_int8_few_rows_20261205.json): today's stacks take it, every row above keeps the 128x128x128
# it measured, and these are the forward's A/B rows (the other side on today's int8 stack)
for _name in ("ours_int8", "ours_int8_auto", "ours_int8_sage"):
    ROWS[_name] = replace(ROWS[_name], int8_few_rows_tile="64x128x128")
ROWS.update((row.name, row) for row in (
    _switched("ours_int8", "few128", "the int8 GEMM's former 128 x 128 x 128 tile up to 1,024 rows",
              int8_few_rows_tile="128x128x128"),
    _switched("ours_int8", "few64w", "the int8 GEMM's 64 x 256 x 128 tile up to 1,024 rows",
              int8_few_rows_tile="64x256x128"),
    _switched("ours_int8", "few128n64", "the int8 GEMM's 128 x 64 x 128 tile up to 1,024 rows",
              int8_few_rows_tile="128x64x128"),
))
ROWS["ours_int8_auto_pkgprep"] = _switched(
    "ours_int8_auto", "pkgprep", "the SageAttention calls' Q / K / V prepared by the package (outside the graph)",
    sage_prep_in_graph=False)
ROWS["ours_int8_sage_prepk"] = _switched("ours_int8_sage", "prepk", "Q / K / V quantized by omni_accel's Triton "
                                         "kernels (one op) instead of inductor's", sage_prep_kernels=True)
ROWS["ours_int8_auto_prepk"] = _switched("ours_int8_auto", "prepk", "the SageAttention calls' Q / K / V quantized "
                                         "by omni_accel's Triton kernels (one op)", sage_prep_kernels=True)
ROWS["ours_int8_sage_prepk_sub32"] = _switched("ours_int8_sage_prepk", "sub32", "the partial reductions read 32 "
                                               "tokens per loop step, 3 stages", sage_kv_subtile=32, sage_kv_stages=3)
ROWS["ours_int8_auto_prepk_sub32"] = _switched("ours_int8_auto_prepk", "sub32", "the partial reductions read 32 "
                                               "tokens per loop step, 3 stages", sage_kv_subtile=32, sage_kv_stages=3)
ROWS["ours_int8_modint8"] = replace(ROWS["ours_int8"], name="ours_int8_modint8", setup=_ours(
    attention="cudnn", quant="int8", quant_config={"modulation": "int8"}, fuse_if_supported=True, compile=True),
    note="ours_int8 (today's kernels) with quant_config['modulation']='int8' (Inductor's reduction for the GEMVs)")
ROWS["ours_int8_modint8_gemv"] = _switched("ours_int8_modint8", "gemv", "the modulation GEMVs in omni_accel's "
                                           "tensor-core Triton kernel", triton_gemv=True, gemv_kernel="dot_64x256")
ROWS["ours_int8_modint8_gemv32"] = _switched("ours_int8_modint8", "gemv32", "the modulation GEMVs in omni_accel's "
                                             "tensor-core Triton kernel, 32-row tiles (GEMV_KERNEL's default)",
                                             triton_gemv=True, gemv_kernel="dot_32x256")
ROWS["ours_int8_modint8_gemvreduce"] = _switched("ours_int8_modint8", "gemvreduce", "the modulation GEMVs in "
                                                 "omni_accel's reduction Triton kernel", triton_gemv=True,
                                                 gemv_kernel="reduce")
ROWS["ours_int8_recip"] = _switched("ours_int8", "recip", "the int8 epilogue kernels multiplying by each row's "
                                    "reciprocal scale instead of dividing", int8_reciprocal=True)
ROWS["ours_int8_fastepi"] = _switched("ours_int8", "fastepi", "the int8 epilogue kernels' GELU by the hardware's "
                                      "tanh and values times the reciprocal scale", int8_gelu_tanh=True,
                                      int8_reciprocal=True)
ROWS["ours_int8_fastepi_rot"] = _switched("ours_int8_fastepi", "rot", "the q / k kernel loading a token's cos / sin "
                                          "once for its heads", qk_shared_rotary=True)
ROWS["ours_int8_auto_fastepi"] = _switched("ours_int8_auto", "fastepi", "the int8 epilogue kernels' GELU by the "
                                           "hardware's tanh and values times the reciprocal scale",
                                           int8_gelu_tanh=True, int8_reciprocal=True)
ROWS["ours_int8_splittail"] = _switched("ours_int8", "splittail", "the int8 GEMMs' short last wave split along K over "
                                       "the idle SMs", int8_split_tail=True)
# SageAttention's preparation kernels became the default (sage_attention.PREP_KERNELS; Wan on an H200,
# bench_peers_h200_wan81_prep_kernels_20261206.json): the rows of today's SageAttention stacks take them, every row
# above keeps what it measured, and the _graphprep rows are the former default (the preparation traced into the graph)
for _name in ("ours_int8_auto", "ours_int8_sage"):
    ROWS[f"{_name}_graphprep"] = _switched(_name, "graphprep", "the SageAttention calls' Q / K / V quantized in the "
                                           "compiled graph (the default before the preparation kernels)")
    ROWS[_name] = replace(ROWS[_name], sage_prep_kernels=True)
ROWS["ours_int8_auto_fastepi"] = replace(ROWS["ours_int8_auto_fastepi"], sage_prep_kernels=True)  # one switch apart
# The int8 linears' bias added in the Triton GEMM's epilogue (kernels.int8.BIAS_IN_GEMM) became the default: today's
# int8 rows take it, every row above keeps what it measured, and the _graphbias rows are the former default (the bias
# added in the compiled graph after the GEMM)
for _name in ("ours_int8", "ours_int8_auto", "ours_int8_sage"):
    ROWS[f"{_name}_graphbias"] = _switched(_name, "graphbias", "the int8 linears' bias added in the compiled graph "
                                           "after the GEMM (the default before the GEMM's epilogue took it)")
    ROWS[_name] = replace(ROWS[_name], int8_bias_in_gemm=True)
# ... and the rows kept one switch from today's (the former preparation, the epilogue diet) take it too
for _name in ("ours_int8_auto_graphprep", "ours_int8_sage_graphprep", "ours_int8_auto_fastepi"):
    ROWS[_name] = replace(ROWS[_name], int8_bias_in_gemm=True)
for _name in ("ours_int8_auto", "ours_int8_sage"):
    ROWS[f"{_name}_fromnorms"] = _switched(_name, "fromnorms", "SageAttention's Q quantized where the q / k kernel "
                                           "computes it, and K's column sums taken there", sage_from_norms=True)
for _heads in (4, 8):
    ROWS[f"ours_int8_sage_fromnorms_h{_heads}"] = _switched("ours_int8_sage_fromnorms", f"h{_heads}", f"{_heads} heads "
                                                           "per program of the two normed kernels",
                                                           sage_normed_heads=_heads)
# A 16-bit MLP's GELU in cuBLASLt's GEMM epilogue, and FLUX's single blocks' proj_out over the concatenation's two
# parts (kernels.epilogue_fusion.GELU_GEMM) became the default: today's rows take it (the 8-bit stacks have no 16-bit
# MLP for it to change), every row above keeps what it measured, and the _nogelugemm rows are the former default
for _name in ("ours_int8", "ours_int8_auto", "ours_int8_sage", "ours_fp8_fp8attn_static_fa_pdl", "ours_bf16_mk_pdl"):
    ROWS[f"{_name}_nogelugemm"] = _switched(_name, "nogelugemm", "the MLP's GELU in an inductor kernel after the GEMM "
                                            "(and the single blocks' concatenation written)")
    ROWS[_name] = replace(ROWS[_name], gelu_gemm=True)
# Qwen-Image's complex-table rotary applied in real arithmetic (compiler.COMPLEX_ROTARY_PAIR_SWAP) became the default
# the same way; the _complexrope rows run the former graph (the complex multiply as ATen kernels)
for _name in ("ours_int8", "ours_int8_auto", "ours_int8_sage", "ours_fp8_fp8attn_static_fa_pdl", "ours_bf16_mk_pdl"):
    ROWS[f"{_name}_complexrope"] = _switched(_name, "complexrope", "Qwen-Image's rotary as diffusers' complex "
                                             "multiply (ATen kernels between inductor's)")
    ROWS[_name] = replace(ROWS[_name], complex_rotary_pair_swap=True)
    # the _nogelugemm rows stay one switch from today's (their 2026-12-06 files ran before this switch existed)
    ROWS[f"{_name}_nogelugemm"] = replace(ROWS[f"{_name}_nogelugemm"], complex_rotary_pair_swap=True)
# 16-bit linears on the cuBLASLt algorithm that a timing in the first forward picks per shape (kernels/gemm_tuning.py,
# off by default until measured in the forward): the _tuned rows are today's with it on
for _name in ("ours_bf16_mk_pdl", "ours_int8"):
    ROWS[f"{_name}_tuned"] = _switched(_name, "tuned", "16-bit linears on the cuBLASLt algorithm timed fastest per "
                                       "shape", tuned_gemm=True)
# The AdaLN modulation linears computed ahead on a second stream (modulation_prefetch.py): the _prefetch rows are
# today's with it on in every GPU forward ("always"; the bf16 stack has no CUDA graph)
for _name in ("ours_bf16_mk_pdl", "ours_int8", "ours_bf16_mk_pdl_tuned"):
    ROWS[f"{_name}_prefetch"] = _switched(_name, "prefetch", "the modulation linears computed ahead on a second "
                                          "stream", modulation_prefetch="always")
# ... and inside the whole-forward CUDA graph it became the default ("graphs"): today's rows take it, every row above
# keeps what it measured, and the _noprefetch rows are the former default
for _name in ("ours_int8", "ours_int8_auto", "ours_int8_sage", "ours_fp8_fp8attn_static_fa_pdl"):
    ROWS[f"{_name}_noprefetch"] = _switched(_name, "noprefetch", "the modulation linears computed in the blocks",
                                            modulation_prefetch="off")
    ROWS[_name] = replace(ROWS[_name], modulation_prefetch="graphs")
# (the bf16 stack has no CUDA graph, where "graphs" changes nothing: no _noprefetch twin)
ROWS["ours_bf16_mk_pdl"] = replace(ROWS["ours_bf16_mk_pdl"], modulation_prefetch="graphs")
# Today's bf16 stack under compile="max": the whole-forward CUDA graph, and with it the modulation prefetch (the
# _graphs row above predates the GELU in the GEMM's epilogue, so it is not today's stack with the graph)
ROWS["ours_bf16_mk_pdl_max"] = replace(ROWS["ours_bf16_mk_pdl"], name="ours_bf16_mk_pdl_max",
                                       setup=_ours(attention="auto", compile="max"),
                                       note="ours_bf16_mk_pdl with compile='max': the whole-forward CUDA graph and, "
                                            "inside it, the modulation prefetch")
ROWS["ours_bf16_mk_pdl_max_noprefetch"] = _switched("ours_bf16_mk_pdl_max", "noprefetch",
                                                    "the modulation linears computed in the blocks",
                                                    modulation_prefetch="off")
# A block's gated residual in the int8 GEMM's epilogue (kernels.epilogue_fusion.GATED_RESIDUAL_INT8, off until timed
# in the forward): the _gatedres rows are today's with it on
for _name in ("ours_int8", "ours_int8_auto", "ours_int8_sage"):
    ROWS[f"{_name}_gatedres"] = _switched(_name, "gatedres", "a block's gated residual in the int8 GEMM's epilogue",
                                          int8_gated_residual=True)
# ... and in the warp-specialized kernel's twin too (above FEW_ROWS rows on Hopper), its residual and / or output
# through pointers (RESIDUAL_WS_IO 1-3). A/B rows only: on an H100 every variant wrote wrong values (the _ws1 row's
# output error 1.42; bench_int8_residual.py counts them per GEMM)
for _io in (1, 2, 3):
    ROWS[f"ours_int8_gatedres_ws{_io}"] = _switched("ours_int8_gatedres", f"ws{_io}", "the gated residual in the "
                                                    f"warp-specialized int8 GEMM too (epilogue IO {_io})",
                                                    int8_residual_ws=True, int8_residual_ws_io=_io)
# Qwen-Image's q / k norm + rotary in the graph pass's kernel (kernels.epilogue_fusion.QK_NORM_ROPE_DIFFUSERS_RMS,
# on by default since timed): the _noqwenqk rows leave it to inductor, as before (FLUX and Wan do not change: their
# norms are torch's). The 2026-12-07 result files name the rows with it on `_qwenqk` (then not the default).
for _name in ("ours_int8", "ours_bf16_mk_pdl"):
    ROWS[f"{_name}_noqwenqk"] = _switched(_name, "noqwenqk", "Qwen-Image's q / k norm + rotary left to inductor",
                                          qk_diffusers_rms=False)
# An upper-bound probe, not a stack: the AdaLN modulation linears return the outputs one plain forward recorded for
# this benchmark's fixed inputs, so their GEMVs (6.4 GB of weights per FLUX forward) leave the timed forward. What
# computing the modulation of every step of a run in one batched GEMM could save at most. Valid only for the recorded
# timestep, guidance and pooled text (the new-inputs check changes neither), so the summary leaves probe rows out.
for _name in ("ours_bf16_mk_pdl", "ours_int8"):
    ROWS[f"{_name}_frozenmod"] = replace(
        ROWS[_name], name=f"{_name}_frozenmod", setup=_frozen_modulation(ROWS[_name].setup), modulation_prefetch="off",
        modulation_table=False,
        probe=True, note=f"PROBE: {_name} with the modulation linears' outputs recorded once (the GEMVs' upper-bound "
                         "cost)")
# The modulation table (modulation_table.py) and the int8 stacks' AdaLN kernel over unpadded parts are defaults (the
# Row fields' defaults); their A sides. The table is faster only where forwards run inside a pipeline call
# (--schedule-steps). bench_peers_h100_flux_modtable_20261207.json's ours_*_modtable rows are today's defaults (the
# parts kernel off), its ours_bf16_mk_pdl / ours_int8 today's _notable rows.
for _name in ("ours_int8", "ours_int8_auto", "ours_int8_sage"):
    ROWS[f"{_name}_nolnparts"] = _switched(_name, "nolnparts", "the AdaLN norm + int8 kernel over the padded "
                                           "power-of-two row", layernorm_parts=False)
for _name in ("ours_bf16_mk_pdl", "ours_int8", "ours_int8_auto", "ours_int8_sage", "ours_fp8_fp8attn_static_fa_pdl"):
    ROWS[f"{_name}_notable"] = _switched(_name, "notable", "the modulation linears computed per forward (no table)",
                                         modulation_table=False)
# auto's long-sequence route to FlashAttention-4 (where flash-attn-4 is installed and sageattention is not) under the
# int8 stack's CUDA graph: the kernel captured inside the graph, against the default (between the graph's segments)
# (with SageAttention's Hopper kernel installed auto takes that instead, and the row repeats ours_int8_auto)
ROWS["ours_int8_auto_fa4graph"] = _switched("ours_int8_auto", "fa4graph", "FlashAttention-4's kernel captured inside "
                                            "the whole-forward CUDA graph", fa4_in_graph=True,
                                            needs=("flash_attn.cute",))
# the int8 stack with every attention call FlashAttention-4 serves on it (between the graph's segments)
ROWS["ours_int8_fa4"] = replace(ROWS["ours_int8"], name="ours_int8_fa4", setup=_ours(
    attention="fa4", quant="int8", fuse_if_supported=True, compile=True), needs=("flash_attn.cute",), cuda_only=True,
    note="ours_int8 with FlashAttention-4 (flash-attn-4) for every attention call it serves")
# attention="auto" sends calls with >= 8,192 keys to FlashAttention-4 where flash-attn-4 is installed (Wan's
# self-attention; FLUX at 1024² stays on cuDNN). Its A/B sides are today's ours_bf16_mk_pdl with the attention pinned.
# Until 2026-12-07 (seventh) they kept the switches of their first definition (no GELU in the GEMM's epilogue, no
# 16-bit q / k kernel, no modulation prefetch), so their files compare more than the attention with ours_bf16_mk_pdl.
ROWS["ours_bf16_mk_pdl_cudnn"] = replace(
    ROWS["ours_bf16_mk_pdl"], name="ours_bf16_mk_pdl_cudnn", setup=_ours(attention="cudnn", compile=True),
    note="ours_bf16_mk_pdl with cuDNN SDPA for every attention call (auto before its FlashAttention-4 route)")
ROWS["ours_bf16_mk_pdl_fa4"] = replace(
    ROWS["ours_bf16_mk_pdl"], name="ours_bf16_mk_pdl_fa4", setup=_ours(attention="fa4", compile=True),
    needs=("flash_attn.cute",), cuda_only=True,
    note="ours_bf16_mk_pdl with FlashAttention-4 (flash-attn-4) for every attention call it serves")
# FlashAttention-4's Hopper tiles (kernels.fa4_attention.TILE_CANDIDATES, the first is FA4's own choice) in the stacks
# that run it: every call (_fa4 rows) or auto's long calls (ours_bf16_mk_pdl, ours_int8_auto without sageattention)
for _name in ("ours_bf16_mk_pdl_fa4", "ours_int8_fa4", "ours_bf16_mk_pdl", "ours_int8_auto"):
    for _tile in fa4_attention.TILE_CANDIDATES:
        _row = _switched(_name, f"t{fa4_attention.tile_name(_tile)}",
                         f"FlashAttention-4's Hopper tile {fa4_attention.tile_name(_tile)}", fa4_tile=_tile)
        ROWS[_row.name] = replace(_row, needs=tuple(dict.fromkeys(_row.needs + ("flash_attn.cute",))),
                                  cuda_only=True)
# auto's FA4 route with the per-shape timing from 4,096 keys (FA4 against cuDNN on each shape's first call below 8,192
# keys). On 2026-12-07 (eighth) the timing was auto's default for a run: ours_bf16_mk_pdl and ours_int8_auto of
# bench_peers_h200_flux_timed_20261207.json, bench_peers_h100_flux_timed_rounds_20261207.json and
# bench_peers_h100_qwen_timed_20261207.json are these rows.
for _name in ("ours_bf16_mk_pdl", "ours_int8_auto"):
    _row = _switched(_name, "timed", "FlashAttention-4 timed against cuDNN per shape from 4,096 keys",
                     fa4_timed_min_tokens=4096)
    ROWS[_row.name] = replace(_row, needs=tuple(dict.fromkeys(_row.needs + ("flash_attn.cute",))), cuda_only=True)
# The 16-bit GEMM tuner on today's stack (the _tuned rows above kept the stack of their day): cuBLASLt's candidates
# alone, and with quack-kernels' CuTe DSL GEMMs on four Hopper tiles beside them
# (quack's "default" on Hopper is its 128 x 192 pingpong tile with a 2 x 1 cluster: left out, it would time it twice)
QUACK_TILES = ("256x128_coop_c2x1", "256x192_coop_c2x1", "128x256_coop_c2x1", "128x192_pp_c2x1")
ROWS["ours_bf16_mk_pdl_tunedlt"] = _switched("ours_bf16_mk_pdl", "tunedlt", "16-bit linears on the cuBLASLt "
                                             "algorithm timed fastest per shape", tuned_gemm=True)


def quack_row(tiles: tuple) -> Row:
    """Today's bf16 stack with the GEMM tuner timing quack-kernels' GEMMs on ``tiles`` beside cuBLASLt's candidates."""
    return replace(_switched("ours_bf16_mk_pdl", "tunedquack", "16-bit linears on the fastest per shape of torch's "
                             f"call, cuBLASLt's candidates and quack-kernels' GEMMs on the tiles {', '.join(tiles)}",
                             tuned_gemm=True, quack_configs=tiles), needs=("quack",), cuda_only=True)


ROWS["ours_bf16_mk_pdl_tunedquack"] = quack_row(QUACK_TILES)
# Today's bf16 stack under compile="max" (the _max row above kept the stack of its day): the whole-forward CUDA graph,
# for a forward whose host time nears its GPU time (Qwen-Image's in 16 bits)
ROWS["ours_bf16_mk_pdl_graph"] = replace(ROWS["ours_bf16_mk_pdl"], name="ours_bf16_mk_pdl_graph",
                                         setup=_ours(attention="auto", compile="max"),
                                         note="ours_bf16_mk_pdl with compile='max': the whole-forward CUDA graph")
# ... and without any graph: since compile=True graphs a family whose adapter sets graphs_16bit (Qwen-Image), the
# default row runs the graph there, and this row is the A side of that choice (ours_bf16_mk_pdl rows in files before
# bench_peers_h100_qwen_image_floor_unfused_20261208.json ran Qwen-Image without the graph)
ROWS["ours_bf16_mk_pdl_nograph"] = replace(ROWS["ours_bf16_mk_pdl"], name="ours_bf16_mk_pdl_nograph",
                                           cuda_graphs=False,
                                           note="ours_bf16_mk_pdl with OMNI_ACCEL_CUDA_GRAPHS=0: no whole-forward "
                                                "CUDA graph for any family")
# The floor of the forward's arithmetic (benchmarks/step_floor.py): its GEMMs and attention calls alone, back to back
# in one CUDA graph, at the sustained clock they draw; what a stack on these kernels can reach at best.
# floor_bf16 joins q / k / v into one product (fuse_qkv=True, which the default bf16 stack does not ask for);
# floor_bf16_unfused keeps them apart, as the default bf16 stack and diffusers run them; the int8 stack fuses them.
ROWS["floor_bf16"] = Row("floor_bf16", step_floor.floor_setup("bf16"), True, probe=True, model_output=False,
                         note="PROBE: the forward's GEMMs (cuBLAS, bias epilogue) and attention calls (cuDNN) alone, "
                              "q / k / v fused, in one CUDA graph; no model output")
ROWS["floor_bf16_unfused"] = Row("floor_bf16_unfused", step_floor.floor_setup("bf16", fuse_qkv=False), True,
                                 probe=True, model_output=False,
                                 note="PROBE: floor_bf16 with q / k / v as three products, as the default bf16 stack "
                                      "runs them")
ROWS["floor_int8"] = Row("floor_int8", step_floor.floor_setup("int8"), False, probe=True, model_output=False,
                         note="PROBE: the forward's GEMMs as omni_accel's int8 GEMM and its attention calls (cuDNN, "
                              "bf16) alone, q / k / v fused as the int8 stack runs them, in one CUDA graph; no model "
                              "output")
# ... with cuDNN's FP8 attention on e4m3 operands: the floor of an int8 stack whose attention is 8-bit, its operands
# quantized in the kernels that write them (the lever the 8-bit targets are missing)
ROWS["floor_int8_fp8attn"] = Row("floor_int8_fp8attn", step_floor.floor_setup("int8", attention="fp8"), False,
                                 probe=True, model_output=False, needs=("cudnn",),
                                 note="PROBE: floor_int8 with cuDNN's FP8 attention (nvidia-cudnn-frontend) on e4m3 "
                                      "operands in place of the bf16 attention")
DEFAULT_CONFIGS = ["diffusers_eager", "diffusers_best", "ours_bf16", "ours_fp8_static", "ours_fp8_fp8attn",
                   "ours_fp8_fp8attn_static", "ours_fp8_full", "ours_bf16_graphs", "ours_fp8_dynamic", "ours_bf16_mk",
                   "ours_fp8_static_mk", "torchao_fp8_rowwise", "torch_compile"]


def skip_reason(row: Row, device: torch.device) -> str | None:
    missing = [p for p in row.needs if not installed(p)]  # installed(): a dotted name whose parent is missing too
    if missing:
        return f"needs {', '.join(missing)}"
    if row.cuda_only and device.type != "cuda":
        return "needs CUDA"
    return None


# -------------------------------------------------------------------------------------- kernel attribution
KINDS = ("gemm", "attention", "quantization", "other fused", "elementwise")


def kernel_kind(name: str) -> str:
    n = name.lower()
    if n.startswith("triton"):
        # inductor names fused kernels after the ops they contain: a max of |x| (dynamic scales) or a scaled,
        # clamped cast (the e4m3 cast of a quantization) marks activation quantization, fused into whatever
        # produced the activation (norm, GELU, RoPE); kernels that feed _scaled_mm carry its name too
        if "amax" in n or ("clamp" in n and "_to_copy" in n and ("reciprocal" in n or "div" in n)):
            return "quantization"
        return "other fused"
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn", "cudnn")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "gemv", "scaled_mm", "wgmma")):
        return "gemm"
    return "elementwise"


def host_profile(fn, device: torch.device, top: int = 20) -> dict:
    """Where the host spends one forward: the seconds until ``fn()`` returns (kernels are queued, not waited for:
    when this is near the forward's event time the GPU waits for the host), and the CPU ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        sync(device)
        t0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        sync(device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
            sync(device)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {"host_ms": round(host_ms, 3),
            "top_cpu": [{"op": e.key[:160], "self_ms": round(e.self_cpu_time_total / 1e3, 3), "calls": e.count}
                        for e in ops]}


def profile_forward(fn, device: torch.device, top: int = 15, trace_path: str | None = None) -> dict:
    """Kernel time of one forward by kind, and idle = the forward's event time minus the sum of its kernels, with
    the gaps between kernels that make it up (``kernel_gaps``); ``trace_path``: also a Chrome trace of it."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
    kernels = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if us > 0:
            kernels.append((evt.key, us / 1e3, evt.count))
    kernels.sort(key=lambda k: -k[1])
    by_kind = {k: 0.0 for k in KINDS}
    for name, ms, _ in kernels:
        by_kind[kernel_kind(name)] += ms
    busy = sum(ms for _, ms, _ in kernels)
    event_ms = start.elapsed_time(end)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    intervals = _device_intervals(prof)
    span_ms = _span_ms(intervals)
    return {"by_kind_ms": {k: round(v, 3) for k, v in by_kind.items()}, "kernel_ms": round(busy, 3),
            "event_ms": round(event_ms, 3), "idle_ms": round(max(0.0, event_ms - busy), 3),
            "top": [{"kernel": n[:140], "ms": round(ms, 3), "calls": c, "kind": kernel_kind(n)}
                    for n, ms, c in kernels[:top]],
            # the forward's time outside its first-to-last GPU activity: the host's work before the first launch
            # (hooks, a graph's input copies and checks) and after the last
            "outside_gpu_span_ms": round(max(0.0, event_ms - span_ms), 3),
            "gaps": kernel_gaps(intervals, top)}


# CUDA runtime calls by which the host waits for the GPU (the synchronous copies too): in a loop of forwards any of
# them lets the GPU run dry while the host prepares the next launch
_HOST_WAITS = frozenset(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                         "cudaMemcpy2D"))


def profile_loop(fn, device: torch.device, calls: int) -> dict:
    """``calls`` forwards launched back to back (as a denoising loop runs them) under the profiler: per forward the
    loop's event time, the kernel time and the idle rest, the gaps between kernels over the whole loop (those
    between forwards included), and the host's waits for the GPU (``_HOST_WAITS``) by name, the loop's own final
    event wait among them. Is the idle of one profiled forward still there when the host can run ahead?"""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loop_ms = calls_ms(fn, calls, device)
    waits = {}
    for evt in prof.profiler.kineto_results.events():
        name = evt.name()
        if evt.device_type() == torch.autograd.DeviceType.CPU and name in _HOST_WAITS:
            waits[name] = waits.get(name, 0) + 1
    return loop_summary(_device_intervals(prof), loop_ms, calls, waits)


def loop_summary(intervals: list[tuple[str, float, float]], event_ms: float, calls: int, waits: dict) -> dict:
    """``profile_loop``'s figures from the loop's device intervals (name, start us, end us) and event time. Busy time
    is the first-to-last span less the gaps between kernels (``kernel_gaps``): overlapping kernels (programmatic
    dependent launch, side streams) count once."""
    gaps = kernel_gaps(intervals)
    span_ms = _span_ms(intervals)
    busy_ms = span_ms - gaps["total_ms"]
    return {"forwards": calls, "ms_per_forward": round(event_ms / calls, 3),
            "busy_ms_per_forward": round(busy_ms / calls, 3),
            "idle_ms_per_forward": round(max(0.0, event_ms - busy_ms) / calls, 3), "gaps": gaps, "host_waits": waits}


def _span_ms(intervals: list[tuple[str, float, float]]) -> float:
    """Milliseconds from the first interval's start to the last one's end (0 without any)."""
    return (max(i[2] for i in intervals) - min(i[1] for i in intervals)) / 1e3 if intervals else 0.0


def _device_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel, copy and fill the profiler saw on the GPU."""
    intervals = []
    for evt in prof.profiler.kineto_results.events():
        if evt.device_type() == torch.autograd.DeviceType.CUDA and evt.duration_ns() > 0:
            start = evt.start_ns() / 1e3
            intervals.append((evt.name(), start, start + evt.duration_ns() / 1e3))
    return intervals


def kernel_gaps(intervals: list[tuple[str, float, float]], top: int = 15) -> dict:
    """Where the GPU sat idle between the kernels of one forward: each gap (the time from the end of everything
    before a kernel to its start; overlapping kernels leave none), summed by the kind of the kernel that waited, and
    the longest ones with the kernels on either side. What the idle time of a CUDA-graph replay is made of."""
    intervals = sorted(intervals, key=lambda i: i[1])
    gaps, busy_until, previous = [], None, None
    for name, start, end in intervals:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, previous, name))
        if busy_until is None or end > busy_until:
            busy_until, previous = end, name
    by_kind = {}
    for us, _, waiting in gaps:
        by_kind[kernel_kind(waiting)] = by_kind.get(kernel_kind(waiting), 0.0) + us
    sizes = [us for us, _, _ in gaps]
    return {"total_ms": round(sum(sizes) / 1e3, 3), "count": len(gaps),
            "over_5us": sum(us > 5 for us in sizes), "over_5us_ms": round(sum(us for us in sizes if us > 5) / 1e3, 3),
            "median_us": round(sorted(sizes)[len(sizes) // 2], 2) if sizes else 0.0,
            "before_kind_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "longest": [{"us": round(us, 1), "after": a[:100], "before": b[:100]}
                        for us, a, b in sorted(gaps, key=lambda g: -g[0])[:top]]}


# ------------------------------------------------------------------------------------------------- running
class DeadlinePassed(BaseException):
    """Raised by SIGALRM at ``--deadline``: a BaseException, so that no library's ``except Exception`` swallows it
    while a long compile is interrupted."""


def arm_deadline(seconds_from_now: float) -> None:
    import signal

    def fire(_sig, _frame):
        raise DeadlinePassed("the run's deadline passed during this row")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(max(1, int(seconds_from_now)))


# The inputs a second, untimed call of every row gets after its timing: a replayed CUDA graph that left a kernel out
# returns the captured call's result, which equals the reference only on the captured inputs.
FRESH_INPUTS = ("hidden_states", "encoder_hidden_states")
# how much further from eager a row may be on the new inputs than on the timed ones before it is flagged
FRESH_ERR_FACTOR = 3.0
FRESH_ERR_SLACK = 0.01


@dataclass
class Reference:
    """bf16 eager outputs: on the timed inputs, and on ``fresh`` values for ``FRESH_INPUTS``."""
    out: torch.Tensor
    fresh_out: torch.Tensor
    fresh: dict


def fresh_values(inputs: dict, seed: int = 4321) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {k: torch.randn(inputs[k].shape, generator=g).to(inputs[k]) for k in FRESH_INPUTS
            if isinstance(inputs.get(k), torch.Tensor)}


@contextlib.contextmanager
def swapped_inputs(inputs: dict, values: dict):
    """``inputs``' tensors rewritten in place with ``values`` (the rows' closures hold these very tensors), and
    restored after."""
    saved = {k: inputs[k].clone() for k in values}
    for k, v in values.items():
        inputs[k].copy_(v)
    try:
        yield
    finally:
        for k, v in saved.items():
            inputs[k].copy_(v)


def eager_reference(transformer, inputs: dict) -> Reference:
    fresh = fresh_values(inputs)
    with torch.no_grad():
        out = first_tensor(transformer(**inputs)).clone()
        with swapped_inputs(inputs, fresh):
            fresh_out = first_tensor(transformer(**inputs)).clone()
    return Reference(out, fresh_out, fresh)


def fresh_input_check(forward, inputs: dict, reference: Reference, timed_err: float) -> dict:
    """The row's error on new inputs, and a flag when it is far above its error on the timed ones."""
    with swapped_inputs(inputs, reference.fresh):
        err = rel_err(first_tensor(forward()), reference.fresh_out)
    entry = {"rel_err_fresh_inputs": round(err, 5)}
    if err > FRESH_ERR_FACTOR * timed_err + FRESH_ERR_SLACK:
        entry["fresh_inputs_disagree"] = True
    return entry


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def run_row(row: Row, spec: dict, pipe, inputs, reference, device, args, clocks, flops) -> dict:
    from omni_accel import compiler

    # the env's package versions are read once at the start; SageAttention's is read again per row, since a build
    # can finish (and install) while the first rows run
    result = {"model": spec["model"], "config": row.name, "note": row.note, "lossless": row.lossless,
              "inductor_options": row.inductor, "sageattention": _version("sageattention")}
    if not row.cuda_graphs:
        result["cuda_graphs_env"] = "0"
    if row.probe:
        result["probe"] = True
    saved = compiler.INDUCTOR_OPTIONS
    compiler.INDUCTOR_OPTIONS = row.inductor
    try:
        with library_switches(row) as switches:
            result.update(switches)
            _run_row(row, spec, pipe, inputs, reference, device, args, clocks, flops, result)
    finally:
        compiler.INDUCTOR_OPTIONS = saved
    return result


def _attention_served() -> dict[str, int]:
    """The calls each packaged attention kernel has computed in this process (fa4_attention.served_calls)."""
    from omni_accel.kernels import sage_attention

    return {label: fa4_attention.served_calls(label)
            for label in (fa4_attention.KERNEL_NAME, sage_attention.KERNEL_NAME)}


def _run_row(row: Row, spec: dict, pipe, inputs, reference, device, args, clocks, flops, result: dict) -> None:
    import omni_accel
    from omni_accel.kernels import epilogue_fusion, gemm_tuning, quant

    undo = lambda: None  # noqa: E731
    rewrites_before = dict(epilogue_fusion.REWRITES)
    served_before = _attention_served()
    gemm_tuning.reset()  # each row times its GEMMs again (the time counts in its first call)
    fa4_attention.reset_timed_choices()  # with the timing switch on, each row times its own shapes
    try:
        t0 = time.perf_counter()
        fn, undo = row.setup(pipe, pipe.transformer, inputs, spec["model"])
        calibration_s = 0.0
        if row.calibrates:
            with torch.no_grad():
                fn()  # observes each FP8 layer's max |x| (and compiles the observing graph)
            sync(device)
            quant.freeze_activation_scales(pipe)
            calibration_s = time.perf_counter() - t0

        def forward():
            with torch.no_grad():
                return fn()

        timing = time_forwards(forward, device, args.iters, args.warmup, on_warm=clocks.mark)
        loop = back_to_back_ms(forward, device, args.loop_forwards, 3) if args.loop_forwards else None
        clock = clocks.since_mark()
        if args.schedule_steps:  # after the per-forward figures' clocks; its own clocks and peak memory
            clocks.mark()
            result.update(schedule_loop(forward, pipe, inputs, device, args.schedule_steps, spec,
                                        compare=row.model_output))
            result["schedule_clocks"] = clocks.since_mark()
        ms = timing["ms"]
        if loop:
            result.update(ms_loop=round(statistics.median(loop), 3),
                          ms_per_step_loop=round(statistics.median(loop) * spec["forwards_per_step"], 3))
        result.update(
            ms=round(ms, 3), ms_min=round(timing["ms_min"], 3), ms_max=round(timing["ms_max"], 3),
            ms_each=timing["ms_each"], gc_while_timed=timing["gc_while_timed"],
            ms_per_step=round(ms * spec["forwards_per_step"], 3),
            tflops=round(flops["total"] / (ms / 1e3) / 1e12, 1),
            first_call_s=round(calibration_s + timing["cold_start_s"], 2), calibration_s=round(calibration_s, 2),
            peak_mem_gib=timing["peak_mem_gib"] and round(timing["peak_mem_gib"], 3),
            rel_err_vs_eager=(round(rel_err(first_tensor(timing["out"]), reference.out), 5) if row.model_output
                              else None), **clock)
        if row.model_output:
            result.update(fresh_input_check(forward, inputs, reference, result["rel_err_vs_eager"]))
        # what the epilogue-fusion pass replaced while this row compiled (none where inductor's cache served a graph)
        result["epilogue_rewrites"] = epilogue_fusion.rewrites_since(rewrites_before)
        result["tuned_gemms"] = gemm_tuning.choices()
        if clock.get("power_w"):
            result["energy_j_per_forward"] = round(clock["power_w"] * ms / 1e3, 2)
        if "omni_accel" in vars(pipe):
            report = pipe.omni_accel.report()
            result["applied"] = [{k: v for k, v in a.items() if k not in ("weight_rel_err", "skipped")}
                                 for a in report["applied"]]
            # attention_fallbacks / attention_served: the shapes a packaged kernel (FlashAttention-4, SageAttention)
            # failed on, which another kernel computed inside the op (process-wide), and the calls it computed (made
            # the row's own below, its profiled forwards included) -- a row whose kernel never ran says so
            for section in ("fp8_activations", "fp8_attention_scales", "attention_fallbacks", "attention_served",
                            "attention_timed"):
                if section in report:
                    result[section] = report[section]
        if args.profile and device.type == "cuda":
            trace = os.path.join(args.trace_dir, f"{spec['model']}_{row.name}.trace.json") if args.trace_dir else None
            if trace:
                os.makedirs(args.trace_dir, exist_ok=True)
            result["profile"] = profile_forward(forward, device, trace_path=trace)
        if args.host_profile:
            result["host_profile"] = host_profile(forward, device)
        if args.profile_loop and device.type == "cuda":
            result["loop_profile"] = profile_loop(forward, device, args.profile_loop)
        if "attention_served" in result:  # this row's own calls (the report's counts are process-wide)
            served = _attention_served()
            result["attention_served"] = {label: served[label] - served_before[label]
                                          for label in result["attention_served"]}
    except Exception as exc:  # noqa: BLE001 -- one failing config costs its row only
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    except DeadlinePassed as exc:
        result["error"] = f"DeadlinePassed: {exc} ({time.perf_counter() - t0:.0f} s into the row)"
        result["deadline_passed"] = True
    finally:
        try:
            undo()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        if "omni_accel" in vars(pipe):
            omni_accel.restore(pipe)
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def schedule_timesteps(pipe, inputs: dict, steps: int, device: torch.device) -> list[torch.Tensor] | None:
    """The transformer's timestep argument at each of ``steps`` steps of the pipeline's own schedule, as the family's
    pipeline computes it (its modulation table's ``schedule_timestep``: FLUX's ``t / 1000`` in the latents' dtype),
    after ``set_timesteps`` as FluxPipeline calls it (sigmas 1 .. 1 / steps, the resolution's shift). None for a
    family without that knowledge."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from omni_accel.pipelines import adapter_for

    spec = adapter_for(pipe).modulation_prefetch
    if spec is None or spec.table is None:
        return None
    scheduler, hidden = pipe.scheduler, inputs[spec.table.batch_arg]
    extra = {}
    if scheduler.config.get("use_dynamic_shifting"):
        config = scheduler.config
        extra["mu"] = calculate_shift(hidden.shape[1], config.get("base_image_seq_len", 256),
                                      config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                      config.get("max_shift", 1.15))
    scheduler.set_timesteps(sigmas=[1.0 - i * (1.0 - 1.0 / steps) / max(steps - 1, 1) for i in range(steps)],
                            device=device, **extra)
    rows = spec.table.schedule_timestep(scheduler.timesteps, hidden.shape[0], hidden.dtype)
    return list(rows.view(steps, hidden.shape[0]))


def schedule_loop(forward, pipe, inputs: dict, device: torch.device, steps: int, spec: dict, groups: int = 2,
                  compare: bool = True) -> dict:
    """ms per step of a denoising run's forwards: ``steps`` forwards back to back at the timesteps of a real schedule
    (``schedule_timesteps``), inside one pipeline call of an accelerated pipeline (its call hooks run: the
    modulation table fills once per call), median of ``groups`` runs after one untimed run (the first run at a
    schedule may grow the table, which captures a whole-forward CUDA graph again). The peers run the same
    forwards. ``schedule_rel_err_vs_single_forwards``: the run's first and last outputs against the same forwards
    called alone, outside a call (the larger relative error of the two: what computing the modulation once per
    call changed; not with ``compare=False``, for a forward that returns no model output)."""
    timesteps = schedule_timesteps(pipe, inputs, steps, device)
    if timesteps is None:
        return {"schedule_steps_skipped": "the family declares no schedule (pipelines/<family>.py)"}
    state = vars(pipe).get("omni_accel")
    fixed = inputs["timestep"]
    per_step, ends = [], {}
    try:
        for group in range(groups + 1):
            if state is not None:
                state.begin_call()
            try:
                def run_all():
                    for i, t in enumerate(timesteps):
                        inputs["timestep"] = t
                        out = forward()
                        if group == groups and i in (0, steps - 1):  # the last run's first and last outputs
                            ends[i] = first_tensor(out).clone()
                ms = back_to_back_ms(run_all, device, 1, 1)[0]  # CUDA events on a GPU
                if group:
                    per_step.append(ms / steps)
            finally:
                if state is not None:
                    state.end_call()
        # the same steps as single forwards outside a call (a table, if any, is not used there)
        errors = []
        for i, out in ends.items() if compare else ():
            inputs["timestep"] = timesteps[i]
            errors.append(rel_err(out, first_tensor(forward())))
    finally:
        inputs["timestep"] = fixed
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None  # since the last run's
    # begin_call (it resets the peak) or the row's start
    return {"schedule_steps": steps, "ms_schedule": round(statistics.median(per_step), 3),
            "ms_per_step_schedule": round(statistics.median(per_step) * spec["forwards_per_step"], 3),
            "schedule_rel_err_vs_single_forwards": round(max(errors), 6) if errors else None,
            "schedule_peak_mem_gib": peak and round(peak, 3)}


def ordered(names: list[str]) -> list[str]:
    """Destructive rows (weights changed in place) after every other row of the model."""
    return [n for n in names if not ROWS[n].destructive] + [n for n in names if ROWS[n].destructive]


def run_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, config) in run order: the configs forward in even rounds and backward in odd ones (A B, B A, A B ...),
    so a clock or temperature drift over the run lands on every config alike instead of on the later ones."""
    return [(r, n) for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]


def combine_rounds(rows: list[dict]) -> list[dict]:
    """One row per (model, config) from rows timed over several rounds: the first round's row (its first call, profile
    and errors: the cold one) with the timings replaced by their medians over the rounds that timed it (each round's
    in ``*_rounds``), ``ms_min`` / ``ms_max`` over all of them, TFLOP/s and energy per forward rescaled to the median,
    ``rounds`` the number of rounds that timed it, and any round's error or passed deadline carried over. Rows of a
    run without rounds pass through unchanged."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["config"]), []).append(row)
    combined = []
    for group in groups.values():
        if "round" not in group[0]:
            combined.extend(group)
            continue
        first = {k: v for k, v in group[0].items() if k != "round"}
        timed = [r for r in group if "ms" in r]
        if timed:
            base = timed[0]
            first.update({k: v for k, v in base.items() if k not in first and k != "round"})  # round 0 may have failed
            for key in ("ms", "ms_loop", "ms_per_step", "ms_per_step_loop", "ms_schedule", "ms_per_step_schedule"):
                values = [r[key] for r in timed if key in r]
                if values:
                    first[key] = round(statistics.median(values), 3)
                    first[f"{key}_rounds"] = values
            first["ms_min"] = min(r["ms_min"] for r in timed)
            first["ms_max"] = max(r["ms_max"] for r in timed)
            scale = base["ms"] / first["ms"]  # figures inverse or proportional to the time, at the median
            first["tflops"] = round(base["tflops"] * scale, 1)
            if "energy_j_per_forward" in base:
                first["energy_j_per_forward"] = round(base["energy_j_per_forward"] / scale, 2)
        first["rounds"] = len(timed)
        errors = [f"round {r['round']}: {r['error']}" for r in group if "error" in r]
        if errors:
            first["error"] = "; ".join(errors)[:2000]
        if any(r.get("deadline_passed") for r in group):
            first["deadline_passed"] = True
        combined.append(first)
    return combined


def paired_ratios(rows: list[dict], baseline: str) -> dict:
    """Per model and config: ``baseline``'s ms over the config's ms within each round (each pair timed close together),
    and their median -- an A/B that a drift between rounds does not move. Also for the loop timings."""
    out: dict[str, dict] = {}
    by_round = {(r["model"], r.get("round", 0), r["config"]): r for r in rows if "ms" in r}
    for (model, round_index, config), row in sorted(by_round.items()):
        base = by_round.get((model, round_index, baseline))
        if base is None or config == baseline:
            continue
        entry = out.setdefault(model, {"baseline": baseline}).setdefault(
            config, {"ratios": [], "loop_ratios": [], "schedule_ratios": []})
        entry["ratios"].append(round(base["ms"] / row["ms"], 4))
        for timing in ("loop", "schedule"):
            if f"ms_{timing}" in base and f"ms_{timing}" in row:
                entry[f"{timing}_ratios"].append(round(base[f"ms_{timing}"] / row[f"ms_{timing}"], 4))
    for model_entry in out.values():
        for config, entry in model_entry.items():
            if config != "baseline":
                for key in ("ratios", "loop_ratios", "schedule_ratios"):
                    if entry[key]:
                        entry[f"median_{key[:-1]}"] = round(statistics.median(entry[key]), 4)
    return out


def summarize(rows: list[dict]) -> dict:
    """Speed-up ratios per model: ours' best lossless vs diffusers' best, ours' best FP8 vs torchao's FP8 and vs
    diffusers' best, ours' best int8 vs torchao's int8, each from rows of the same run (a format against the same
    format: the int8 rows never stand in for FP8)."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        # a row whose output on new inputs is off (fresh_input_check) is no candidate for any ratio
        ok = {r["config"]: r for r in rows
              if r["model"] == model and "ms" in r and not r.get("fresh_inputs_disagree") and not r.get("probe")}

        entry = _best_and_ratios(ok, "ms", "")
        if any("ms_schedule" in r for r in ok.values()):  # --schedule-steps: the same from the runs' per-step times
            entry.update(_best_and_ratios({n: r for n, r in ok.items() if "ms_schedule" in r}, "ms_schedule", "_run"))
        out[model] = entry
    return out


def _best_and_ratios(ok: dict[str, dict], key: str, suffix: str) -> dict:
    """``summarize``'s entry for one timing (``key``): ours' best row per format and its ratios to the peers, every
    name ending in ``suffix``."""
    def best(wanted: Callable[[str, dict], bool]):
        return min((r for n, r in ok.items() if n.startswith("ours") and wanted(n, r)), key=lambda r: r[key],
                   default=None)

    # lossy rows by the format of their linears; a lossy attention beside bf16 linears is in neither
    ours_bf16 = best(lambda n, r: r["lossless"])
    # FP8 linears: "fp8" in the name, but not an int8 stack with FP8 attention (ours_int8_fp8attn_*)
    ours_fp8 = best(lambda n, r: not r["lossless"] and "fp8" in n and not n.startswith("ours_int8"))
    ours_int8 = best(lambda n, r: not r["lossless"] and n.startswith("ours_int8"))
    entry = {f"ours_best_lossless{suffix}": ours_bf16 and ours_bf16["config"],
             f"ours_best_fp8{suffix}": ours_fp8 and ours_fp8["config"]}
    if ours_int8:
        entry[f"ours_best_int8{suffix}"] = ours_int8["config"]
    for label, mine, peer in (("lossless_vs_diffusers_best", ours_bf16, "diffusers_best"),
                              ("fp8_vs_torchao", ours_fp8, "torchao_fp8_rowwise"),
                              ("fp8_vs_diffusers_best", ours_fp8, "diffusers_best"),
                              ("int8_vs_torchao_int8", ours_int8, "torchao_int8"),
                              # the 8-bit stack a user would pick against the peers' FP8 path: named apart
                              ("int8_vs_torchao_fp8", ours_int8, "torchao_fp8_rowwise"),
                              ("int8_vs_diffusers_best", ours_int8, "diffusers_best"),
                              ("lossless_vs_diffusers_eager", ours_bf16, "diffusers_eager")):
        if mine and peer in ok:
            entry[f"{label}{suffix}"] = round(ok[peer][key] / mine[key], 3)
            if key == "ms" and "ms_loop" in mine and "ms_loop" in ok[peer]:  # the same pair, timed back to back
                entry[f"{label}_loop"] = round(ok[peer]["ms_loop"] / mine["ms_loop"], 3)
    return entry


# ------------------------------------------------------------------------------------------ table and plot
def markdown_table(result: dict) -> str:
    """One row per config: ms per step, the speed-up over diffusers' best recipe of the same run, and the rest."""
    loop = any("ms_loop" in r for r in result["rows"])  # back-to-back timing was asked for: its own column
    steps = next((r["schedule_steps"] for r in result["rows"] if "ms_schedule" in r), None)  # --schedule-steps
    run_header = f"ms/step in a {steps}-step run (× diffusers best) | " if steps else ""
    lines = ["| model | config | ms/step | " + ("ms/step in a loop | " if loop else "") + run_header
             + "× diffusers best | TFLOP/s | rel. err vs eager | new inputs | first call s | peak GiB | SM MHz | W |",
             "|---|---|---:|" + ("---:|" if loop else "") + ("---:|" if steps else "")
             + "---:|---:|---:|---:|---:|---:|---:|---:|"]
    best = {r["model"]: r["ms"] for r in result["rows"] if r["config"] == "diffusers_best" and "ms" in r}
    best_run = {r["model"]: r["ms_schedule"] for r in result["rows"]
                if r["config"] == "diffusers_best" and "ms_schedule" in r}
    for r in result["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['model']} | {r['config']} | {r.get('error', '')[:60]} | | | | | | | | |"
                         + (" |" if loop else "") + (" |" if steps else ""))
            continue
        ratio = f"{best[r['model']] / r['ms']:.2f}" if r["model"] in best else ""
        in_loop = (f"{r['ms_per_step_loop']:.1f} | " if "ms_per_step_loop" in r else " | ") if loop else ""
        if steps:
            run_ratio = f" ({best_run[r['model']] / r['ms_schedule']:.2f})" if r["model"] in best_run else ""
            in_loop += f"{r['ms_per_step_schedule']:.1f}{run_ratio} | " if "ms_schedule" in r else " | "
        output = _has_model_output(r)
        error = f"{r['rel_err_vs_eager']:.4f}" if output else "— (no model output)"
        lines.append(f"| {r['model']} | {r['config']} | {r['ms_per_step']:.1f} | {in_loop}{ratio} | {r['tflops']:.0f} | "
                     f"{error} | {_fresh_cell(r) if output else ''} | {r['first_call_s']:.1f} | "
                     f"{r.get('peak_mem_gib') or ''} | "
                     f"{r.get('sm_clock_mhz', '')} | {r.get('power_w', '')} |")
    return "\n".join(lines)


TABLE_BLOCK = re.compile(r"(<!-- peers-table: (?P<files>[^ ]+) -->\n)(?P<body>.*?)(<!-- /peers-table -->)", re.S)


def tables_from(paths: list[str]) -> str:
    """The markdown table of each result file (paths relative to the repository root), headed by its GPU."""
    parts = []
    for path in paths:
        with open(os.path.join(ROOT, path)) as f:
            result = json.load(f)
        parts.append(f"`{os.path.basename(path)}` ({result['env']['gpu']}, torch {result['env']['torch']}):\n\n"
                     f"{markdown_table(result)}\n")
    return "\n".join(parts)


def update_tables(markdown_path: str, check: bool = False) -> int:
    """Regenerate every peers-table block of ``markdown_path`` from the files its marker names; with ``check``,
    report the stale blocks instead and return 1 if there are any."""
    with open(markdown_path) as f:
        text = f.read()
    stale = []

    def regenerate(match: re.Match) -> str:
        body = tables_from(match["files"].split(","))
        if body != match["body"]:
            stale.append(match["files"])
        return match.group(1) + body + match.group(4)

    new_text, blocks = TABLE_BLOCK.subn(regenerate, text)
    if not blocks:
        print(f"error: {markdown_path} has no '<!-- peers-table: FILES -->' ... '<!-- /peers-table -->' block; add "
              "one naming the result files its table comes from", file=sys.stderr)
        return 2
    if check:
        for files in stale:
            print(f"{markdown_path}: the table from {files} is stale; run python benchmarks/bench_peers.py "
                  f"--readme {markdown_path}", file=sys.stderr)
        return 1 if stale else 0
    with open(markdown_path, "w") as f:
        f.write(new_text)
    return 0


def _has_model_output(row: dict) -> bool:
    """False for the rows whose forward returns no model output (the floor rows; their files' error is 1.0)."""
    return row.get("rel_err_vs_eager") is not None and (row["config"] not in ROWS or ROWS[row["config"]].model_output)


def _fresh_cell(row: dict) -> str:
    if "rel_err_fresh_inputs" not in row:
        return ""
    return f"{row['rel_err_fresh_inputs']:.4f}" + (" (off: excluded)" if row.get("fresh_inputs_disagree") else "")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result["rows"] if "ms" in r})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["rows"] if r["model"] == model and "ms" in r]
        names = [r["config"] for r in rows]
        values = [r["ms_per_step"] for r in rows]
        colors = ["#4c72b0" if n.startswith("ours") else "#999999" for n in names]
        ax.barh(names, values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per denoising step (lower is better)")
        ax.set_title(f"{model}: {result['specs'][model]['shape']}"[:80], fontsize=9)
    fig.suptitle(f"{result['env']['gpu']}, torch {result['env']['torch']}: omni_accel (blue) vs peers (grey)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny random models (CPU smoke test)")
    ap.add_argument("--models", default="flux", help=f"comma list: {','.join(SPECS)}")
    ap.add_argument("--configs", default=None, help=f"comma list in run order (default: {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--iters", type=int, default=None, help="timed forwards per row (default 10; tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up forwards incl. the first (default 3; tiny 1)")
    ap.add_argument("--time-budget", type=float, default=560.0, help="seconds; rows that would start later skip")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds after the start at which a running row is interrupted (its row records it) and the "
                         "run ends, writing what it has; 0 = none")
    ap.add_argument("--blocks", type=int, default=0,
                    help="keep N blocks of each stack (FLUX: N dual + 2N single) at full width: per-kernel A/B runs "
                         "in a fraction of the time; ms/step then is not a whole model's; 0 = all")
    ap.add_argument("--profile", action="store_true", help="kernel time by kind of one forward per row (CUDA)")
    ap.add_argument("--trace-dir", default=None,
                    help="with --profile: also write each row's profiled forward as a Chrome trace into this folder")
    ap.add_argument("--host-profile", action="store_true",
                    help="host seconds per forward and the CPU ops by self time (is the GPU waiting for Python?)")
    ap.add_argument("--profile-loop", type=int, default=0,
                    help="profile N forwards launched back to back (CUDA): per forward busy and idle GPU time, the "
                         "gaps between kernels across forwards, the host's waits for the GPU; 0 = off")
    ap.add_argument("--log-clocks", action="store_true", help="SM clock and board power over each row's forwards")
    ap.add_argument("--loop-forwards", type=int, default=0,
                    help="also time N forwards launched back to back, as a denoising loop runs them (3 groups): "
                         "ms_loop / ms_per_step_loop per row, beside the per-forward timing; 0 = off")
    ap.add_argument("--quack-tiles", default=",".join(QUACK_TILES),
                    help="the quack GEMM tiles of the ours_bf16_mk_pdl_tunedquack row (comma-separated "
                         "omni_accel.kernels.quack_gemm names)")
    ap.add_argument("--schedule-steps", type=int, default=0,
                    help="also time N forwards at the timesteps of a real N-step schedule inside one pipeline call "
                         "(2 runs): ms_schedule / ms_per_step_schedule per row, what a denoising run costs per step "
                         "with the modulation table's once-per-call work counted; 0 = off")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every config this many times, in alternating order (A B, B A, ...): rows carry the "
                         "median and each round's figure, and 'paired' holds each config's speed-up over the first "
                         "config within each round (an A/B that drift over the run does not move); profiles are "
                         "taken in the first round only")
    ap.add_argument("--out", default="benchmarks/results/bench_peers.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    ap.add_argument("--table-from", default=None,
                    help="print the markdown table of result files (comma list) and exit: the README's tables")
    ap.add_argument("--readme", default=None,
                    help="rewrite the blocks of this markdown file between '<!-- peers-table: FILES -->' and "
                         "'<!-- /peers-table -->' from those result files (comma list), and exit")
    ap.add_argument("--check", action="store_true",
                    help="with --readme: change nothing, exit 1 if a block differs from its result files")
    args = ap.parse_args(argv)
    if args.loop_forwards < 0:
        ap.error(f"--loop-forwards {args.loop_forwards}: give a number of forwards (>= 1), or 0 for none")
    if args.schedule_steps < 0:
        ap.error(f"--schedule-steps {args.schedule_steps}: give a number of steps (>= 1), or 0 for none")
    if args.profile_loop < 0:
        ap.error(f"--profile-loop {args.profile_loop}: give a number of forwards (>= 1), or 0 for none")
    if args.blocks < 0:
        ap.error(f"--blocks {args.blocks}: give the number of blocks to keep per stack (>= 1), or 0 for all")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give the number of times to time each config (>= 1)")
    try:
        for name in args.quack_tiles.split(","):
            quack_gemm.check_name(name)
    except AccelError as exc:
        ap.error(f"--quack-tiles: {exc}")
    if args.check and not args.readme:
        ap.error("--check compares a markdown file's peers-table blocks with their result files: give it with "
                 "--readme FILE")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table_from:
        print(tables_from(args.table_from.split(",")))
        return 0
    if args.readme:
        return update_tables(args.readme, check=args.check)
    ROWS["ours_bf16_mk_pdl_tunedquack"] = quack_row(tuple(args.quack_tiles.split(",")))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU; use --device cpu --tiny", file=sys.stderr)
        return 2
    models = args.models.split(",")
    configs = args.configs.split(",") if args.configs else list(DEFAULT_CONFIGS)
    unknown = [m for m in models if m not in SPECS] + [c for c in configs if c not in ROWS]
    if unknown:
        print(f"error: unknown model/config {unknown}; models: {list(SPECS)}, configs: {list(ROWS)}", file=sys.stderr)
        return 2
    destructive = [c for c in configs if ROWS[c].destructive]
    if len(destructive) > 1:
        print(f"error: --configs has {len(destructive)} rows that change the weights in place ({destructive}); the "
              "second would quantize the first one's weights. Run each in its own invocation.", file=sys.stderr)
        return 2
    if destructive and args.rounds > 1:
        print(f"error: --rounds {args.rounds} would run {destructive[0]} (it changes the weights in place) before "
              "other rows of a later round; time it with --rounds 1 in its own invocation.", file=sys.stderr)
        return 2
    args.iters = args.iters or (2 if args.tiny else 10)
    args.warmup = args.warmup or (1 if args.tiny else 3)
    t_start = time.perf_counter()

    import diffusers

    import omni_accel

    log(f"adapters: {ensure_adapters()}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    from omni_accel.kernels.sage_attention import hopper_kernel_built

    packages = ("torchao", "nvidia-cudnn-frontend", "triton", "flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl",
                "sageattention")
    versions = {p: _version(p) for p in packages}
    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "diffusers": diffusers.__version__, "omni_accel": omni_accel.__version__,
           "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
           "python": platform.python_version(), **versions,
           # whether attention="sage" / auto's long route can run the quantized Hopper route (a 1.x install cannot)
           "sageattention_hopper_kernel": hopper_kernel_built()}
    clocks = ClockLog(enabled=args.log_clocks and device.type == "cuda")
    gemm = measure_gemm_tflops(device, args.tiny)
    result = {"benchmark": "bench_peers", "env": env, "gemm_bf16_tflops": round(gemm, 1),
              "gemm_clocks": clocks.since_mark(), "iters": args.iters, "warmup": args.warmup, "specs": {},
              "rows": [], "skipped": [], "summary": {}}
    log(f"env {env}; bf16 GEMM {gemm:.1f} TFLOP/s")

    if args.deadline:
        arm_deadline(args.deadline - (time.perf_counter() - t_start))

    timed_rows: list[dict] = []  # every round's rows; result["rows"] holds one per config

    def write() -> None:
        result["rows"] = combine_rounds(timed_rows)
        if args.rounds > 1:
            result["round_rows"] = timed_rows
            result["paired"] = paired_ratios(timed_rows, configs[0])
        result["summary"] = summarize(result["rows"])
        result["total_s"] = round(time.perf_counter() - t_start, 1)
        write_result(args.out, result)

    for model in models:
        spec = with_blocks(SPECS[model](args.tiny), args.blocks)
        flops = analytic_flops({**spec, "model": "wan" if model == "wan81" else model})
        result["specs"][model] = {"shape": spec["shape"], "cfg": spec["cfg"], "forwards_per_step": spec["forwards_per_step"],
                                  "tflop_per_forward": round(flops["total"] / 1e12, 3),
                                  "attention_share": round(flops["attention"] / flops["total"], 3)}
        log(f"{model}: {spec['shape']}; {flops['total'] / 1e12:.2f} TFLOP/forward "
            f"({flops['attention'] / flops['total']:.0%} attention)")
        transformer = build_transformer(spec, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        pipe = build_pipeline(spec, transformer)
        inputs = make_inputs(spec, device, transformer.dtype)
        reference = eager_reference(transformer, inputs)
        sync(device)
        for round_index, name in run_order(ordered(configs), args.rounds):
            row = ROWS[name]
            reason = skip_reason(row, device)
            if reason is None and time.perf_counter() - t_start > args.time_budget:
                reason = f"time budget of {args.time_budget:.0f} s spent"
            if reason is not None:
                if round_index == 0 or reason.startswith("time budget"):  # a missing package: once
                    result["skipped"].append({"model": model, "config": name, "skipped": reason,
                                              **({"round": round_index} if args.rounds > 1 else {})})
                log(f"{model} {name}: skipped ({reason})")
                write()
                continue
            log(f"{model} {name} ..." + (f" (round {round_index + 1} of {args.rounds})" if args.rounds > 1 else ""))
            # later rounds time the row again; its profile (minutes of tracing) comes from the first
            row_args = args if round_index == 0 else argparse.Namespace(**{**vars(args), "profile": False,
                                                                            "host_profile": False})
            entry = run_row(row, spec, pipe, inputs, reference, device, row_args, clocks, flops)
            if args.rounds > 1:
                entry["round"] = round_index
            timed_rows.append(entry)
            if entry.get("deadline_passed"):
                log(f"{model} {name}: deadline passed; ending the run")
                write()
                break
            shown = {k: entry.get(k) for k in ("ms_per_step", "ms_each", "gc_while_timed", "ms_per_step_schedule",
                                               "tflops", "rel_err_vs_eager", "first_call_s", "peak_mem_gib",
                                               "sm_clock_mhz", "power_w", "error")}
            log(f"{model} {name}: {shown}" + (f" kinds {entry['profile']['by_kind_ms']} idle "
                                              f"{entry['profile']['idle_ms']}" if "profile" in entry else ""))
            write()
        del pipe, transformer, inputs, reference
        gc.collect()
        if any(r.get("deadline_passed") for r in timed_rows):
            break
        if device.type == "cuda":
            torch.cuda.empty_cache()
    clocks.stop()
    if args.deadline:
        import signal

        signal.alarm(0)
    cudnn_fp8 = sys.modules.get("omni_accel.kernels.cudnn_fp8_attention")
    cudnn_refusals = cudnn_fp8.refused_shapes() if cudnn_fp8 is not None else {}
    if cudnn_refusals:
        result["cudnn_fp8_refused_shapes"] = cudnn_refusals
    write()
    print(markdown_table(result))
    print(result["summary"])
    if "paired" in result:
        print({model: {config: entry.get("median_ratio") for config, entry in by_config.items() if config != "baseline"}
               for model, by_config in result["paired"].items()})
    try:
        plot(result, args.plot or os.path.splitext(args.out)[0] + ".png")
    except Exception as exc:  # noqa: BLE001 -- no matplotlib: the JSON is what matters
        log(f"plot skipped: {exc!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
