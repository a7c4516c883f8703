"""Omni speech (thinker -> talker -> token2wav) on the tiny random Qwen2.5-Omni: vLLM vs the transformers reference,
streaming, and the OpenAI speech endpoints. One vLLM pipeline for the module (three engines: thinker pooling and
generate, talker)."""

import io
import os
import socket
import subprocess
import sys
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


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory):
    return save_tiny_model("qwen2_5_omni", tmp_path_factory.mktemp("omni") / "tiny")


@pytest.fixture(scope="module")
def reference(omni_path):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_path).eval()


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
                                       talker_eos_token_id=list(lay.codec_stops), thinker_do_sample=False)
    assert result.thinker_ids == seq[0, ids.shape[1]:].tolist()
    assert result.waveform.shape == ref_wave.shape and result.waveform.shape[0] == len(result.codes) * 2 * 240 + 1
    _close(result.waveform, ref_wave, 1e-3)


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


def test_bad_model_folder(tmp_path):
    from omni_accel.ar_bridge.speech import SpeechPipeline

    with pytest.raises(AccelError, match="has no readable config.json"):
        SpeechPipeline(tmp_path, engine="transformers")
    with pytest.raises(AccelError, match=r"engine='tpu' is not known; use 'vllm' or 'transformers'"):
        SpeechPipeline(tmp_path, engine="tpu")


# -- the server ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def speech_server(omni_path):
    """``omni-accel serve --speech-model`` in a subprocess (transformers engines: the vLLM path is tested above)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "omni_accel", "serve", "--speech-model", str(omni_path),
                             "--speech-engine", "transformers", "--speech-greedy", "--speech-max-codes", "48",
                             "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-3000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError("speech server did not start")
        yield url
    finally:
        stop_process_group(proc, 10)


def test_openai_client_speech_wav_and_streamed_pcm(speech_server):
    from openai import OpenAI

    client = OpenAI(base_url=speech_server + "/v1", api_key="none")
    audio = client.audio.speech.create(model="tiny", input=TEXT, voice="Chelsie", response_format="wav")
    with wave.open(io.BytesIO(audio.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() > 0
    pieces = []
    with client.audio.speech.with_streaming_response.create(model="tiny", input=TEXT, voice="Ethan",
                                                            response_format="pcm") as response:
        assert response.headers["content-type"] == "audio/pcm"
        for piece in response.iter_bytes():
            pieces.append(piece)
    assert pieces and sum(map(len, pieces)) % 2 == 0 and sum(map(len, pieces)) > 0


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
    assert "response_format='ogg' is not supported; use one of wav, pcm" in r.json()["error"]["message"]
    r = httpx.post(speech_server + "/v1/audio/speech", json={"voice": "Chelsie"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter"


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
