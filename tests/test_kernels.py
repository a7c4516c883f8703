"""Fused kernels (omni_accel/kernels/fused*.py): Triton kernels in Triton's interpreter against float64, the eager
fallback against diffusers' layers, the kernels pass on every family's tiny pipeline, torch.compile, the benchmark.

Tolerances, against the same formula in float64 on the same inputs: float32 max abs error <= 1e-5 (values O(1..10));
bfloat16 |err| <= 2^-7 x (|exact| + 1e-3) -- one bf16 ulp: Triton's interpreter rounds float32 -> bfloat16 by
truncation (numpy has no bf16), so the bound is one ulp where the GPU's round-to-nearest gives half;
float16 |err| <= 2^-10 x (|exact| + 1e-3). Pipelines in float32: max abs difference <= 1e-5 with the Triton path,
and exactly equal with the eager fallback on CPU (same op sequence as diffusers).
"""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from diffusers.models import normalization as dnorm

import omni_accel
from omni_accel import AccelError
from omni_accel.hooks import add_hook
from omni_accel.kernels import fused
from omni_accel.kernels.fused_pass import KINDS, _FusedForwardHook
from omni_accel.testing import run, run_accelerated, tiny_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("flux", "flux2", "qwen_image", "sd3", "wan", "z_image")
BOUND = {"torch.bfloat16": 2.0 ** -7, "torch.float16": 2.0 ** -10}


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORKER = _load("kernels_worker", "tests/kernels_worker.py")


# --------------------------------------------------------------------------- Triton kernels, interpreted on CPU
@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """One subprocess with TRITON_INTERPRET=1 runs every kernel case and every family's pipeline (~35 s)."""
    pytest.importorskip("triton", reason="triton is Linux-only in the test extra")
    out = tmp_path_factory.mktemp("kernels") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMNI_ACCEL_KERNELS="auto")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "kernels_worker.py"), str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_worker_ran_the_triton_path_in_the_interpreter(interpreted):
    assert interpreted["interpreted"] is True and interpreted["uses_triton_cpu"] is True


@pytest.mark.parametrize("case", WORKER.KERNEL_CASES)
def test_triton_kernel_matches_float64(interpreted, case):
    r = interpreted["kernels"][case]
    assert "error" not in r, r.get("error")
    assert r["contiguous"]
    if r["dtype"] == "torch.float32":
        assert r["max_abs_err"] <= 1e-5, r
    else:
        assert r["max_err_over_ref"] <= BOUND[r["dtype"]], r


@pytest.mark.parametrize("case", WORKER.INT8_GEMM_CASES + WORKER.INT8_TMA_CASES + WORKER.INT8_WS_CASES
                         + WORKER.INT8_SPLIT_TAIL_CASES)
def test_int8_gemm_kernel_equals_int_mm_and_the_rescale(interpreted, case):
    """Exact int32 sums either way, then the same fp32 rescale and one rounding: the outputs are equal (with the
    last wave split along K too: integer partial sums, added in any order)."""
    r = interpreted["int8_gemm"][case]
    assert "error" not in r, r.get("error")
    assert r["equal"], r
    if case.startswith("int8_split_tail"):  # the split path ran: the persistent kernel, then tail tiles x splits
        assert [tuple(launch) for launch in r["launched"]] == [
            ("_int8_gemm_rescale_ws_kernel", 4), ("_int8_gemm_split_tail_kernel",
                                                  {"int8_split_tail-64x96x224-bias-bfloat16": 2 * 2,
                                                   "int8_split_tail-400x176x24-nobias-bfloat16": 1 * 4,
                                                   "int8_split_tail-400x160x40-bias-float16": 2 * 2}[case])], r
    elif case.startswith("int8_ws"):  # not asked for: one launch
        assert [launch[0] for launch in r["launched"]] == ["_int8_gemm_rescale_ws_kernel"], r


def test_split_tail_plan_fills_the_idle_programs_of_a_short_last_wave(monkeypatch):
    """FLUX's GEMMs on 132 SMs with 128 x 256 tiles: 432 tiles (4,608 x 3,072 outputs) leave 36 for a last wave, split
    3 ways; 1,728 (x 12,288) leave 12, split at most TAIL_MAX_SPLITS ways; 1,296 (x 9,216) leave 108, more than
    half: not split. One wave or less, an even division, or the switch off: nothing split."""
    from omni_accel.kernels import int8_gemm_triton as g

    monkeypatch.setattr(g, "SPLIT_TAIL", True)
    assert g.split_tail_plan(432, 132, 120) == (396, 3)
    assert g.split_tail_plan(1728, 132, 24) == (1716, g.TAIL_MAX_SPLITS)
    assert g.split_tail_plan(1296, 132, 24) == (1296, 1)
    assert g.split_tail_plan(100, 132, 24) == (100, 1)
    assert g.split_tail_plan(264, 132, 24) == (264, 1)
    assert g.split_tail_plan(133, 132, 2) == (132, 2)  # no more splits than K steps
    monkeypatch.setattr(g, "SPLIT_TAIL", False)
    assert g.split_tail_plan(432, 132, 120) == (432, 1)
    assert g.split_tail_plan(432, 132, 120, enabled=True) == (396, 3)  # a benchmark asks without the switch


@pytest.mark.parametrize("case", WORKER.FP8_QUANT_CASES)
def test_fp8_row_quantization_kernel_matches_the_torch_expression(interpreted, case):
    r = interpreted["fp8_quant"][case]
    assert "error" not in r, r.get("error")
    assert r["scales_equal"]
    # every byte equal except the interpreter's own carry bug (see kernels_worker.fp8_quant_cases)
    assert r["other_mismatches"] == 0 and r["frac_equal"] > 0.9, r


@pytest.mark.parametrize("case", WORKER.CONCAT_GELU_CASES)
def test_concat_gelu_kernel_matches_its_formula(interpreted, case):
    """The epilogue-fusion kernel: e4m3 output bytes as the float32 formula's (a rounding tie may flip, one e4m3
    step = 2^-3 relative); bf16 within one ulp (the interpreter truncates to bf16)."""
    r = interpreted["concat_gelu"][case]
    assert "error" not in r, r.get("error")
    assert r["shape"] == r["ref_shape"]
    if r["dtype"] == "torch.float8_e4m3fn":
        assert r["frac_equal"] > 0.98 and r["max_err_over_ref"] <= 2.0 ** -3, r
    else:
        assert r["max_err_over_ref"] <= BOUND[r["dtype"]], r


@pytest.mark.parametrize("way", WORKER.CONCAT_GELU_INT8_WAYS)
@pytest.mark.parametrize("case", WORKER.CONCAT_GELU_INT8_CASES)
def test_concat_gelu_int8_kernel_quantizes_rows_as_the_int8_linear_does(interpreted, case, way):
    """The int8 epilogue kernels (one pass with the row in registers, two passes over blocks; each also with the
    GELU through tanh and values multiplied by the row's reciprocal scale): the int8 values and per-row scales of
    ``quantize_rows_int8`` applied to the 16-bit concatenation, a value at a rounding tie aside (one int8 step)."""
    r = interpreted["concat_gelu_int8"][f"{case}/{way}"]
    assert "error" not in r, r.get("error")
    assert r["dtype"] == "torch.int8" and r["shape"] == r["ref_shape"] and r["scale_shape"] == [r["shape"][0], 1]
    assert r["int8_max_diff"] <= 1 and r["int8_frac_equal"] > 0.99, r
    assert r["scale_max_rel_err"] <= 2.0 ** -8, r


