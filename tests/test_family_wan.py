"""Wan family: tiny 2.1 T2V, 2.1 I2V and 2.2 two-expert pipelines against the wan adapter."""

from __future__ import annotations

import inspect

import pytest
import torch

import omni_accel
from omni_accel.pipelines import adapter_for, get_adapter
from omni_accel.testing import run, run_accelerated, tiny_pipeline

ADAPTER = get_adapter("wan")
VARIANTS = ("wan", "wan_i2v", "wan22")
STEPS = 2


def _needs(variant):
    if variant == "wan_i2v":
        # diffusers' WanImageToVideoPipeline calls ftfy.fix_text on every prompt without checking it is installed
        pytest.importorskip("ftfy")


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(variant):
        _needs(variant)
        if variant not in cache:
            pipe, kwargs = tiny_pipeline(variant, seed=0)
            cache[variant] = (pipe, kwargs, run(pipe, kwargs, seed=0))
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_builds_runs_deterministically(built, variant):
    pipe, kwargs, reference = built(variant)
    assert reference.shape[1] == kwargs["num_frames"] and torch.isfinite(reference).all()
    assert adapter_for(pipe).family == "wan"
    assert type(pipe).__name__ in ADAPTER.pipeline_classes
    calls = {name: 0 for name, _ in ADAPTER.transformers_of(pipe)}
    handles = [module.register_forward_pre_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
               for name, module in ADAPTER.transformers_of(pipe)]
    try:
        again = run(pipe, kwargs, seed=0)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(again, reference)
    # Wan 2.2: the high-noise expert takes step 1, the low-noise expert step 2, two CFG forwards each
    assert calls == ({"transformer": 2, "transformer_2": 2} if variant == "wan22" else {"transformer": 4})
    if variant == "wan":  # a fresh build with the same seed gives the same pipeline
        fresh, fresh_kwargs = tiny_pipeline(variant, seed=0)
        assert torch.equal(run(fresh, fresh_kwargs, seed=0), reference)


@pytest.mark.parametrize("variant", VARIANTS)
def test_adapter_matches_model(built, variant):
    pipe, _, _ = built(variant)
    transformers = ADAPTER.transformers_of(pipe)
    assert [n for n, _ in transformers] == (["transformer", "transformer_2"] if variant == "wan22" else ["transformer"])
    for _, transformer in transformers:
        for list_name in ADAPTER.block_lists:
            assert len(getattr(transformer, list_name)) > 0
        forward = inspect.signature(transformer.forward).parameters
        block_forward = inspect.signature(ADAPTER.blocks_of(transformer)[0][1].forward).parameters
        for item in ADAPTER.sequence_inputs:
            assert item.name in (forward if item.where == "transformer" else block_forward), item
        transformer.get_submodule(ADAPTER.teacache.modulated_input)
        processors = [m.processor for m in transformer.modules() if getattr(m, "processor", None) is not None]
        assert processors and all("dispatch_attention_fn" in inspect.getsource(type(p).__call__) for p in processors)
    for name in ADAPTER.text_encoder_names:
        assert getattr(pipe, name) is not None


@pytest.mark.parametrize("variant", VARIANTS)
def test_accelerate_attention_then_restore(built, variant):
    pipe, kwargs, reference = built(variant)
    for attention in ("auto", "math"):
        out, report = run_accelerated(pipe, kwargs, seed=0, attention=attention)
        assert (out - reference).abs().max().item() <= 1e-4, attention
        assert report["last_call"]["transformer_forwards"] == STEPS * 2  # true CFG; both experts counted
    assert torch.equal(run(pipe, kwargs, seed=0), reference)


def test_odd_token_count():
    pipe, kwargs = tiny_pipeline("wan", seed=0, num_frames=9, height=48, width=16)
    seen = []
    handle = pipe.transformer.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    try:
        out = run(pipe, kwargs, seed=0)
    finally:
        handle.remove()
    assert seen and all(n == 9 for n in seen)  # 3 latent frames x 3 x 1 patches
    assert out.shape[1:] == (9, 3, 48, 16)
    omni_accel.accelerate(pipe, attention="math")
    try:
        assert (run(pipe, kwargs, seed=0) - out).abs().max().item() <= 1e-4
    finally:
        omni_accel.restore(pipe)


def test_compile_then_restore(built):
    pipe, kwargs, reference = built("wan")
    out, report = run_accelerated(pipe, kwargs, seed=0, compile=True)
    assert (out - reference).abs().max().item() <= 1e-3
    assert report["last_call"]["transformer_forwards"] == STEPS * 2
    assert torch.equal(run(pipe, kwargs, seed=0), reference)
