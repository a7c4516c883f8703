"""/v1/videos: OpenAI's Videos API over tiny Wan pipelines (T2V, I2V, 2.2 with two experts), driven by the official
openai client and raw HTTP; the job lifecycle, cancel, pagination, content and thumbnail, limits, the bounded store,
and torchrun with 2 gloo ranks."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from conftest import stop_process_group
from omni_accel.testing import tiny_pipeline
from test_serve import ROOT, ThreadServer, assert_error, free_port, png_bytes, wait_healthy, wait_until

API_KEY = "video-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
VIDEOS = "/v1/videos"
SMALL = {"size": "32x32", "num_frames": "5", "num_inference_steps": "2"}  # form fields of a quick clip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Tiny pipelines saved as folders: what --model / --video-model load."""
    out = {}
    for family in ("flux", "wan", "wan_i2v", "wan22"):
        pipe, _ = tiny_pipeline(family)
        out[family] = str(tmp_path_factory.mktemp(family) / family)
        pipe.save_pretrained(out[family])
    return out


def load(dirs, video: str, *flags):
    """(argv, image model, video model) as `omni-accel serve --model tiny-flux --video-model tiny-X FLAGS` loads
    them."""
    from omni_accel.cli import build_parser
    from omni_accel.serve.server import load_model
    from omni_accel.serve.videos import load_video_model

    argv = ["--model", dirs["flux"], "--video-model", dirs[video], "--device", "cpu", *flags]
    args = build_parser().parse_args(["serve", *argv])
    return argv, load_model(args), load_video_model(args)


@pytest.fixture(scope="module")
def t2v(dirs):
    """The text-to-video server of most tests, with acceleration flags on the video model."""
    argv, model, video = load(dirs, "wan", "--attention", "sdpa", "--fuse-qkv", "--api-key", API_KEY,
                              "--max-frames", "9", "--max-request-cost", "0.05")
    with ThreadServer(model, argv, video_model=video) as server:
        server.argv, server.model, server.video = argv, model, video
        yield server


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def video_queue(server):
    return next(q for q in server.server.drains if q.name == "videos")


def mp4_frames(data: bytes) -> np.ndarray:
    from omni_accel.video_io import decode_mp4

    frames, _ = decode_mp4(data)
    return frames.astype(np.int16)


def record_encoded_frames(monkeypatch) -> list:
    """The frames the server hands to the MP4 encoder, as uint8 arrays: the pipeline's output before the lossy
    codec. (Comparing decoded MP4s instead is not stable: a sub-level change in the frames moves x264's rate-control
    decisions, which moves decoded pixels by whole levels.)"""
    from omni_accel import video_io

    recorded, encode = [], video_io.encode_mp4

    def recording(frames, fps):
        recorded.append(video_io.frames_to_array(frames).astype(np.int16))
        return encode(frames, fps)

    monkeypatch.setattr(video_io, "encode_mp4", recording)
    return recorded


