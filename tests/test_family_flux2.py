"""FLUX.2 adapter and tiny pipelines (Flux2Pipeline + Flux2KleinPipeline): structure, determinism,
accelerate()/restore() equivalence and transformer-forward counts (distilled vs Klein's true CFG)."""

from __future__ import annotations

import inspect

import pytest
import torch

import omni_accel
from omni_accel.pipelines import adapter_for, get_adapter
from omni_accel.testing import run, run_accelerated, tiny_pipeline
from omni_accel.testing.tiny_flux2 import build

FAMILY = "flux2"


@pytest.fixture(scope="module")
def tiny():
    pipe, kwargs = tiny_pipeline("flux2")
    return pipe, kwargs, run(pipe, kwargs, seed=0)


@pytest.fixture(scope="module")
def klein():
    pipe, kwargs = build("flux2_klein")
    return pipe, kwargs, run(pipe, kwargs, seed=0)


def test_adapter_structure(tiny):
    pipe, _, _ = tiny
    adapter = adapter_for(pipe)
    assert adapter.family == FAMILY and adapter is get_adapter(FAMILY)
    assert type(pipe).__name__ in adapter.pipeline_classes
    transformer = pipe.transformer
    for list_name in adapter.block_lists:
        assert len(getattr(transformer, list_name)) > 0, list_name
    forward_params = set(inspect.signature(transformer.forward).parameters)
    for s in adapter.sequence_inputs:
        if s.where == "transformer":
            assert s.name in forward_params, s.name
    first = adapter.blocks_of(transformer)[0][1]
    block_params = set(inspect.signature(first.forward).parameters)
    for s in adapter.sequence_inputs:
        if s.where == "block":
            assert s.name in block_params, s.name
    single = transformer.single_transformer_blocks[0]
    assert adapter.extra["single_block_sequence"]["arg"] in inspect.signature(single.forward).parameters
    assert isinstance(transformer.get_submodule(adapter.teacache.modulated_input), torch.nn.Module)
    assert adapter.teacache.coefficients == ()
    assert all(hasattr(pipe, n) for n in adapter.text_encoder_names) and hasattr(pipe, adapter.vae_name)
    processors = {type(m.processor).__name__ for m in transformer.modules() if hasattr(m, "processor")}
    assert processors == {"Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"}
    assert adapter.attention_via_dispatcher


def test_klein_adapter(klein):
    pipe, _, _ = klein
    adapter = adapter_for(pipe)
    assert adapter.family == FAMILY and type(pipe).__name__ in adapter.pipeline_classes
    per_pipe = adapter.extra["cfg_by_pipeline"][type(pipe).__name__]
    assert per_pipe["cfg"] == "true_cfg"
    assert per_pipe["cfg_scale_arg"] in inspect.signature(type(pipe).__call__).parameters


def test_deterministic(tiny, klein):
    for pipe, kwargs, reference in (tiny, klein):
        assert torch.equal(run(pipe, kwargs, seed=0), reference)
        assert not torch.equal(run(pipe, kwargs, seed=1), reference)
    pipe2, kwargs2 = tiny_pipeline("flux2")
    assert torch.equal(run(pipe2, kwargs2, seed=0), tiny[2])


def test_odd_token_count_resolution(tiny):
    pipe, kwargs, _ = tiny
    assert kwargs["max_sequence_length"] % 2 == 1
    assert run(pipe, dict(kwargs, height=48, width=80)).shape[-2:] == (48, 80)  # 3 * 5 = 15 image tokens


@pytest.mark.parametrize("attention", ["auto", "math"])
def test_accelerate_attention_then_restore(tiny, attention):
    pipe, kwargs, reference = tiny
    out, report = run_accelerated(pipe, kwargs, attention=attention)
    assert (out - reference).abs().max().item() <= 1e-4
    assert report["family"] == FAMILY
    assert report["last_call"]["transformer_forwards"] == kwargs["num_inference_steps"]  # guidance-distilled
    assert torch.equal(run(pipe, kwargs), reference)


def test_klein_true_cfg_two_forwards_per_step(klein):
    pipe, kwargs, reference = klein
    assert kwargs["guidance_scale"] > 1 and not pipe.config.is_distilled
    omni_accel.accelerate(pipe, attention="math")
    try:
        out = run(pipe, kwargs)
        forwards = pipe.omni_accel.report()["last_call"]["transformer_forwards"]
        run(pipe, dict(kwargs, guidance_scale=1.0))
        forwards_no_cfg = pipe.omni_accel.report()["last_call"]["transformer_forwards"]
    finally:
        omni_accel.restore(pipe)
    assert forwards == 2 * kwargs["num_inference_steps"]
    assert forwards_no_cfg == kwargs["num_inference_steps"]
    assert (out - reference).abs().max().item() <= 1e-4
    assert torch.equal(run(pipe, kwargs), reference)


def test_accelerate_compile_then_restore(tiny):
    pipe, kwargs, reference = tiny
    out, report = run_accelerated(pipe, kwargs, compile=True)
    assert "compile" in [p["pass"] for p in report["applied"]]
    assert (out - reference).abs().max().item() <= 1e-3
    assert torch.equal(run(pipe, kwargs), reference)
