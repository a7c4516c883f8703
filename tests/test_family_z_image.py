"""Z-Image adapter and tiny pipeline: structure, determinism, accelerate()/restore() equivalence and the
transformer-forward count of batched CFG (one forward per step on a doubled batch)."""

from __future__ import annotations

import inspect

import pytest
import torch

from omni_accel.pipelines import adapter_for, get_adapter
from omni_accel.testing import run, run_accelerated, tiny_pipeline

FAMILY = "z_image"


@pytest.fixture(scope="module")
def tiny():
    pipe, kwargs = tiny_pipeline("z_image")
    return pipe, kwargs, run(pipe, kwargs, seed=0)


def test_adapter_structure(tiny):
    pipe, _, _ = tiny
    adapter = adapter_for(pipe)
    assert adapter.family == FAMILY and adapter is get_adapter(FAMILY)
    assert type(pipe).__name__ in adapter.pipeline_classes
    transformer = pipe.transformer
    optional = set(adapter.extra["optional_block_lists"])
    for list_name in adapter.block_lists:
        assert hasattr(transformer, list_name), list_name
        if list_name in optional:  # siglip_refiner: only on Omni checkpoints (siglip_feat_dim set)
            assert getattr(transformer, list_name) is None
        else:
            assert len(getattr(transformer, list_name)) > 0, list_name
    assert [n for n, _ in adapter.blocks_of(transformer)] == ["noise_refiner.0", "context_refiner.0", "layers.0"]
    forward_params = set(inspect.signature(transformer.forward).parameters)
    for s in adapter.sequence_inputs:
        if s.where == "transformer":
            assert s.name in forward_params, s.name
    first = adapter.blocks_of(transformer)[0][1]
    block_params = set(inspect.signature(first.forward).parameters)
    for s in adapter.sequence_inputs:
        if s.where == "block":
            assert s.name in block_params, s.name
    assert isinstance(transformer.get_submodule(adapter.teacache.modulated_input), torch.nn.Module)
    assert adapter.teacache.coefficients == ()
    call_params = inspect.signature(type(pipe).__call__).parameters
    assert adapter.cfg == "batched_cfg" and adapter.cfg_scale_arg in call_params
    assert adapter.negative_prompt_arg in call_params
    assert all(hasattr(pipe, n) for n in adapter.text_encoder_names) and hasattr(pipe, adapter.vae_name)
    processors = {type(m.processor).__name__ for m in transformer.modules() if hasattr(m, "processor")}
    assert processors == {"ZSingleStreamAttnProcessor"}
    assert adapter.attention_via_dispatcher


def test_deterministic(tiny):
    pipe, kwargs, reference = tiny
    assert torch.equal(run(pipe, kwargs, seed=0), reference)
    assert not torch.equal(run(pipe, kwargs, seed=1), reference)
    pipe2, kwargs2 = tiny_pipeline("z_image")
    assert torch.equal(run(pipe2, kwargs2, seed=0), reference)


def test_odd_token_counts(tiny):
    pipe, kwargs, _ = tiny
    prompt_embeds, negative_embeds = pipe.encode_prompt(kwargs["prompt"], max_sequence_length=64)
    assert prompt_embeds[0].shape[0] % 2 == 1 and negative_embeds[0].shape[0] % 2 == 1
    assert run(pipe, dict(kwargs, height=48, width=80)).shape[-2:] == (48, 80)  # 3 * 5 = 15 image tokens


@pytest.mark.parametrize("attention", ["auto", "math"])
def test_accelerate_attention_then_restore(tiny, attention):
    pipe, kwargs, reference = tiny
    out, report = run_accelerated(pipe, kwargs, attention=attention)
    assert (out - reference).abs().max().item() <= 1e-4
    assert report["family"] == FAMILY
    # batched CFG (guidance_scale 4.0 > 0): still one transformer forward per step
    assert report["last_call"]["transformer_forwards"] == kwargs["num_inference_steps"]
    assert torch.equal(run(pipe, kwargs), reference)


def test_without_cfg_one_forward_per_step(tiny):
    pipe, kwargs, _ = tiny
    turbo = dict(kwargs, guidance_scale=0.0)
    plain = run(pipe, turbo)
    out, report = run_accelerated(pipe, turbo)
    assert report["last_call"]["transformer_forwards"] == kwargs["num_inference_steps"]
    assert (out - plain).abs().max().item() <= 1e-4


def test_accelerate_compile_then_restore(tiny):
    pipe, kwargs, reference = tiny
    out, report = run_accelerated(pipe, kwargs, compile=True)
    applied = [p for p in report["applied"] if p["pass"] == "compile"]
    assert applied and applied[0]["blocks"] == 3
    assert (out - reference).abs().max().item() <= 1e-3
    assert torch.equal(run(pipe, kwargs), reference)