def test_openai_client_lifecycle_text_to_video(t2v, dirs, monkeypatch):
    """create_and_poll -> completed with the rounding reported; the MP4 has the frames and size asked for and
    matches the plain pipeline's clip; the thumbnail is its first frame; list pages newest first; delete frees the
    files; /v1/models lists both models; the acceleration flags reached the video model."""
    from diffusers import DiffusionPipeline

    from omni_accel.serve.videos import run_video_spec

    c = client(t2v.url)
    encoded = record_encoded_frames(monkeypatch)
    video = c.videos.create_and_poll(prompt="a cat walks on grass", size="32x32", seconds="1", poll_interval_ms=100,
                                     extra_body={"fps": 4, "num_inference_steps": 2, "seed": 3})
    assert (video.status, video.progress, video.size, video.seconds) == ("completed", 100, "32x32", "1.25")
    assert video.model_extra["num_frames"] == 5 and video.model_extra["frames_note"] == (
        "seconds=1 x fps=4 = 4 frames; WanPipeline makes 4 * k + 1 frames, so 5 (1.25 s at 4 fps)")
    served = mp4_frames(c.videos.download_content(video.id).content)
    assert served.shape == (5, 32, 32, 3)
    (frames,) = encoded
    codec_error = float(np.abs(served - frames).mean())
    assert codec_error < 4, codec_error  # yuv420p halves the colour resolution of these noise-like frames: ~2.5
    thumbnail = np.asarray(Image.open(io.BytesIO(c.videos.download_content(video.id, variant="thumbnail").content)))
    assert np.array_equal(thumbnail, frames[0])  # PNG: lossless

    # the same clip from the plain pipeline (no acceleration)
    from omni_accel.serve.engine import LoadedModel
    from omni_accel.video_io import frames_to_array

    plain = LoadedModel.from_pipeline(DiffusionPipeline.from_pretrained(dirs["wan"]), "plain")
    spec = {"prompt": "a cat walks on grass", "width": 32, "height": 32, "num_frames": 5, "steps": 2, "seed": 3}
    reference = frames_to_array(run_video_spec(plain, spec)).astype(np.int16)
    assert np.abs(frames - reference).max() <= 1  # fuse_qkv + sdpa are lossless up to fp32 summation order
    other_seed = frames_to_array(run_video_spec(plain, {**spec, "seed": 4})).astype(np.int16)
    assert np.abs(frames - other_seed).mean() > 0.5, np.abs(frames - other_seed).mean()
    applied = {p["pass"] for p in t2v.video.pipe.omni_accel.report()["applied"]}
    assert {"fuse_qkv", "attention"} <= applied

    others = [c.videos.create(prompt=f"clip {i}", extra_body={**SMALL, "num_frames": 1, "num_inference_steps": 1})
              for i in range(2)]
    for other in others:
        assert c.videos.poll(other.id, poll_interval_ms=100).status == "completed"
    newest_first = [v.id for v in c.videos.list(limit=2)]  # the client follows last_id over two pages
    assert newest_first == [others[1].id, others[0].id, video.id]
    first_page = c.videos.list(limit=2)
    assert first_page.has_more and len(first_page.data) == 2
    assert [v.id for v in c.videos.list(order="asc")] == newest_first[::-1]

    deleted = c.videos.delete(video.id)
    assert deleted.deleted and deleted.object == "video.deleted"
    with pytest.raises(openai.NotFoundError):
        c.videos.retrieve(video.id)
    store = video_queue(t2v).kinds["video"].store
    assert not any(name.startswith(video.id) for name in os.listdir(store.folder))
    assert [m.id for m in c.models.list()] == ["flux", "wan"]
    text = httpx.get(t2v.url + "/metrics").text
    assert re.search(r'^omni_accel_jobs_total\{outcome="completed",route="/v1/videos"\} 3\.0$', text, re.M)


class SlowVideo:
    """Stands in for the video pipeline: ``steps`` steps of 0.1 s, progress reported, stopped when cancelled."""

    def __init__(self, steps=20):
        self.steps, self.prompts, self.aborted = steps, [], 0

    def __call__(self, spec, control):
        from omni_accel.serve.jobs import Aborted

        self.prompts.append(spec["prompt"])
        for i in range(self.steps):
            if control():
                self.aborted += 1
                raise Aborted()
            time.sleep(0.1)
            control.progress(i + 1, self.steps)
        return np.zeros((spec["num_frames"], spec["height"], spec["width"], 3), dtype=np.float32)