@pytest.mark.parametrize("reciprocal", ["", "-reciprocal"])
@pytest.mark.parametrize("case", WORKER.LAYERNORM_INT8_CASES)
def test_layernorm_int8_kernel_quantizes_rows_as_the_int8_linear_does(interpreted, case, reciprocal):
    """The AdaLN kernel's int8 form (dividing by the row's scale, or multiplying by its reciprocal): the int8 values
    and per-row scales of ``quantize_rows_int8`` applied to the modulated rows rounded to 16 bits, a value at a
    rounding tie aside (one int8 step)."""
    r = interpreted["layernorm_int8"][case + reciprocal]
    assert "error" not in r, r.get("error")
    assert r["dtype"] == "torch.int8" and r["shape"] == r["ref_shape"] and r["scale_shape"] == [r["shape"][0], 1]
    assert r["int8_max_diff"] <= 1 and r["int8_frac_equal"] > 0.99, r
    assert r["scale_max_rel_err"] <= 2.0 ** -8, r


@pytest.mark.parametrize("inputs", [i + r for i in WORKER.LAYERNORM_PARTS_INPUTS for r in ("", "-reciprocal")])
@pytest.mark.parametrize("case", WORKER.LAYERNORM_PARTS_CASES)
def test_layernorm_int8_parts_kernel_gives_the_padded_kernels_bytes(interpreted, case, inputs):
    """The AdaLN int8 kernel's parts form (C as 1, 3 or 5 unpadded power-of-two tiles; two streams or one; a short
    last program or none; dividing by the row's scale or multiplying by its reciprocal; bf16 or fp16): the padded
    kernel's int8 values and row scales, bit for bit, each kernel launched with its tiles. The two add a row's sums
    in different orders: on rows whose sums are exact in any order (``exact_sum_rows``) no order can move a value;
    on these random rows none moved."""
    r = interpreted["layernorm_parts"][f"{case}/{inputs}"]
    assert "error" not in r, r.get("error")
    assert r["int8_equal"] and r["scales_equal"], r
    c, parts, rows_a, rows_b, (rows, _), _ = WORKER.LAYERNORM_PARTS_SHAPES[WORKER.LAYERNORM_PARTS_CASES.index(case)]
    programs = -(-(rows_a + rows_b) // rows)
    assert r["launched"] == [
        ["_layernorm_modulate_int8_parts_kernel", programs,
         {"PARTS": parts, "BLOCK": c // parts, "EVEN_ROWS": (rows_a + rows_b) % rows == 0}],
        ["_layernorm_modulate_int8_kernel", programs, {"BLOCK": 1 << (c - 1).bit_length()}]], r


@pytest.mark.parametrize("kernel, case", [("qk_norm_rope", c) for c in WORKER.QK_NORM_ROPE_CASES]
                         + [("layernorm", c) for c in WORKER.LAYERNORM_CASES])
def test_fp8_epilogue_kernel_matches_its_formula(interpreted, kernel, case):
    """FP8 attention's q / k kernel and the AdaLN kernel: e4m3 bytes as the float32 formula's, a rounding tie aside
    (one step, 2^-3)."""
    r = interpreted[kernel][case]
    assert "error" not in r, r.get("error")
    assert r["shape"] == r["ref_shape"]
    if case.endswith(("bf16", "fp16")):  # the 16-bit form: the formula's float32 values rounded the same way
        assert r["dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[case[-4:]]
        assert r["frac_equal"] > 0.97 and r["max_err_over_ref"] <= 2.0 ** -7, r
        return
    assert r["frac_equal"] > 0.97 and r["max_err_over_ref"] <= 2.0 ** -3, r


@pytest.mark.parametrize("family", WORKER.PIPELINE_FAMILIES)
def test_triton_path_pipeline_matches_plain_and_restores(interpreted, family):
    r = interpreted["pipelines"][family]
    assert "error" not in r, r.get("error")
    assert r["max_abs_diff"] <= 1e-5, r
    assert r["restored_equal"]
    (applied,) = r["applied"]
    assert applied["path"] == "triton" and applied["modules"] > 0


@pytest.mark.parametrize("case", WORKER.ATTENTION_CASES)
def test_fp8_attention_kernel_reproduces_its_arithmetic_and_bounds_the_error(interpreted, case):
    """Against a float64 emulation of the same quantized arithmetic: exact where the interpreter is (int8 Q K^T,
    16-bit P V); the interpreter's own e4m3 dot is off by ~5 % (measured on a lone 16x16 product), so 8-bit P V is
    held to that. Against exact attention: what each precision costs, and int8 Q K^T beating e4m3 on DiT-like keys
    (why it is the default). The GPU numbers at FLUX shapes are in benchmarks/results/bench_attention*.json."""
    r = interpreted["fp8_attention"][case]
    assert "error" not in r, r.get("error")
    mode, _, inputs, dtype = case.split("-")
    assert r["finite"] and r["dtype"] == f"torch.{dtype}"
    assert r["rel_err_vs_emulation"] <= (1e-5 if mode == "int8" else 0.08), r
    bound = {"int8": 0.04, "int8_fp8": 0.08, "int8_block_fp8": 0.08, "fp8": 0.1 if inputs == "randn" else 0.3}[mode]
    assert r["rel_err_vs_exact"] <= bound, r
    if mode == "int8_block_fp8":  # the TMA-fed forms: same arithmetic, same tile order, so the same bits
        assert r["tma_max_diff_vs_pointer"] == 0.0 and r["tma_ws_max_diff_vs_pointer"] == 0.0, r
        assert r["routed_tma_max_diff_vs_pointer"] == 0.0, r
    e4m3 = interpreted["fp8_attention"].get(case.replace(mode, "fp8", 1))
    if mode in ("int8_fp8", "int8_block_fp8") and inputs == "outliers" and e4m3 is not None:
        assert r["rel_err_vs_exact"] < e4m3["rel_err_vs_exact"] / 2, (r, e4m3)


def test_fp8_attention_pipeline_routes_every_call_and_restores(interpreted):
    r = interpreted["fp8_attention_pipeline"]
    assert "error" not in r, r.get("error")
    assert r["launches"] == r["expected_launches"] > 0
    assert r["routed_while_applied"] and r["dispatcher_restored"] and r["restored_equal"]
    assert r["finite"] and 0 < r["rel_err"] <= 0.05, r
    # compile=True: no graph break from the routing (it had one per attention call), no recompile on a second call
    assert r["graph_breaks"] == 0 and r["graphs_second_call"] == r["graphs_first_call"] > 0, r
    assert r["compiled_rel_err"] <= 0.05, r


def test_fp8_attention_is_refused_without_a_gpu_before_anything_is_patched():
    if fused.interpreted():
        pytest.skip("under the interpreter the CPU path is allowed; the worker covers it")
    pipe, _ = tiny_pipeline("flux")
    module = sys.modules[type(pipe.transformer).__module__]
    dispatcher = module.dispatch_attention_fn
    with pytest.raises(AccelError) as err:
        omni_accel.accelerate(pipe, attention="fp8")
    assert str(err.value) == ("attention='fp8' needs a CUDA GPU with FP8 tensor cores but the pipeline runs on cpu; "
                              "use attention='auto'.")
    assert module.dispatch_attention_fn is dispatcher and "omni_accel" not in vars(pipe)


def _compile_for_hopper(kernel, pointers: dict, consts: dict, options: dict, floats=("eps",), aligned: bool = False):
    """``kernel`` lowered to an sm_90 cubin without a GPU (triton ships ptxas): pointer arguments typed by
    ``pointers``, the ``floats`` fp32, other scalars i32; ``aligned`` marks pointers and strides 16-divisible, as the
    JIT specializes them for real tensors."""
    if fused.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1; the worker covers that path")
    triton = pytest.importorskip("triton", reason="triton is Linux-only in the test extra")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in floats else "i32") for n in names}
    divisible = [n for n in names if aligned and n not in consts and (n.endswith("_ptr") or n.startswith("stride"))]
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter does not lower anything; compiling to an sm_90 cubin does."""
    if fused.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1; the worker covers that path")
    ft = fused._triton_module()
    cases = [
        (ft._layernorm_modulate_kernel, dict(x_ptr="*bf16", scale_ptr="*bf16", shift_ptr="*bf16", out_ptr="*bf16"),
         dict(ROWS=1, BLOCK=4096)),
        (ft._rms_norm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16"),
         dict(HAS_WEIGHT=True, ROWS=32, BLOCK=128)),
        (ft._rms_norm_kernel, dict(x_ptr="*fp32", w_ptr="*fp32", out_ptr="*fp32"),
         dict(HAS_WEIGHT=False, ROWS=1, BLOCK=8192)),
        (ft._rms_norm_rope_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32",
                                        out_ptr="*bf16"), dict(HAS_WEIGHT=True, ROWS=32, BLOCK=64)),
        (ft._gated_residual_kernel, dict(x_ptr="*bf16", gate_ptr="*bf16", y_ptr="*bf16", out_ptr="*bf16"),
         dict(BLOCK=1024)),
        (ft._quantize_rows_fp8_kernel, dict(x_ptr="*bf16", out_ptr="*fp8e4nv", scale_ptr="*fp32"),
         dict(BLOCK=2048)),
    ]
    for kernel, pointers, consts in cases:
        compiled = _compile_for_hopper(kernel, pointers, consts, {"num_warps": 8},
                                       floats=("eps", "fp8_max", "min_amax"))
        assert "cubin" in compiled.asm, kernel.__name__


@pytest.mark.parametrize("mode", ["fp8", "int8_fp8", "int8", "int8_block_fp8"])
def test_fp8_attention_kernel_compiles_for_hopper_in_every_mode(mode):
    """Hopper's 8-bit MMAs constrain operand layouts and the reduction size; lowering to an sm_90 cubin (with one
    of the autotuned tile configs, the argument specializations the JIT makes) catches what the interpreter cannot.
    With per-key K scales ("int8_fp8") ptxas serializes the warp-group MMAs (its C7515 "wgmma ... serialized"
    warning); with block-scaled K it keeps them pipelined and spills nothing."""
    from omni_accel.kernels import fp8_attention as fa
    from omni_accel.kernels import fp8_attention_triton as fat

    qk_int8, pv_fp8 = fa.MODES[mode]
    qk_type = "*i8" if qk_int8 else "*fp8e4nv"
    pointers = dict(q_ptr=qk_type, k_ptr=qk_type, v_ptr="*fp8e4nv" if pv_fp8 else "*bf16", out_ptr="*bf16",
                    q_scale_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    consts = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, EVEN_K=True, QK_INT8=qk_int8, PV_FP8=pv_fp8,
                  P_MULT=fat.P_SCALE, K_BLOCK=fa.K_BLOCKS.get(mode, 0))
    consts["stride_vs" if pv_fp8 else "stride_vd"] = 1  # V's token-contiguous (e4m3) or dim-contiguous layout
    compiled = _compile_for_hopper(fat._fp8_attention_kernel, pointers, consts, {"num_warps": 8, "num_stages": 3},
                                   floats=("qk_scale",), aligned=True)
    assert "cubin" in compiled.asm
    assert "wgmma" in compiled.asm["ptx"], "no Hopper warp-group MMA: the 8-bit operands were not laid out for it"
    if qk_int8 and pv_fp8:  # why the block mode exists: per-key scales serialize the MMAs, per-tile ones do not
        report = _ptxas_report(compiled.asm["ptx"])
        assert ("C7515" in report) == (mode not in fa.K_BLOCKS), report
        assert mode not in fa.K_BLOCKS or "0 bytes spill stores" in report, report


@pytest.mark.parametrize("warp_specialize", [False, True])
def test_tma_attention_kernel_lowers_for_hopper_with_its_tiles(warp_specialize):
    """Every tile config the TMA attention kernel's autotuner tries lowers to an sm_90 cubin whose Q, K and V come
    by TMA into warp-group MMAs, without spills; warp specialized, the 4-warp tile is split into producer and
    consumer partitions (setmaxnreg hands the consumers the registers)."""
    from omni_accel.kernels import fp8_attention_triton as fat

    pointers = dict(q_ptr="*i8", k_ptr="*i8", v_ptr="*fp8e4nv", out_ptr="*bf16", q_scale_ptr="*fp32",
                    k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    # every tile with keys a whole number of tiles (FLUX), the first also with a short last tile (Wan's 32,760)
    cases = [(tile, True) for tile in fat._TMA_CONFIGS[warp_specialize]] + [(fat._TMA_CONFIGS[warp_specialize][0],
                                                                              False)]
    for (block_m, block_n, warps, stages), even_k in cases:
        consts = dict(HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n, EVEN_K=even_k, P_MULT=fat.P_SCALE,
                      K_BLOCK=fat.K_BLOCK_TILES, WARP_SPECIALIZE=warp_specialize, STAGES=stages)
        compiled = _compile_for_hopper(fat._int8_attention_tma_kernel, pointers, consts,
                                       {"num_warps": warps, "num_stages": stages}, floats=("qk_scale",), aligned=True)
        ptx = compiled.asm["ptx"]
        assert "wgmma" in ptx and "cp.async.bulk.tensor" in ptx, (block_m, block_n, warps)
        assert "0 bytes spill stores" in _ptxas_report(ptx), (block_m, block_n, warps)
        if warp_specialize and warps == 4:
            assert "setmaxnreg" in ptx, (block_m, block_n, warps)


@pytest.mark.parametrize("capability, expected", [((9, 0), "triton_tma"), ((8, 9), "triton"), ((10, 0), "triton")])
def test_fp8_attention_takes_the_tma_kernel_on_hopper_only(monkeypatch, capability, expected):
    """Without cuDNN's FP8 package, attention="fp8" runs the Triton kernel's TMA-fed form on Hopper (measured there)
    and its pointer form on other GPUs and the CPU."""
    import torch

    from omni_accel.kernels import cudnn_fp8_attention
    from omni_accel.kernels import fp8_attention as fa

    if fa._INTERPRETED:
        pytest.skip("this process imported triton with TRITON_INTERPRET=1: the interpreter always takes 'triton'")
    pytest.importorskip("triton", reason="triton is Linux-only in the test extra")
    monkeypatch.setattr(cudnn_fp8_attention, "unavailable_reason", lambda device: "nvidia-cudnn-frontend is missing")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch build: never asked
    assert fa.implementation_for(torch.device("cuda")) == "triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fa.implementation_for(torch.device("cuda")) == expected
    assert fa.implementation_for(torch.device("cuda", 0)) == expected
    assert fa.implementation_for(torch.device("cpu")) == "triton"


def test_tma_attention_refuses_what_it_cannot_run(monkeypatch):
    import torch

    pytest.importorskip("triton", reason="triton is Linux-only in the test extra")
    from omni_accel.kernels import fp8_attention_triton as fat

    q = torch.zeros(1, 2, 32, 16, dtype=torch.int8)
    v = torch.zeros(1, 2, 16, 32, dtype=torch.float8_e4m3fn).transpose(2, 3)
    scales = torch.ones(1, 2, 32)
    out = torch.empty(1, 32, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"design='tiled' is not known; use one of pointer, tma, tma_ws"):
        fat.launch(q, q, v, scales, scales, scales, 1.0, out, True, True, interpreted=True, k_block=128,
                   design="tiled")
    with pytest.raises(ValueError, match=r"design='tma' runs int8 Q K\^T with per-block K scales and e4m3 P V "
                                         r"only \(mode 'int8_block_fp8'\)"):
        fat.launch(q, q, v, scales, scales, scales, 1.0, out, True, True, interpreted=True, k_block=0, design="tma")
    assert fat.tma_ready(q, q, v) is None
    with pytest.raises(ValueError, match=r"^tile: tile \(64, 256, 4, 3\) is not BLOCK_M,BLOCK_N,warps,stages with "
                                         r"BLOCK_N dividing 128; e.g. 64,128,4,3$"):
        fat.launch(q, q, v, scales, scales, scales, 1.0, out, True, True, interpreted=False, k_block=128,
                   design="tma", tile=(64, 256, 4, 3))
    monkeypatch.setenv("OMNI_ACCEL_TMA_ATTENTION_CONFIGS_WS", "64,128,4,3;64,128")
    monkeypatch.setattr(fat, "_tma_autotuned", {})
    with pytest.raises(ValueError, match=r"^OMNI_ACCEL_TMA_ATTENTION_CONFIGS_WS: tile '64,128' is not "):
        fat._tma_kernel(True)
    unaligned = torch.zeros(1, 2, 16, 40, dtype=torch.float8_e4m3fn)[..., :32].transpose(2, 3)  # 40-byte rows
    with pytest.raises(ValueError, match=r"the TMA attention kernel cannot read these operands: v's base or strides "
                                         r"are not 16-byte aligned \(strides \(1280, 640, 1, 40\)\)"):
        fat.launch(q, q, unaligned, scales, scales, scales, 1.0, out, True, True, interpreted=True, k_block=128,
                   design="tma")


@pytest.mark.parametrize("case", WORKER.INT8_GEMV_CASES)
def test_int8_gemv_kernel_is_the_rescaled_product(interpreted, case):
    """The int8-weight GEMV of the modulation linears, each of its kernels (the tensor-core tiles, the reduction):
    within one bf16 step of the exact product, as the float32 multiply-and-sum it replaces is."""
    r = interpreted["int8_gemv"][case]
    assert "error" not in r, r.get("error")
    m, n = (int(v) for v in case.split("-")[1].split("x")[::2])
    assert r["shape"] == [m, n] and r["dtype"] == "torch.bfloat16"
    assert r["max_ulps_vs_exact"] <= 1.0 and r["reference_max_ulps_vs_exact"] <= 1.0, r
    assert len(r["kernels_max_ulps_vs_exact"]) > 1 and max(r["kernels_max_ulps_vs_exact"].values()) <= 1.0, r


def test_int8_gemv_kernel_compiles_for_hopper_without_spills():
    from omni_accel.kernels import int8_gemm_triton as g

    for rows in (1, 2, 16):
        block_m, block_k = g.gemv_tiles(rows)
        compiled = _compile_for_hopper(
            g._int8_gemv_kernel, dict(x_ptr="*bf16", w_ptr="*i8", w_scale_ptr="*fp32", out_ptr="*bf16"),
            dict(BLOCK_M=block_m, BLOCK_N=g.GEMV_BLOCK_N, BLOCK_K=block_k), {"num_warps": 4}, aligned=True)
        assert "ld.global" in compiled.asm["ptx"] and ".local" not in compiled.asm["ptx"], rows


@pytest.mark.parametrize("case", WORKER.SAGE_PREP_CASES + WORKER.SAGE_PREP_SUBTILE_CASES + WORKER.SAGE_PREP_FUSED_CASES)
def test_sage_prep_kernels_give_the_packages_operands(interpreted, case):
    """The four SageAttention preparation kernels: int8 Q and K, V's e4m3 values and every scale bit for bit what
    the PyTorch expressions (the package's layouts) give; also with the partial reductions read in 32-token steps,
    and from strided views of a fused q / k / v projection."""
    r = interpreted["sage_prep"][case]
    assert "error" not in r, r.get("error")
    assert all(r[f"{name}_equal"] for name in ("q8", "q_scale", "k8", "k_scale", "v8", "v_scale")), r
    assert r["v8_shape_equal"] and r["v8_differ_frac"] == 0.0, r


@pytest.mark.parametrize("case", WORKER.SAGE_NORMED_CASES)
def test_sage_preparation_from_the_q_k_kernels_inputs_gives_the_unfused_operands(interpreted, case):
    """sage_prep_triton.quantize_normed (Q quantized where it is normalized and rotated, K's column sums taken where
    K is written): every operand bit for bit what the q / k kernel's 16-bit output quantized by the PyTorch
    expressions gives, for one stream and a joint block's two, with and without a bias, bf16 and fp16, programs of 1,
    2 and 4 heads; int8 K too
    but for a value at a rounding tie, which K's mean summed in another order (32-key partials) may move by one."""
    r = interpreted["sage_normed"][case]
    assert "error" not in r, r.get("error")
    assert r["heads_per_program"] == int(case.rsplit("-h", 1)[1])  # the programs that loop over heads ran too
    assert all(r[f"{name}_equal"] for name in ("q8", "q_scale", "k_scale", "v8", "v_scale")), r
    assert r["k8_equal"] or (r["k8_max_diff"] == 1 and r["k8_differ_frac"] < 1e-3), r


def test_sage_prep_kernels_compile_for_hopper_without_spills():
    from omni_accel.kernels import sage_prep_triton as sp

    for d in (64, 128):
        cases = [
            (sp._kv_partials_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", k_sum_ptr="*fp32", v_amax_ptr="*fp32"),
             dict(TOKENS=128, D=d, SUB=128, STAGES=1), 8),
            (sp._kv_partials_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", k_sum_ptr="*fp32", v_amax_ptr="*fp32"),
             dict(TOKENS=128, D=d, SUB=32, STAGES=3), 4),
            (sp._queries_kernel, dict(q_ptr="*bf16", q8_ptr="*i8", scale_ptr="*fp32"), dict(D=d), 2),
            (sp._keys_kernel, dict(k_ptr="*bf16", mean_ptr="*fp32", k8_ptr="*i8", scale_ptr="*fp32"), dict(D=d), 8),
            (sp._values_kernel, dict(v_ptr="*bf16", inverse_ptr="*fp32", v8_ptr="*fp8e4nv"), dict(D=d), 8),
            (sp._kv_partials_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", k_sum_ptr="*fp32", v_amax_ptr="*fp32"),
             dict(TOKENS=128, D=d, SUB=128, STAGES=1, HAS_K=False), 8),
        ]
        normed = dict(src_ptr="*bf16", bias_ptr="*bf16", w_ptr="*bf16", src2_ptr="*bf16", bias2_ptr="*bf16",
                      w2_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32")
        for two in (False, True):
            flags = dict(D=d, HAS_BIAS=True, TWO=two, BF16=True, BIT_ROUND=False,
                         HEADS_PER_PROGRAM=sp._heads_per_program(24))
            cases += [
                (sp._normed_queries_kernel, {**normed, "q8_ptr": "*i8", "scale_ptr": "*fp32"}, flags,
                 sp.PREP_WARPS["normed_queries"]),
                (sp._normed_keys_kernel, {**normed, "k_ptr": "*bf16", "k_sum_ptr": "*fp32"},
                 {**flags, "TOKENS": sp.NORMED_KEY_TOKENS}, sp.PREP_WARPS["normed_keys"]),
            ]
        for kernel, pointers, consts, warps in cases:
            compiled = _compile_for_hopper(kernel, pointers, consts, {"num_warps": warps}, aligned=True)
            assert "0 bytes spill stores" in _ptxas_report(compiled.asm["ptx"]), (kernel.__name__, d, consts)


def test_int8_gemv_refuses_more_rows_than_one_mma_tile_and_unknown_kernels():
    from omni_accel.kernels import int8_gemm_triton as g

    w, scale = torch.zeros(8, 32, dtype=torch.int8), torch.ones(1, 8)
    with pytest.raises(ValueError) as err:
        g.int8_gemv(torch.zeros(17, 32, dtype=torch.bfloat16), w, scale)
    assert str(err.value) == ("int8_gemv takes up to 16 rows of x, got 17; use int8_mm_rescale (quantize x first) or "
                              "the layer's dequantized path for more")
    with pytest.raises(ValueError) as err:
        g.int8_gemv(torch.zeros(1, 32, dtype=torch.bfloat16), w, scale, kernel="dot")
    assert str(err.value) == ("kernel='dot' is not a GEMV kernel; use one of ('dot_64x256', 'dot_32x256', "
                              "'dot_64x128', 'dot_128x128', 'reduce')")


def test_tensor_core_int8_gemv_compiles_for_hopper_to_pipelined_copies_and_mmas():
    """The tensor-core GEMV lowers for sm_90 with asynchronous copies (the pipelined weight loads it exists for) where
    K is a multiple of the tile's (the modulation linears'), feeding bf16 tensor-core MMAs, without spills; with a
    masked K tail it still multiplies on the tensor cores."""
    from omni_accel.kernels import int8_gemm_triton as g

    for name, (block_n, block_k, warps, stages) in g.GEMV_DOT_TILES.items():
        for even_k in (True, False):
            compiled = _compile_for_hopper(
                g._int8_gemv_dot_kernel, dict(x_ptr="*bf16", w_ptr="*i8", w_scale_ptr="*fp32", out_ptr="*bf16"),
                dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=even_k, FLOAT32_DOT=False),
                {"num_warps": warps, "num_stages": stages}, aligned=True)
            ptx = compiled.asm["ptx"]
            mma = "wgmma.mma_async.sync.aligned.m64n16k16" if block_n % 64 == 0 else "mma.sync.aligned.m16n8k16"
            assert mma in ptx and ("cp.async" in ptx or not even_k), (name, even_k)  # the FLUX-sized path pipelines
            assert "0 bytes spill stores" in _ptxas_report(ptx), (name, even_k)


def test_int8_gemm_kernel_compiles_to_hopper_int8_mmas_in_every_tile_config():
    """Each shipped tile configuration lowers to an sm_90 cubin whose PTX multiplies with warp-group int8 MMAs
    (wgmma ... s8), without spilling registers; the interpreter checks the arithmetic, not this."""
    from omni_accel.kernels import int8_gemm_triton as g

    pointers = dict(x_ptr="*i8", w_ptr="*i8", out_ptr="*bf16", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                    bias_ptr="*bf16")
    for name, (block_m, block_n, block_k, group_m, warps, stages) in g.CONFIGS.items():
        consts = dict(HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                      EVEN_K=True)
        compiled = _compile_for_hopper(g._int8_gemm_rescale_kernel, pointers, consts,
                                       {"num_warps": warps, "num_stages": stages}, floats=(), aligned=True)
        ptx = compiled.asm["ptx"]
        assert "wgmma" in ptx and ".s8" in ptx, name
        report = _ptxas_report(ptx)
        assert "0 bytes spill stores" in report, (name, report)


def test_the_tile_picked_by_row_count_is_a_shipped_one():
    """Up to FEW_ROWS rows the pointer kernel takes FEW_ROWS_TILE (64 rows a tile: FLUX's 512 text rows fill more
    SMs), above it the large tile or the TMA / warp-specialized kernels; each name is one the launcher knows."""
    from omni_accel.kernels import int8_gemm_triton as g

    assert g.pick_config(512) == g.FEW_ROWS_TILE == "64x128x128" and g.FEW_ROWS_TILE in g.CONFIGS
    assert g.pick_config(g.FEW_ROWS + 1) == "128x256x128"
    assert g.pick_config(4096, tma=True) == "tma_128x256x128" and "tma_128x256x128" in g.TMA_CONFIGS
    assert g.pick_config(4096, tma=True, warp_specialize=True) == g.WS_TILE and g.WS_TILE in g.WS_CONFIGS


def test_persistent_tma_int8_gemm_compiles_to_tma_copies_and_int8_mmas():
    """The persistent kernel's tiles lower for sm_90 with TMA bulk-tensor copies (not per-thread loads) feeding
    warp-group int8 MMAs, within the shared memory an H100 / H200 block gets (227 KiB), without spills."""
    from omni_accel.kernels import int8_gemm_triton as g

    for name, (block_m, block_n, block_k, group_m, warps, stages) in g.TMA_CONFIGS.items():
        consts = dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, PROGRAMS=132)
        pointers = dict(x_desc=f"tensordesc<i8[{block_m}, {block_k}]>", w_desc=f"tensordesc<i8[{block_n}, {block_k}]>",
                        out_desc=f"tensordesc<bf16[{block_m}, {block_n}]>", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                        bias_ptr="*bf16")
        compiled = _compile_for_hopper(g._int8_gemm_rescale_tma_kernel, pointers, consts,
                                       {"num_warps": warps, "num_stages": stages}, floats=(), aligned=True)
        ptx = compiled.asm["ptx"]
        assert "cp.async.bulk.tensor" in ptx and "wgmma" in ptx and ".s8" in ptx, name
        assert compiled.metadata.shared <= 227 * 1024, (name, compiled.metadata.shared)
        assert "0 bytes spill stores" in _ptxas_report(ptx), name


def test_warp_specialized_int8_gemm_compiles_to_producer_and_consumer_partitions():
    """Each warp-specialized tile lowers for sm_90 into Triton's partitions (a producer issuing TMA copies, consumers
    whose registers are raised with setmaxnreg) feeding s8 warp-group MMAs, within 227 KiB of shared memory, no
    spills. Triton silently falls back to the unspecialized loop where it cannot partition (8 consumer warps did),
    which this catches."""
    from omni_accel.kernels import int8_gemm_triton as g

    pointers = dict(x_ptr="*i8", w_ptr="*i8", out_ptr="*bf16", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                    bias_ptr="*bf16")
    for name, (block_m, block_n, block_k, group_m, warps, stages) in g.WS_CONFIGS.items():
        consts = dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, PROGRAMS=132)
        compiled = _compile_for_hopper(g._int8_gemm_rescale_ws_kernel, pointers, consts,
                                       {"num_warps": warps, "num_stages": stages}, floats=(), aligned=True)
        ptx = compiled.asm["ptx"]
        assert "ttg.warp_specialize" in compiled.asm["ttgir"] and "setmaxnreg" in ptx, name
        assert "cp.async.bulk.tensor" in ptx and "wgmma" in ptx and ".s8" in ptx, name
        assert compiled.metadata.shared <= 227 * 1024, (name, compiled.metadata.shared)
        assert "0 bytes spill stores" in _ptxas_report(ptx), name


