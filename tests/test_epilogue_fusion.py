"""The epilogue-fusion graph pass (omni_accel/kernels/epilogue_fusion.py) on CPU: what it replaces, what it leaves,
and that the replaced graph computes the same values. The Triton kernel itself runs in Triton's interpreter in
tests/kernels_worker.py (test_kernels.py asserts its cases).

The reference is the same function compiled without the pass (inductor's own fusion): bf16 outputs equal to it, e4m3
outputs within one e4m3 step (|diff| <= 2^-3 |ref| + 2^-9) and almost every byte equal (a value at a rounding tie may
go the other way). Both keep float32 between the bias, the GELU and the concatenation where eager rounds each to
bf16, so against eager they differ by up to 2 bf16 ulps (checked too).
"""

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from omni_accel import compiler
from omni_accel.compiler import sigmoid_gelu
from omni_accel.kernels import epilogue_fusion
from omni_accel.kernels.fp8 import FP8_DTYPE, quantize_static

BF16 = torch.bfloat16
S, H, D, MLP = 24, 2, 16, 96  # tokens, heads, head dim, MLP width


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        a8=(torch.randn(1, S, H, D, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE),
        a_scale=torch.full((1, 1, 1, 1), 0.01),
        a16=torch.randn(1, H, S, D, generator=g).to(BF16).transpose(1, 2),  # an SDPA output: (1, S, H, D) view
        x=torch.randn(1, S, 40, generator=g).to(BF16),
        w=(torch.randn(MLP, 40, generator=g) / 6).to(BF16),
        bias=(torch.randn(MLP, generator=g) * 0.1).to(BF16),
        inverse=torch.tensor(448.0 / 8),
    )


def _single_block_epilogue(a8, a_scale, a16, x, w, bias, inverse, fp8_attention: bool, cast: bool,
                           gelu=sigmoid_gelu, a_first=True, dim=2):
    """FLUX's single-stream block from attention output to proj_out's input, as the compiled FP8 stack runs it."""
    a = (a8.float() * a_scale).to(BF16) if fp8_attention else a16
    a = a.reshape(1, S, H * D)
    h = (x.reshape(-1, 40) @ w.t()).reshape(1, S, MLP) + bias
    if dim != 2:  # along the tokens: the MLP's first H * D channels, so that the widths agree
        h = h[..., :H * D]
    parts = [a, gelu(h)] if a_first else [gelu(h), a]
    joint = torch.cat(parts, dim=dim)
    if not cast:
        return joint
    return quantize_static(joint.reshape(-1, joint.shape[-1]), inverse)[0]


def _compiled(fn, *args, with_pass: bool = True, **kwargs):
    """(output, {rewrite kind: count}) of ``fn`` compiled with or without the pass."""
    torch._dynamo.reset()
    before = dict(epilogue_fusion.REWRITES)
    # no FX graph cache: a graph loaded from it skips the passes, and the counts would read 0
    options = {"fx_graph_cache": False}
    if with_pass:
        options[compiler.POST_GRAD_PASS] = epilogue_fusion.GRAPH_PASS
    out = torch.compile(fn, options=options)(*args, **kwargs)
    delta = epilogue_fusion.rewrites_since(before)
    return out, delta


def _compiled_with_pass(fn, *args, **kwargs):
    return _compiled(fn, *args, **kwargs)


def _assert_bf16_close(out, ref, ulps: int = 1):
    assert out.dtype == ref.dtype == BF16 and out.shape == ref.shape
    assert ((out.float() - ref.float()).abs() <= ulps * 2.0 ** -7 * ref.float().abs() + 2.0 ** -12).all()


def _assert_e4m3_close(out, ref):
    assert out.dtype == ref.dtype == FP8_DTYPE and out.shape == ref.shape
    o, r = out.float(), ref.float()
    assert ((o - r).abs() <= 2.0 ** -3 * r.abs() + 2.0 ** -9).all()
    assert (o == r).float().mean() > 0.95


@pytest.mark.parametrize("fp8_attention", [True, False])
def test_fp8_concat_epilogue_becomes_one_operation_with_the_same_values(fp8_attention):
    inputs = _inputs()
    ref, _ = _compiled(_single_block_epilogue, **inputs, fp8_attention=fp8_attention, cast=True, with_pass=False)
    out, delta = _compiled_with_pass(_single_block_epilogue, **inputs, fp8_attention=fp8_attention, cast=True)
    assert delta == {"concat_gelu_fp8": 1}
    _assert_e4m3_close(out, ref)
    _assert_e4m3_close(out, _single_block_epilogue(**inputs, fp8_attention=fp8_attention, cast=True))


def test_bf16_concat_epilogue_becomes_one_operation_with_the_same_values():
    inputs = _inputs(1)
    ref, _ = _compiled(_single_block_epilogue, **inputs, fp8_attention=False, cast=False, with_pass=False)
    out, delta = _compiled_with_pass(_single_block_epilogue, **inputs, fp8_attention=False, cast=False)
    assert delta == {"concat_gelu": 1}
    assert torch.equal(out, ref)
    _assert_bf16_close(out, _single_block_epilogue(**inputs, fp8_attention=False, cast=False), ulps=2)


def _feed_forward_epilogue(x, w, bias, inverse, cast: bool):
    """A dual-stream block's feed-forward between its two linears: GELU of the first's output (+ bias), cast for an
    FP8 second linear."""
    h = sigmoid_gelu((x.reshape(-1, 40) @ w.t()).reshape(1, S, MLP) + bias)
    return quantize_static(h.reshape(-1, MLP), inverse)[0] if cast else h


def test_a_gelu_feeding_an_fp8_linear_becomes_the_operation_without_a_first_input():
    inputs = {k: v for k, v in _inputs(4).items() if k in ("x", "w", "bias", "inverse")}
    ref, _ = _compiled(_feed_forward_epilogue, **inputs, cast=True, with_pass=False)
    out, delta = _compiled_with_pass(_feed_forward_epilogue, **inputs, cast=True)
    assert delta == {"gelu_fp8": 1}
    _assert_e4m3_close(out, ref)
    # a bf16 GELU is one inductor kernel already: left alone
    _, delta = _compiled_with_pass(_feed_forward_epilogue, **inputs, cast=False)
    assert delta == {}


def _mlp(x, w, bias, w2, b2, gelu=sigmoid_gelu):
    """A 16-bit MLP: linear, tanh GELU (the sigmoid form compile=True installs), linear."""
    h = gelu((x.reshape(-1, 40) @ w.t()).reshape(1, S, MLP) + bias)
    return torch.nn.functional.linear(h, w2, b2)


def _mlp_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    inputs = {k: v for k, v in _inputs(seed).items() if k in ("x", "w", "bias")}
    return dict(inputs, w2=(torch.randn(40, MLP, generator=g) / 10).to(BF16),
                b2=(torch.randn(40, generator=g) * 0.1).to(BF16))