def test_progress_cancel_on_delete_and_disconnect(t2v):
    """Progress moves while a job runs; DELETE cancels a running job (aborted at its next step) and a queued one
    (never run); a job outlives the client that created it."""
    queue = video_queue(t2v)
    slow, real = SlowVideo(), queue.executor
    queue.executor = slow
    try:
        with httpx.Client(base_url=t2v.url, headers=AUTH, timeout=30) as http:
            def create(prompt):
                r = http.post(VIDEOS, data={"prompt": prompt, **SMALL})
                assert r.status_code == 200, r.text
                return r.json()

            running, queued = create("running"), create("queued")
            assert queued["status"] == "queued" and queued["progress"] == 0
            time.sleep(0.6)
            now = http.get(f"{VIDEOS}/{running['id']}")
            assert now.json()["status"] == "in_progress" and 0 < now.json()["progress"] < 100
            assert now.headers["openai-poll-after-ms"] == "500"
            assert_error(http.get(f"{VIDEOS}/{running['id']}/content"), 409, code="video_not_ready")
            assert http.delete(f"{VIDEOS}/{queued['id']}").json()["deleted"]
            assert http.delete(f"{VIDEOS}/{running['id']}").json()["deleted"]
            assert_error(http.get(f"{VIDEOS}/{running['id']}"), 404, code="not_found")
            assert wait_until(lambda: slow.aborted == 1) and slow.prompts == ["running"]

        slow.steps = 3  # a client that goes away right after creating: the job still runs and is there to fetch
        with httpx.Client(base_url=t2v.url, headers=AUTH, timeout=30) as gone:
            orphan = gone.post(VIDEOS, data={"prompt": "orphan", **SMALL}).json()
        assert wait_until(lambda: httpx.get(f"{t2v.url}{VIDEOS}/{orphan['id']}", headers=AUTH).json()["status"]
                     == "completed")
    finally:
        queue.executor = real


def test_shutdown_cancels_queued_then_running_video_jobs(t2v):
    """The drain (SIGTERM) fails a queued video job with 'cancelled' at once and refuses new ones (503); a running
    one is failed the same way when the grace ends."""
    with ThreadServer(t2v.model, t2v.argv, video_model=t2v.video) as s:
        queue = video_queue(s)
        queue.executor = SlowVideo(50)
        running = httpx.post(s.url + VIDEOS, headers=AUTH, data={"prompt": "left running", **SMALL}).json()
        queued = httpx.post(s.url + VIDEOS, headers=AUTH, data={"prompt": "left queued", **SMALL}).json()
        queue.drain()  # what SIGTERM does first
        state = httpx.get(f"{s.url}{VIDEOS}/{queued['id']}", headers=AUTH).json()
        assert state["status"] == "failed" and state["error"] == {
            "code": "cancelled", "message": "the server shut down before the video was finished"}
        assert_error(httpx.post(s.url + VIDEOS, headers=AUTH, data={"prompt": "late", **SMALL}), 503,
                     code="unavailable")
        assert httpx.get(f"{s.url}{VIDEOS}/{running['id']}", headers=AUTH).json()["status"] == "in_progress"
        queue.abandon_running()  # the grace ran out
        state = httpx.get(f"{s.url}{VIDEOS}/{running['id']}", headers=AUTH).json()
        assert state["status"] == "failed" and state["error"]["code"] == "cancelled"


