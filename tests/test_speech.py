"""Omni speech (thinker -> talker -> token2wav) on the tiny random Qwen2.5-Omni: vLLM vs the transformers reference,
streaming, and the OpenAI speech endpoints. One vLLM pipeline for the module (three engines: thinker pooling and
generate, talker); the vLLM servers are built from their command line around it, in threads of this process."""

import base64
import concurrent.futures
import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import wave

import pytest
import torch

from conftest import stop_process_group

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from omni_accel.ar_bridge.engine import vllm_available  # noqa: E402
from omni_accel.errors import AccelError  # noqa: E402
from omni_accel.testing import save_tiny_model  # noqa: E402

GREEDY = {}  # sampling={} -> greedy talker, no repetition penalty
TEXT = "hello there"
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm-cpu is installed in CI (README test command)")


VOCODER_GAIN = 2000.0


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory):
    """The tiny model with a louder vocoder: its random BigVGAN peaks at ~6e-5 of full scale, which 16-bit PCM turns
    into 0 +- 2 steps -- too coarse to tell a right stream from a wrong one. Its last conv has no bias and only a
    clamp to [-1, 1] follows, so scaling its weight scales the waveform (peak ~0.11, nothing clipped)."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_model("qwen2_5_omni", tmp_path_factory.mktemp("omni") / "tiny")
    weights_file = os.path.join(path, "model.safetensors")
    weights = load_file(weights_file)
    weights["token2wav.code2wav_bigvgan_model.conv_post.weight"] *= VOCODER_GAIN
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def reference(omni_path):
    """transformers' own model. Its talker takes an attention mask to add the codec pad / bos rows and use M-RoPE
    positions, but generate() drops a mask of all ones: the pipeline's hook hands it one, as here."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omni_accel.ar_bridge.omni_qwen2_5 import keep_talker_mask

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_path).eval()
    model.talker.register_forward_pre_hook(keep_talker_mask, with_kwargs=True)
    return model


@pytest.fixture(scope="module")
def tf_pipe(omni_path):
    from omni_accel.ar_bridge.speech import SpeechPipeline

    with SpeechPipeline(omni_path, engine="transformers") as pipe:
        yield pipe


@pytest.fixture(scope="module")
def vllm_pipe(omni_path):
    if not vllm_available():
        pytest.skip("vllm-cpu is installed in CI (README test command)")
    from omni_accel.ar_bridge.speech import SpeechPipeline

    with SpeechPipeline(omni_path, engine="vllm") as pipe:
        yield pipe


def _close(a, b, rel):
    err = (a - b).abs().max().item()
    assert a.shape == b.shape and err <= rel * b.abs().max().item(), (err, b.abs().max().item())


def test_tiny_model_is_a_loadable_qwen2_5_omni(omni_path, reference):
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    cfg = reference.config
    assert cfg.thinker_config.text_config.hidden_size // cfg.thinker_config.text_config.num_attention_heads >= 32
    assert cfg.talker_config.head_dim >= 32 and reference.has_talker
    assert set(reference.speaker_map) == {"Chelsie", "Ethan"}
    tok = AutoTokenizer.from_pretrained(omni_path)
    assert tok.audio_token == "<|AUDIO|>" and len(tok) == cfg.thinker_config.text_config.vocab_size
    assert WhisperFeatureExtractor.from_pretrained(omni_path).feature_size == 128
    with pytest.raises(AccelError, match="has no tiny saved model"):
        save_tiny_model("nope", omni_path)


def test_transformers_pipeline_equals_reference_generate(tf_pipe, reference):
    """Chat mode on the transformers engines reproduces transformers' own generate(..., return_audio=True)."""
    result = tf_pipe.generate(TEXT, "Ethan", mode="chat", max_codes=40, max_text_tokens=10, sampling=GREEDY, seed=3)
    ids = torch.tensor([tf_pipe.prompt_ids(TEXT)])
    lay = tf_pipe.layout
    torch.manual_seed(3)  # the reference draws the DiT noise from the global generator
    seq, ref_wave = reference.generate(ids, speaker="Ethan", thinker_max_new_tokens=10, talker_max_new_tokens=40,
                                       talker_do_sample=False, talker_repetition_penalty=1.0,
                                       talker_eos_token_id=list(lay.codec_stops), thinker_do_sample=False,
                                       attention_mask=torch.ones_like(ids))
    assert result.thinker_ids == seq[0, ids.shape[1]:].tolist()
    assert result.waveform.shape == ref_wave.shape and result.waveform.shape[0] == len(result.codes) * 2 * 240 + 1
    _close(result.waveform, ref_wave, 1e-3)


def _image(seed: int = 0, size=(80, 60)):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


def _tone(seconds: float = 1.0, rate: int = 16000, hz: float = 440.0):
    import numpy as np

    return (0.3 * np.sin(np.arange(int(seconds * rate)) / rate * 2 * np.pi * hz)).astype("float32")


