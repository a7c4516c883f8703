"""fuse_qkv=True: one q/k/v GEMM per stream through diffusers' fuse_projections(); lossless, restorable, refused
where the family's processors would ignore it."""

import pytest
import torch

import omni_accel
from omni_accel.testing import run, tiny_pipeline

FUSABLE = ["flux", "flux2", "wan", "wan22"]


def _linear_names(module: torch.nn.Module) -> set[str]:
    return {n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("family", FUSABLE)
def test_fused_projections_match_plain_and_restore_exactly(family):
    pipe, kwargs = tiny_pipeline(family)
    plain = run(pipe, kwargs)
    transformers = [getattr(pipe, n) for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None]
    before = [{k: v.clone() for k, v in t.state_dict().items()} for t in transformers]
    omni_accel.accelerate(pipe, fuse_qkv=True)
    try:
        out = run(pipe, kwargs)
        applied = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "fuse_qkv"]
        names = _linear_names(pipe.transformer)
    finally:
        omni_accel.restore(pipe)
    assert (out - plain).abs().max().item() <= 1e-4
    assert len(applied) == len(transformers) and all(a["fused"] > 0 for a in applied)
    # the separate linears are out of the module tree while fused (no second copy of the weights)
    assert any(n.endswith("to_qkv") for n in names)
    assert not any(n.endswith((".to_k", ".to_v")) for n in names)
    for t, state in zip(transformers, before):
        after = t.state_dict()
        assert list(after) == list(state), "restore() changed the parameter names or their order"
        assert all(torch.equal(after[k], state[k]) for k in state)
    assert torch.equal(run(pipe, kwargs), plain)


def test_fused_projections_compose_with_fp8_and_quantize_the_fused_linear():
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, fuse_qkv=True, quant="fp8_weight_only")
    try:
        out = run(pipe, kwargs)
        quantized = {n for n, m in pipe.transformer.named_modules() if type(m).__name__ == "Fp8Linear"}
    finally:
        omni_accel.restore(pipe)
    assert any(n.endswith("attn.to_qkv") for n in quantized)
    assert not any(n.endswith("attn.to_q") for n in quantized)
    assert (out - plain).abs().max().item() < 0.05
    assert torch.equal(run(pipe, kwargs), plain)


def test_projections_the_user_fused_stay_fused():
    pipe, kwargs = tiny_pipeline("flux")
    attn = pipe.transformer.transformer_blocks[0].attn
    attn.fuse_projections()
    omni_accel.accelerate(pipe, fuse_qkv=True)
    applied = next(a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "fuse_qkv")
    omni_accel.restore(pipe)
    assert applied["already_fused"] == 1
    assert attn.fused_projections and hasattr(attn, "to_qkv")


@pytest.mark.parametrize(
    "family, knobs, message",
    [
        ("qwen_image", {}, "fuse_qkv=True does not reach qwen_image: its attention processors compute q, k and v "
                           "with separate linears and do not read diffusers' fused_projections flag. Families it "
                           "works for: flux, flux2, wan. Use fuse_qkv=False."),
        ("flux", {"tp": 2}, "fuse_qkv=True cannot be combined with tp=2"),
    ],
)
def test_refusals_name_the_reason_and_leave_the_pipeline_untouched(family, knobs, message):
    pipe, _ = tiny_pipeline(family)
    names = _linear_names(pipe.transformer)
    with pytest.raises(omni_accel.AccelError) as err:
        omni_accel.accelerate(pipe, fuse_qkv=True, **knobs)
    assert message in str(err.value)
    assert _linear_names(pipe.transformer) == names
    assert "omni_accel" not in vars(pipe)


def test_a_lora_wrapped_projection_is_refused_not_dropped():
    pipe, _ = tiny_pipeline("flux")
    attn = pipe.transformer.transformer_blocks[0].attn

    class LoraLinear(torch.nn.Linear):  # stands in for peft's wrapper: not a plain nn.Linear
        pass

    wrapped = LoraLinear(attn.to_k.in_features, attn.to_k.out_features)
    attn.to_k = wrapped
    with pytest.raises(omni_accel.AccelError, match=r"transformer_blocks\.0\.attn\.to_k is a LoraLinear"):
        omni_accel.accelerate(pipe, fuse_qkv=True)
    assert attn.to_k is wrapped and not getattr(attn, "fused_projections", False)


def test_fuse_qkv_must_be_a_bool():
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(omni_accel.AccelError, match=r"fuse_qkv='yes' must be True or False"):
        omni_accel.accelerate(pipe, fuse_qkv="yes")