def test_split_tail_kernel_compiles_to_hopper_int8_mmas_and_a_released_arrival():
    """The split-tail kernel lowers for sm_90 with the warp-specialized kernel's tile: s8 warp-group MMAs, no spills
    (the partial tile is stored before the epilogue re-reads it in chunks), the arrival counter one thread's acq_rel
    atomic after a barrier (every thread's partial stored first), the partials read through L2."""
    from omni_accel.kernels import int8_gemm_triton as g

    block_m, block_n, block_k, group_m, _, _ = g.WS_CONFIGS[g.WS_TILE]
    warps, stages = g.TAIL_LAUNCH
    pointers = dict(x_ptr="*i8", w_ptr="*i8", out_ptr="*bf16", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                    bias_ptr="*bf16", partial_ptr="*i32", arrivals_ptr="*i32")
    consts = dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, EVEN_K=True,
                  CHUNK_N=64)
    compiled = _compile_for_hopper(g._int8_gemm_split_tail_kernel, pointers, consts,
                                   {"num_warps": warps, "num_stages": stages}, floats=(), aligned=True)
    ptx = compiled.asm["ptx"]
    assert "wgmma" in ptx and ".s8" in ptx
    assert re.search(r"bar\.sync[^\n]*\n(?:(?!st\.global)[^\n]*\n)*?[^\n]*@%p\d+ atom\.global\.gpu\.acq_rel\.add",
                     ptx), "the arrival: one thread's acq_rel atomic after a barrier, no store in between"
    assert "ld.global.cg" in ptx
    assert "0 bytes spill stores" in _ptxas_report(ptx)