def test_image_and_audio_inputs_equal_reference_generate(tf_pipe, reference):
    """An image and an audio clip reach the thinker's towers and the talker's positions as transformers' own
    generate() takes them (thinker ids and waveform equal); the image changes the spoken answer; the prompt holds
    one placeholder per merged 2x2 patch and per audio-tower frame."""
    image, tone = _image(), _tone()
    result = tf_pipe.generate(TEXT, "Ethan", mode="chat", max_codes=24, max_text_tokens=10, sampling=GREEDY, seed=3,
                              images=[image], audios=[tone])
    ids, media = tf_pipe.prompt(TEXT, images=[image], audios=[tone])
    grid = media.thinker_inputs["image_grid_thw"][0].tolist()
    # 80x60 -> 84x56 pixels -> 6x4 patches -> 6 merged; 1 s -> 100 feature frames -> 25 audio positions
    assert grid == [1, 4, 6] and media.placeholders == 6 + 25 and result.prompt_tokens == len(ids)
    assert len(ids) == len(tf_pipe.prompt_ids(TEXT)) + media.placeholders + 4  # + the bos/eos marks
    inputs = dict(media.thinker_inputs)
    pixels = inputs.pop("pixel_values")  # thinker_ only: the reference hands unprefixed kwargs to its talker too
    ids = torch.tensor([ids])
    torch.manual_seed(3)
    seq, ref_wave = reference.generate(ids, speaker="Ethan", thinker_max_new_tokens=10, talker_max_new_tokens=24,
                                       talker_do_sample=False, talker_repetition_penalty=1.0,
                                       talker_eos_token_id=list(tf_pipe.layout.codec_stops), thinker_do_sample=False,
                                       attention_mask=torch.ones_like(ids), thinker_pixel_values=pixels, **inputs)
    assert result.thinker_ids == seq[0, ids.shape[1]:].tolist()
    assert result.waveform.shape == ref_wave.shape
    _close(result.waveform, ref_wave, 1e-3)
    plain = tf_pipe.generate(TEXT, "Ethan", mode="chat", max_codes=24, max_text_tokens=10, sampling=GREEDY, seed=3)
    seen = tf_pipe.generate(TEXT, "Ethan", mode="chat", max_codes=24, max_text_tokens=10, sampling=GREEDY, seed=3,
                            images=[image])
    assert seen.codes != plain.codes
    with pytest.raises(AccelError, match=r"audio clip 0 has shape \(480016,\) \(30.00 s\); give mono samples at "
                                         r"16000 Hz, at most 30 s per clip"):
        tf_pipe.reply(TEXT, audios=[_tone(30.001)])
    with pytest.raises(AccelError, match="remove <|IMAGE|> from the text"):
        tf_pipe.reply("<|IMAGE|>" + TEXT, images=[image])
    with pytest.raises(AccelError, match="image and audio inputs are for mode='chat'"):
        tf_pipe.generate(TEXT, images=[image])