@pytest.mark.parametrize("case", [
    dict(name="size off the multiple", data={"size": "30x30"}, param="size", code="invalid_size",
         message="size=30x30: width and height must be multiples of 16 for this model; the nearest valid size is "
                 "'32x32'"),
    dict(name="frames above --max-frames", data={"num_frames": "13"}, param="num_frames",
         message="invalid value for 'num_frames': 13 is more than this server allows (at most 9, --max-frames)"),
    dict(name="seconds above --max-frames", data={"seconds": "4", "num_frames": None}, param="seconds",
         message="seconds=4 x fps=16 = 64 frames; WanPipeline makes 4 * k + 1 frames, so 65 (4.06 s at 16 fps): "
                 "more frames than this server allows (at most 9, --max-frames)"),
    dict(name="seconds and num_frames", data={"seconds": "1"}, param="num_frames",
         message="send seconds or num_frames, not both"),
    dict(name="seconds not a number", data={"seconds": "soon", "num_frames": None}, param="seconds",
         message="seconds='soon' is not a positive number of seconds (e.g. '4')"),
    dict(name="cost above the bound", data={"num_frames": "9", "num_inference_steps": "8"}, code="request_too_costly",
         message="this video (32x32, 9 frames, 8 steps) costs 0.07373 megapixel-steps (frames x width x height x "
                 "steps / 1e6), more than this server allows per request (0.05, --max-request-cost); ask for fewer "
                 "frames, steps or pixels"),
    dict(name="image to a text-to-video model", files={"input_reference": ("a.png", png_bytes(32, 32), "image/png")},
         param="input_reference", code="unsupported_parameter"),
    dict(name="second expert's guidance on one expert", data={"guidance_scale_2": "3"}, param="guidance_scale_2",
         message="guidance_scale_2 applies to Wan 2.2's two experts; 'wan' has one transformer"),
    dict(name="lora", data={"lora": '{"name": "x"}'}, param="lora", code="lora_not_supported"),
    dict(name="two videos", data={"n": "2"}, param="n"),
    dict(name="unknown model", data={"model": "sora-2"}, status=404, code="model_not_found"),
    dict(name="no prompt", data={"prompt": None}, param="prompt", code="missing_required_parameter"),
    dict(name="no API key", headers={}, status=401, code="invalid_api_key"),
], ids=lambda c: c["name"])
def test_bad_video_requests_are_refused_before_admission(t2v, case):
    before = video_queue(t2v).kinds["video"].store.page(None, 100, True)[0]
    data = {k: v for k, v in {"prompt": "x", **SMALL, **case.get("data", {})}.items() if v is not None}
    r = httpx.post(t2v.url + VIDEOS, data=data, files=case.get("files"), headers=case.get("headers", AUTH),
                   timeout=30)
    err = assert_error(r, case.get("status", 400), case.get("param", "?"), case.get("code", "?"))
    if "message" in case:
        assert err["message"] == case["message"]
    assert video_queue(t2v).kinds["video"].store.page(None, 100, True)[0] == before  # no job was made


def test_content_and_listing_errors(t2v):
    http = httpx.Client(base_url=t2v.url, headers=AUTH, timeout=30)
    assert_error(http.get(f"{VIDEOS}/video_nope"), 404, code="not_found")
    assert_error(http.get(f"{VIDEOS}/video_nope/content"), 404, code="not_found")
    assert_error(http.get(VIDEOS, params={"after": "video_nope"}), 400, param="after")
    assert_error(http.get(VIDEOS, params={"limit": 0}), 400, param="limit")
    made = http.post(VIDEOS, data={"prompt": "x", "size": "16x16", "num_frames": "1", "num_inference_steps": "1"})
    video_id = made.json()["id"]
    assert wait_until(lambda: http.get(f"{VIDEOS}/{video_id}").json()["status"] == "completed")
    assert_error(http.get(f"{VIDEOS}/{video_id}/content", params={"variant": "spritesheet"}), 400, param="variant")


def test_store_keeps_the_newest_within_count_and_bytes(tmp_path):
    """Finished videos beyond the count or the bytes are evicted oldest first; running jobs never are; files of
    an earlier run are cleared at start-up, other files left alone."""
    from omni_accel.serve.jobs import COMPLETED, IN_PROGRESS, Job
    from omni_accel.serve.videos import VideoStore

    (tmp_path / f"video_{'0' * 32}.mp4").write_bytes(b"old run")
    (tmp_path / "notes.txt").write_text("mine")
    store = VideoStore(str(tmp_path), max_count=2, max_bytes=1000)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]

    def finished(name, size):
        job = Job(kind=None, route=VIDEOS, params=None, id=f"video_{name * 32}")
        store.add(job)
        job.status = IN_PROGRESS
        assert store.save(job, b"m" * (size - 10), b"p" * 10)
        job.status = COMPLETED
        store.finished()
        return job.id

    running = Job(kind=None, route=VIDEOS, params=None, id=f"video_{'f' * 32}", status=IN_PROGRESS)
    store.add(running)
    a, b = finished("a", 100), finished("b", 100)
    c = finished("c", 100)  # three finished: the oldest goes
    assert [store.get(i) is not None for i in (a, b, c)] == [False, True, True] and store.get(running.id)
    d = finished("d", 900)  # 100 + 900 > 1000 bytes: b goes
    assert store.get(b) is None and store.get(c) is not None and store.get(d) is not None
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt", f"{c}.mp4", f"{c}.png", f"{d}.mp4", f"{d}.png"])