def test_the_scratch_allocator_is_set_where_none_is_and_a_callers_own_is_kept():
    """Device-built descriptors need Triton's scratch allocator, which lives in a ContextVar: unset in every new
    thread (a server's workers). The kernel sets torch's there, and leaves one the caller set alone."""
    import contextvars

    import triton
    from triton.runtime import _allocation

    from omni_accel.kernels import int8_gemm_triton as g

    def ensured():
        g._ensure_scratch_allocator()
        return _allocation._allocator.get()

    def callers_own():
        triton.set_allocator(mine)
        return ensured()

    def mine(size, alignment, stream):
        return None

    assert contextvars.Context().run(ensured) is g._torch_scratch
    assert contextvars.Context().run(callers_own) is mine


def test_tma_config_refuses_operands_it_cannot_take():
    from omni_accel.kernels import int8_gemm_triton as g

    # refused twice over: CPU tensors outside the interpreter, and K = 24 (rows of 24 bytes are not 16-byte aligned)
    x = torch.zeros(32, 24, dtype=torch.int8)
    w = torch.zeros(16, 24, dtype=torch.int8)
    scale = torch.ones(32, 1)
    with pytest.raises(ValueError, match=r"config='tma_128x256x128': these operands cannot use TMA \(needs a "
                                         r"Hopper-or-newer GPU and 16-byte aligned rows: K a multiple of 16, N of 8\); "
                                         r"use a config without 'tma_' or 'ws_'"):
        g.int8_mm_rescale(x, w, scale, torch.ones(1, 16), None, torch.bfloat16, "tma_128x256x128")