def test_a_16_bit_gelu_between_two_linears_moves_into_the_first_gemm(monkeypatch):
    inputs = _mlp_inputs(7)
    ref, _ = _compiled(_mlp, **inputs, with_pass=False)
    out, delta = _compiled_with_pass(_mlp, **inputs)
    assert delta == {"gelu_gemm": 1}
    assert (out.float() - ref.float()).abs().max() <= 4 * 2.0 ** -8 * ref.float().abs().max()
    # the GELU of the float32 sums, rounded once: at most one bf16 step from the float32 formula, plus the product's
    want = torch.nn.functional.gelu(inputs["x"].reshape(-1, 40).float() @ inputs["w"].float().t()
                                    + inputs["bias"].float(), approximate="tanh")
    gelu_only = epilogue_fusion.linear_gelu(inputs["x"].reshape(-1, 40), inputs["w"].t(), inputs["bias"])
    assert gelu_only.dtype == BF16
    assert ((gelu_only.float() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-6).all()
    monkeypatch.setattr(epilogue_fusion, "GELU_GEMM", False)
    _, delta = _compiled_with_pass(_mlp, **inputs)
    assert delta == {}


def test_a_gelu_read_by_anything_but_linears_stays_with_inductor():
    """Inductor's GELU (libdevice tanh, not the sigmoid form) and a GELU whose output is also returned compile as
    before."""
    inputs = _mlp_inputs(8)
    _, delta = _compiled_with_pass(_mlp, **inputs, gelu=lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    assert delta == {}

    def mlp_and_hidden(x, w, bias, w2, b2):
        h = sigmoid_gelu((x.reshape(-1, 40) @ w.t()).reshape(1, S, MLP) + bias)
        return torch.nn.functional.linear(h, w2, b2), h

    _, delta = _compiled_with_pass(mlp_and_hidden, **inputs)
    assert delta == {}


def test_concat_linear_equals_the_linear_of_the_concatenation():
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(6, 8, generator=g), torch.randn(6, 24, generator=g)
    w, bias = torch.randn(5, 32, generator=g), torch.randn(5, generator=g)
    want = torch.nn.functional.linear(torch.cat([a, b], -1), w, bias)
    torch.testing.assert_close(epilogue_fusion.concat_linear(a, b, w.t(), bias), want)
    torch.testing.assert_close(epilogue_fusion.concat_linear(a, b, w.t(), None), want - bias)
    # in bf16 the first part's sums are rounded once more on the way: still within two bf16 steps of the largest value
    out = epilogue_fusion.concat_linear(a.to(BF16), b.to(BF16), w.to(BF16).t(), bias.to(BF16))
    want16 = torch.nn.functional.linear(torch.cat([a, b], -1).to(BF16).float(), w.to(BF16).float(),
                                        bias.to(BF16).float())
    assert out.dtype == BF16 and (out.float() - want16).abs().max() <= 2 * 2.0 ** -8 * want16.abs().max()


def test_a_gelu_converted_to_another_dtype_stays_with_inductor():
    """The op writes the GELU in its linear's dtype: a bf16 linear whose GELU is converted to fp16 for an fp16 linear
    is not rewritten (it would hand the fp16 linear a bf16 input), and compiles as before."""
    inputs = _mlp_inputs(10)

    def mixed(x, w, bias, w2, b2):
        h = (x.reshape(-1, 40) @ w.t()).reshape(1, S, MLP) + bias
        hf = h.float()
        g = (hf * torch.sigmoid(compiler._TWO_SQRT_2_OVER_PI * (hf + 0.044715 * hf * hf * hf))).to(torch.float16)
        return torch.nn.functional.linear(g, w2.to(torch.float16), b2.to(torch.float16))

    ref = mixed(**inputs)
    out, delta = _compiled_with_pass(mixed, **inputs)
    assert delta == {} and out.dtype == torch.float16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("variant", ["libdevice_gelu", "gelu_first", "token_dim"])
def test_other_concatenations_are_left_to_inductor(variant):
    """Only [x, sigmoid-form GELU] along the last dim is replaced: inductor's own GELU, the inputs swapped or a
    concatenation along the tokens compile as they did, to the same values."""
    inputs = _inputs(2)
    kwargs = {"libdevice_gelu": dict(gelu=lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
              "gelu_first": dict(a_first=False), "token_dim": dict(dim=1)}[variant]
    cast = variant != "token_dim"
    ref = _single_block_epilogue(**inputs, fp8_attention=True, cast=cast, **kwargs)
    out, delta = _compiled_with_pass(_single_block_epilogue, **inputs, fp8_attention=True, cast=cast, **kwargs)
    assert delta == {}
    assert out.shape == ref.shape


@pytest.mark.parametrize("int8_proj_out", [False, True], ids=["bf16", "int8_proj_out"])
def test_flux_single_block_compiles_its_epilogue_into_the_operation(int8_proj_out, monkeypatch):
    """diffusers' FLUX single-stream block, with the sigmoid GELU compile=True installs: its concatenation of the
    attention output and the MLP is the replaced one (with ``proj_out`` an int8 linear, as ``quant="int8"``
    installs, together with that layer's activation quantization), and the block's output is unchanged. (The bf16
    block's default, the GELU in the GEMM, is the next test.)"""
    from omni_accel.kernels.int8 import Int8Linear
    from omni_accel.testing import tiny_pipeline

    monkeypatch.setattr(epilogue_fusion, "GELU_GEMM", False)
    pipe, _ = tiny_pipeline("flux")
    block = pipe.transformer.single_transformer_blocks[0].to(BF16)
    if int8_proj_out:
        block.proj_out = Int8Linear(block.proj_out, gemm="cublas")
    delta = _block_unchanged_by_the_pass(block, gelus=1, dim=block.proj_out.out_features, seed=3)
    assert delta == {"concat_gelu_int8" if int8_proj_out else "concat_gelu": 1}


def test_flux_blocks_in_bf16_take_the_gelu_into_the_gemm():
    """With 16-bit linears (the default switch) the single block's MLP GELU moves into proj_mlp's GEMM and proj_out
    reads the attention output and the GELU's output without a concatenation; the dual block's two feed-forwards
    take their GELU into their first GEMM. The outputs move by the GELU's rounding only: it is rounded to bf16
    once from the float32 sums, where the unfused graph rounds the GEMM's output first."""
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("flux")
    single = pipe.transformer.single_transformer_blocks[0].to(BF16)
    dual = pipe.transformer.transformer_blocks[0].to(BF16)
    dim = single.proj_out.out_features
    assert _block_unchanged_by_the_pass(single, gelus=1, dim=dim, seed=3, ulps=8) == {"concat_gelu_gemm": 1}
    assert _block_unchanged_by_the_pass(dual, gelus=2, dim=dim, seed=5, ulps=8) == {"gelu_gemm": 2}


def _block_unchanged_by_the_pass(block, gelus: int, dim: int, seed: int, ulps: int = 0) -> dict:
    """Compile a FLUX block (with the sigmoid GELU, ``gelus`` of them) with and without the pass on random streams;
    assert its outputs are equal (within ``ulps`` bf16 steps of the largest output value) and return the pass's
    rewrites."""
    count, undo = compiler.use_sigmoid_gelu(block)
    assert count == gelus
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 20, dim, generator=g).to(BF16)
    text = torch.randn(1, 6, dim, generator=g).to(BF16)
    temb = torch.randn(1, dim, generator=g).to(BF16)
    with torch.no_grad():
        ref, _ = _compiled(block, hidden, text, temb, with_pass=False)
        out, delta = _compiled_with_pass(block, hidden, text, temb)
    undo()
    for o, r in zip(out, ref):
        if ulps:
            assert (o.float() - r.float()).abs().max() <= ulps * 2.0 ** -8 * r.float().abs().max()
        else:
            assert torch.equal(o, r)
    return delta


# ------------------------------------------------------------------------ concatenation + GELU -> int8 linear
def _int8_single_block_epilogue(a16, x, w, bias, quantize=None):
    """The single-stream block's epilogue as the int8 stack runs it: the bf16 concatenation, then the int8
    ``proj_out``'s per-token quantization (``quantize`` in place of kernels/int8.py's, for the near misses)."""
    from omni_accel.kernels.int8 import quantize_rows_int8

    joint = _single_block_epilogue(None, None, a16, x, w, bias, None, fp8_attention=False, cast=False)
    return (quantize or quantize_rows_int8)(joint.reshape(-1, joint.shape[-1]))


@pytest.fixture
def int8_epilogue(monkeypatch):
    monkeypatch.setattr(epilogue_fusion, "INT8", True)


def test_a_concatenation_feeding_an_int8_linear_becomes_one_operation_with_the_same_values(int8_epilogue):
    """The int8 rows and their scales come out of the one operation, equal to inductor's own kernels' (the 16-bit
    concatenation is never written)."""
    inputs = {k: v for k, v in _inputs(6).items() if k in ("a16", "x", "w", "bias")}
    (ref_q, ref_scale), _ = _compiled(_int8_single_block_epilogue, **inputs, with_pass=False)
    (q, scale), delta = _compiled_with_pass(_int8_single_block_epilogue, **inputs)
    assert delta == {"concat_gelu_int8": 1}
    assert q.dtype == torch.int8 and torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
    # eager rounds each step of the GELU to bf16: an int8 value may move by one
    eager_q, eager_scale = _int8_single_block_epilogue(**inputs)
    assert (q.int() - eager_q.int()).abs().max() <= 1
    assert torch.allclose(scale, eager_scale, rtol=2.0 ** -7)


def _quantize_half_up(x):
    """quantize_rows_int8 with another rounding (half away from zero): not the int8 linear's quantization."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / 127.0
    q = x.float() / scale
    return (torch.sign(q) * torch.floor(q.abs() + 0.5)).clamp(-127, 127).to(torch.int8), scale


def _quantize_without_floor(x):
    scale = x.abs().amax(dim=-1, keepdim=True).float() / 127.0
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("quantize", [_quantize_half_up, _quantize_without_floor], ids=["half_up", "no_floor"])
def test_other_row_quantizations_keep_the_bf16_operation(int8_epilogue, quantize):
    """A quantization that is not exactly the int8 linear's is not folded in: the concatenation becomes the bf16
    operation and inductor quantizes after it, to the same values as without the pass."""
    inputs = {k: v for k, v in _inputs(7).items() if k in ("a16", "x", "w", "bias")}
    (ref_q, ref_scale), _ = _compiled(_int8_single_block_epilogue, **inputs, quantize=quantize, with_pass=False)
    (q, scale), delta = _compiled_with_pass(_int8_single_block_epilogue, **inputs, quantize=quantize)
    assert delta == {"concat_gelu": 1}
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)


def _int8_feed_forward_epilogue(x, w, bias):
    """The dual-stream block's feed-forward as the int8 stack runs it: GELU of the first linear's output, then the
    int8 second linear's per-token quantization."""
    from omni_accel.kernels.int8 import quantize_rows_int8

    h = _feed_forward_epilogue(x, w, bias, None, cast=False)
    return quantize_rows_int8(h.reshape(-1, MLP))


def test_a_gelu_feeding_an_int8_linear_becomes_the_operation_without_a_first_input(int8_epilogue):
    """The int8 rows and scales of the GELU come out of one operation, equal to inductor's own kernels'; with the
    switch off inductor keeps it (a bf16 GELU feeding a quantization is one of its kernels already)."""
    inputs = {k: v for k, v in _inputs(8).items() if k in ("x", "w", "bias")}
    (ref_q, ref_scale), _ = _compiled(_int8_feed_forward_epilogue, **inputs, with_pass=False)
    (q, scale), delta = _compiled_with_pass(_int8_feed_forward_epilogue, **inputs)
    assert delta == {"gelu_int8": 1}
    assert q.dtype == torch.int8 and torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
    epilogue_fusion.INT8 = False  # the fixture's monkeypatch puts it back
    _, delta = _compiled_with_pass(_int8_feed_forward_epilogue, **inputs)
    assert delta == {}


def test_flux_dual_block_compiles_both_feed_forwards_into_the_operation():
    """diffusers' FLUX dual-stream block with its feed-forwards' second linears in int8 (as ``quant="int8"``
    installs them): the image and the text stream's GELU + quantization are both replaced, and the block's outputs
    are unchanged."""
    from omni_accel.kernels.int8 import Int8Linear
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("flux")
    block = pipe.transformer.transformer_blocks[0].to(BF16)
    for ff in (block.ff, block.ff_context):
        ff.net[2] = Int8Linear(ff.net[2], gemm="cublas")
    assert _block_unchanged_by_the_pass(block, gelus=2, dim=block.ff.net[2].out_features, seed=5) == {"gelu_int8": 2}


def test_the_int8_form_has_a_switch(monkeypatch):
    """On by default; off, the concatenation is the bf16 operation and inductor quantizes after it."""
    inputs = {k: v for k, v in _inputs(6).items() if k in ("a16", "x", "w", "bias")}
    _, delta = _compiled_with_pass(_int8_single_block_epilogue, **inputs)
    assert delta == {"concat_gelu_int8": 1}
    monkeypatch.setattr(epilogue_fusion, "INT8", False)
    _, delta = _compiled_with_pass(_int8_single_block_epilogue, **inputs)
    assert delta == {"concat_gelu": 1}


def test_compile_options_carry_the_pass_on_gpus_only(monkeypatch):
    assert compiler.POST_GRAD_PASS not in compiler.compile_options(True, torch.device("cpu")).get("options", {})
    options = compiler.compile_options(True, torch.device("cuda"))["options"]
    assert options[compiler.POST_GRAD_PASS] is epilogue_fusion.GRAPH_PASS
    assert compiler._printable({"options": options})["options"][compiler.POST_GRAD_PASS] == "EpilogueFusionPass"
    monkeypatch.setattr(compiler, "EPILOGUE_FUSION", False)
    assert compiler.POST_GRAD_PASS not in compiler.compile_options(True, torch.device("cuda"))["options"]


def test_the_pass_has_a_cache_key_that_follows_its_switch(monkeypatch):
    """inductor caches compiled graphs only for custom passes with a uuid (the compile-cache file relies on that),
    and a graph compiled without the q / k replacement must not be served to a process that has it."""
    key = epilogue_fusion.GRAPH_PASS.uuid()
    assert isinstance(key, str) and key == epilogue_fusion.EpilogueFusionPass().uuid()
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE", False)
    without_qk = epilogue_fusion.GRAPH_PASS.uuid()
    monkeypatch.setattr(epilogue_fusion, "LAYERNORM", False)
    without_norm = epilogue_fusion.GRAPH_PASS.uuid()
    monkeypatch.setattr(epilogue_fusion, "PDL", False)
    without_pdl = epilogue_fusion.GRAPH_PASS.uuid()
    monkeypatch.setattr(epilogue_fusion, "GELU_GEMM", False)
    assert len({key, without_qk, without_norm, without_pdl, epilogue_fusion.GRAPH_PASS.uuid()}) == 5


# ------------------------------------------------------------------ q / k: RMSNorm + rotary + static FP8 cast
def _attention_operands(x, w_qkv, b_qkv, wq, wk, cos, sin, k_mean, inv_q, inv_k, inv_v, sequence_dim=1):
    """What the compiled FP8 stack computes between a FLUX single block's fused q / k / v projection and cuDNN's FP8
    attention: split, heads, the q / k RMSNorm, the pair-swap rotary, K's calibrated mean, the static casts."""
    from diffusers.models import embeddings

    from omni_accel.kernels.cudnn_fp8_attention import _static_e4m3

    qkv = (x.reshape(-1, 40) @ w_qkv.t()).reshape(1, S, 3 * H * D) + b_qkv
    q, k, v = (t.unflatten(-1, (H, -1)) for t in qkv.split(H * D, dim=-1))
    q = torch.nn.functional.rms_norm(q, (D,), wq, 1e-6)
    k = torch.nn.functional.rms_norm(k, (D,), wk, 1e-6)
    rope = compiler._pair_swap_rotary(embeddings.apply_rotary_emb)
    if sequence_dim == 2:  # heads first: the rows are not (token, head) pairs
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = (rope(t, (cos, sin), sequence_dim=sequence_dim) for t in (q, k))
    if sequence_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return _static_e4m3(q, inv_q), _static_e4m3(k.float() - k_mean, inv_k), _static_e4m3(v, inv_v)


def _attention_inputs(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(S, D // 2, generator=g) * 6.28
    return dict(
        x=torch.randn(1, S, 40, generator=g).to(BF16),
        w_qkv=(torch.randn(3 * H * D, 40, generator=g) / 6).to(BF16),
        b_qkv=(torch.randn(3 * H * D, generator=g) * 0.1).to(BF16),
        wq=(1 + 0.1 * torch.randn(D, generator=g)).to(BF16), wk=(1 + 0.1 * torch.randn(D, generator=g)).to(BF16),
        cos=angles.cos().repeat_interleave(2, -1), sin=angles.sin().repeat_interleave(2, -1),
        k_mean=torch.randn(1, 1, H, D, generator=g) * 0.3,
        inv_q=torch.full((1, 1, 1, 1), 448.0 / 8), inv_k=torch.full((1, 1, 1, 1), 448.0 / 8),
        inv_v=torch.full((1, 1, 1, 1), 448.0 / 4))


def test_fp8_attention_q_and_k_become_one_operation_each_with_the_same_values():
    inputs = _attention_inputs()
    ref, _ = _compiled(_attention_operands, **inputs, with_pass=False)
    out, delta = _compiled_with_pass(_attention_operands, **inputs)
    assert delta == {"qk_norm_rope_fp8": 2}  # q and k; v's plain cast stays with inductor
    for o, r in zip(out, ref):
        _assert_e4m3_close(o, r)
    assert torch.equal(out[2], ref[2])


def _attention_operands_16(x, w_qkv, b_qkv, wq, wk, cos, sin, float_use=False, **_):
    """The same from the projection to a 16-bit attention's q and k (the bf16 and int8 stacks: no cast), or
    (``float_use``) to a consumer that reads them in float32 (SageAttention's quantization in the graph)."""
    from diffusers.models import embeddings

    qkv = (x.reshape(-1, 40) @ w_qkv.t()).reshape(1, S, 3 * H * D) + b_qkv
    q, k, v = (t.unflatten(-1, (H, -1)) for t in qkv.split(H * D, dim=-1))
    rope = compiler._pair_swap_rotary(embeddings.apply_rotary_emb)
    q, k = (rope(torch.nn.functional.rms_norm(t, (D,), w, 1e-6), (cos, sin), sequence_dim=1)
            for t, w in ((q, wq), (k, wk)))
    if float_use:
        return q.float().abs().amax(dim=-1), k.float() * 3.0, v
    return q * 1.0, k, v


def _joint_attention_operands(x, text, w_qkv, b_qkv, wq, wk, cos, sin, k_mean, inv_q, inv_k, inv_v, cast=True):
    """A joint (dual-stream) block's q and k: each stream's own fused projection and norms, the two concatenated
    along the tokens (text first) before the rotary, then FP8 attention's static casts or (``cast=False``) 16-bit."""
    from diffusers.models import embeddings

    from omni_accel.kernels.cudnn_fp8_attention import _static_e4m3

    rope = compiler._pair_swap_rotary(embeddings.apply_rotary_emb)
    streams = []
    # the text stream's projection laid out differently: an extra part first, so its q / k sit one part further
    text_w, text_b = torch.cat([w_qkv[:H * D] * 0.3, w_qkv * 0.5]), torch.cat([b_qkv[:H * D], b_qkv * 2])
    for tokens, weights in ((text, (text_w, text_b, wk, wq)), (x, (w_qkv, b_qkv, wq, wk))):
        w, b, norm_q, norm_k = weights
        qkv = (tokens.reshape(-1, 40) @ w.t()).reshape(1, tokens.shape[1], w.shape[0]) + b
        q, k, v = (t.unflatten(-1, (H, -1)) for t in qkv.split(H * D, dim=-1)[-3:])
        streams.append((torch.nn.functional.rms_norm(q, (D,), norm_q, 1e-6),
                        torch.nn.functional.rms_norm(k, (D,), norm_k, 1e-6), v))
    q, k, v = (torch.cat([a, b], dim=1) for a, b in zip(*streams))
    cos, sin = torch.cat([cos[:4], cos]), torch.cat([sin[:4], sin])  # tables over text + image tokens
    q, k = (rope(t, (cos, sin), sequence_dim=1) for t in (q, k))
    if not cast:
        return q * 1.0, k, v
    return _static_e4m3(q, inv_q), _static_e4m3(k.float() - k_mean, inv_k), _static_e4m3(v, inv_v)


def _joint_inputs(seed: int):
    g = torch.Generator().manual_seed(seed + 100)
    return dict(**_attention_inputs(seed), text=torch.randn(1, 4, 40, generator=g).to(BF16))


def _error_vs_exact(values, exact, scales) -> list[float]:
    """Each of q and k's relative error against the float64 computation (the FP8 outputs divided by their scale)."""
    return [((v.double() / s - e).norm() / e.norm()).item() for v, e, s in zip(values, exact, scales)]


def test_joint_blocks_q_and_k_read_both_streams_in_one_operation(monkeypatch):
    """q and k concatenated from two streams before the rotary (FLUX's dual-stream blocks): one operation each,
    reading both projections in place (QK_NORM_ROPE_JOINT), for FP8 attention's casts and (switched on) the 16-bit
    form. The kernel keeps
    each stream's normalized value in float32 where the concatenation rounds it to bf16 first, so values where the
    rotary cancels differ from inductor's by more than one step: it is held to being as close to the float64
    computation as inductor's kernels are."""
    inputs = _joint_inputs(11)
    assert epilogue_fusion.QK_NORM_ROPE_JOINT is True  # the default; off, inductor keeps them
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_JOINT", False)
    _, delta = _compiled_with_pass(_joint_attention_operands, **inputs)
    assert delta == {}
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_JOINT", True)
    exact = _joint_attention_operands(**{k: v.double() for k, v in inputs.items()}, cast=False)
    exact = [exact[0], exact[1] - inputs["k_mean"].double()]
    scales = [inputs["inv_q"].double(), inputs["inv_k"].double()]
    ref, _ = _compiled(_joint_attention_operands, **inputs, with_pass=False)
    out, delta = _compiled_with_pass(_joint_attention_operands, **inputs)
    assert delta == {"qk_norm_rope_fp8": 2}
    assert out[0].dtype == out[1].dtype == FP8_DTYPE and torch.equal(out[2], ref[2])
    for ours, inductors in zip(_error_vs_exact(out, exact, scales), _error_vs_exact(ref, exact, scales)):
        assert ours <= inductors * 1.05, (ours, inductors)
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_16", True)
    exact16 = _joint_attention_operands(**{k: v.double() for k, v in inputs.items()}, cast=False)
    ref, _ = _compiled(_joint_attention_operands, **inputs, cast=False, with_pass=False)
    out, delta = _compiled_with_pass(_joint_attention_operands, **inputs, cast=False)
    assert delta == {"qk_norm_rope": 2}
    ones = [torch.tensor(1.0, dtype=torch.float64)] * 2
    for ours, inductors in zip(_error_vs_exact(out, exact16, ones), _error_vs_exact(ref, exact16, ones)):
        assert ours <= inductors * 1.05, (ours, inductors)


def test_16_bit_q_and_k_become_the_operation_without_the_cast_when_switched_on(monkeypatch):
    """QK_NORM_ROPE_16 (on by default): a 16-bit q and k from the fused projection's norm + rotary become one
    operation each, with inductor's values; off, nothing is replaced. FP8 attention's casts still go to the FP8 form
    (checked with the switch on too)."""
    inputs = _attention_inputs(9)
    assert epilogue_fusion.QK_NORM_ROPE_16 is True
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_16", False)
    _, delta = _compiled_with_pass(_attention_operands_16, **inputs)
    assert delta == {}
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_16", True)
    ref, _ = _compiled(_attention_operands_16, **inputs, with_pass=False)
    out, delta = _compiled_with_pass(_attention_operands_16, **inputs)
    assert delta == {"qk_norm_rope": 2}
    for o, r in zip(out, ref):
        _assert_bf16_close(o, r)
    _, delta = _compiled_with_pass(_attention_operands, **_attention_inputs(10))
    assert delta == {"qk_norm_rope_fp8": 2}
    # a float32 use that is not FP8 attention's cast (SageAttention's quantization) is served too; it reads the
    # 16-bit rounding the graph asks for, which inductor's own kernel may skip (one bf16 step)
    ref, _ = _compiled(_attention_operands_16, **inputs, float_use=True, with_pass=False)
    out, delta = _compiled_with_pass(_attention_operands_16, **inputs, float_use=True)
    assert delta == {"qk_norm_rope": 2}
    for o, r in zip(out[:2], ref[:2]):
        assert ((o - r).abs() <= 2.0 ** -8 * r.abs() + 1e-6).all()


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_qkv"])
def test_qwen_image_blocks_q_and_k_become_the_16_bit_operation_with_diffusers_rms_norm(monkeypatch, fused):
    """Qwen-Image's q / k norms are diffusers' RMSNorm (the normalized value rounded to bf16 before the weight, its
    16-bit input read twice) and its rotary tables per stream, (1, S, 1, D) views the complex rotary's real form
    builds. With QK_NORM_ROPE_DIFFUSERS_RMS (the default) the four q / k (image and text) become the operation, its
    tables materialized as (S, D), from separate or fused projections, for a batch of two; the block's output is
    inductor's bit for bit on the CPU (inductor's fused kernel keeps the intermediate rounding out, as the kernel
    does). Off, or where inductor emulates precision casts (its kernel would then round before the weight), nothing
    is replaced."""
    from diffusers.models.transformers import transformer_qwenimage

    assert epilogue_fusion.QK_NORM_ROPE_DIFFUSERS_RMS  # on by default (timed on a GPU)
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_16", True)
    heads, head_dim = 2, 64
    torch.manual_seed(0)
    block = transformer_qwenimage.QwenImageTransformerBlock(heads * head_dim, heads, head_dim).to(BF16).eval()
    if fused:
        block.attn.fuse_projections()
    count, undo = compiler.use_complex_rotary_pair_swap(block, ("apply_rotary_emb_qwen",))
    g = torch.Generator().manual_seed(3)
    image, text = (torch.randn(2, n, heads * head_dim, generator=g).to(BF16) for n in (16, 6))
    temb = torch.randn(2, heads * head_dim, generator=g).to(BF16)
    rotary = tuple(torch.polar(torch.ones(n, head_dim // 2), torch.rand(n, head_dim // 2, generator=g) * 6.28)
                   for n in (16, 6))
    args = (image, text, None, temb, rotary)
    try:
        with torch.no_grad():
            ref, _ = _compiled(block, *args, with_pass=False)
            monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_DIFFUSERS_RMS", False)
            _, off = _compiled_with_pass(block, *args)
            monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_DIFFUSERS_RMS", True)
            out, delta = _compiled_with_pass(block, *args)
            with torch._inductor.config.patch(emulate_precision_casts=True):
                _, emulated = _compiled_with_pass(block, *args)
    finally:
        undo()
    assert count == 1 and off == {} and emulated == {} and delta == {"qk_norm_rope": 4}
    for o, r in zip(out, ref):
        assert torch.equal(o, r)


@pytest.mark.parametrize("layout", ["rows", "view", "broadcast"])
def test_rotary_tables_reach_the_operation_as_contiguous_rows(layout):
    """The q / k operation reads its rotary tables as (S, D) contiguous rows: a 2-D table goes in as it is, a
    (1, S, 1, D) table the graph builds contiguously as a reshape of it, and one that is not contiguous once
    reshaped (here broadcast along the tokens) through a copy; every form holds the table's values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    table = {"rows": torch.randn(S, D), "view": torch.randn(1, S, 1, D),
             "broadcast": torch.randn(1, 1, 1, D).expand(1, S, 1, D)}[layout]
    graph = torch.fx.Graph()
    node = graph.placeholder("table")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        node.meta["val"] = mode.from_tensor(table)
        rows = epilogue_fusion._table_rows(graph, node)
    graph.output(rows)
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    expected = {"rows": [], "view": [torch.ops.aten.reshape.default],
                "broadcast": [torch.ops.aten.reshape.default, torch.ops.aten.clone.default]}[layout]
    assert targets == expected
    assert rows.meta["val"].shape == (S, D) and rows.meta["val"].is_contiguous()
    out = torch.fx.GraphModule(torch.nn.Module(), graph)(table)
    assert out.is_contiguous() and torch.equal(out, table.reshape(S, D))


@pytest.mark.parametrize("kind", ["single", "dual"])
def test_flux_blocks_q_and_k_become_the_16_bit_operation(monkeypatch, kind):
    """diffusers' FLUX blocks in bf16 with the pair-swap rotary compile=True installs: q and k are replaced (switches
    on; the dual-stream block's read both streams). The single block's output is inductor's bit for bit on the CPU;
    the dual block's, whose concatenation rounds the normalized values to bf16 where the kernel does not, is as close
    to inductor's as inductor's is to eager."""
    from omni_accel.testing import tiny_pipeline

    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_16", True)
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_JOINT", True)
    pipe, _ = tiny_pipeline("flux")
    count, undo = compiler.use_rotary_pair_swap(pipe.transformer)
    blocks = pipe.transformer.single_transformer_blocks if kind == "single" else pipe.transformer.transformer_blocks
    block = blocks[0].to(BF16)
    dim, head_dim = block.attn.to_q.in_features, block.attn.to_q.in_features // block.attn.heads
    g = torch.Generator().manual_seed(13)
    streams = [torch.randn(1, n, dim, generator=g).to(BF16) for n in (16, 6)] + [torch.randn(1, dim, generator=g)
                                                                                .to(BF16)]
    angles = torch.rand(22, head_dim // 2, generator=g) * 6.28
    rotary = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    try:
        with torch.no_grad():
            ref, _ = _compiled(block, *streams, rotary, with_pass=False)
            out, delta = _compiled_with_pass(block, *streams, rotary)
            eager = block(*streams, image_rotary_emb=rotary)
    finally:
        undo()
    assert count > 0 and delta == {"qk_norm_rope": 2}
    for o, r, e in zip(out, ref, eager):
        if kind == "single":
            assert torch.equal(o, r)
        else:
            assert 0 < torch.linalg.norm((o - r).float()) <= torch.linalg.norm((e - r).float())


def test_the_16_bit_form_leaves_fp8_attentions_casts_to_the_fp8_form_with_other_uses(monkeypatch):
    """K's float32 value (after K's mean) also read elsewhere: the FP8 form still takes q and k from their casts,
    the 16-bit form (switched on, and visiting the 16-bit node first) does not take them away."""
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_16", True)

    def operands_and_a_statistic(**inputs):
        from diffusers.models import embeddings

        from omni_accel.kernels.cudnn_fp8_attention import _static_e4m3

        qkv = (inputs["x"].reshape(-1, 40) @ inputs["w_qkv"].t()).reshape(1, S, 3 * H * D) + inputs["b_qkv"]
        q, k, _ = (t.unflatten(-1, (H, -1)) for t in qkv.split(H * D, dim=-1))
        rope = compiler._pair_swap_rotary(embeddings.apply_rotary_emb)
        q, k = (rope(torch.nn.functional.rms_norm(t, (D,), w, 1e-6), (inputs["cos"], inputs["sin"]),
                     sequence_dim=1) for t, w in ((q, inputs["wq"]), (k, inputs["wk"])))
        k_centred = k.float() - inputs["k_mean"]
        return (_static_e4m3(q, inputs["inv_q"]), _static_e4m3(k_centred, inputs["inv_k"]),
                k_centred.abs().amax())

    _, delta = _compiled_with_pass(operands_and_a_statistic, **_attention_inputs(15))
    assert delta == {"qk_norm_rope_fp8": 2}


def test_q_and_k_replacement_has_a_switch(monkeypatch):
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE", False)
    _, delta = _compiled_with_pass(_attention_operands, **_attention_inputs(7))
    assert delta == {}


def test_q_and_k_in_another_layout_are_left_to_inductor():
    """Heads before tokens (the rotary's sequence_dim=2): the rows are not the kernel's (token, head) pairs."""
    inputs = _attention_inputs(6)
    out, delta = _compiled_with_pass(_attention_operands, **inputs, sequence_dim=2)
    assert delta == {}
    ref, _ = _compiled(_attention_operands, **inputs, sequence_dim=2, with_pass=False)
    assert all(torch.equal(o, r) for o, r in zip(out, ref))


# ------------------------------------------------------------- LayerNorm + modulate + static cast(s), the AdaLN input
def _adaln_input(text, image, emb, inv_a, inv_b, two: bool, streams: bool = True, three: bool = False):
    """FLUX's single-stream block from its two streams to its FP8 linears' inputs: the concatenation, AdaLN's
    LayerNorm * (1 + scale) + shift, and one static cast per linear that reads it."""
    from omni_accel.kernels.fp8 import quantize_static

    x = torch.cat([text, image], dim=1) if streams else image
    shift, scale, _ = emb.chunk(3, dim=1)
    y = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    rows = y.reshape(-1, y.shape[-1])
    first = quantize_static(rows, inv_a)[0]
    if three:  # separate q, k and v projections
        return first, quantize_static(rows, inv_b)[0], quantize_static(rows, inv_a * 2)[0]
    return (first, quantize_static(rows, inv_b)[0]) if two else first


def _adaln_inputs(seed: int = 8):
    g = torch.Generator().manual_seed(seed)
    return dict(text=torch.randn(1, 6, 48, generator=g).to(BF16), image=torch.randn(1, 18, 48, generator=g).to(BF16),
                emb=(torch.randn(1, 3 * 48, generator=g) * 0.2).to(BF16),
                inv_a=torch.tensor(448.0 / 6), inv_b=torch.tensor(448.0 / 3))


@pytest.mark.parametrize("two, streams, three", [(True, True, False), (False, True, False), (False, False, False),
                                                (False, False, True)])
def test_adaln_norm_feeding_fp8_linears_becomes_one_operation(two, streams, three):
    inputs = _adaln_inputs()
    ref, _ = _compiled(_adaln_input, **inputs, two=two, streams=streams, three=three, with_pass=False)
    out, delta = _compiled_with_pass(_adaln_input, **inputs, two=two, streams=streams, three=three)
    assert delta == {"layernorm_modulate_fp8": 1}
    many = two or three
    for o, r in zip(out if many else [out], ref if many else [ref]):
        _assert_e4m3_close(o, r)


def test_a_norm_with_a_16_bit_use_is_left_to_inductor():
    """One use of the modulated output stays bf16 (a residual, a bf16 linear): the norm is not replaced."""
    def norm_and_keep(text, image, emb, inv_a, inv_b):
        from omni_accel.kernels.fp8 import quantize_static

        x = torch.cat([text, image], dim=1)
        shift, scale, _ = emb.chunk(3, dim=1)
        y = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        return quantize_static(y.reshape(-1, y.shape[-1]), inv_a)[0], y * 2

    out, delta = _compiled_with_pass(norm_and_keep, **_adaln_inputs(9))
    assert delta == {}


def _adaln_int8_input(text, image, emb, linears: int = 2, streams: bool = True):
    """The same norm feeding ``linears`` int8 linears (FLUX's single block: the fused q / k / v and the MLP), each
    quantizing its input per row itself, as kernels/int8.py's Int8Linear does."""
    from omni_accel.kernels.int8 import quantize_rows_int8

    x = torch.cat([text, image], dim=1) if streams else image
    shift, scale, _ = emb.chunk(3, dim=1)
    y = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    return [quantize_rows_int8(y.reshape(-1, y.shape[-1])) for _ in range(linears)]


def _assert_int8_rows_close(out, ref, equal_frac: float = 0.97):
    """Each linear's int8 rows and scales within one int8 step and a bf16 rounding of the scale of ``ref``'s: the
    kernel keeps the normalized row in float32 until its one rounding to bf16, where inductor may round in between
    and eager rounds after every operation."""
    for (q, scale), (q_ref, scale_ref) in zip(out, ref):
        assert q.dtype == torch.int8 and q.shape == q_ref.shape and scale.shape == scale_ref.shape
        assert (q.int() - q_ref.int()).abs().max() <= 1 and (q == q_ref).float().mean() > equal_frac
        assert torch.allclose(scale, scale_ref, rtol=2.0 ** -7, atol=0)


@pytest.fixture
def layernorm_int8(monkeypatch):
    monkeypatch.setattr(epilogue_fusion, "LAYERNORM_INT8", True)


@pytest.mark.parametrize("linears, streams", [(2, True), (1, True), (1, False), (3, False)])
def test_adaln_norm_feeding_int8_linears_becomes_one_operation(layernorm_int8, linears, streams):
    """LayerNorm + modulate whose every use is an int8 linear's row quantization: one operation writes the int8 rows
    and scales once, for every linear reading them."""
    inputs = {k: v for k, v in _adaln_inputs(10).items() if k in ("text", "image", "emb")}
    ref, _ = _compiled(_adaln_int8_input, **inputs, linears=linears, streams=streams, with_pass=False)
    out, delta = _compiled_with_pass(_adaln_int8_input, **inputs, linears=linears, streams=streams)
    assert delta == {"layernorm_modulate_int8": 1}
    _assert_int8_rows_close(out, ref)
    _assert_int8_rows_close(out, _adaln_int8_input(**inputs, linears=linears, streams=streams), equal_frac=0.8)


def test_the_int8_norm_has_a_switch(monkeypatch):
    """On by default; off, inductor keeps its own norm + quantization kernels."""
    assert epilogue_fusion.LAYERNORM_INT8 is True
    monkeypatch.setattr(epilogue_fusion, "LAYERNORM_INT8", False)
    inputs = {k: v for k, v in _adaln_inputs(11).items() if k in ("text", "image", "emb")}
    out, delta = _compiled_with_pass(_adaln_int8_input, **inputs)
    assert delta == {}
    ref, _ = _compiled(_adaln_int8_input, **inputs, with_pass=False)
    assert all(torch.equal(o, r) for pair, ref_pair in zip(out, ref) for o, r in zip(pair, ref_pair))


def test_a_quantization_of_rows_of_another_width_is_left_to_inductor(layernorm_int8):
    """The norm's rows viewed at half their width before the int8 quantization: not the rows the kernel quantizes,
    so nothing is replaced and the graph compiles to inductor's values."""
    from omni_accel.kernels.int8 import quantize_rows_int8

    def half_width_rows(text, image, emb):
        x = torch.cat([text, image], dim=1)
        shift, scale, _ = emb.chunk(3, dim=1)
        y = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        return quantize_rows_int8(y.reshape(-1, y.shape[-1] // 2))

    inputs = {k: v for k, v in _adaln_inputs(14).items() if k in ("text", "image", "emb")}
    out, delta = _compiled_with_pass(half_width_rows, **inputs)
    ref, _ = _compiled(half_width_rows, **inputs, with_pass=False)
    assert delta == {} and all(torch.equal(o, r) for o, r in zip(out, ref))


def test_flux_blocks_with_int8_linears_have_their_norms_replaced(layernorm_int8):
    """diffusers' FLUX blocks with every block linear in int8 (as ``quant="int8"`` installs them): each AdaLN norm
    feeding them becomes the operation (one in a single-stream block, the two streams' two in a dual-stream block),
    beside the GELU epilogues, and the blocks' outputs stay as close to inductor's own as its own are to eager's
    (an int8 step moved by a rounding reaches the output through the next GEMM)."""
    from omni_accel.kernels.int8 import Int8Linear
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("flux")
    blocks = [(pipe.transformer.single_transformer_blocks[0], 1, {"layernorm_modulate_int8": 1, "concat_gelu_int8": 1}),
              (pipe.transformer.transformer_blocks[0], 2, {"layernorm_modulate_int8": 4, "gelu_int8": 2})]
    for block, gelus, expected in blocks:
        block = block.to(BF16)
        for module in list(block.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear) and not name.startswith("linear"):  # AdaLN's own stays bf16
                    setattr(module, name, Int8Linear(child, gemm="cublas"))
        count, undo = compiler.use_sigmoid_gelu(block)
        assert count == gelus
        dim = block.attn.to_q.in_features
        g = torch.Generator().manual_seed(12)
        streams = [torch.randn(1, n, dim, generator=g).to(BF16) for n in (20, 6)] + [torch.randn(1, dim, generator=g)
                                                                                    .to(BF16)]
        with torch.no_grad():
            ref, _ = _compiled(block, *streams, with_pass=False)
            out, delta = _compiled_with_pass(block, *streams)
            eager = block(*streams)
        undo()
        assert delta == expected
        for o, r, e in zip(out, ref, eager):
            assert torch.linalg.norm((o - r).float()) <= 2 * torch.linalg.norm((e - r).float()) + 1e-6


# -------------------------------------------------------------------------------- programmatic dependent launch
def test_the_kernels_use_pdl_where_inductor_does(monkeypatch):
    """Inductor launches its own kernels with programmatic dependent launch when it compiles with
    ``triton.enable_pdl`` for a Hopper or newer GPU; the pass's kernels follow that decision (and the PDL switch)."""
    from torch._inductor import config

    cuda = torch.device("cuda", 0)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    with config.patch({"triton.enable_pdl": True}):
        assert epilogue_fusion._pdl(cuda) and not epilogue_fusion._pdl(torch.device("cpu"))
        capability[0] = (8, 9)
        assert not epilogue_fusion._pdl(cuda)
        capability[0] = (10, 0)
        assert epilogue_fusion._pdl(cuda)
        monkeypatch.setattr(epilogue_fusion, "PDL", False)
        assert not epilogue_fusion._pdl(cuda)
    monkeypatch.setattr(epilogue_fusion, "PDL", True)
    with config.patch({"triton.enable_pdl": False}):
        assert not epilogue_fusion._pdl(cuda)


@pytest.mark.parametrize("pdl", [True, False])
def test_the_pdl_decision_reaches_every_operation_the_pass_puts_in(monkeypatch, pdl):
    """Each operation carries the decision taken while the pass ran, for its kernel's launch."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Recording(CustomGraphPass):
        def __init__(self):
            self.flags = {}

        def __call__(self, graph):
            epilogue_fusion.GRAPH_PASS(graph)
            for node in graph.nodes:
                if node.op == "call_function" and "omni_accel" in str(node.target):
                    self.flags.setdefault(node.target.name(), set()).add(node.args[-1])

        def uuid(self):
            return None

    monkeypatch.setattr(epilogue_fusion, "_pdl", lambda device: pdl)
    monkeypatch.setattr(epilogue_fusion, "LAYERNORM_INT8", True)
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_16", True)
    recording = Recording()
    adaln = _adaln_inputs()
    for fn, inputs in ((_single_block_epilogue, dict(**_inputs(), fp8_attention=True, cast=True)),
                       (_attention_operands, _attention_inputs()), (_adaln_input, dict(**adaln, two=True)),
                       (_adaln_int8_input, {k: v for k, v in adaln.items() if k in ("text", "image", "emb")}),
                       (_attention_operands_16, _attention_inputs())):
        torch._dynamo.reset()
        torch.compile(fn, options={"fx_graph_cache": False, compiler.POST_GRAD_PASS: recording})(**inputs)
    assert recording.flags == {f"omni_accel::{op}": {pdl} for op in ("concat_gelu", "qk_norm_rope_fp8",
                                                                      "layernorm_modulate_fp8",
                                                                      "layernorm_modulate_int8", "qk_norm_rope")}


def test_the_int8_epilogue_kernels_take_their_switches(monkeypatch):
    """The operations hand the module switches to the kernel launchers: the one-pass kernel by default (the two-pass
    one with ``INT8_ONE_PASS`` off), the GELU by tanh and the reciprocal scale only when ``INT8_GELU_TANH`` /
    ``INT8_RECIPROCAL`` are on (they are off by default), for the AdaLN kernel too."""
    from omni_accel.kernels import epilogue_triton

    assert epilogue_fusion.INT8_ONE_PASS is True
    assert epilogue_fusion.INT8_GELU_TANH is False and epilogue_fusion.INT8_RECIPROCAL is False
    seen = []

    def gelu_launcher(a, a_scale, h, bias, dtype, pdl=False, one_pass=True, gelu_tanh=False, reciprocal=False):
        seen.append(("gelu", one_pass, gelu_tanh, reciprocal))
        return epilogue_fusion.concat_gelu_int8_reference(a, a_scale, h, bias, dtype)

    def norm_launcher(a, b, scale, shift, eps, dtype, pdl=False, reciprocal=False):
        seen.append(("norm", reciprocal))
        return epilogue_fusion.layernorm_modulate_int8_reference(a, b, scale, shift, eps, dtype)

    monkeypatch.setattr(epilogue_fusion, "_use_triton", lambda device: True)
    monkeypatch.setattr(epilogue_triton, "concat_gelu_int8", gelu_launcher)
    monkeypatch.setattr(epilogue_triton, "layernorm_modulate_int8", norm_launcher)
    a, h = torch.randn(3, 2, 16).to(BF16), torch.randn(3, 64).to(BF16)
    x, mod = torch.randn(4, 32).to(BF16), torch.randn(32).to(BF16)
    for one_pass, tanh, reciprocal in ((False, False, False), (True, False, False), (True, True, False),
                                       (True, False, True)):
        monkeypatch.setattr(epilogue_fusion, "INT8_ONE_PASS", one_pass)
        monkeypatch.setattr(epilogue_fusion, "INT8_GELU_TANH", tanh)
        monkeypatch.setattr(epilogue_fusion, "INT8_RECIPROCAL", reciprocal)
        torch.ops.omni_accel.concat_gelu_int8(a, None, h, None, BF16)
        torch.ops.omni_accel.layernorm_modulate_int8(x, None, mod, mod, 1e-6, BF16)
    assert seen == [("gelu", False, False, False), ("norm", False), ("gelu", True, False, False), ("norm", False),
                    ("gelu", True, True, False), ("norm", False), ("gelu", True, False, True), ("norm", True)]


def test_16_bit_linears_left_by_the_patterns_become_tuned_gemms_with_the_same_values(monkeypatch):
    """With gemm_tuning.TUNED_GEMMS on and above its MIN_GFLOP (lowered here: the test's linears are tiny) a 16-bit
    linear the other patterns did not take becomes omni_accel::linear_tuned, after them: the MLP keeps its GELU in the
    first GEMM and its second linear is tuned. Off a GPU the op is torch's call, so the values are those of the graph
    without the pass."""
    from omni_accel.kernels import gemm_tuning

    inputs = _mlp_inputs(11)
    ref, _ = _compiled(_mlp, **inputs, with_pass=False)
    monkeypatch.setattr(gemm_tuning, "MIN_GFLOP", 0.0)
    _, delta = _compiled_with_pass(_mlp, **inputs)
    assert delta == {"gelu_gemm": 1}  # off by default
    monkeypatch.setattr(gemm_tuning, "TUNED_GEMMS", True)
    out, delta = _compiled_with_pass(_mlp, **inputs)
    assert delta == {"gelu_gemm": 1, "tuned_gemm": 1}
    assert (out.float() - ref.float()).abs().max() <= 4 * 2.0 ** -8 * ref.float().abs().max()
    monkeypatch.setattr(gemm_tuning, "MIN_GFLOP", 20.0)  # the test's linears are far below the default size
    _, delta = _compiled_with_pass(_mlp, **inputs)
    assert delta == {"gelu_gemm": 1}


def test_a_tuned_linear_off_a_gpu_is_torchs_call_bit_for_bit(monkeypatch):
    from omni_accel.kernels import gemm_tuning

    monkeypatch.setattr(gemm_tuning, "TUNED_GEMMS", True)
    monkeypatch.setattr(gemm_tuning, "MIN_GFLOP", 0.0)
    inputs = _mlp_inputs(12)
    x, w, bias = inputs["x"].reshape(-1, 40), inputs["w"], inputs["bias"]
    assert torch.equal(torch.ops.omni_accel.linear_tuned(x, w.t(), bias), torch.addmm(bias, x, w.t()))
    assert torch.equal(torch.ops.omni_accel.linear_tuned(x, w.t(), None), torch.mm(x, w.t()))


# ------------------------------------------------- a block's gated residual in the int8 GEMM (GATED_RESIDUAL_INT8)
@pytest.fixture
def gated_residual_on(monkeypatch):
    """The switch on, as an A/B row sets it (off by default until a whole forward has been timed with it)."""
    monkeypatch.setattr(epilogue_fusion, "GATED_RESIDUAL_INT8", True)

N_OUT = 48  # the int8 linear's output width


def _int8_projection(seed: int = 0):
    """An int8 linear on the Triton GEMM (as ``quant="int8"`` installs it on a GPU; off a GPU its op runs the PyTorch
    reference), 40 -> N_OUT, bias in the GEMM."""
    from omni_accel.kernels.int8 import Int8Linear

    torch.manual_seed(seed)
    return Int8Linear(torch.nn.Linear(40, N_OUT).to(BF16), gemm="triton")


def _gated_inputs(seed: int, gate_rows: int = 1, gate_dtype=BF16):
    """x (1, S, 40), the hidden state (1, S, N_OUT) and a modulation output (1, [gate_rows,] 3 N_OUT) whose last
    chunk is the gate: one row (the batch-1 AdaLN modulation), or one per token."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, 3 * N_OUT) if gate_rows == 1 else (1, gate_rows, 3 * N_OUT)
    return dict(x=torch.randn(1, S, 40, generator=g).to(BF16), hidden=(torch.randn(1, S, N_OUT, generator=g) * 4)
                .to(BF16), emb=torch.randn(*shape, generator=g).to(gate_dtype))


def _gate(emb):
    gate = emb.chunk(3, dim=-1)[2]
    return gate.unsqueeze(1) if gate.dim() == 2 else gate


def _gated_residual(layer, form: str):
    """``residual + gate * layer(x)`` as the blocks write it: FLUX's dual and single blocks and Qwen-Image's
    (``gate * out``, then ``hidden + that``), the operands the other way round, and Wan's float32 form."""
    def dual(x, hidden, emb):
        return hidden + _gate(emb) * layer(x)

    def swapped(x, hidden, emb):
        return layer(x) * _gate(emb) + hidden

    def wan(x, hidden, emb):  # the gate in float32, the sum too, rounded back to the hidden state's dtype
        return (hidden.float() + layer(x).float() * _gate(emb)).type_as(hidden)

    return {"dual": dual, "swapped": swapped, "wan": wan}[form]


class _GraphRecording(CustomGraphPass):
    """A post-grad pass that runs the epilogue pass and keeps the graph it leaves."""

    def __init__(self):
        self.graph = None

    def __call__(self, graph):
        epilogue_fusion.GRAPH_PASS(graph)
        self.graph = graph

    def uuid(self):
        return None

    def targets(self) -> list:
        return [str(n.target) for n in self.graph.nodes if n.op == "call_function"]


def _compiled_recorded(fn, *args):
    """(output, {rewrite kind: count}, the recording with the graph the pass left) of ``fn`` compiled with the pass."""
    recording = _GraphRecording()
    torch._dynamo.reset()
    before = dict(epilogue_fusion.REWRITES)
    out = torch.compile(fn, options={"fx_graph_cache": False, compiler.POST_GRAD_PASS: recording})(*args)
    return out, epilogue_fusion.rewrites_since(before), recording


@pytest.mark.parametrize("form", ["dual", "swapped", "wan"])
def test_a_gated_residual_after_an_int8_linear_moves_into_its_gemm(form, gated_residual_on):
    """``hidden + gate * int8_linear(x)`` with one gate row becomes omni_accel::int8_mm_rescale_residual: the GEMM's
    own op is gone from the graph, and the values equal inductor's unfused graph's bit for bit (the op rounds the
    product to bf16 before the gated add, which it computes in float32 and rounds once, as inductor's kernel does
    with the GEMM's bf16 output)."""
    layer = _int8_projection()
    fn = _gated_residual(layer, form)
    inputs = _gated_inputs(20, gate_dtype=torch.float32 if form == "wan" else BF16)
    with torch.no_grad():
        ref, _ = _compiled(fn, **inputs, with_pass=False)
        out, delta, recording = _compiled_recorded(fn, *inputs.values())
        eager = fn(**inputs)
    assert delta == {"gated_residual_int8": 1}
    targets = recording.targets()
    assert "omni_accel.int8_mm_rescale_residual.default" in targets
    assert "omni_accel.int8_mm_rescale.default" not in targets
    assert out.dtype == BF16 and out.shape == (1, S, N_OUT) and torch.equal(out, ref)
    # eager rounds gate * product to bf16 before the add (not Wan's float32 form): the two differ by that rounding
    # (half a bf16 step of the product term) and their own (half a step of each result) at most
    if form == "wan":
        assert torch.equal(out, eager)
    else:
        with torch.no_grad():
            term = _gate(inputs["emb"]).float() * layer(inputs["x"]).float()
        bound = 2.0 ** -8 * (term.abs() + eager.float().abs() + out.float().abs())
        assert ((out.float() - eager.float()).abs() <= bound).all()


def test_the_gated_residual_op_keeps_the_linears_bias_in_the_gemm(gated_residual_on):
    """The GEMM's bias (int8.BIAS_IN_GEMM) goes into the fused op with the other operands."""
    layer = _int8_projection(1)
    _, _, recording = _compiled_recorded(_gated_residual(layer, "dual"), *_gated_inputs(21).values())
    (fused,) = [n for n in recording.graph.nodes if n.target == torch.ops.omni_accel.int8_mm_rescale_residual.default]
    bias = fused.args[4]
    assert bias is not None and tuple(bias.meta["val"].shape) == (N_OUT,)


def _gemm_read_twice(layer):
    def fn(x, hidden, emb):
        y = layer(x)
        return hidden + _gate(emb) * y, y * 2

    return fn


@pytest.mark.parametrize("case", ["per_token_gate", "second_user", "switch_off", "int8_off", "cublas", "bf16_linear",
                                  "broadcast_residual"])
def test_other_gated_residuals_stay_with_inductor(monkeypatch, case, gated_residual_on):
    """Not rewritten: a gate per token (the kernel takes one row of N values), a GEMM output read by anything else
    (it must be written anyway), the switch or the int8 pass off, the traced cuBLAS path and 16-bit linears (no
    int8_mm_rescale in the graph), a residual that broadcasts; the values are inductor's."""
    from omni_accel.kernels.int8 import Int8Linear

    layer = _int8_projection(2)
    fn = _gated_residual(layer, "dual")
    inputs = _gated_inputs(22, gate_rows=S if case == "per_token_gate" else 1)
    if case == "second_user":
        fn = _gemm_read_twice(layer)
    elif case == "switch_off":
        monkeypatch.setattr(epilogue_fusion, "GATED_RESIDUAL_INT8", False)
    elif case == "int8_off":
        monkeypatch.setattr(epilogue_fusion, "INT8", False)
    elif case == "cublas":
        torch.manual_seed(2)
        fn = _gated_residual(Int8Linear(torch.nn.Linear(40, N_OUT).to(BF16), gemm="cublas"), "dual")
    elif case == "bf16_linear":
        torch.manual_seed(2)
        fn = _gated_residual(torch.nn.Linear(40, N_OUT).to(BF16), "dual")
    elif case == "broadcast_residual":
        inputs["hidden"] = inputs["hidden"][:, :1].contiguous()  # (1, 1, N) added to every token's row
    with torch.no_grad():
        ref, _ = _compiled(fn, **inputs, with_pass=False)
        out, delta, recording = _compiled_recorded(fn, *inputs.values())
    assert delta == {}
    assert "omni_accel.int8_mm_rescale_residual.default" not in recording.targets()
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert torch.equal(o, r)


def test_the_pass_leaves_the_residual_where_the_gpu_kernel_would_not_take_it(monkeypatch, gated_residual_on):
    """On a GPU the pass asks int8_gemm_triton.residual_in_gemm (by the GEMM's rows and device) whether the kernel the
    GEMM runs takes the residual (on Hopper above FEW_ROWS rows, the warp-specialized kernel's twin is off by
    default); off a GPU the op's torch reference takes every call."""
    from types import SimpleNamespace

    from omni_accel.kernels import int8_gemm_triton

    asked = []
    monkeypatch.setattr(int8_gemm_triton, "residual_in_gemm", lambda rows, device: asked.append(rows) or rows <= 1024)

    def on_gpu(rows):
        return SimpleNamespace(is_cuda=True, shape=(rows, 3072), device=torch.device("cuda", 0))

    assert epilogue_fusion._residual_kernel_takes(on_gpu(512))
    assert not epilogue_fusion._residual_kernel_takes(on_gpu(4096))
    assert epilogue_fusion._residual_kernel_takes(torch.empty(4096, 8)) and asked == [512, 4096]


def test_the_gated_residual_has_a_switch_in_the_cache_key(monkeypatch):
    """Off by default; a graph compiled with the residual in the GEMM must not be served to a process without it, nor
    one compiled with the warp-specialized kernel's twin allowed to a process without that."""
    from omni_accel.kernels import int8_gemm_triton

    assert epilogue_fusion.GATED_RESIDUAL_INT8 is False  # off until a whole forward has been timed with it
    monkeypatch.setattr(epilogue_fusion, "GATED_RESIDUAL_INT8", True)
    key = epilogue_fusion.GRAPH_PASS.uuid()
    monkeypatch.setattr(epilogue_fusion, "GATED_RESIDUAL_INT8", False)
    without = epilogue_fusion.GRAPH_PASS.uuid()
    monkeypatch.setattr(int8_gemm_triton, "RESIDUAL_WARP_SPECIALIZED", True)  # which calls the pass takes
    assert len({key, without, epilogue_fusion.GRAPH_PASS.uuid()}) == 3


def _int8_flux_block(kind: str):
    """A tiny FLUX block in bf16 with every block linear an int8 linear (AdaLN's own stays 16-bit), the sigmoid GELU
    compile=True installs: (block, undo of the GELU)."""
    from omni_accel.kernels.int8 import Int8Linear
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("flux")
    transformer = pipe.transformer
    block = (transformer.single_transformer_blocks[0] if kind == "single" else transformer.transformer_blocks[0])
    block = block.to(BF16)
    for module in list(block.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and not name.startswith("linear"):
                setattr(module, name, Int8Linear(child, gemm="triton"))
    _, undo = compiler.use_sigmoid_gelu(block)
    return block, undo


def _from_views(node):
    while node.op == "call_function" and node.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
        node = node.args[0]
    return node


@pytest.mark.parametrize("kind, expected", [
    ("dual", {"layernorm_modulate_int8": 4, "gelu_int8": 2, "gated_residual_int8": 4}),
    ("single", {"layernorm_modulate_int8": 1, "concat_gelu_int8": 1, "gated_residual_int8": 1}),
])
def test_flux_blocks_with_triton_int8_linears_take_their_gated_residuals_into_the_gemms(monkeypatch, kind, expected, gated_residual_on):
    """diffusers' FLUX blocks as the int8 stack runs them on a GPU (the Triton GEMM): the dual block's four gated
    residuals (attention and feed-forward, both streams) and the single block's one (``residual + gate *
    proj_out(...)``) become the fused op, beside the other int8 rewrites; the dual block's second AdaLN norm reads
    the fused op's output (its hidden state). The blocks' outputs equal those compiled with the switch off, bit for
    bit, and stay as close to eager's as inductor's own."""
    from omni_accel.kernels.int8 import Int8Linear

    block, undo = _int8_flux_block(kind)
    linears = sum(isinstance(m, Int8Linear) for m in block.modules())
    dim = block.attn.to_q.in_features
    g = torch.Generator().manual_seed(23)
    streams = [torch.randn(1, n, dim, generator=g).to(BF16) for n in (20, 6)] + [torch.randn(1, dim, generator=g)
                                                                                .to(BF16)]
    with torch.no_grad():
        out, delta, recording = _compiled_recorded(block, *streams)
        monkeypatch.setattr(epilogue_fusion, "GATED_RESIDUAL_INT8", False)
        off, off_delta, _ = _compiled_recorded(block, *streams)
        ref, _ = _compiled(block, *streams, with_pass=False)
        eager = block(*streams)
    undo()
    assert delta == expected
    assert off_delta == {k: v for k, v in expected.items() if k != "gated_residual_int8"}
    fused = [n for n in recording.graph.nodes if n.target == torch.ops.omni_accel.int8_mm_rescale_residual.default]
    plain = [n for n in recording.graph.nodes if n.target == torch.ops.omni_accel.int8_mm_rescale.default]
    assert len(fused) == expected["gated_residual_int8"] and len(plain) + len(fused) == linears
    if kind == "dual":  # norm2 of both streams reads the attention's gated residual, now the fused op's output
        norms = [n for n in recording.graph.nodes if n.target == torch.ops.omni_accel.layernorm_modulate_int8.default]
        assert sum(_from_views(n.args[0]) in fused for n in norms) == 2
    for o, r_off, r, e in zip(out, off, ref, eager):
        assert torch.equal(o, r_off)
        assert torch.linalg.norm((o - r).float()) <= 2 * torch.linalg.norm((e - r).float()) + 1e-6
