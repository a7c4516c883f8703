"""int8 W8A8 linears (quant="int8"): the integer arithmetic, its error against e4m3, refusals, compile, restore."""

import dataclasses

import pytest
import torch

import omni_accel
from omni_accel import AccelError
from omni_accel.kernels import int8 as int8_mod
from omni_accel.kernels.fp8 import Fp8Linear
from omni_accel.kernels.int8 import Int8Linear, quantize_rows_int8
from omni_accel.kernels.qlinear import QuantizedLinear
from omni_accel.kernels.quant import quant_error_report
from omni_accel.testing import run, run_compiled_twice, tiny_pipeline


def _linear(n_in=64, n_out=48, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_row_quantization_rounds_to_the_nearest_of_127_steps_per_row():
    x = torch.randn(32, 256) * torch.logspace(-2, 2, 32)[:, None]  # rows over four decades: scales are per row
    x_int8, scale = quantize_rows_int8(x)
    assert x_int8.dtype == torch.int8 and scale.shape == (32, 1)
    assert torch.equal(x_int8.abs().amax(dim=1), torch.full((32,), 127, dtype=torch.int8))  # each row's max -> 127
    assert ((x_int8.float() * scale - x).abs() <= scale / 2 * (1 + 1e-5)).all()  # half a step at most
    zeros, zero_scale = quantize_rows_int8(torch.zeros(2, 8))  # an all-zero row: no division by zero
    assert torch.equal(zeros, torch.zeros(2, 8, dtype=torch.int8)) and (zero_scale > 0).all()


def test_int8_linear_is_the_exact_integer_product_rescaled():
    lin = _linear()
    layer = Int8Linear(lin)
    x = torch.randn(5, 7, 64)
    y = layer(x)
    assert y.shape == (5, 7, 48) and y.dtype == x.dtype
    xq, xs = quantize_rows_int8(x.reshape(-1, 64))
    wq, ws = quantize_rows_int8(lin.weight.detach())
    exact_sums = xq.long() @ wq.long().t()  # what the int32 accumulator holds
    expected = exact_sums.double() * xs.double() * ws.double().t() + lin.bias.detach().double()
    torch.testing.assert_close(y.reshape(-1, 48).double(), expected, rtol=1e-5, atol=1e-5)
    assert layer.weight_int8.dtype == torch.int8 and layer.weight_int8.shape == (48, 64)


@pytest.mark.parametrize("in_gemm", [True, False])
def test_triton_int8_linear_adds_its_bias_in_the_gemm_epilogue(monkeypatch, in_gemm):
    """BIAS_IN_GEMM: the op gets the bias and rounds once (no add after it in the traced graph, so a fused q / k / v
    projection's V leaves the GEMM final); off, the graph adds the bias to the rounded product."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(int8_mod, "BIAS_IN_GEMM", in_gemm)
    lin = _linear(256, 96).to(torch.bfloat16)
    layer = Int8Linear(lin, gemm="triton")
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    xq, xs = quantize_rows_int8(x)
    operands = (xq, layer.weight_int8, xs, layer.weight_scale)
    once = int8_mod.int8_mm_rescale_reference(*operands, layer.bias, torch.bfloat16)
    twice = int8_mod.int8_mm_rescale_reference(*operands, None, torch.bfloat16) + layer.bias
    assert not torch.equal(once, twice)  # the roundings differ somewhere: the comparison below can tell them apart
    assert torch.equal(layer(x), once if in_gemm else twice)
    graph = make_fx(layer)(x).graph
    (gemm,) = [n for n in graph.nodes if n.target == torch.ops.omni_accel.int8_mm_rescale.default]
    assert (gemm.args[4] is not None) == in_gemm
    assert any(n.target == torch.ops.aten.add.Tensor and gemm in n.args for n in graph.nodes) != in_gemm


def test_cublas_int8_linear_keeps_its_bias_in_the_graph():
    """The cuBLAS path is traced: Inductor fuses the bias into the rescale kernel, so the switch leaves it alone."""
    lin = _linear(64, 48).to(torch.bfloat16)
    layer = Int8Linear(lin, gemm="cublas")
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    xq, xs = quantize_rows_int8(x)
    product = int8_mod.int8_mm_rescale_reference(xq, layer.weight_int8, xs, layer.weight_scale, None, torch.bfloat16)
    assert int8_mod.BIAS_IN_GEMM and torch.equal(layer(x), product + layer.bias)


def test_int8_is_more_precise_than_e4m3_on_gaussian_layers():
    """The reason the mode exists: 7 bits on each row's largest value against e4m3's 3 mantissa bits."""
    lin = _linear(256, 128).to(torch.bfloat16)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    exact = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    int8_err = _rel(Int8Linear(lin)(x), exact)
    fp8_err = _rel(Fp8Linear(lin, "w8a8")(x), exact)
    assert int8_err < 0.015 and int8_err < fp8_err / 2, (int8_err, fp8_err)


def test_short_inputs_are_padded_for_the_gpu_gemm_and_cut_back(monkeypatch):
    layer = Int8Linear(_linear())
    x = torch.randn(3, 64)
    plain = layer(x)
    seen = []
    int_mm = torch._int_mm

    def spy(a, b):
        seen.append(a.shape[0])
        return int_mm(a, b)

    monkeypatch.setattr(int8_mod, "rows_to_pad", lambda x2: 32 - x2.shape[0])  # as on a GPU
    monkeypatch.setattr(torch, "_int_mm", spy)
    padded = layer(x)
    assert seen == [32] and padded.shape == (3, 48)
    assert torch.equal(padded, plain)
    monkeypatch.undo()
    assert int8_mod.rows_to_pad(torch.zeros(3, 64)) == 0  # the CPU GEMM takes any row count


def test_int8_pipeline_is_closer_to_plain_than_fp8_and_restores_exactly():
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    errors = {}
    for mode in ("int8", "fp8"):
        omni_accel.accelerate(pipe, quant=mode, quant_config={"measure_error": True})
        errors[mode] = _rel(run(pipe, kwargs), plain)
        if mode == "int8":
            (quant,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "quant"]
            t = pipe.transformer
            assert quant["mode"] == "int8" and quant["fast_accum"] is False
            assert isinstance(t.transformer_blocks[0].attn.to_q, Int8Linear)
            assert isinstance(t.transformer_blocks[0].norm1.linear, torch.nn.Linear)  # AdaLN modulation kept
            layer_errors = quant_error_report(pipe)
            assert len(layer_errors) == quant["layers"]
            assert all(0 < e["output_rel_err"] < 0.03 for e in layer_errors.values())
        omni_accel.restore(pipe)
    assert errors["int8"] < 0.01 and errors["int8"] < errors["fp8"], errors
    assert not any(isinstance(m, Int8Linear) for m in pipe.transformer.modules())
    assert torch.equal(run(pipe, kwargs), plain)


def test_int8_takes_shapes_the_fp8_gemm_refuses():
    pipe, kwargs = tiny_pipeline("wan")  # hidden size 24: a multiple of 8, not of 16
    plain = run(pipe, kwargs)
    with pytest.raises(AccelError, match=r"not a multiple of 16 \(FP8 GEMM alignment\)"):
        omni_accel.accelerate(pipe, quant="fp8")
    omni_accel.accelerate(pipe, quant="int8")
    assert _rel(run(pipe, kwargs), plain) < 0.02
    omni_accel.restore(pipe)


def test_int8_compiles_without_graph_breaks_or_recompiles():
    pipe, kwargs = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, quant="int8")
    eager = run(pipe, kwargs)
    omni_accel.restore(pipe)
    compiled, counts = run_compiled_twice(pipe, kwargs, quant="int8", compile=True)
    assert counts["graph_breaks"] == 0
    assert counts["graphs_second_call"] == counts["graphs_first_call"] > 0
    assert _rel(compiled, eager) < 1e-3


@pytest.mark.parametrize("quant_config, message", [
    ({"activations": "static"},
     "quant_config['activations']='static' is not offered with quant='int8': int8 has no exponent, so one scale per "
     "layer rounds a token with small values coarsely (on the built-in model it lowered the worst image from 43.3 "
     "to 28.9 dB). Drop 'activations' (a scale per token), or use quant='fp8' for static scales."),
    ({"fast_accum": True},
     "quant_config['fast_accum']=True needs quant='fp8': quant='int8' runs int8 GEMMs, which accumulate exactly in "
     "int32 and have no FP8 accumulation to speed up. Use quant='fp8', or drop 'fast_accum'."),
])
def test_int8_refuses_fp8_only_settings_before_patching(quant_config, message):
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe, quant="int8", quant_config=quant_config)
    assert str(info.value) == message
    assert not hasattr(pipe, "omni_accel")


def test_int8_without_int8_matmul_names_the_reason_and_the_alternative(monkeypatch):
    pipe, _ = tiny_pipeline("flux")
    monkeypatch.setattr(int8_mod, "_cpu_int_mm_works", lambda: False)
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe, quant="int8")
    assert str(info.value) == (
        f"quant='int8' needs int8 matrix multiplication, which is not available here: this torch build "
        f"({torch.__version__}) has no CPU torch._int_mm. Use quant='fp8_weight_only' (e4m3 weights dequantized on "
        "the fly: half the weight memory, runs anywhere), or run on a GPU with int8 tensor cores (Turing or newer).")
    assert not hasattr(pipe, "omni_accel")


def test_auto_attention_keeps_the_lossless_rows_beside_int8(monkeypatch):
    """FP8 attention brought the int8 pipeline's worst built-in image back to 24.7 dB (docs/fp8.md): auto's FP8 row
    belongs to quant="fp8" only."""
    from omni_accel.kernels import attention as attn

    asked, choose = {}, attn.choose_auto

    def spy(device, dtype, compiled, head_dim, fp8_stack, *args, **kwargs):
        asked[quant] = fp8_stack
        return choose(device, dtype, compiled, head_dim, fp8_stack, *args, **kwargs)

    monkeypatch.setattr(attn, "choose_auto", spy)
    pipe, _ = tiny_pipeline("flux")
    for quant in ("int8", "fp8"):
        omni_accel.accelerate(pipe, quant=quant, attention="auto", compile=True)
        omni_accel.restore(pipe)
    assert asked == {"int8": False, "fp8": True}


@pytest.mark.parametrize("installed", [True, False])
@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (8, 0)])
@pytest.mark.parametrize("compiled", [True, False])
def test_auto_sends_only_the_compiled_int8_stacks_long_sequences_to_sageattention_on_hopper(
        monkeypatch, installed, capability, compiled):
    """Measured in one run on an H100 with int8 linears and compile=True: FLUX (4,608 keys) cuDNN 93.4 ms per step,
    SageAttention 100.2; Wan 81 frames (32,760 keys) SageAttention 4.04 s, cuDNN 4.72. So auto keeps cuDNN and routes
    calls from sage_attention.AUTO_MIN_TOKENS keys to SageAttention, only for quant="int8", compiled, on Hopper (the
    only GPU measured), where the package is installed; elsewhere the rows it had before."""
    from omni_accel.kernels import attention as attn
    from omni_accel.kernels import sage_attention

    monkeypatch.setattr(sage_attention, "installed", lambda package: installed)
    monkeypatch.setattr(sage_attention, "hopper_kernel_built", lambda: installed)
    cuda = torch.device("cuda")
    rule = attn.choose_auto(cuda, torch.bfloat16, compiled, 128, False, capability, int8_stack=True)
    lossless = attn.choose_auto(cuda, torch.bfloat16, compiled, 128, False, capability, int8_stack=False)
    routed = installed and capability == (9, 0) and compiled
    assert rule.backend == lossless.backend == ("cudnn" if compiled and capability >= (9, 0) else "sdpa")
    assert (rule.long_backend == "sage") == routed and rule.why
    if routed:
        assert rule.long_min_tokens == sage_attention.AUTO_MIN_TOKENS == 16384
    else:  # the rows it had before: cuDNN (+ FA4's long route) or PyTorch's own choice; the report names the miss
        assert dataclasses.replace(rule, passed_over=lossless.passed_over) == lossless
        sage_missed = [line for line in rule.passed_over if line.startswith("sage ")]
        # listed only where installing would route calls: Hopper (elsewhere the route was never measured)
        assert bool(sage_missed) == (compiled and capability == (9, 0))
    assert lossless.long_backend != "sage" and not any(line.startswith("sage ") for line in lossless.passed_over)
    if not installed and capability == (9, 0):
        assert sage_attention.auto_refusal(capability) == (
            "sageattention is not installed; build SageAttention 2 from source on the GPU machine: pip install "
            "--no-build-isolation git+https://github.com/thu-ml/SageAttention.git")
        if compiled:
            assert rule.passed_over[0] == f"sage from 16384 keys: {sage_attention.auto_refusal(capability)}"
    if installed and capability == (10, 0):
        assert sage_attention.auto_refusal(capability) == ("SageAttention was measured on Hopper (sm_90) only; this "
                                                           "GPU is sm_100")


# ------------------------------------------------------------------ quant_config={"modulation": "int8"}
def test_weight_only_layer_is_the_rescaled_product_eager_and_as_a_traced_reduction():
    lin = _linear(64, 48).to(torch.bfloat16)
    layer = int8_mod.Int8WeightOnlyLinear(lin)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    wq, ws = quantize_rows_int8(lin.weight.detach())
    expected = x.double() @ (wq.double() * ws.double()).t() + lin.bias.detach().double()
    eager = layer(x)
    traced = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)  # the multiply-and-sum form
    assert eager.dtype == traced.dtype == torch.bfloat16 and layer.weight_int8.dtype == torch.int8
    for got in (eager, traced):
        assert _rel(got, expected) < 0.01
    assert _rel(eager, lin(x)) < 0.02 and 0 < layer.weight_rel_err < 0.01


def test_weight_only_layer_takes_the_triton_gemv_on_gpus_when_switched_on(monkeypatch):
    """With TRITON_GEMV a GPU call of up to 16 rows goes to omni_accel::int8_gemv (the check comes before the traced
    form's, so compiled calls take it too); off (the default until timed), with more rows, or on the CPU it does
    not."""
    lin = _linear(64, 48).to(torch.bfloat16)
    layer = int8_mod.Int8WeightOnlyLinear(lin)
    calls = []

    def gemv(x, w_int8, w_scale):
        calls.append(tuple(x.shape))
        return int8_mod.int8_gemv_reference(x, w_int8, w_scale)

    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert int8_mod.TRITON_GEMV is False
    monkeypatch.setattr(torch.ops.omni_accel, "int8_gemv", gemv, raising=False)
    monkeypatch.setattr(int8_mod, "TRITON_GEMV", True)
    layer(x)  # the CPU: not the GPU kernel
    assert calls == []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the dispatch only reads is_cuda
    monkeypatch.setattr(int8_mod, "TRITON_GEMV", False)
    layer(x)  # off: not either
    assert calls == []
    monkeypatch.setattr(int8_mod, "TRITON_GEMV", True)
    out = layer(x)
    layer(torch.randn(17, 64, dtype=torch.bfloat16))  # more rows: the GEMM
    assert calls == [(3, 64)]
    assert torch.equal(out, int8_mod.int8_gemv_reference(x, layer.weight_int8, layer.weight_scale)
                       + lin.bias.detach().to(torch.bfloat16))


def test_modulation_int8_quantizes_the_family_skip_list_weights_only_and_restores(monkeypatch):
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, quant="int8", quant_config={"modulation": "int8", "skip": ["*.norm1_context.linear"]})
    t = pipe.transformer
    (quant,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "quant"]
    assert isinstance(t.transformer_blocks[0].norm1.linear, int8_mod.Int8WeightOnlyLinear)
    assert isinstance(t.single_transformer_blocks[0].norm.linear, int8_mod.Int8WeightOnlyLinear)
    assert isinstance(t.transformer_blocks[0].norm1_context.linear, torch.nn.Linear)  # the user's skip wins
    assert quant["modulation_layers"] == len(t.transformer_blocks) + len(t.single_transformer_blocks)
    assert "transformer_blocks.0.norm1.linear" not in quant["skipped"]
    assert quant["skipped"]["transformer_blocks.0.norm1_context.linear"] == "skip pattern '*.norm1_context.linear'"
    assert 0 < quant["modulation_weight_rel_err_max"] < 0.01
    assert _rel(run(pipe, kwargs), plain) < 0.01
    omni_accel.restore(pipe)
    assert not any(isinstance(m, QuantizedLinear) for m in t.modules())
    assert torch.equal(run(pipe, kwargs), plain)


def test_unknown_modulation_mode_is_refused_before_patching():
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe, quant="fp8", quant_config={"modulation": "fp8"})
    assert str(info.value) == (
        "quant_config['modulation']='fp8' is not known; use 'bf16' (the AdaLN modulation linears as they are, the "
        "default) or 'int8' (their weights in int8, activations in 16 bits).")
    assert not hasattr(pipe, "omni_accel")


def test_triton_int8_gemm_choice_gives_the_cublas_outputs_and_compiles_whole():
    """quant_config={"int8_gemm": "triton"}: the same int32 sums and rescale behind one op (on the CPU its PyTorch
    reference; tests/test_kernels.py checks the Triton kernel against it), so the pipeline's output equals the
    default's, eager and compiled without graph breaks."""
    pipe, kwargs = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, quant="int8")  # auto: cuBLAS's (here the CPU's) _int_mm off a CUDA GPU
    (quant,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "quant"]
    assert quant["int8_gemm"] == "cublas"
    cublas = run(pipe, kwargs)
    omni_accel.restore(pipe)
    omni_accel.accelerate(pipe, quant="int8", quant_config={"int8_gemm": "triton"})
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    assert isinstance(layer, Int8Linear) and layer.gemm == "triton" and "triton GEMM" in repr(layer)
    assert torch.equal(run(pipe, kwargs), cublas)
    omni_accel.restore(pipe)
    compiled, counts = run_compiled_twice(pipe, kwargs, quant="int8", quant_config={"int8_gemm": "triton"},
                                          compile=True)
    assert counts["graph_breaks"] == 0 and counts["graphs_second_call"] == counts["graphs_first_call"] > 0
    assert _rel(compiled, cublas) < 1e-3


@pytest.mark.parametrize("quant, quant_config, message", [
    ("int8", {"int8_gemm": "cutlass"},
     "quant_config['int8_gemm']='cutlass' is not known; use 'auto' (the default: 'triton' on a CUDA GPU with Triton "
     "installed, else 'cublas'), 'triton' (omni_accel's int8 GEMM with the rescale in its epilogue) or 'cublas' "
     "(torch._int_mm)."),
    ("fp8", {"int8_gemm": "triton"},
     "quant_config['int8_gemm'] applies to quant='int8' only (quant='fp8'); set quant='int8', or drop 'int8_gemm'."),
])
def test_int8_gemm_choice_is_checked_before_patching(quant, quant_config, message):
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe, quant=quant, quant_config=quant_config)
    assert str(info.value) == message
    assert not hasattr(pipe, "omni_accel")