def _ptxas_report(ptx: str) -> str:
    """What Triton's own ptxas says of ``ptx`` for sm_90a with -v: registers, spills, performance warnings."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", source.name, "-o", os.devnull],
                              capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("pdl", [True, False])
def test_epilogue_kernels_compile_for_hopper_with_and_without_pdl(pdl):
    """The epilogue-fusion kernels lowered to sm_90 cubins at FLUX's shapes (what the interpreter never runs: the
    approximate reciprocal, the rotary's register swap, the e4m3 stores). With PDL their PTX waits for the kernels
    before them (griddepcontrol.wait) and releases the next one (griddepcontrol.launch_dependents); without, neither."""
    from omni_accel.kernels import epilogue_triton as et

    cases = [  # (kernel, pointer types, constexprs, warps)
        (et._concat_gelu_kernel, dict(a_ptr="*fp8e4nv", a_scale_ptr="*fp32", h_ptr="*bf16", bias_ptr="*bf16",
                                      inverse_ptr="*fp32", out_ptr="*fp8e4nv"),
         dict(A_COLS=3072, A_HEAD=128, H_COLS=12288, A_SCALED=True, HAS_BIAS=True, CAST=True, APPROX=True, ROWS=4,
              BLOCK=512), 4),
        (et._qk_norm_rope_kernel, dict(src_ptr="*bf16", bias_ptr="*bf16", w_ptr="*bf16", src2_ptr="*bf16",
                                       bias2_ptr="*bf16", w2_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32",
                                       k_mean_ptr="*fp32", inverse_ptr="*fp32", out_ptr="*fp8e4nv"),
         dict(HEADS=24, D=128, HAS_BIAS=True, HAS_MEAN=True, CAST=True, TWO=False, ROWS=8), 4),
        (et._qk_norm_rope_kernel, dict(src_ptr="*bf16", bias_ptr="*bf16", w_ptr="*bf16", src2_ptr="*bf16",
                                       bias2_ptr="*bf16", w2_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32",
                                       k_mean_ptr="*fp32", inverse_ptr="*fp32", out_ptr="*bf16"),
         dict(HEADS=24, D=128, HAS_BIAS=True, HAS_MEAN=False, CAST=False, TWO=True, ROWS=8, SHARED_TOKEN=True), 4),
        (et._layernorm_modulate_cast_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", scale_ptr="*bf16", shift_ptr="*bf16",
                                                  inverse0_ptr="*fp32", inverse1_ptr="*fp32", inverse2_ptr="*fp32",
                                                  out_ptr="*fp8e4nv"),
         dict(C=3072, BLOCK=4096, ROWS=2, SPLIT=True, COUNT=2), 8),
        (et._concat_gelu_int8_kernel, dict(a_ptr="*bf16", a_scale_ptr="*fp32", h_ptr="*bf16", bias_ptr="*bf16",
                                           out_ptr="*i8", scale_ptr="*fp32"),
         dict(A_COLS=3072, A_HEAD=3072, H_COLS=12288, A_SCALED=False, HAS_BIAS=True, APPROX=True, BF16=True, ROWS=1,
              A_BLOCK=1024, H_BLOCK=1024), 4),
        (et._layernorm_modulate_int8_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", scale_ptr="*bf16", shift_ptr="*bf16",
                                                  out_ptr="*i8", row_scale_ptr="*fp32"),
         dict(C=3072, BLOCK=4096, ROWS=2, SPLIT=True, BF16=True, APPROX=True), 8),
        (et._layernorm_modulate_int8_parts_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", scale_ptr="*bf16",
                                                        shift_ptr="*bf16", out_ptr="*i8", row_scale_ptr="*fp32"),
         dict(C=3072, PARTS=3, BLOCK=1024, ROWS=2, SPLIT=True, EVEN_ROWS=False, BF16=True, APPROX=True), 8),
        (et._concat_gelu_int8_row_kernel, dict(a_ptr="*bf16", a_scale_ptr="*fp32", h_ptr="*bf16", bias_ptr="*bf16",
                                               out_ptr="*i8", scale_ptr="*fp32"),
         dict(A_COLS=3072, A_HEAD=128, H_COLS=12288, A_SCALED=False, HAS_BIAS=True, APPROX=True, BF16=True,
              WIDTH=16384), 8),
    ]
    for kernel, pointers, consts, warps in cases:
        ptx = _compile_for_hopper(kernel, pointers, {**consts, "PDL": pdl}, {"num_warps": warps}).asm["ptx"]
        for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
            assert (instruction in ptx) == pdl, (kernel.__name__, instruction)


def test_int8_epilogue_kernels_spare_special_function_instructions_when_asked():
    """With the GELU through the hardware's tanh and the reciprocal row scale, the one-pass int8 epilogue kernel at
    FLUX's single-block width issues one special-function instruction per value (tanh.approx) where it issued three
    (ex2, rcp and the division), divides once per row, and still fits its registers (no spills); the AdaLN kernel
    drops its per-value division too."""
    from omni_accel.kernels import epilogue_triton as et

    gelu_pointers = dict(a_ptr="*bf16", a_scale_ptr="*fp32", h_ptr="*bf16", bias_ptr="*bf16", out_ptr="*i8",
                         scale_ptr="*fp32")
    gelu_consts = dict(A_COLS=3072, A_HEAD=128, H_COLS=12288, A_SCALED=False, HAS_BIAS=True, APPROX=True, BF16=True,
                       WIDTH=16384, PDL=True)
    per_thread = 16384 // 256  # values of the row per thread at 8 warps
    counts = {}
    for fast in (False, True):
        ptx = _compile_for_hopper(et._concat_gelu_int8_row_kernel, gelu_pointers,
                                  {**gelu_consts, "GELU_TANH": fast, "RECIPROCAL": fast}, {"num_warps": 8},
                                  aligned=True).asm["ptx"]
        counts[fast] = {op: ptx.count(op + " ") for op in ("ex2.approx.ftz.f32", "rcp.approx.ftz.f32",
                                                          "div.full.f32", "div.rn.f32", "tanh.approx.f32")}
        if fast:
            assert "spill" not in _ptxas_report(ptx).replace("0 bytes spill", "")
    assert counts[False]["ex2.approx.ftz.f32"] == counts[False]["rcp.approx.ftz.f32"] == per_thread, counts
    assert counts[False]["div.full.f32"] >= per_thread and counts[False]["tanh.approx.f32"] == 0, counts
    assert counts[True]["tanh.approx.f32"] == per_thread, counts
    assert counts[True]["ex2.approx.ftz.f32"] == counts[True]["rcp.approx.ftz.f32"] == 0, counts
    assert counts[True]["div.full.f32"] + counts[True]["div.rn.f32"] <= 2, counts  # the row's scale and reciprocal
    norm_pointers = dict(a_ptr="*bf16", b_ptr="*bf16", scale_ptr="*bf16", shift_ptr="*bf16", out_ptr="*i8",
                         row_scale_ptr="*fp32")
    norm_consts = dict(C=3072, BLOCK=4096, ROWS=2, SPLIT=True, BF16=True, APPROX=True, PDL=True)
    divisions = [_compile_for_hopper(et._layernorm_modulate_int8_kernel, norm_pointers,
                                     {**norm_consts, "RECIPROCAL": r}, {"num_warps": 8}).asm["ptx"]
                 .count("div.full.f32 ") for r in (False, True)]
    assert divisions[0] - divisions[1] == 2 * 4096 // 256, divisions  # one per value of the program's two rows


def test_layernorm_int8_refuses_a_tile_that_splits_a_stream():
    from omni_accel.kernels import epilogue_triton as et

    a, b = torch.zeros(6, 8), torch.zeros(5, 8)
    with pytest.raises(ValueError, match=r"^layernorm_modulate_int8: tile rows 4 must divide the first stream's 6 "
                                         r"rows \(a program reads one stream\); pick a divisor$"):
        et.layernorm_modulate_int8(a, b, torch.zeros(8), torch.zeros(8), 1e-6, torch.bfloat16, tile=(4, 4))


def test_layernorm_int8_parts_kernel_compiles_for_hopper_without_spills():
    """The parts kernel lowered to sm_90 at FLUX's, SD3's and Wan's widths (3 x 1024, 3 x 512, 5 x 1024) with the
    default tile (two rows, 8 warps): no spills; no float -> int conversion (an int8 value is the low byte of one
    addition's bits); one bf16 conversion per two values; with the reciprocal row scale no division per value."""
    from omni_accel.kernels import epilogue_triton as et

    pointers = dict(a_ptr="*bf16", b_ptr="*bf16", scale_ptr="*bf16", shift_ptr="*bf16", out_ptr="*i8",
                    row_scale_ptr="*fp32")
    for c in (3072, 1536, 5120):
        parts, block = et.layernorm_parts(c)
        consts = dict(C=c, PARTS=parts, BLOCK=block, ROWS=2, SPLIT=True, EVEN_ROWS=False, BF16=True, APPROX=True,
                      PDL=True)
        ptx = {r: _compile_for_hopper(et._layernorm_modulate_int8_parts_kernel, pointers, {**consts, "RECIPROCAL": r},
                                      {"num_warps": 8}, aligned=True).asm["ptx"] for r in (False, True)}
        values = 2 * c // 256  # of the program's two rows, per thread
        for reciprocal, code in ptx.items():
            assert "spill" not in _ptxas_report(code).replace("0 bytes spill", ""), (c, reciprocal)
            assert "cvt.rzi" not in code and "cvt.rni" not in code, (c, reciprocal)
            assert code.count("cvt.rn.bf16x2.f32 ") == values // 2 and "cvt.rn.bf16.f32 " not in code, (c, reciprocal)
        assert ptx[False].count("div.full.f32 ") - ptx[True].count("div.full.f32 ") == values, c


def test_layernorm_int8_parts_takes_up_to_five_power_of_two_blocks_and_falls_back_otherwise(monkeypatch):
    """``parts=True`` launches the parts kernel where C is 1, 3 or 5 power-of-two blocks of at least 16 values
    (FLUX's, SD3's and Wan's widths among them) and the padded kernel for any other width (56 = 7 x 8, 24 = 3 x 8:
    no such split); ``parts=False`` the padded kernel; ``parts=None`` follows ``LAYERNORM_PARTS``."""
    from omni_accel.kernels import epilogue_triton as et

    assert [et.layernorm_parts(c) for c in (3072, 1536, 5120, 4096, 48, 80, 64, 16)] == [
        (3, 1024), (3, 512), (5, 1024), (1, 4096), (3, 16), (5, 16), (1, 64), (1, 16)]
    assert [et.layernorm_parts(c) for c in (56, 24, 7 * 1024, 9 * 512, 8)] == [None] * 5
    launched = []

    class Recording:  # kernel[grid](...) noting (kernel name, programs, its block constexprs), launching nothing
        def __init__(self, kernel, device):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(
                (self.kernel.__name__, grid[0], {k: kwargs[k] for k in ("PARTS", "BLOCK") if k in kwargs}))

    monkeypatch.setattr(et, "_launcher", Recording)

    def launch(c: int, parts: bool | None):
        launched.clear()
        a, b = torch.zeros(6, c, dtype=torch.bfloat16), torch.zeros(5, c, dtype=torch.bfloat16)
        et.layernorm_modulate_int8(a, b, a[0], a[0], 1e-6, torch.bfloat16, parts=parts)
        return launched

    padded, split = "_layernorm_modulate_int8_kernel", "_layernorm_modulate_int8_parts_kernel"
    # the parts kernel at PARTS_TILE (1 row per program: 11 programs), the padded one at 2 rows (6 programs)
    assert et.PARTS_TILE == (1, 4)
    assert launch(3072, True) == [(split, 11, {"PARTS": 3, "BLOCK": 1024})]
    assert launch(5120, True) == [(split, 11, {"PARTS": 5, "BLOCK": 1024})]
    assert launch(56, True) == [(padded, 6, {"BLOCK": 64})]
    assert launch(24, True) == [(padded, 6, {"BLOCK": 32})]
    assert launch(3072, False) == [(padded, 6, {"BLOCK": 4096})]
    for switch, kernel in ((False, padded), (True, split)):
        monkeypatch.setattr(et, "LAYERNORM_PARTS", switch)
        assert [name for name, _, _ in launch(3072, None)] == [kernel], switch


# ---------------------------------------------------------------------------- eager fallback vs diffusers' layers
def _hooked(module):
    add_hook(module, "kernels", _FusedForwardHook(KINDS[type(module)].forward))
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_forwards_match_the_diffusers_layers(dtype):
    torch.manual_seed(0)
    c = 24
    x, emb = torch.randn(2, 7, c, dtype=dtype), torch.randn(2, c, dtype=dtype)
    layers = [
        (dnorm.AdaLayerNormZero(c), dict(emb=emb)),
        (dnorm.AdaLayerNormZero(c, norm_type="fp32_layer_norm"), dict(emb=emb)),
        (dnorm.AdaLayerNormZeroSingle(c), dict(emb=emb)),
        (dnorm.AdaLayerNormContinuous(c, c, elementwise_affine=False, eps=1e-6), dict(conditioning_embedding=emb)),
    ]
    q = torch.randn(2, 7, 3, 8, dtype=dtype)
    norms = [torch.nn.RMSNorm(8, eps=1e-6), torch.nn.RMSNorm(8), dnorm.RMSNorm(8, eps=1e-6),
             dnorm.RMSNorm(8, eps=1e-6, elementwise_affine=False)]
    with torch.no_grad():
        for layer, kwargs in layers:
            layer.to(dtype)
            plain = layer(x, **kwargs)
            fused_out = _hooked(layer)(x, **kwargs)
            for a, b in zip(plain if isinstance(plain, tuple) else (plain,),
                            fused_out if isinstance(fused_out, tuple) else (fused_out,)):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert (a.float() - b.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 0.1)
        for norm in norms:
            if getattr(norm, "weight", None) is not None:
                norm.weight.normal_()
            norm.to(dtype)
            plain = norm(q)
            out = _hooked(norm)(q)
            assert out.dtype == plain.dtype, type(norm)
            assert (out.float() - plain.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 0.05)


def test_diffusers_rmsnorm_fp32_weight_keeps_its_output_dtype():
    norm = dnorm.RMSNorm(8, eps=1e-6)  # fp32 weight, bf16 input: diffusers returns float32
    q = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = norm(q)
        out = _hooked(norm)(q)
    assert plain.dtype == out.dtype == torch.float32
    assert torch.allclose(plain, out, atol=1e-6)


def test_rope_reference_matches_diffusers_apply_rotary_emb():
    from diffusers.models.embeddings import apply_rotary_emb

    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8)
    angles = torch.rand(5, 4) * 6.28
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    assert torch.allclose(fused.rope_ref(x, cos, sin), apply_rotary_emb(x, (cos, sin), sequence_dim=1), atol=1e-6)


