"""SD3 family: the tiny StableDiffusion3Pipeline against the sd3 adapter."""

from __future__ import annotations

import inspect

import pytest
import torch

import omni_accel
from omni_accel.pipelines import adapter_for, get_adapter
from omni_accel.testing import run, run_accelerated, tiny_pipeline

ADAPTER = get_adapter("sd3")
STEPS = 2


@pytest.fixture(scope="module")
def built():
    pipe, kwargs = tiny_pipeline("sd3", seed=0)
    return pipe, kwargs, run(pipe, kwargs, seed=0)


def test_builds_runs_deterministically(built):
    pipe, kwargs, reference = built
    assert reference.shape == (1, 3, kwargs["height"], kwargs["width"]) and torch.isfinite(reference).all()
    assert torch.equal(run(pipe, kwargs, seed=0), reference)
    fresh, fresh_kwargs = tiny_pipeline("sd3", seed=0)
    assert torch.equal(run(fresh, fresh_kwargs, seed=0), reference)
    assert adapter_for(pipe).family == "sd3"
    assert type(pipe).__name__ in ADAPTER.pipeline_classes


def test_adapter_matches_model(built):
    pipe, kwargs, _ = built
    (name, transformer), = ADAPTER.transformers_of(pipe)
    for list_name in ADAPTER.block_lists:
        assert len(getattr(transformer, list_name)) > 0
    forward = inspect.signature(transformer.forward).parameters
    block_forward = inspect.signature(ADAPTER.blocks_of(transformer)[0][1].forward).parameters
    for item in ADAPTER.sequence_inputs:
        assert item.name in (forward if item.where == "transformer" else block_forward), item
    transformer.get_submodule(ADAPTER.teacache.modulated_input)
    assert [n for n in ADAPTER.text_encoder_names if getattr(pipe, n) is None] == []
    # the joint attention calls SDPA directly, so diffusers' dispatcher cannot reach it
    processors = {type(m.processor) for m in transformer.modules() if getattr(m, "processor", None) is not None}
    assert processors and not any("dispatch_attention_fn" in inspect.getsource(p.__call__) for p in processors)
    assert ADAPTER.attention_via_dispatcher is False

    # batched CFG: one forward per step on a doubled batch; text = 77 CLIP + max_sequence_length T5 tokens (odd)
    seen = []
    handle = transformer.register_forward_pre_hook(lambda m, a, k: seen.append(
        (k["hidden_states"].shape[0], k["encoder_hidden_states"].shape[1])), with_kwargs=True)
    try:
        run(pipe, kwargs, seed=0)
    finally:
        handle.remove()
    assert seen == [(2, 77 + kwargs["max_sequence_length"])] * STEPS
    assert seen[0][1] % 2 == 1


def test_accelerate_attention_then_restore(built):
    pipe, kwargs, reference = built
    for attention in ("auto", "math"):
        out, report = run_accelerated(pipe, kwargs, seed=0, attention=attention)
        assert (out - reference).abs().max().item() <= 1e-4, attention
        assert report["last_call"]["transformer_forwards"] == STEPS  # batched CFG: one forward per step
    assert torch.equal(run(pipe, kwargs, seed=0), reference)


def test_odd_token_count():
    pipe, kwargs = tiny_pipeline("sd3", seed=0, height=12, width=20)
    seen = []
    handle = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda m, a, k: seen.append(k["hidden_states"].shape[1]), with_kwargs=True)
    try:
        out = run(pipe, kwargs, seed=0)
    finally:
        handle.remove()
    assert seen and all(n == 15 for n in seen)  # 3 x 5 patches
    omni_accel.accelerate(pipe, attention="math")
    try:
        assert (run(pipe, kwargs, seed=0) - out).abs().max().item() <= 1e-4
    finally:
        omni_accel.restore(pipe)


def test_dual_attention_layout_runs():
    """SD3.5's dual-attention blocks (attn2, SD35AdaLayerNormZeroX) work with the same adapter."""
    pipe, kwargs = tiny_pipeline("sd3", seed=0, dual_attention_layers=(0,), qk_norm="rms_norm")
    reference = run(pipe, kwargs, seed=0)
    pipe.transformer.get_submodule(ADAPTER.teacache.modulated_input)
    omni_accel.accelerate(pipe, attention="math")
    try:
        assert (run(pipe, kwargs, seed=0) - reference).abs().max().item() <= 1e-4
    finally:
        omni_accel.restore(pipe)


def test_compile_then_restore():
    # one block (the context_pre_only last-block type) keeps this to a single inductor graph
    pipe, kwargs = tiny_pipeline("sd3", seed=0, num_layers=1)
    reference = run(pipe, kwargs, seed=0)
    out, report = run_accelerated(pipe, kwargs, seed=0, compile=True)
    assert (out - reference).abs().max().item() <= 1e-3
    assert report["last_call"]["transformer_forwards"] == STEPS
    assert torch.equal(run(pipe, kwargs, seed=0), reference)