def test_auto_int8_gemm_takes_triton_on_a_cuda_gpu_with_triton(monkeypatch):
    from omni_accel import deps

    monkeypatch.setattr(deps, "installed", lambda module: True)
    assert int8_mod.resolve_int8_gemm("auto", torch.device("cuda")) == "triton"
    assert int8_mod.resolve_int8_gemm("auto", torch.device("cpu")) == "cublas"
    assert int8_mod.resolve_int8_gemm("cublas", torch.device("cuda")) == "cublas"
    monkeypatch.setattr(deps, "installed", lambda module: module != "triton")
    assert int8_mod.resolve_int8_gemm("auto", torch.device("cuda")) == "cublas"


# ------------------------------------------------------------------ the gated residual in the GEMM's epilogue
def _gated_operands(rows=24, n_in=64, n_out=40, seed=3, dtype=torch.bfloat16):
    lin = _linear(n_in, n_out, seed).to(dtype)
    g = torch.Generator().manual_seed(seed)
    xq, xs = quantize_rows_int8(torch.randn(rows, n_in, generator=g).to(dtype))
    wq, ws = quantize_rows_int8(lin.weight.detach())
    gate = torch.randn(n_out, generator=g).to(dtype)
    residual = (torch.randn(rows, n_out, generator=g) * 4).to(dtype)
    return (xq, wq, xs, ws.reshape(1, -1), lin.bias.detach()), gate, residual