def test_hook_runs_the_original_forward_when_autograd_needs_it():
    layer = _hooked(torch.nn.RMSNorm(8, eps=1e-6))
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()  # a custom op without a backward formula would raise here
    assert x.grad is not None and layer.weight.grad is not None


def test_public_functions_name_the_bad_shape():
    x = torch.randn(2, 5, 8)
    with pytest.raises(AccelError, match=r"layernorm_modulate: scale must be \(2, 8\) for x of shape \(2, 5, 8\), "
                                         r"got \(2, 6\)\."):
        fused.layernorm_modulate(x, torch.randn(2, 6), torch.randn(2, 8))
    with pytest.raises(AccelError, match=r"rms_norm_rope: cos must be \(5, 8\) for x of shape \(2, 5, 1, 8\), "
                                         r"got \(4, 8\)\."):
        fused.rms_norm_rope(x[:, :, None], None, 1e-6, torch.randn(4, 8), torch.randn(5, 8))


# ------------------------------------------------------------------------------------------- torch.compile on CPU
def test_compiled_module_using_the_kernels_runs_on_cpu_without_graph_breaks():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = dnorm.AdaLayerNormZero(24)
            self.norm_q = torch.nn.RMSNorm(8, eps=1e-6)

        def forward(self, x, emb):
            y, gate, *_ = self.norm(x, emb=emb)
            return fused.gated_residual(x, gate, self.norm_q(y.unflatten(-1, (3, 8))).flatten(-2))

    torch.manual_seed(0)
    block = Block().eval().requires_grad_(False)
    x, emb = torch.randn(2, 5, 24), torch.randn(2, 24)
    plain = block(x, emb)
    _hooked(block.norm), _hooked(block.norm_q)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)  # fake impls + functionalization

    torch._dynamo.reset()
    out = torch.compile(block, backend=backend, fullgraph=True)(x, emb)
    assert len(graphs) == 1
    for op in ("layernorm_modulate", "rms_norm", "gated_residual"):
        assert f"omni_accel.{op}" in graphs[0], graphs[0]
    assert (out - plain).abs().max() <= 1e-5


