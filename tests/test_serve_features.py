"""omni-accel serve: per-request LoRA adapters (built-in model and adapter), sleep mode, and images through
/v1/chat/completions -- with the official openai client where it applies. The omni (speech) chat is tested in
tests/test_speech.py beside the vLLM pipeline it needs."""

import base64
import concurrent.futures
import io

import httpx
import numpy as np
import openai
import pytest

from test_serve import ThreadServer

STEPS = 8
PROMPT = "a large red circle in the center on a blue background"


class CliServer(ThreadServer):
    """The server exactly as ``omni-accel serve ARGS`` builds it, the model loaded through load_model (LoRA adapters
    are put in place before accelerate()), uvicorn in a thread of this process."""

    def __init__(self, *argv):
        from omni_accel.cli import build_parser
        from omni_accel.serve.server import load_model

        self.model = load_model(build_parser().parse_args(["serve", *argv]))
        super().__init__(self.model, ["--no-warmup", *argv])


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    """--lora-dir ROOT with a second adapter ('other': seeded random weights on the built-in adapter's modules)."""
    from omni_accel.builtin import load_builtin
    from omni_accel.builtin.train_lora import TARGET_MODULES
    from omni_accel.testing.lora import random_lora

    root = tmp_path_factory.mktemp("adapters")
    pipe = load_builtin()
    state = random_lora(pipe, rank=4, seed=5, std=0.05, targets=tuple(f"*{t}" for t in TARGET_MODULES))
    pipe.save_lora_weights(str(root / "other"), transformer_lora_layers={k.removeprefix("transformer."): v
                                                                         for k, v in state.items()})
    return root


@pytest.fixture(scope="module")
def lora_server(lora_root):
    from omni_accel.builtin import builtin_lora_path

    with CliServer("--lora", f"swap={builtin_lora_path()}", "--lora-dir", str(lora_root), "--max-lora-rank", "8",
                   "--max-loras", "2", "--enable-sleep-mode") as s:
        yield s


def _generate(url: str, **body) -> httpx.Response:
    body = {"prompt": PROMPT, "size": "128x128", "seed": 3, "num_inference_steps": STEPS, **body}
    return httpx.post(url + "/v1/images/generations", json=body, timeout=120)


def _background(b64: str) -> str:
    from PIL import Image

    from omni_accel.builtin.metric import analyze

    return analyze(Image.open(io.BytesIO(base64.b64decode(b64))))["bg"]


def test_adapters_are_models_with_their_parent(lora_server):
    from omni_accel.builtin import builtin_lora_path

    cards = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x").models.list().data
    by_id = {c.id: c for c in cards}
    assert set(by_id) == {"omni-accel-builtin", "swap"}
    assert by_id["swap"].parent == "omni-accel-builtin" and by_id["swap"].root == builtin_lora_path()


def test_concurrent_requests_with_different_adapters_each_get_their_own(lora_server):
    """Three requests at once -- the base model, the built-in adapter by model name, the directory adapter by path --
    are never batched together and each gets what it gets alone."""
    url = lora_server.url
    bodies = {"base": {}, "swap": {"model": "swap"}, "other": {"lora": {"path": "other", "scale": 1.0}}}
    alone = {name: _generate(url, **body).json()["data"][0]["b64_json"] for name, body in bodies.items()}
    assert len(set(alone.values())) == 3
    assert _background(alone["base"]) == "blue" and _background(alone["swap"]) == "red"  # the adapter as trained
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(_generate, url, **body) for name, body in bodies.items()}
        together = {name: f.result().json()["data"][0]["b64_json"] for name, f in futures.items()}
    assert together == alone
    assert _generate(url, lora={"name": "swap", "scale": 0.0}).json()["data"][0]["b64_json"] == alone["base"]


@pytest.mark.parametrize("body, status, param, message", [
    ({"lora": {"path": "../../etc"}}, 400, "lora.path", "lora.path='../../etc' resolves outside the server's adapter "
                                                        "root; give a folder under it."),
    ({"lora": {"name": "nope"}}, 404, "lora.name", "lora.name='nope' is not an adapter of this server; known: "
                                                   "['swap']."),
    ({"lora": {"path": "missing"}}, 404, "lora.path", "lora.path='missing' does not exist under the server's adapter "
                                                      "root."),
    ({"model": "nope"}, 404, "model", "the model 'nope' does not exist; this server serves 'omni-accel-builtin' and "
                                      "the LoRA adapters swap (see GET /v1/models)"),
])
def test_bad_adapters_get_openai_errors(lora_server, body, status, param, message):
    r = _generate(lora_server.url, **body)
    assert r.status_code == status and r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == message


