"""Qwen-Image family: tiny text-to-image, Edit and Edit-Plus pipelines against the qwen_image adapter."""

from __future__ import annotations

import inspect

import pytest
import torch

import omni_accel
from omni_accel.pipelines import adapter_for, get_adapter
from omni_accel.testing import run, run_accelerated, tiny_pipeline

ADAPTER = get_adapter("qwen_image")
VARIANTS = ("qwen_image", "qwen_image_edit", "qwen_image_edit_plus")
STEPS = 2


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(variant):
        if variant not in cache:
            pipe, kwargs = tiny_pipeline(variant, seed=0)
            cache[variant] = (pipe, kwargs, run(pipe, kwargs, seed=0))
        return cache[variant]

    return get


def _check_adapter(pipe):
    assert adapter_for(pipe).family == "qwen_image"
    assert type(pipe).__name__ in ADAPTER.pipeline_classes
    (_, transformer), = ADAPTER.transformers_of(pipe)
    for list_name in ADAPTER.block_lists:
        assert len(getattr(transformer, list_name)) > 0
    forward = inspect.signature(transformer.forward).parameters
    block_forward = inspect.signature(ADAPTER.blocks_of(transformer)[0][1].forward).parameters
    for item in ADAPTER.sequence_inputs:
        assert item.name in (forward if item.where == "transformer" else block_forward), item
    transformer.get_submodule(ADAPTER.teacache.modulated_input)
    transformer.get_submodule(ADAPTER.extra["teacache_modulation"])
    assert len(ADAPTER.teacache.coefficients) == 5
    processors = [m.processor for m in transformer.modules() if getattr(m, "processor", None) is not None]
    assert processors and all("dispatch_attention_fn" in inspect.getsource(type(p).__call__) for p in processors)


def _block_inputs(pipe, kwargs):
    """Run once and record, per block-0 call, (image tokens, text tokens, rope (img, txt) lengths)."""
    seen = []

    def hook(module, args, kw):
        img_freqs, txt_freqs = kw["image_rotary_emb"]
        seen.append((kw["hidden_states"].shape[1], kw["encoder_hidden_states"].shape[1],
                     img_freqs.shape[0], txt_freqs.shape[0]))

    handle = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = run(pipe, kwargs, seed=0)
    finally:
        handle.remove()
    return out, seen


def test_text_to_image(built):
    pipe, kwargs, reference = built("qwen_image")
    assert reference.shape == (1, 3, 32, 32) and torch.isfinite(reference).all()
    _check_adapter(pipe)
    assert not ADAPTER.is_edit_pipeline(pipe)
    again, seen = _block_inputs(pipe, kwargs)
    assert torch.equal(again, reference)
    # true CFG: two forwards per step; rope tuple is (image part, text part) and matches both streams
    assert len(seen) == 2 * STEPS
    for image_tokens, text_tokens, img_rope, txt_rope in seen:
        assert (image_tokens, img_rope) == (16, 16) and txt_rope >= text_tokens
    assert seen[0][1] % 2 == 1  # the default prompt's kept text is an odd number of tokens
    fresh, fresh_kwargs = tiny_pipeline("qwen_image", seed=0)
    assert torch.equal(run(fresh, fresh_kwargs, seed=0), reference)


def test_text_to_image_accelerate_then_restore(built):
    pipe, kwargs, reference = built("qwen_image")
    for attention in ("auto", "math"):
        out, report = run_accelerated(pipe, kwargs, seed=0, attention=attention)
        assert (out - reference).abs().max().item() <= 1e-4, attention
        assert report["last_call"]["transformer_forwards"] == 2 * STEPS  # true CFG
    assert torch.equal(run(pipe, kwargs, seed=0), reference)


def test_odd_token_count():
    pipe, kwargs = tiny_pipeline("qwen_image", seed=0, height=24, width=40)
    out, seen = _block_inputs(pipe, kwargs)
    assert seen and all(s[0] == 15 and s[2] == 15 for s in seen)  # 3 x 5 packed patches
    omni_accel.accelerate(pipe, attention="math")
    try:
        assert (run(pipe, kwargs, seed=0) - out).abs().max().item() <= 1e-4
    finally:
        omni_accel.restore(pipe)


@pytest.mark.parametrize("variant", ["qwen_image_edit", "qwen_image_edit_plus"])
def test_edit_variants(built, variant):
    """Edit pipelines: the reference images' latents join the image sequence; the adapter sees them as edit."""
    pipe, kwargs, reference = built(variant)
    assert torch.isfinite(reference).all()
    _check_adapter(pipe)
    assert ADAPTER.is_edit_pipeline(pipe)
    references = len(kwargs["image"]) if isinstance(kwargs["image"], list) else 1
    omni_accel.accelerate(pipe, attention="auto")
    try:
        out, seen = _block_inputs(pipe, kwargs)
        report = pipe.omni_accel.report()
    finally:
        omni_accel.restore(pipe)
    assert (out - reference).abs().max().item() <= 1e-4
    assert report["last_call"]["transformer_forwards"] == 2 * STEPS
    generated = (kwargs["height"] // 32) * (kwargs["width"] // 32)  # 16x VAE, 2x2 packing
    # every input image is resized to ~1024^2 by the pipeline: 32 x 32 packed tokens each
    assert all(s[0] == s[2] == generated + references * 32 * 32 for s in seen)
    assert torch.equal(run(pipe, kwargs, seed=0), reference)  # restored, and deterministic


def test_compile_then_restore(built):
    pipe, kwargs, reference = built("qwen_image")
    out, report = run_accelerated(pipe, kwargs, seed=0, compile=True)
    assert (out - reference).abs().max().item() <= 1e-3
    assert report["last_call"]["transformer_forwards"] == 2 * STEPS
    assert torch.equal(run(pipe, kwargs, seed=0), reference)