# ---------------------------------------------------------------------------------- the pass, eager path on CPU
@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_pass_matches_plain_and_restores(family):
    pipe, kwargs = tiny_pipeline(family)
    plain = run(pipe, kwargs)
    out, report = run_accelerated(pipe, kwargs, kernels=True)
    applied = [a for a in report["applied"] if a["pass"] == "kernels"]
    assert (out - plain).abs().max().item() <= 1e-5
    assert torch.equal(run(pipe, kwargs), plain), f"{family}: restore() did not bring the plain output back"
    (entry,) = applied
    assert entry["path"] == ("triton" if fused.uses_triton("cpu") else "eager")
    assert entry["modules"] == sum(entry["installed"].values()) > 0


def test_report_counts_the_flux_kernels():
    pipe, kwargs = tiny_pipeline("flux", num_layers=2, num_single_layers=3)
    omni_accel.accelerate(pipe, kernels=True)
    try:
        (entry,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "kernels"]
        hooked = sum("omni_accel.kernels" in getattr(m, "_diffusers_hook").hooks
                     for m in pipe.transformer.modules() if hasattr(m, "_diffusers_hook"))
    finally:
        omni_accel.restore(pipe)
    assert entry["installed"] == {"ada_norm_zero": 4, "ada_norm_zero_single": 3, "ada_norm_continuous": 1,
                                  "rms_norm": 2 * 4 + 3 * 2}
    assert entry["skipped"] == {} and hooked == entry["modules"] == 22
    assert not any("omni_accel.kernels" in m._diffusers_hook.hooks
                   for m in pipe.transformer.modules() if hasattr(m, "_diffusers_hook"))