def test_reply_text_streams_in_pieces_that_join_into_the_whole(tf_pipe):
    pieces: list[str] = []
    text, tokens = tf_pipe.reply(TEXT, max_text_tokens=12, audios=[_tone()], on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == text and tokens == 12
    cancel = threading.Event()
    cancel.set()
    from omni_accel.ar_bridge.speech import SpeechCancelled

    with pytest.raises(SpeechCancelled, match="during the thinker's generation"):
        tf_pipe.reply(TEXT, cancel=cancel)


def _streamed_chat_speaks_first_and_equals(pipe, text, options, whole, on_chunk=lambda: None) -> dict:
    """Stream the chat, text pieces and audio chunks in the order they come: an audio chunk must come before the
    last text delta, and the text, codes and waveform must equal ``whole`` (the non-streamed chat). The stats."""
    events, texts, chunks, stats = [], [], [], {}
    for chunk in pipe.stream(text, "Ethan", stats=stats, on_text=lambda p: (texts.append(p), events.append("text")),
                             **options):
        events.append("audio")
        chunks.append(chunk)
        on_chunk()
    last_text = len(events) - 1 - events[::-1].index("text")
    assert events.index("audio") < last_text and len(texts) > 1
    assert "".join(texts) == stats["text"] == whole.text and stats["codes"] == whole.codes
    wave = torch.cat(chunks)
    assert wave.shape == whole.waveform.shape and (wave - whole.waveform).abs().max().item() <= 1e-3
    return stats


def test_streamed_chat_speaks_before_the_thinker_ends_and_equals_the_whole(tf_pipe):
    """Streamed chat on the transformers engines: the talker runs behind the thinker (its step j once the thinker
    has read reply token j + 1), so an audio chunk comes while the thinker still writes -- held here at its 30th
    pass until a chunk arrives (a talker waiting for the whole reply would never release it). Text, codes and
    waveform equal the non-streamed chat; a cancel mid-stream stops both stages."""
    from omni_accel.ar_bridge.speech import SpeechCancelled

    text = "there dog about how red story when why"  # the tiny thinker's text grows to its 40th token with it
    options = dict(mode="chat", max_codes=48, max_text_tokens=40, sampling=GREEDY, seed=3)
    whole = tf_pipe.generate(text, "Ethan", **options)
    assert len(whole.thinker_ids) == 40 and len(whole.codes) == 48  # a long reply, all codes used
    audio_seen = threading.Event()
    released, passes = [], [0]

    def hold(module, args, kwargs):
        passes[0] += 1
        if passes[0] == 30:  # the first chunk needs 24 codes: the thinker's passes up to ~25
            released.append(audio_seen.wait(120))

    handle = tf_pipe.thinker.model.register_forward_pre_hook(hold, with_kwargs=True)
    try:
        _streamed_chat_speaks_first_and_equals(tf_pipe, text, options, whole, on_chunk=audio_seen.set)
    finally:
        handle.remove()
    assert released == [True] and passes[0] == 40
    cancel = threading.Event()
    with pytest.raises(SpeechCancelled):
        for _ in tf_pipe.stream(text, "Ethan", cancel=cancel, **options):
            cancel.set()
    assert tf_pipe.reply(TEXT, max_text_tokens=4)[1] == 4  # both stages stopped, the pipeline free


@needs_vllm
def test_vllm_thinker_and_talker_tokens_equal_transformers(vllm_pipe, tf_pipe):
    assert vllm_pipe.engines == {"thinker": "vllm", "talker": "vllm"}
    for mode in ("chat", "tts"):
        a = vllm_pipe.generate(TEXT, "Chelsie", mode=mode, max_codes=40, max_text_tokens=10, sampling=GREEDY)
        b = tf_pipe.generate(TEXT, "Chelsie", mode=mode, max_codes=40, max_text_tokens=10, sampling=GREEDY)
        assert a.thinker_ids == b.thinker_ids, mode
        assert a.codes == b.codes and len(a.codes) > 0, mode
        _close(a.waveform, b.waveform, 1e-3)


@needs_vllm
def test_vllm_image_and_audio_inputs_equal_transformers(vllm_pipe, tf_pipe, monkeypatch):
    """An image and an audio clip on the vLLM engines (the towers' rows as prompt embeds, transformers' M-RoPE
    positions for the thinker and the talker) give the transformers engines' thinker tokens, talker codes and
    waveform, and they change the vLLM thinker's answer. The tiny model's tokens hardly depend on positions, so the
    positions are checked themselves: the vLLM talker gets transformers' talker positions step by step (3-D in the
    prompt, prompt length + delta at its first decode step: where its reply rows start), and the thinker's states
    match transformers' within 1e-4 of the peak, while 1-D positions are off by more than ten times that."""
    from omni_accel.ar_bridge import omni_qwen2_5 as family

    image, tone = _image(), _tone()
    kwargs = dict(mode="chat", max_codes=24, max_text_tokens=10, sampling=GREEDY, seed=3)
    reference_positions, vllm_positions, add = [], [], family.TalkerReply.add

    def read_reference(module, args, inputs):
        reference_positions.append(inputs["position_ids"][-3:, 0])

    def read_vllm(embeds, positions):
        vllm_positions.append((positions.clone(), family.TalkerReply.start))
        return add(embeds, positions)

    monkeypatch.setattr(family.TalkerReply, "add", read_vllm)
    handle = tf_pipe.talker.model.model.register_forward_pre_hook(read_reference, with_kwargs=True)
    try:
        for media in ({"audios": [tone]}, {"images": [image], "audios": [tone]}):
            reference_positions.clear(), vllm_positions.clear()
            vllm_pipe.talker.engine._live().reset_prefix_cache()  # the whole prompt's positions, not the uncached part
            a = vllm_pipe.generate(TEXT, "Ethan", **kwargs, **media)
            b = tf_pipe.generate(TEXT, "Ethan", **kwargs, **media)
            assert a.thinker_ids == b.thinker_ids and a.codes == b.codes and a.prompt_tokens == b.prompt_tokens
            _close(a.waveform, b.waveform, 1e-3)
    finally:
        handle.remove()
    got = torch.cat([p for p, _ in vllm_positions], dim=1)
    expected = torch.cat(reference_positions, dim=1)[:, :got.shape[1]]
    prompt = vllm_positions[0][0].shape[1]
    assert got.shape[1] > prompt + 10 and torch.equal(got, expected)
    assert not torch.equal(got[1], got[0]) and vllm_positions[1][0][0, 0].item() == vllm_positions[1][1] < prompt
    ids, media = vllm_pipe.prompt(TEXT, images=[image], audios=[tone])
    states = vllm_pipe.thinker.states(ids, media)
    _close(states, tf_pipe.thinker.states(ids, media), 1e-4)
    monkeypatch.setattr(family.MediaTowers, "thinker_positions",
                        lambda self, ids, media: (torch.arange(len(ids)).expand(3, -1), 0))
    assert (vllm_pipe.thinker.states(ids, media) - states).abs().max() > 10 * 1e-4 * states.abs().max()
    monkeypatch.undo()
    assert a.text != vllm_pipe.reply(TEXT, max_text_tokens=10)[0]  # the media change the answer
    seen = vllm_pipe.reply(TEXT, max_text_tokens=10, images=[image])
    assert seen == tf_pipe.reply(TEXT, max_text_tokens=10, images=[image])
    stats = {}  # streamed: the talker behind the thinker, the pooled states over the media prompt
    chunks = list(vllm_pipe.stream(TEXT, "Ethan", **kwargs, images=[image], audios=[tone], stats=stats))
    assert stats["codes"] == a.codes and stats["text"] == a.text
    _close(torch.cat(chunks), a.waveform, 1e-3)


@needs_vllm
def test_vllm_streamed_chat_speaks_before_the_thinker_ends_and_equals_the_whole(vllm_pipe, monkeypatch):
    """Streamed chat on the vLLM engines: the thinker, the pooling passes over the reply so far and the talker take
    turns (one thinker token per talker step), so an audio chunk comes before the last text delta. Text, codes and
    waveform equal the non-streamed chat (one pooling pass over the whole reply); a cancel mid-stream stops the
    thinker's and the talker's requests."""
    from omni_accel.ar_bridge.speech import SpeechCancelled

    text = "there dog about how red story when why"  # the tiny thinker's text grows to its 40th token with it
    options = dict(mode="chat", max_codes=48, max_text_tokens=40, sampling=GREEDY, seed=3)
    whole = vllm_pipe.generate(text, "Ethan", **options)
    assert len(whole.thinker_ids) == 40 and len(whole.codes) == 48  # a long reply, all codes used
    passes = []
    states = vllm_pipe.thinker.states
    monkeypatch.setattr(vllm_pipe.thinker, "states", lambda ids, media=None: passes.append(len(ids)) or states(ids))
    stats = _streamed_chat_speaks_first_and_equals(vllm_pipe, text, options, whole)
    n = stats["prompt_tokens"]  # passes over the prompt and a growing part of the reply, every 8 tokens or more
    assert len(passes) > 2 and passes == sorted(passes) and passes[-1] == n + 39 and passes[0] < n + 8
    cancel = threading.Event()
    with pytest.raises(SpeechCancelled):
        for _ in vllm_pipe.stream(text, "Ethan", cancel=cancel, **options):
            cancel.set()
    for engine in (vllm_pipe.thinker.gen, vllm_pipe.talker.engine):
        assert not engine._live().llm_engine.has_unfinished_requests()
    assert vllm_pipe.reply(TEXT, max_text_tokens=4)[1] == 4  # the pipeline is free


def test_talker_reply_slot_refuses_a_row_not_written_yet():
    from omni_accel.ar_bridge.omni_qwen2_5 import TalkerReply

    embeds = torch.zeros(2, 3)
    with TalkerReply.lock:
        try:
            TalkerReply.rows, TalkerReply.start, TalkerReply.complete = torch.ones(2, 3), 5, False
            assert TalkerReply.add(embeds, torch.tensor([5, 6])).sum().item() == 6  # rows 0 and 1 are in
            with pytest.raises(RuntimeError, match=r"the talker read reply row 2 before the thinker wrote it"):
                TalkerReply.add(embeds, torch.tensor([6, 7]))
            TalkerReply.complete = True  # the whole reply: its last row repeats
            assert TalkerReply.add(embeds, torch.tensor([9, 10])).sum().item() == 6
        finally:
            TalkerReply.rows, TalkerReply.start, TalkerReply.complete = None, 0, True


@needs_vllm
def test_streamed_chunks_join_into_the_whole_waveform(vllm_pipe):
    whole = vllm_pipe.generate(TEXT, "Chelsie", max_codes=60, sampling=GREEDY, seed=1)
    stats = {}
    chunks = list(vllm_pipe.stream(TEXT, "Chelsie", max_codes=60, sampling=GREEDY, seed=1, stats=stats))
    joined = torch.cat(chunks)
    assert stats["codes"] == whole.codes and stats["chunks"] == len(chunks) >= 3
    assert stats["first_chunk_s"] < stats["total_s"]
    assert joined.shape == whole.waveform.shape
    err = (joined - whole.waveform).abs().max().item() / whole.waveform.abs().max().item()
    # measured 6e-7 on the tiny model (docs/speech.md; its random DiT barely reaches past the window context of 24
    # codes back and 12 ahead); the bound leaves room for a DiT whose flow carries further
    assert err < 1e-3, err
    # the first chunk is exact: its window is the first blocks of the whole pass plus the same future context
    n0 = chunks[0].numel()
    _close(chunks[0][: n0 // 2], whole.waveform[: n0 // 2], 1e-2)


@needs_vllm
def test_speech_function_and_bad_input(vllm_pipe):
    import omni_accel.ar_bridge as ab

    wave_, sr = ab.speech(TEXT, voice="ethan", model=vllm_pipe, max_codes=12, sampling=GREEDY)
    assert sr == 24000 and wave_.ndim == 1 and wave_.numel() == 12 * 480 + 1
    with pytest.raises(AccelError, match=r"voice='alloy' is not one of this model's voices \(Chelsie, Ethan\)"):
        vllm_pipe.speech(TEXT, voice="alloy")
    with pytest.raises(AccelError, match=r"mode='sing' is not known"):
        vllm_pipe.generate(TEXT, mode="sing")
    with pytest.raises(AccelError, match=r"speed=9.0 is outside 0.25..4.0"):
        vllm_pipe.speech(TEXT, speed=9.0)
    fast, _ = vllm_pipe.speech(TEXT, max_codes=12, sampling=GREEDY, speed=2.0)
    assert abs(fast.numel() - wave_.numel() / 2) <= 1


@needs_vllm
def test_sleep_and_wake_keep_the_speech_and_text_replies_skip_the_talker(vllm_pipe):
    """omni_accel.sleep releases token2wav / embeddings and puts the three vLLM engines through vLLM's own sleep
    (a CPU worker only pauses); after wake_up the same request gives the same codes and waveform. reply() is the
    thinker's answer alone: the text a chat-mode generation speaks."""
    import omni_accel

    before = vllm_pipe.generate(TEXT, "Chelsie", mode="chat", max_codes=24, max_text_tokens=8, sampling=GREEDY, seed=1)
    report = omni_accel.sleep(vllm_pipe)
    assert report["engines"] == 3 and report["where"] == "disk" and omni_accel.is_sleeping(vllm_pipe)
    assert vllm_pipe.token2wav.module.code2wav_bigvgan_model.conv_post.weight.numel() == 0
    omni_accel.wake_up(vllm_pipe)
    after = vllm_pipe.generate(TEXT, "Chelsie", mode="chat", max_codes=24, max_text_tokens=8, sampling=GREEDY, seed=1)
    assert after.codes == before.codes and torch.equal(after.waveform, before.waveform)
    text, tokens = vllm_pipe.reply(TEXT, max_text_tokens=8)
    assert text == before.text and 0 < tokens <= 8


def test_bad_model_folder(tmp_path):
    from omni_accel.ar_bridge.speech import SpeechPipeline

    with pytest.raises(AccelError, match="has no readable config.json"):
        SpeechPipeline(tmp_path, engine="transformers")
    with pytest.raises(AccelError, match=r"engine='tpu' is not known; use 'vllm' or 'transformers'"):
        SpeechPipeline(tmp_path, engine="tpu")
    with pytest.raises(AccelError, match=r"states_every=0 must be an int >= 1 \(reply tokens between the vLLM"):
        SpeechPipeline(tmp_path, states_every=0)


@needs_vllm
def test_cancel_stops_the_vllm_talker(vllm_pipe, monkeypatch):
    """A set cancel event ends the request at the next talker step or chunk and aborts the vLLM talker request."""
    from omni_accel.ar_bridge.speech import SpeechCancelled

    aborted = _spy_on_talker_aborts(vllm_pipe, monkeypatch)
    cancel = threading.Event()
    chunks = vllm_pipe.stream(TEXT, "Chelsie", max_codes=2000, sampling=GREEDY, cancel=cancel)
    assert next(chunks).numel() > 0
    cancel.set()
    with pytest.raises(SpeechCancelled):
        next(chunks)
    assert len(aborted) == 1 and not vllm_pipe.talker.engine._live().llm_engine.has_unfinished_requests()
    cancel.set()  # already set when the request starts: nothing is spoken
    with pytest.raises(SpeechCancelled):
        vllm_pipe.generate(TEXT, "Chelsie", max_codes=2000, sampling=GREEDY, cancel=cancel)
    assert len(aborted) == 2
    assert vllm_pipe.generate(TEXT, "Chelsie", max_codes=12, sampling=GREEDY).codes  # the pipeline is free again


def _spy_on_talker_aborts(pipe, monkeypatch) -> list:
    """Record the vLLM talker requests the pipeline aborts (what "the engine was told to stop" means)."""
    engine = pipe.talker.engine._live().llm_engine
    aborted, abort = [], engine.abort_request

    def spy(request_ids, *args, **kwargs):
        aborted.append((time.monotonic(), list(request_ids)))
        return abort(request_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "abort_request", spy)
    return aborted


# -- the server ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc=None, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise RuntimeError(f"speech server {url} did not start")


@pytest.fixture(scope="module")
def speech_server(omni_path):
    """``omni-accel serve --speech-model`` in a subprocess: the CLI path, on the transformers engines."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "omni_accel", "serve", "--speech-model", str(omni_path),
                             "--speech-engine", "transformers", "--speech-greedy", "--speech-max-codes", "48",
                             "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        stop_process_group(proc, 10)


@contextlib.contextmanager
def _vllm_server(pipe, *flags):
    """``omni-accel serve --speech-model PATH --speech-engine vllm FLAGS`` -- parsed and built as the CLI builds it,
    with uvicorn in a thread of this process -- around the module's vLLM pipeline, so that the servers of this module
    share one vLLM start (~15-20 s each on 2 cores)."""
    from omni_accel.cli import build_parser
    from omni_accel.serve.speech import build_speech_server

    port = _free_port()
    args = build_parser().parse_args(["serve", "--speech-model", pipe.path, "--speech-engine", "vllm",
                                      "--speech-greedy", "--port", str(port), *flags])
    assert pipe.engines == {"thinker": args.speech_engine, "talker": args.speech_engine}
    server, _ = build_speech_server(args, pipe)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, timeout=30)
        yield url
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def vllm_server(vllm_pipe):
    with _vllm_server(vllm_pipe, "--speech-max-codes", "48") as url:
        yield url


@pytest.fixture(scope="module")
def long_server(vllm_pipe):
    """2000 codes at most (the tiny greedy talker uses them all: minutes of streaming) and one waiting place."""
    with _vllm_server(vllm_pipe, "--speech-max-codes", "2000", "--max-queue", "1") as url:
        yield url


def _pcm(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32)


def _metric(url: str, name: str, **labels) -> float:
    import httpx

    text = httpx.get(url + "/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}(?:\{{{re.escape(wanted)}\}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_openai_client_speech_wav_and_streamed_pcm(engine, request):
    """wav is a valid file; pcm arrives in several chunks that join into the wav's samples (within the streaming
    tolerance, docs/speech.md: 1e-3 of the peak, plus one 16-bit step of rounding)."""
    from openai import OpenAI

    url = request.getfixturevalue("speech_server" if engine == "transformers" else "vllm_server")
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    audio = client.audio.speech.create(model="tiny", input=TEXT, voice="Ethan", response_format="wav")
    assert audio.content[:4] == b"RIFF" and audio.content[8:12] == b"WAVE"
    with wave.open(io.BytesIO(audio.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() > 0
        whole = _pcm(w.readframes(w.getnframes()))
    pieces = []
    with client.audio.speech.with_streaming_response.create(model="tiny", input=TEXT, voice="Ethan",
                                                            response_format="pcm") as response:
        assert response.headers["content-type"] == "audio/pcm" and response.headers["x-sample-rate"] == "24000"
        for piece in response.iter_bytes():
            pieces.append(piece)
    assert len(pieces) > 1, "the PCM came in one piece: not streamed"
    joined = _pcm(b"".join(pieces))
    peak = whole.abs().max().item()
    assert joined.shape == whole.shape and peak > 1000  # the louder tiny vocoder: thousands of steps, not 0 +- 2
    assert (joined - whole).abs().max().item() <= 1e-3 * peak + 1


@needs_vllm
def test_chat_completions_text_audio_and_streamed_with_the_openai_client(vllm_pipe, vllm_server):
    """/v1/chat/completions on the omni model: text + audio (message.audio: wav, transcript = content), text only
    (the talker skipped), streamed SSE: text deltas as the thinker writes them (several, joining into the
    non-streamed text), then pcm16 audio chunks each with the next words of the transcript; sampling_params_list
    accepted."""
    from openai import OpenAI

    client = OpenAI(base_url=vllm_server + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": TEXT}]
    expected = vllm_pipe.generate(TEXT, "Chelsie", mode="chat", max_codes=48, max_text_tokens=16, sampling=GREEDY,
                                  seed=0, conversation={"system": "You are brief.", "history": []})
    r = client.chat.completions.create(model="tiny", messages=messages, modalities=["text", "audio"],
                                       audio={"voice": "Chelsie", "format": "wav"}, max_tokens=16,
                                       extra_body={"sampling_params_list": [{"max_tokens": 16}, {}]})
    message = r.choices[0].message
    assert message.content == expected.text and message.audio.transcript == expected.text
    assert r.usage.prompt_tokens == expected.prompt_tokens > 0 and r.usage.completion_tokens == 16
    wav_bytes = base64.b64decode(message.audio.data)
    with wave.open(io.BytesIO(wav_bytes)) as w:
        assert w.getframerate() == 24000 and w.getnframes() == expected.waveform.numel()
    assert message.audio.id and message.audio.expires_at > time.time()
    text_only = client.chat.completions.create(model="tiny", messages=messages, modalities=["text"], max_tokens=16)
    assert text_only.choices[0].message.content == expected.text and text_only.choices[0].message.audio is None
    text_deltas = [e.choices[0].delta.content for e in client.chat.completions.create(
        model="tiny", messages=messages, modalities=["text"], max_tokens=16, stream=True) if e.choices[0].delta.content]
    assert len(text_deltas) > 1 and "".join(text_deltas) == expected.text
    events = list(client.chat.completions.create(model="tiny", messages=messages, modalities=["text", "audio"],
                                                 audio={"voice": "Chelsie", "format": "pcm16"}, max_tokens=16,
                                                 stream=True))
    deltas = [e.choices[0].delta for e in events]
    audio_at = [i for i, d in enumerate(deltas) if d.audio and d.audio.data]
    text_at = [i for i, d in enumerate(deltas) if d.content]
    assert len(text_at) > 1 and "".join(deltas[i].content for i in text_at) == expected.text
    assert len(audio_at) >= 2 and text_at[-1] < audio_at[0]  # the talker starts from the whole reply
    transcript = [d.audio.transcript or "" for d in deltas if d.audio]
    assert "".join(transcript) == expected.text and transcript[audio_at.index(audio_at[0])] != expected.text
    pcm = b"".join(base64.b64decode(deltas[i].audio.data) for i in audio_at)
    assert len(pcm) == 2 * expected.waveform.numel()
    assert events[-1].choices[0].finish_reason == "stop"


def _data_url(data: bytes, media: str) -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _wav_file(samples, rate: int) -> bytes:
    from omni_accel.serve.speech import encode

    return encode(torch.from_numpy(samples), rate, "wav")


def test_chat_image_and_audio_parts_with_the_openai_client(speech_server, omni_path):
    """On the transformers engines an image_url part and an input_audio part (wav at 24 kHz, mp3) reach the thinker:
    the prompt counts their placeholders (usage.prompt_tokens), the audio changes the answer, a spoken answer to
    both comes back, and streamed gives the same text, transcript and pcm; streamed text deltas join into the
    non-streamed text. Bad media are 400s naming the part."""
    import httpx
    from openai import OpenAI
    from transformers import Qwen2VLImageProcessorPil

    from omni_accel.serve.speech import encode

    client = OpenAI(base_url=speech_server + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = {"type": "text", "text": TEXT}
    png = {"type": "image_url", "image_url": {"url": _data_url(_png(_image()), "image/png")}}
    wav = {"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav_file(_tone(rate=24000), 24000))
                                                  .decode(), "format": "wav"}}

    def chat(*parts, **kwargs):
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": list(parts)}],
                                              max_tokens=12, **kwargs)

    plain = chat(ask)
    grid = Qwen2VLImageProcessorPil.from_pretrained(omni_path)(images=[_image()])["image_grid_thw"][0]
    seen = chat(png, ask)
    assert seen.usage.prompt_tokens == plain.usage.prompt_tokens + int(grid.prod()) // 4 + 2
    heard = chat(wav, ask)
    assert heard.usage.prompt_tokens == plain.usage.prompt_tokens + 25 + 2  # 1 s -> 25 audio positions + marks
    assert heard.choices[0].message.content != plain.choices[0].message.content
    deltas = [e.choices[0].delta.content for e in chat(wav, ask, stream=True) if e.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == heard.choices[0].message.content
    mp3 = encode(torch.from_numpy(_tone(rate=24000)), 24000, "mp3")
    by_mp3 = chat({"type": "input_audio", "input_audio": {"data": base64.b64encode(mp3).decode(), "format": "mp3"}},
                  ask)
    assert by_mp3.usage.prompt_tokens >= heard.usage.prompt_tokens  # the encoder's padding makes it a bit longer
    spoken = chat(wav, png, ask, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})
    assert spoken.choices[0].message.audio.transcript == spoken.choices[0].message.content
    with wave.open(io.BytesIO(base64.b64decode(spoken.choices[0].message.audio.data))) as w:
        assert w.getnframes() > 0
        samples = torch.frombuffer(bytearray(w.readframes(w.getnframes())), dtype=torch.int16).float()
    # streamed, the talker runs behind the thinker (the transformers engines): the same text, transcript and audio
    deltas = [e.choices[0].delta for e in chat(wav, png, ask, modalities=["text", "audio"], stream=True,
                                               audio={"voice": "Ethan", "format": "pcm16"})]
    content = spoken.choices[0].message.content
    assert "".join(d.content or "" for d in deltas) == content
    assert "".join(d.audio.transcript or "" for d in deltas if d.audio) == content
    pcm = _pcm(b"".join(base64.b64decode(d.audio.data) for d in deltas if d.audio and d.audio.data)).float()
    assert pcm.shape == samples.shape and (pcm - samples).abs().max().item() <= 1 + 1e-3 * samples.abs().max()

    def bad(messages) -> dict:
        r = httpx.post(speech_server + "/v1/chat/completions", json={"messages": messages}, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    long_wav = {"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav_file(_tone(31.0), 16000))
                                                       .decode(), "format": "wav"}}
    err = bad([{"role": "user", "content": [long_wav, ask]}])
    assert err["code"] == "audio_too_long" and "longer than 30 s" in err["message"]
    err = bad([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}},
                                            ask]}])
    assert err["code"] == "invalid_audio" and err["param"] == "messages[0].content"
    err = bad([{"role": "user", "content": [png, ask]}, {"role": "assistant", "content": "ok"},
               {"role": "user", "content": TEXT}])
    assert err["code"] == "unsupported_content" and err["param"] == "messages[0].content"


@needs_vllm
def test_vllm_server_answers_image_and_audio_parts_as_transformers(speech_server, vllm_server):
    """``--speech-engine vllm`` takes image_url and input_audio parts: the same text and spoken audio as the
    transformers server (within one 16-bit step plus 1e-3 of the peak); streamed text deltas join into the text."""
    from openai import OpenAI

    parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav_file(_tone(rate=24000), 24000))
                                                     .decode(), "format": "wav"}},
             {"type": "image_url", "image_url": {"url": _data_url(_png(_image()), "image/png")}},
             {"type": "text", "text": TEXT}]
    answers = []
    for url in (vllm_server, speech_server):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=12,
                                           modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})
        with wave.open(io.BytesIO(base64.b64decode(r.choices[0].message.audio.data))) as w:
            samples = _pcm(w.readframes(w.getnframes())).float()
        answers.append((r.choices[0].message.content, samples, r.usage.prompt_tokens))
    (text, got, tokens), (ref_text, ref, ref_tokens) = answers
    assert text == ref_text and tokens == ref_tokens and got.shape == ref.shape and got.numel() > 0
    assert (got - ref).abs().max().item() <= 1 + 1e-3 * ref.abs().max().item()
    client = OpenAI(base_url=vllm_server + "/v1", api_key="none", max_retries=0, timeout=120)
    deltas = [e.choices[0].delta.content for e in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=12, stream=True)
        if e.choices[0].delta.content]
    assert "".join(deltas) == text


def test_flac_and_mp3_decode(speech_server):
    """flac decodes (soundfile) to the wav's samples; mp3 starts with an MPEG audio frame and decodes to about the
    same length (the encoder adds its delay and pads the last frame)."""
    import httpx
    import soundfile

    def speak(fmt: str) -> httpx.Response:
        r = httpx.post(speech_server + "/v1/audio/speech", json={"input": TEXT, "voice": "Chelsie",
                                                                 "response_format": fmt}, timeout=120)
        assert r.status_code == 200, r.text
        return r

    with wave.open(io.BytesIO(speak("wav").content)) as w:
        whole = _pcm(w.readframes(w.getnframes()))
    flac = speak("flac")
    assert flac.headers["content-type"] == "audio/flac" and flac.content[:4] == b"fLaC"
    samples, rate = soundfile.read(io.BytesIO(flac.content), dtype="int16")
    assert rate == 24000 and samples.ndim == 1
    assert samples.shape[0] == whole.shape[0] and (_pcm(samples.tobytes()) - whole).abs().max().item() <= 1
    mp3 = speak("mp3")
    assert mp3.headers["content-type"] == "audio/mpeg"
    assert mp3.content[0] == 0xFF and mp3.content[1] & 0xE0 == 0xE0  # an MPEG audio frame's 11-bit sync word
    decoded, rate = soundfile.read(io.BytesIO(mp3.content), dtype="float32")
    assert rate == 24000 and whole.shape[0] <= decoded.shape[0] <= whole.shape[0] + 4 * 1152
    assert decoded.std() > 0.01  # audio, not silence (the wav's std is ~0.03 of full scale)


def test_voices_and_bad_requests(speech_server):
    import httpx

    voices = httpx.get(speech_server + "/v1/audio/voices").json()
    assert [v["id"] for v in voices["data"]] == ["Chelsie", "Ethan"]
    r = httpx.post(speech_server + "/v1/audio/speech", json={"input": TEXT, "voice": "alloy"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "voice" and "voice='alloy' is not one of this model's voices" in err["message"]
    r = httpx.post(speech_server + "/v1/audio/speech", json={"input": TEXT, "response_format": "ogg"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "response_format='ogg' is not supported; use one of wav, pcm, flac, mp3" in r.json()["error"]["message"]
    r = httpx.post(speech_server + "/v1/audio/speech", json={"voice": "Chelsie"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter"


def _wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.05)
    return condition()


def _first_chunk_seconds(url: str, stream_body: dict | None = None) -> tuple[float, bytes]:
    """Seconds until a pcm stream's first bytes arrive, and those bytes; the connection is closed right after."""
    import httpx

    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/audio/speech", json=stream_body or {"input": TEXT, "response_format": "pcm"},
                      timeout=120) as r:
        assert r.status_code == 200
        first = next(r.iter_bytes())
        return time.monotonic() - t0, first


@needs_vllm
def test_client_disconnect_mid_stream_stops_the_generation(long_server, vllm_pipe, monkeypatch):
    """A client that closes a stream after its first chunk: the talker request is aborted within a chunk's time
    and the next request starts at once (uncancelled, the first would hold the pipeline for 2000 codes)."""
    def cancelled() -> float:
        return _metric(long_server, "omni_accel_cancelled_requests_total", reason="disconnect", stage="running")

    aborted = _spy_on_talker_aborts(vllm_pipe, monkeypatch)
    before = cancelled()
    seconds, first = _first_chunk_seconds(long_server)
    closed = time.monotonic()
    assert len(first) > 0
    assert _wait_for(lambda: aborted), "the talker was not told to stop"
    stop_s = aborted[0][0] - closed
    next_s, _ = _first_chunk_seconds(long_server)
    # the stop waits for at most one chunk's DiT pass (the first chunk's time bounds it, with room for a loaded
    # machine); the next request's first chunk then comes about as fast as the first one did
    assert stop_s < 3 * seconds + 2, (stop_s, seconds)
    assert next_s < 3 * seconds + 5, (next_s, seconds)
    assert _wait_for(lambda: cancelled() == before + 2) and _wait_for(lambda: len(aborted) == 2)


@needs_vllm
def test_speech_queue_full_429_and_metrics_label(long_server):
    """One request running and one waiting (--max-queue 1): the next gets 429 + Retry-After with an OpenAI body; the
    waiting one whose client gives up never runs; /metrics counts speech under its own endpoint label."""
    import httpx

    speech = "/v1/audio/speech"
    counted = {"429": ("omni_accel_requests_total", {"endpoint": speech, "status": "429"}),
               "499": ("omni_accel_requests_total", {"endpoint": speech, "status": "499"}),
               "left the queue": ("omni_accel_cancelled_requests_total", {"reason": "disconnect", "stage": "queued"}),
               "rejected": ("omni_accel_rejected_requests_total", {}),
               "other": ("omni_accel_requests_total", {"endpoint": "other", "status": "429"})}
    before = {key: _metric(long_server, name, **labels) for key, (name, labels) in counted.items()}

    def queued() -> int:
        return httpx.get(long_server + "/health").json()["queue_depth"]

    body = {"input": TEXT, "response_format": "pcm"}
    with httpx.stream("POST", long_server + speech, json=body, timeout=120) as running:
        pieces = running.iter_bytes()  # kept: dropping the iterator closes the connection
        assert running.status_code == 200 and next(pieces)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            impatient = pool.submit(httpx.post, long_server + speech, json=body, timeout=httpx.Timeout(30, read=2.0))
            assert _wait_for(lambda: queued() == 1, 10)
            refused = httpx.post(long_server + speech, json=body, timeout=30)
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
            with pytest.raises(httpx.ReadTimeout):
                impatient.result()
            assert _wait_for(lambda: queued() == 0, 10)  # it gave up its place while the first still runs
    assert _wait_for(lambda: httpx.get(long_server + "/health").json()["running"] == 0)  # closed: it stops too
    after = {key: _metric(long_server, name, **labels) for key, (name, labels) in counted.items()}
    assert {key: after[key] - before[key] for key in counted} == {"429": 1, "499": 1, "left the queue": 1,
                                                                 "rejected": 1, "other": 0}


@needs_vllm
def test_speech_timeout_504_stops_the_generation(vllm_pipe, vllm_server, monkeypatch):
    """--request-timeout 1 on a 2000-code request: 504 with an OpenAI body, the talker is aborted, and the next
    request (here on another server over the same pipeline) is served."""
    import httpx

    aborted = _spy_on_talker_aborts(vllm_pipe, monkeypatch)
    with _vllm_server(vllm_pipe, "--speech-max-codes", "2000", "--request-timeout", "1") as url:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/audio/speech", json={"input": TEXT}, timeout=60)
        assert r.status_code == 504 and time.monotonic() - t0 < 5
        assert r.json()["error"]["code"] == "request_timeout" and r.json()["error"]["type"] == "timeout_error"
        assert _metric(url, "omni_accel_cancelled_requests_total", reason="timeout", stage="running") == 1
    r = httpx.post(vllm_server + "/v1/audio/speech", json={"input": TEXT}, timeout=120)
    assert r.status_code == 200 and r.content[:4] == b"RIFF" and len(aborted) == 1


@needs_vllm
def test_failure_mid_stream_reaches_the_client(vllm_pipe, vllm_server, monkeypatch):
    """After the first chunk the DiT fails: an SSE stream ends with an error event (OpenAI error body), a PCM stream
    is cut (the client reads an incomplete body, not a short success); the server keeps serving."""
    import httpx

    real_chunk = vllm_pipe.token2wav._chunk
    calls = []

    def second_chunk_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("DiT exploded")
        return real_chunk(*args, **kwargs)

    monkeypatch.setattr(vllm_pipe.token2wav, "_chunk", second_chunk_fails)
    r = httpx.post(vllm_server + "/v1/audio/speech", json={"input": TEXT, "response_format": "pcm",
                                                           "stream_format": "sse"}, timeout=120)
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and [e["type"] for e in events] == ["speech.audio.delta", "error"]
    assert base64.b64decode(events[0]["audio"])
    assert events[1]["error"]["code"] == "pipeline_error" and "DiT exploded" in events[1]["error"]["message"]
    assert set(events[1]["error"]) == {"message", "type", "param", "code"}

    calls.clear()
    received = []
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
        with httpx.stream("POST", vllm_server + "/v1/audio/speech", json={"input": TEXT, "response_format": "pcm"},
                          timeout=120) as stream:
            assert stream.status_code == 200
            for piece in stream.iter_bytes():
                received.append(piece)
    assert received  # the first chunk came, then the cut
    assert _metric(vllm_server, "omni_accel_speech_stream_errors_total", code="pipeline_error") == 2
    monkeypatch.undo()
    assert httpx.post(vllm_server + "/v1/audio/speech", json={"input": TEXT}, timeout=120).status_code == 200


def test_token2wav_regional_compile_matches_eager(omni_path):
    """The DiT blocks compiled with omni_accel's compile-pass options give the eager waveform."""
    from omni_accel.ar_bridge import omni_qwen2_5 as family
    from omni_accel.ar_bridge.speech import SpeechPipeline, Token2Wav

    cfg = family.read_config(str(omni_path))
    speakers = SpeechPipeline._speakers(str(omni_path))
    t2w = Token2Wav(SpeechPipeline._token2wav_module(str(omni_path), cfg), speakers, num_steps=4)
    codes = list(range(12))
    eager = t2w.wave(codes, "Chelsie", seed=0)
    t2w.compile()
    compiled = t2w.wave(codes, "Chelsie", seed=0)
    assert t2w.compiled and all(b._compiled_call_impl is not None for b in t2w.dit.transformer_blocks)
    _close(compiled, eager, 1e-4)