def test_gated_residual_op_is_the_unfused_arithmetic_in_a_new_tensor():
    """omni_accel::int8_mm_rescale_residual (off a GPU, its PyTorch reference): residual + gate * the int8 linear's
    product, the product rounded to bf16 first (the unfused graph writes it so) and the gated add in float32, rounded
    once -- what inductor's kernel after the GEMM computes. Against the float64 formula: half a bf16 step of the
    result plus the product's rounding scaled by the gate. The residual is only read."""
    operands, gate, residual = _gated_operands()
    before = residual.clone()
    out = torch.ops.omni_accel.int8_mm_rescale_residual(*operands, gate, residual, torch.bfloat16)
    product = int8_mod.int8_mm_rescale_reference(*operands, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == residual.shape
    assert torch.equal(out, (residual.float() + gate.float() * product.float()).to(torch.bfloat16))
    xq, wq, xs, ws, bias = operands
    exact_product = (xq.double() @ wq.double().t()) * xs.double() * ws.double() + bias.double()
    exact = residual.double() + gate.double() * exact_product
    bound = 2.0 ** -8 * (exact.abs() + (gate.double() * exact_product).abs()) + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()
    # a test that can tell: the gated add of the unrounded product differs somewhere
    once = (residual.float() + gate.float() * int8_mod.int8_mm_rescale_reference(*operands, torch.float32))
    assert not torch.equal(out, once.to(torch.bfloat16))
    assert torch.equal(residual, before) and out.data_ptr() != residual.data_ptr()


def test_gated_residual_op_traces_to_its_fake_shape_and_takes_no_bias():
    from torch.fx.experimental.proxy_tensor import make_fx

    (xq, wq, xs, ws, _), gate, residual = _gated_operands(rows=8, dtype=torch.float16)

    def fn(xq, wq, xs, ws, gate, residual):
        return torch.ops.omni_accel.int8_mm_rescale_residual(xq, wq, xs, ws, None, gate, residual, torch.float16)

    graph = make_fx(fn, tracing_mode="fake")(xq, wq, xs, ws, gate, residual).graph
    (node,) = [n for n in graph.nodes if n.target == torch.ops.omni_accel.int8_mm_rescale_residual.default]
    assert tuple(node.meta["val"].shape) == (8, 40) and node.meta["val"].dtype == torch.float16
    product = int8_mod.int8_mm_rescale_reference(xq, wq, xs, ws, None, torch.float16)
    assert torch.equal(fn(xq, wq, xs, ws, gate, residual),
                       (residual.float() + gate.float() * product.float()).to(torch.float16))


@pytest.mark.parametrize("change, message", [
    ({"residual": None}, "int8_mm_rescale takes the gated residual's gate and residual together, or neither"),
    ({"residual": "short"}, r"int8_mm_rescale's gated residual needs a residual of the output's shape \(24, 40\) and "
                            r"one gate value per output column \(40\); got residual \(23, 40\), gate \(40,\)"),
    ({"gate": "wide"}, r"got residual \(24, 40\), gate \(41,\)"),
    ({"residual": "float32"}, r"int8_mm_rescale's residual must have the output's dtype, 16-bit or float32 "
                              r"\(residual torch.float32, output torch.bfloat16\)"),
])
def test_the_triton_gemm_refuses_residual_operands_it_cannot_take(change, message):
    """Checked before any launch (so on the CPU too): both operands or neither, the output's shape, one gate value
    per column, the output's dtype."""
    from omni_accel.kernels import int8_gemm_triton as g

    operands, gate, residual = _gated_operands()
    given = {"gate": gate, "residual": residual}
    for name, how in change.items():
        given[name] = {None: None, "short": residual[:-1], "wide": torch.zeros(41, dtype=gate.dtype),
                       "float32": residual.float()}[how]
    with pytest.raises(ValueError, match=message):
        g.int8_mm_rescale(*operands, torch.bfloat16, **given)
