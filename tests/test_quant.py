"""Quantized linears (quant="fp8" / "fp8_weight_only"; int8 across the families, tests/test_int8.py has the rest):
arithmetic, error bounds, savings, refusals, restore."""

import json
import re

import pytest
import torch

import omni_accel
from omni_accel import AccelError
from omni_accel.kernels import fp8 as fp8_mod
from omni_accel.kernels.fp8 import Fp8Linear, dequantize_rows, quantize_rows
from omni_accel.kernels.qlinear import QuantizedLinear
from omni_accel.kernels.quant import quant_error_report
from omni_accel.testing import run, tiny_pipeline


def _linear(n_in=64, n_out=48, seed=0, bias=True):
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out, bias=bias)


def test_row_quantization_error_is_within_e4m3_precision():
    x = torch.randn(32, 256) * torch.logspace(-2, 2, 32)[:, None]  # rows over four decades: scales are per row
    x_fp8, scale = quantize_rows(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scale.shape == (32, 1)
    back = dequantize_rows(x_fp8, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2**-4 per element (largest |x| maps to 448 exactly)
    rel = ((back - x).abs() / x.abs().clamp(min=1e-6))[x.abs() > scale * 2**-6]
    assert rel.max() <= 2**-4 + 1e-6
    assert torch.allclose(back.abs().amax(dim=1), x.abs().amax(dim=1), rtol=1e-6)


def test_w8a8_is_the_scaled_product_of_the_quantized_operands():
    lin = _linear()
    layer = Fp8Linear(lin, "w8a8")
    x = torch.randn(5, 7, 64, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (5, 7, 48) and y.dtype == torch.bfloat16
    # the same arithmetic spelled out: per-token activation scale, per-channel weight scale
    xq, xs = quantize_rows(x.reshape(-1, 64))
    wq, ws = quantize_rows(lin.weight.detach())
    expected = (xq.float() * xs) @ (wq.float() * ws).t() + lin.bias.detach()
    torch.testing.assert_close(y.reshape(-1, 48).float(), expected, rtol=2e-2, atol=2e-2)
    # and close to the exact bf16 layer: FP8 error, not a wrong scale (that would be off by orders of magnitude)
    exact = lin.to(torch.bfloat16)(x).float()
    assert ((y.float() - exact).norm() / exact.norm()) < 0.06


def test_weight_only_dequantizes_on_the_fly_in_the_activation_dtype():
    lin = _linear(bias=False)
    layer = Fp8Linear(lin, "weight_only")
    x = torch.randn(3, 64)
    wq, ws = quantize_rows(lin.weight.detach())
    torch.testing.assert_close(layer(x), x @ (wq.float() * ws).t())
    assert layer.weight_fp8.element_size() == 1  # the stored weight is one byte per element
    assert 0 < layer.weight_rel_err < 0.04


@pytest.mark.parametrize("family", ["flux", "qwen_image", "sd3", "z_image", "flux2"])
@pytest.mark.parametrize("mode", ["fp8", "fp8_weight_only", "int8"])
def test_quantized_pipeline_stays_close_and_restores_exactly(family, mode):
    pipe, kwargs = tiny_pipeline(family)
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, quant=mode, quant_config={"measure_error": True})
    out = run(pipe, kwargs)
    assert ((out - plain).norm() / plain.norm()) < 0.03
    (quant,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "quant"]
    assert quant["layers"] > 0 and quant["mode"] == mode
    # FP8 / int8 store a byte per weight (+ one fp32 scale per row): well under half of the fp32 linears replaced
    assert quant["linear_bytes_after"] < 0.35 * quant["linear_bytes_before"]
    errors = quant_error_report(pipe)
    assert len(errors) == quant["layers"]
    assert all(0 < e["output_rel_err"] < 0.08 for e in errors.values())  # measured on the first call's inputs
    omni_accel.restore(pipe)
    assert not any(isinstance(m, QuantizedLinear) for m in pipe.transformer.modules())
    assert torch.equal(run(pipe, kwargs), plain)


def test_family_skip_list_keeps_modulation_linears_and_users_can_extend_it():
    pipe, _ = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, quant="fp8_weight_only", quant_config={"skip": ["*.ff.net.2", "*.proj_out"]})
    (quant,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "quant"]
    t = pipe.transformer
    assert isinstance(t.transformer_blocks[0].norm1.linear, torch.nn.Linear)  # family default: AdaLN modulation
    assert isinstance(t.single_transformer_blocks[0].norm.linear, torch.nn.Linear)
    assert isinstance(t.transformer_blocks[0].ff.net[2], torch.nn.Linear)  # user's pattern
    assert isinstance(t.single_transformer_blocks[0].proj_out, torch.nn.Linear)
    assert isinstance(t.transformer_blocks[0].attn.to_q, Fp8Linear)
    assert isinstance(t.x_embedder, torch.nn.Linear) and isinstance(t.proj_out, torch.nn.Linear)  # outside blocks
    assert quant["skipped"]["transformer_blocks.0.ff.net.2"] == "skip pattern '*.ff.net.2'"
    assert quant["skipped"]["transformer_blocks.0.norm1.linear"] == "skip pattern '*.norm1.linear'"
    assert quant["fast_accum"] is False  # weight-only layers run bf16 GEMMs: no FP8 accumulation
    omni_accel.restore(pipe)


def _fingerprint(pipe):
    return [(n, type(m).__name__) for n, m in pipe.transformer.named_modules()]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(quant="fp8", quant_config={"bits": 4}),
         "quant_config has unknown keys ['bits']; known keys: ['skip', 'measure_error', 'activations', 'scales', "
         "'attention_scales', 'fast_accum', 'modulation', 'int8_gemm']."),
        (dict(quant="fp8", quant_config={"fast_accum": 1}),
         "quant_config['fast_accum']=1 must be True or False."),
        (dict(quant="fp8_weight_only", quant_config={"fast_accum": True}),
         "quant_config['fast_accum']=True needs quant='fp8': quant='fp8_weight_only' runs bf16 GEMMs, which have no "
         "FP8 accumulation to speed up. Use quant='fp8', or drop 'fast_accum'."),
        (dict(quant="fp8", quant_config={"measure_error": "yes"}),
         "quant_config['measure_error']='yes' must be True or False."),
        (dict(quant_config={"skip": []}),
         "quant_config was given without quant=...; add quant='fp8', 'fp8_weight_only' or 'int8'."),
        (dict(quant="fp8_weight_only", quant_config={"skip": ["*"]}),
         "quant='fp8_weight_only': no linear layer of the transformer can be quantized"),
    ],
)
def test_bad_quant_settings_are_refused_before_patching(kwargs, message):
    pipe, _ = tiny_pipeline("flux")
    before = _fingerprint(pipe)
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe, compile=True, **kwargs)
    assert message in str(info.value)
    assert _fingerprint(pipe) == before and not hasattr(pipe, "omni_accel")