def test_sd35_modules_without_a_kernel_are_skipped_and_reported():
    pipe, kwargs = tiny_pipeline("sd3", dual_attention_layers=(0,), qk_norm="rms_norm")
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, kernels=True)
    try:
        out = run(pipe, kwargs)
        (entry,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "kernels"]
    finally:
        omni_accel.restore(pipe)
    assert entry["skipped"] == {"transformer_blocks.0.norm1": "SD35AdaLayerNormZeroX has no fused kernel"}
    # block 0: attn + attn2 Q/K norms (6), block 1: attn (4); norm1 of block 1; norm1_context x2 (the last block's
    # is an AdaLayerNormContinuous) and norm_out
    assert entry["installed"] == {"ada_norm_zero": 2, "ada_norm_continuous": 2, "rms_norm": 10}
    assert (out - plain).abs().max().item() <= 1e-5


def test_family_without_sites_is_reported_and_unchanged(monkeypatch):
    import omni_accel.api as api

    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    bare = dataclasses.replace(api.adapter_for(pipe), kernels=())
    monkeypatch.setattr(api, "adapter_for", lambda p: bare)
    omni_accel.accelerate(pipe, kernels=True)
    try:
        (entry,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "kernels"]
        out = run(pipe, kwargs)
        hooked = [n for n, m in pipe.transformer.named_modules()
                  if hasattr(m, "_diffusers_hook") and "omni_accel.kernels" in m._diffusers_hook.hooks]
    finally:
        omni_accel.restore(pipe)
    assert entry == {"pass": "kernels", "installed": {}, "note": "flux declares no fused-kernel sites; nothing changed"}
    assert hooked == [] and torch.equal(out, plain)


def test_forced_triton_without_interpreter_is_refused_before_patching(monkeypatch):
    if fused.interpreted():
        pytest.skip("triton runs CPU tensors in this process")
    pytest.importorskip("triton", reason="triton is Linux-only in the test extra")
    pipe, _ = tiny_pipeline("flux")
    monkeypatch.setattr(fused, "_backend", "triton")
    with pytest.raises(AccelError, match=r"^kernel backend 'triton' got a tensor on cpu: Triton runs CPU tensors only "
                                         r"in its interpreter; set TRITON_INTERPRET=1 before importing torch/triton, "
                                         r"or use backend 'auto'\.$"):
        omni_accel.accelerate(pipe, kernels=True)
    assert "omni_accel" not in vars(pipe)
    assert not any(hasattr(m, "_diffusers_hook") for m in pipe.transformer.modules())


def test_unknown_backend_names_the_choices():
    with pytest.raises(AccelError, match=r"kernel backend 'fast' is not known; use one of auto, triton, eager\."):
        fused.set_backend("fast")


# ------------------------------------------------------------------------------------------------- benchmark
def test_bench_kernels_tiny_cpu_writes_a_row_per_kernel(tmp_path):
    bench = _load("bench_kernels", "benchmarks/bench_kernels.py")
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--tiny", "--no-compile", "--iters", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["errors"], result["errors"]
    assert {r["kernel"] for r in result["rows"]} == {
        "layernorm_modulate", "rms_norm_qk (vs torch.nn.RMSNorm)", "rms_norm_qk (vs diffusers RMSNorm)",
        "rms_norm_rope", "gated_residual"}
    for r in result["rows"]:
        assert r["eager_ms"] > 0 and r["max_abs_err_eager"] < 0.1
    assert {"torch", "triton", "diffusers", "gpu"} <= set(result["env"])


def test_bench_row_failure_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    bench = _load("bench_kernels", "benchmarks/bench_kernels.py")

    def broken(*args):
        raise RuntimeError("boom")

    real = bench.rows_for
    monkeypatch.setattr(bench, "rows_for", lambda shape: [dict(real(shape)[0], build=broken)] + real(shape)[1:2])
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--tiny", "--no-compile", "--iters", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rows"][0]["error"] == "RuntimeError: boom" and "eager_ms" in result["rows"][1]