def test_sleep_then_a_request_wakes_the_model_with_the_same_image(lora_server):
    url = lora_server.url
    before = _generate(url).json()["data"][0]["b64_json"]
    r = httpx.post(url + "/sleep", params={"level": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["is_sleeping"] and r.json()["released_bytes"] > 40 * 2**20
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    woke = _generate(url)
    assert woke.status_code == 200 and woke.headers["server-timing"].startswith("wake;dur=")
    assert woke.json()["data"][0]["b64_json"] == before
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    bad = httpx.post(url + "/sleep", params={"level": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"


def test_image_through_chat_completions_with_the_openai_client(lora_server):
    """The last user message is the prompt; height / width / steps / seed from extra_body; the image comes back as
    an image_url content part -- the same image /v1/images/generations gives. Streamed: one chunk with the part."""
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    extra = {"height": 128, "width": 128, "num_inference_steps": STEPS, "seed": 3}
    messages = [{"role": "system", "content": "draw"}, {"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model="omni-accel-builtin", messages=messages, extra_body=extra)
    (part,) = r.choices[0].message.content
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
    assert part["image_url"]["url"].split(",", 1)[1] == _generate(lora_server.url).json()["data"][0]["b64_json"]
    chunks = list(client.chat.completions.create(model="swap", messages=messages, extra_body=extra, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    streamed = chunks[0].choices[0].delta.content[0]["image_url"]["url"].split(",", 1)[1]
    assert streamed == _generate(lora_server.url, model="swap").json()["data"][0]["b64_json"]
    bad = httpx.post(lora_server.url + "/v1/chat/completions", json={"messages": [{"role": "assistant",
                                                                                   "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "messages must end with a user message."


def test_no_auto_wake_answers_503_and_sleep_mode_off_refuses(tmp_path):
    import omni_accel
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("flux")
    folder = tmp_path / "flux"
    pipe.save_pretrained(folder)
    common = ["--model", str(folder), "--default-size", "48x32", "--attention", "sdpa"]
    body = {"prompt": "a fox", "num_inference_steps": 2, "seed": 0}
    with CliServer(*common, "--enable-sleep-mode", "--no-auto-wake") as s:
        assert httpx.post(s.url + "/sleep").status_code == 200
        r = httpx.post(s.url + "/v1/images/generations", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "model_asleep"
        assert omni_accel.is_sleeping(s.model.pipe)
        assert httpx.post(s.url + "/wake_up").json()["is_sleeping"] is False
        assert httpx.post(s.url + "/v1/images/generations", json=body, timeout=60).status_code == 200
    with CliServer(*common) as s:
        r = httpx.post(s.url + "/sleep")
        assert r.status_code == 400 and r.json()["error"]["code"] == "sleep_mode_disabled"


def test_video_jobs_with_and_without_an_adapter(tmp_path, monkeypatch):
    """--video-lora on the tiny Wan: a job naming the adapter (model: NAME) gets another clip than the base model,
    and the adapter at scale 0 gives the base model's clip; the adapter is listed with its parent."""
    from test_serve_videos import API_KEY, record_encoded_frames
    from test_serve_videos import client as video_client

    from omni_accel.testing import tiny_pipeline
    from omni_accel.testing.lora import random_lora

    wan, _ = tiny_pipeline("wan")
    flux, _ = tiny_pipeline("flux")
    for name, pipe in (("wan", wan), ("flux", flux)):
        pipe.save_pretrained(tmp_path / name)
    state = random_lora(wan, rank=4, seed=2, std=0.5, targets=("*to_q", "*to_k", "*to_v", "*to_out.0"))
    wan.save_lora_weights(str(tmp_path / "wan_lora"),
                          transformer_lora_layers={k.removeprefix("transformer."): v for k, v in state.items()})
    argv = ["--model", str(tmp_path / "flux"), "--video-model", str(tmp_path / "wan"), "--device", "cpu",
            "--video-lora", f"motion={tmp_path / 'wan_lora'}", "--api-key", API_KEY]
    from omni_accel.cli import build_parser
    from omni_accel.serve.server import load_model
    from omni_accel.serve.videos import load_video_model

    args = build_parser().parse_args(["serve", *argv])
    with ThreadServer(load_model(args), argv, video_model=load_video_model(args)) as s:
        c = video_client(s.url)
        extra = {"num_frames": 5, "num_inference_steps": 2, "seed": 3}

        encoded = record_encoded_frames(monkeypatch)

        def clip(**more):
            video = c.videos.create_and_poll(prompt="a cat walks", size="32x32", poll_interval_ms=100,
                                             **{"extra_body": {**extra, **more.pop("extra_body", {})}}, **more)
            assert video.status == "completed", video
            return encoded[-1]

        base, adapted = clip(), clip(model="motion")
        assert np.abs(base - adapted).mean() > 0.5
        assert np.abs(clip(extra_body={"lora": '{"name": "motion", "scale": 0.0}'}) - base).max() <= 1
        cards = {m.id: m for m in c.models.list().data}
        assert cards["motion"].parent == "wan" and "videos" in cards["motion"].capabilities