def test_fast_accum_is_the_default_of_every_fp8_gemm_and_can_be_turned_off(monkeypatch):
    pipe, kwargs = tiny_pipeline("flux")
    seen, scaled_mm = [], torch._scaled_mm

    def spy(*args, **kw):
        seen.append(kw.get("use_fast_accum"))
        return scaled_mm(*args, **kw)

    omni_accel.accelerate(pipe, quant="fp8")  # the default
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    run(pipe, kwargs)
    (quant,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "quant"]
    assert quant["fast_accum"] is True
    assert len(seen) >= quant["layers"] and set(seen) == {True}
    assert "fast_accum=True" in repr(pipe.transformer.transformer_blocks[0].attn.to_q)
    omni_accel.restore(pipe)
    omni_accel.accelerate(pipe, quant="fp8", quant_config={"fast_accum": False})  # fp32 promotion kept
    seen.clear()
    run(pipe, kwargs)
    assert seen and set(seen) == {False}
    omni_accel.restore(pipe)


def test_fp8_without_fp8_matmul_suggests_weight_only(monkeypatch):
    pipe, _ = tiny_pipeline("flux")
    monkeypatch.setattr(fp8_mod, "_cpu_scaled_mm_works", lambda: False)
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe, quant="fp8")
    assert str(info.value).startswith(
        "quant='fp8' needs FP8 matrix multiplication, which is not available here: this torch build"
    )
    assert "Use quant='fp8_weight_only'" in str(info.value)
    assert not hasattr(pipe, "omni_accel")


def test_fp8_needs_shapes_the_fp8_gemm_takes():
    pipe, _ = tiny_pipeline("wan")  # hidden size 24: not a multiple of 16
    with pytest.raises(AccelError, match=r"not a multiple of 16 \(FP8 GEMM alignment\).*fp8_weight_only"):
        omni_accel.accelerate(pipe, quant="fp8")
    omni_accel.accelerate(pipe, quant="fp8_weight_only")  # dequantize-on-the-fly has no alignment rule
    omni_accel.restore(pipe)


def test_scales_file_is_read_again_once_rewritten(tmp_path):
    """A scales file is parsed once per version (accelerate() consults it from several checks); rewriting it in
    place gives the new scales, and a broken rewrite is refused with the path as the user gave it."""
    from omni_accel.kernels import quant

    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"scales": {"a": 0.5}}))
    assert quant._load_scales(str(path)).linears == {"a": 0.5}
    assert quant._load_scales(str(path)) is quant._load_scales(str(path))
    path.write_text(json.dumps({"scales": {"a": 0.25, "b": 1.0}}))
    assert quant._load_scales(str(path)).linears == {"a": 0.25, "b": 1.0}
    path.write_text("{not json")
    with pytest.raises(AccelError, match=re.escape(f"quant_config['scales']={str(path)!r} could not be read")):
        quant._load_scales(str(path))


def test_to_host_copies_values_dtype_and_strides_into_new_memory():
    """The quant pass parks the original weights in host memory with to_host: the same values, dtype and strides
    (a transposed weight stays transposed), in memory of its own."""
    from omni_accel.kernels.quant import to_host

    weight = torch.randn(48, 32, dtype=torch.bfloat16).t()
    host = to_host(weight)
    assert host.device.type == "cpu" and host.dtype == torch.bfloat16
    assert host.stride() == weight.stride() and torch.equal(host, weight)
    assert host.data_ptr() != weight.data_ptr()