def test_image_to_video_and_wan22_request_fields(dirs):
    """An I2V model animates input_reference (a file, or a data: URL) and requires it; a Wan 2.2 model takes
    guidance_scale_2, boundary_ratio and flow_shift per request (each changes the clip; the pipeline's own settings
    are back afterwards)."""
    argv, model, video = load(dirs, "wan_i2v", "--no-warmup")
    with ThreadServer(model, argv, video_model=video) as s:
        c = client(s.url)
        made = c.videos.create_and_poll(prompt="a green field", input_reference=("in.png", png_bytes(48, 32),
                                                                                 "image/png"),
                                        size="32x32", poll_interval_ms=100,
                                        extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 0})
        assert made.status == "completed", made.error
        assert mp4_frames(c.videos.download_content(made.id).content).shape == (5, 32, 32, 3)
        url = "data:image/png;base64," + base64.b64encode(png_bytes(32, 32)).decode()
        r = httpx.post(s.url + VIDEOS, data={"prompt": "x", "input_reference[image_url]": url, **SMALL}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "queued"
        assert_error(httpx.post(s.url + VIDEOS, data={"prompt": "x", **SMALL}), 400, param="input_reference",
                     code="missing_required_parameter")
        assert_error(httpx.post(s.url + VIDEOS, data={"prompt": "x", "input_reference[image_url]": "https://x/a.png",
                                                      **SMALL}), 400, code="invalid_image")

    from omni_accel.serve.videos import run_video_spec

    argv, model, video = load(dirs, "wan22")
    # each field changes the clip (4 steps at t = 1000, 858, 602, 9: boundary 0.5 hands the third step to the other
    # expert), and the pipeline's own settings are back after the call
    spec = {"prompt": "a cat", "width": 32, "height": 32, "num_frames": 5, "steps": 4, "seed": 0}
    plain = run_video_spec(video, spec)
    fields = {"guidance_scale_2": 1.0, "boundary_ratio": 0.5, "flow_shift": 12.0}
    for name, value in fields.items():
        assert not np.array_equal(run_video_spec(video, {**spec, name: value}), plain), name
    assert np.array_equal(run_video_spec(video, spec), plain) and video.pipe.config.boundary_ratio == 0.875
    with ThreadServer(model, argv, video_model=video) as s:  # and they reach the call from the form
        queue, calls = video_queue(s), []
        real = queue.executor
        queue.executor = lambda spec, control: calls.append(spec) or real(spec, control)
        made = client(s.url).videos.create_and_poll(prompt="a cat", size="32x32", poll_interval_ms=100,
                                                    extra_body={"num_frames": 5, "num_inference_steps": 4,
                                                                "seed": 0, **fields})
        assert made.status == "completed", made.error
        assert {name: calls[-1][name] for name in fields} == fields


def test_a_non_video_pipeline_is_refused_as_video_model(dirs):
    from omni_accel.cli import CliError, build_parser
    from omni_accel.serve.videos import load_video_model

    args = build_parser().parse_args(["serve", "--video-model", dirs["flux"], "--device", "cpu"])
    with pytest.raises(CliError, match=r"is a FluxPipeline, not a video pipeline \(serve it with --model\)"):
        load_video_model(args)


def test_torchrun_two_ranks_serve_videos(dirs, tmp_path):
    """torchrun, 2 gloo ranks, --sp 2: rank 0 serves /v1/videos, both ranks run the sequence-parallel Wan call,
    and the clip equals the single-process one (its first frame compared losslessly through the thumbnail)."""
    from diffusers import DiffusionPipeline

    from omni_accel.serve.engine import LoadedModel
    from omni_accel.serve.videos import run_video_spec
    from omni_accel.video_io import frames_to_array

    port = free_port()
    log = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "omni_accel", "-v", "serve", "--model", dirs["flux"], "--video-model", dirs["wan"], "--port",
           str(port), "--no-warmup", "--device", "cpu", "--sp", "2"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_healthy(url, proc)["world_size"] == 2
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        made = c.videos.create_and_poll(prompt="a cat walks on grass", size="32x32", poll_interval_ms=200,
                                        extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 5})
        assert made.status == "completed", made.error
        served = mp4_frames(c.videos.download_content(made.id).content)
        first = np.asarray(Image.open(io.BytesIO(c.videos.download_content(made.id, variant="thumbnail").content)))
        deadline = time.time() + 30
        while "rank 1 ran batch 1 (video" not in log.read_text() and time.time() < deadline:
            time.sleep(0.2)
    finally:
        stop_process_group(proc, 30)
    text = log.read_text()
    assert "rank 1 ran batch 1 (video" in text, text[-3000:]
    assert len(re.findall(r"omni_accel on WanPipeline \(wan\): [a-z_, ]*sequence_parallel", text)) == 2, text[-3000:]
    single = LoadedModel.from_pipeline(DiffusionPipeline.from_pretrained(dirs["wan"]), "single")
    spec = {"prompt": "a cat walks on grass", "width": 32, "height": 32, "num_frames": 5, "steps": 2, "seed": 5}
    reference = frames_to_array(run_video_spec(single, spec)).astype(np.int16)
    assert served.shape == (5, 32, 32, 3)
    # the thumbnail is the first frame, losslessly: 2 ranks give the single-process frame up to fp32 summation order
    assert np.abs(first.astype(np.int16) - reference[0]).max() <= 1


