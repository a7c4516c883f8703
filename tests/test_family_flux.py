"""FLUX.1 adapter and tiny pipelines: structure of the adapter, determinism, accelerate()/restore() equivalence."""

from __future__ import annotations

import inspect

import pytest
import torch

from omni_accel.pipelines import adapter_for, get_adapter
from omni_accel.testing import run, run_accelerated, tiny_pipeline

FAMILY = "flux"


@pytest.fixture(scope="module")
def tiny():
    pipe, kwargs = tiny_pipeline("flux")
    return pipe, kwargs, run(pipe, kwargs, seed=0)


def _block_params(block):
    return set(inspect.signature(block.forward).parameters)


def test_adapter_structure(tiny):
    pipe, _, _ = tiny
    adapter = adapter_for(pipe)
    assert adapter.family == FAMILY and adapter is get_adapter(FAMILY)
    assert type(pipe).__name__ in adapter.pipeline_classes
    transformer = pipe.transformer
    for list_name in adapter.block_lists:
        assert len(getattr(transformer, list_name)) > 0, list_name
    forward_params = set(inspect.signature(transformer.forward).parameters)
    for list_name in adapter.block_lists:  # every block kind takes the declared block-level inputs
        block_params = _block_params(getattr(transformer, list_name)[0])
        for s in adapter.sequence_inputs:
            if s.where == "block":
                assert s.name in block_params, (list_name, s.name)
    for s in adapter.sequence_inputs:
        if s.where == "transformer":
            assert s.name in forward_params, s.name
    assert isinstance(transformer.get_submodule(adapter.teacache.modulated_input), torch.nn.Module)
    assert len(adapter.teacache.coefficients) == 5
    assert all(hasattr(pipe, n) for n in adapter.text_encoder_names)
    assert hasattr(pipe, adapter.vae_name)
    assert adapter.cfg_scale_arg in inspect.signature(type(pipe).__call__).parameters
    assert adapter.negative_prompt_arg in inspect.signature(type(pipe).__call__).parameters


def test_attention_goes_through_dispatcher(tiny):
    pipe, _, _ = tiny
    processors = {type(m.processor).__name__ for m in pipe.transformer.modules() if hasattr(m, "processor")}
    assert processors == {"FluxAttnProcessor"}
    assert adapter_for(pipe).attention_via_dispatcher


def test_deterministic(tiny):
    pipe, kwargs, reference = tiny
    assert torch.equal(run(pipe, kwargs, seed=0), reference)
    assert not torch.equal(run(pipe, kwargs, seed=1), reference)
    pipe2, kwargs2 = tiny_pipeline("flux")
    assert torch.equal(run(pipe2, kwargs2, seed=0), reference)


def test_odd_token_count_resolution(tiny):
    pipe, kwargs, _ = tiny
    assert kwargs["max_sequence_length"] % 2 == 1
    out = run(pipe, dict(kwargs, height=48, width=80))
    assert out.shape[-2:] == (48, 80)  # (48/16) * (80/16) = 15 image tokens


@pytest.mark.parametrize("attention", ["auto", "math"])
def test_accelerate_attention_then_restore(tiny, attention):
    pipe, kwargs, reference = tiny
    out, report = run_accelerated(pipe, kwargs, attention=attention)
    assert (out - reference).abs().max().item() <= 1e-4
    assert report["family"] == FAMILY
    assert report["last_call"]["transformer_forwards"] == kwargs["num_inference_steps"]  # distilled: 1 per step
    assert torch.equal(run(pipe, kwargs), reference)


def test_true_cfg_counts_two_forwards_per_step(tiny):
    pipe, kwargs, _ = tiny
    adapter = adapter_for(pipe)
    cfg_kwargs = dict(kwargs, **{adapter.cfg_scale_arg: 2.0, adapter.negative_prompt_arg: "blurry"})
    plain = run(pipe, cfg_kwargs)
    out, report = run_accelerated(pipe, cfg_kwargs)
    assert report["last_call"]["transformer_forwards"] == 2 * kwargs["num_inference_steps"]
    assert (out - plain).abs().max().item() <= 1e-4


def test_accelerate_compile_then_restore(tiny):
    pipe, kwargs, reference = tiny
    out, report = run_accelerated(pipe, kwargs, compile=True)
    assert "compile" in [p["pass"] for p in report["applied"]]
    assert (out - reference).abs().max().item() <= 1e-3
    assert torch.equal(run(pipe, kwargs), reference)


def test_kontext_edit_pipeline():
    pipe, kwargs = tiny_pipeline("flux_kontext")
    adapter = adapter_for(pipe)
    assert adapter.family == FAMILY and adapter.is_edit_pipeline(pipe)
    assert type(pipe).__name__ in adapter.pipeline_classes
    reference = run(pipe, kwargs)
    assert reference.shape[-2:] == (kwargs["height"], kwargs["width"])
    assert torch.equal(run(pipe, kwargs), reference)
    out, report = run_accelerated(pipe, kwargs, attention="math")
    assert report["last_call"]["transformer_forwards"] == kwargs["num_inference_steps"]
    assert (out - reference).abs().max().item() <= 1e-4
    assert torch.equal(run(pipe, kwargs), reference)