@pytest.mark.skipif(not os.path.isfile(os.path.join(os.path.dirname(__file__), "..", "omni_accel", "builtin",
                                                    "video_model", "model_index.json")),
                    reason="the trained video weights are not in this tree")
def test_openai_client_against_the_builtin_video_model(dirs):
    """`serve --video-model builtin`: /v1/models lists it, create_and_poll with the defaults gives a 17-frame 64x64
    MP4 in which the shape moves the captioned way over the captioned background."""
    from omni_accel.builtin import video_metric as VM
    from omni_accel.cli import build_parser
    from omni_accel.serve.server import load_model
    from omni_accel.serve.videos import BUILTIN_VIDEO_ID, load_video_model

    argv = ["--model", dirs["flux"], "--video-model", "builtin", "--device", "cpu", "--api-key", API_KEY]
    args = build_parser().parse_args(["serve", *argv])
    caption = "a red circle moving from left to right on a blue background"
    with ThreadServer(load_model(args), argv, video_model=load_video_model(args)) as server:
        c = client(server.url)
        assert BUILTIN_VIDEO_ID in [m.id for m in c.models.list()]
        video = c.videos.create_and_poll(model=BUILTIN_VIDEO_ID, prompt=caption, poll_interval_ms=100,
                                         extra_body={"seed": 0})
        assert video.status == "completed"
        frames = mp4_frames(c.videos.download_content(video.id).content)
    assert frames.shape == (17, 64, 64, 3)
    score = VM.score(frames.clip(0, 255).astype(np.uint8), caption)
    assert score["bg_color"] and score["direction"], score
