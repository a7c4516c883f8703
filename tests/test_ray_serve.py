"""`omni-accel serve --ray` on a real local Ray cluster (2 CPUs, no dashboard), shared by every test of this module:
the built-in model in two replicas behind the ingress (the official openai client, the API key, /health and
/metrics, 429 across replicas, a replica killed under load), a replica of two gloo processes (--sp 2) that answers
the single-process image and is replaced when a rank dies, and autoscaling up and down with a drain. The
applications replace one another on the cluster (one at a time: two CPUs). About 2-3 minutes."""

from __future__ import annotations

import base64
import io
import os
import signal
import sys
import threading
import time

import httpx
import pytest
import ray
from ray import serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.ray_load import deploy, free_port, health, load, prompt, replica_pids, wait_running  # noqa: E402

KEY = "ray-test-key"
GEN = "/v1/images/generations"
REPLICA_FLAGS = ["--device", "cpu", "--replica-cpus", "0.5", "--no-warmup"]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster and Serve's HTTP proxy on a free port for the whole module."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


def lora_flags() -> list[str]:
    from omni_accel.builtin import builtin_lora_path

    return ["--lora", f"swap={builtin_lora_path()}", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def two_replicas(cluster):
    """The built-in model (with the built-in LoRA adapter as model 'swap') in two replicas."""
    url = deploy(["--replicas", "2", "--max-queue", "2", "--max-concurrency", "2", "--api-key", KEY, *lora_flags(),
                  *REPLICA_FLAGS], cluster)
    assert wait_running(url, 2, 60) is not None
    return url


def single_process_pixels(seed: int, size: int = 64, steps: int = 4, argv=()):
    """The image one `omni-accel serve` process would answer: the model loaded as the server loads it."""
    import numpy as np

    from omni_accel.cli import build_parser
    from omni_accel.serve.engine import run_spec
    from omni_accel.serve.server import load_model

    model = load_model(build_parser().parse_args(["serve", "--device", "cpu", *argv]))
    spec = {"op": "generate", "prompts": [prompt(seed)], "negative_prompts": None, "seeds": [seed], "width": size,
            "height": size, "steps": steps, "guidance_scale": model.defaults.get("guidance_scale"),
            "true_cfg_scale": None, "images": []}
    return np.asarray(run_spec(model, spec)[0], dtype=np.int16)


def pixels(b64: str):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def test_openai_client_gets_the_single_server_image_through_the_ray_endpoint(two_replicas):
    from openai import AuthenticationError, OpenAI

    client = OpenAI(base_url=two_replicas + "/v1", api_key=KEY, max_retries=0)
    result = client.images.generate(prompt=prompt(7), size="64x64", extra_body={"seed": 7, "num_inference_steps": 4})
    got = pixels(result.data[0].b64_json)
    assert got.shape == (64, 64, 3) and result.data[0].seed == 7
    assert abs(got - single_process_pixels(7, argv=lora_flags())).max() <= 1  # what a single server runs
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"omni-accel-builtin", "swap"} and cards["swap"].parent == "omni-accel-builtin"
    with pytest.raises(AuthenticationError):  # the ingress keeps the API key
        OpenAI(base_url=two_replicas + "/v1", api_key="wrong", max_retries=0).models.list()


def test_per_request_lora_and_images_through_chat_completions_on_the_replicas(two_replicas):
    """The chat route and per-request LoRA of the single server, through the ingress: the adapter (by model name)
    changes the image as trained -- the background takes the shape's colour -- in chat and image answers alike;
    sleep mode is off under Ray (400)."""
    from openai import OpenAI

    from omni_accel.builtin.metric import analyze
    from PIL import Image

    client = OpenAI(base_url=two_replicas + "/v1", api_key=KEY, max_retries=0, timeout=120)
    text = "a large red circle in the center on a blue background"
    extra = {"height": 128, "width": 128, "num_inference_steps": 8, "seed": 3}
    chat = client.chat.completions.create(model="swap", messages=[{"role": "user", "content": text}],
                                          extra_body=extra)
    (part,) = chat.choices[0].message.content
    swapped = part["image_url"]["url"].split(",", 1)[1]
    image = lambda **body: client.images.generate(prompt=text, size="128x128", extra_body={  # noqa: E731
        "seed": 3, "num_inference_steps": 8, **body}).data[0].b64_json
    assert swapped == image(lora={"name": "swap"})
    background = lambda b64: analyze(Image.open(io.BytesIO(base64.b64decode(b64))))["bg"]  # noqa: E731
    assert background(swapped) == "red" and background(image()) == "blue"
    r = httpx.post(two_replicas + "/sleep", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "sleep_mode_disabled"


def test_health_and_metrics_report_the_replicas(two_replicas):
    body = health(two_replicas)
    assert body["status"] == "ok" and body["replicas"] == {"running": 2, "starting": 0, "stopping": 0}
    metrics = httpx.get(two_replicas + "/metrics").text
    assert 'omni_accel_replicas{state="running"} 2.0' in metrics


def test_queue_full_429_only_once_every_replica_is_full(two_replicas):
    """Two replicas of --max-queue 2 and --max-concurrency 2 hold 8 requests; 14 slow ones at once: the first 8
    are served, the others answered 429 queue_full with Retry-After, as a full single server answers."""
    body = lambda i: {"prompt": prompt(i), "size": "128x128", "num_inference_steps": 40, "seed": i}  # noqa: E731
    outcome = load(two_replicas, 14, 14, body, headers={"Authorization": f"Bearer {KEY}"})
    statuses = outcome.statuses()
    assert set(statuses) == {"200", "429"}, statuses
    assert statuses["200"] >= 8  # no 429 while a replica had room
    refused = [a for a in outcome.answers if a[0] == 429]
    assert all(a[1] and a[4] == "queue_full" for a in refused)


def test_a_replica_killed_under_load_every_request_answered_and_it_comes_back(cluster):
    """The short CI run of benchmarks/bench_ray_failover.py: 40 requests from 8 clients, one replica SIGKILLed
    after 30 % of them: every request is answered 200, or 503 with Retry-After; the replica is back within 60 s."""
    from benchmarks import bench_ray_failover

    result = bench_ray_failover.run(bench_ray_failover.parse_args(["--requests", "40", "--concurrency", "8",
                                                                   "--replica-cpus", "0.5"]), port=cluster)
    assert set(result["statuses"]) <= {"200", "503"}, result
    assert result["status_503_with_retry_after"] == result["statuses"].get("503", 0)
    assert not result["no_answer"] and result["other_answers"] == 0
    assert result["replica_back_after_s"] is not None and result["replica_back_after_s"] <= 60, result
    assert result["statuses"].get("200", 0) >= 30


def test_a_two_process_gloo_replica_answers_the_single_process_image_and_a_dead_rank_replaces_it(cluster):
    url = deploy(["--gpus-per-replica", "2", "--sp", "2", *REPLICA_FLAGS], cluster)
    request = {"prompt": prompt(3), "size": "64x64", "num_inference_steps": 4, "seed": 3}
    r = httpx.post(url + GEN, json=request, timeout=120)
    assert r.status_code == 200, r.text
    assert abs(pixels(r.json()["data"][0]["b64_json"]) - single_process_pixels(3)).max() <= 1
    assert health(url)["world_size"] == 2
    (rank0, follower), = replica_pids(count=1)
    t0 = time.monotonic()
    os.kill(follower, signal.SIGKILL)
    while time.monotonic() - t0 < 30:  # the group ends within 30 s and Ray Serve starts a new one
        if not os.path.exists(f"/proc/{rank0}") or open(f"/proc/{rank0}/status").read().count("zombie"):
            break
        time.sleep(0.2)
    ended_s = time.monotonic() - t0
    assert ended_s < 30, "rank 0 outlived its dead follower by 30 s"
    assert wait_running(url, 1, 90) is not None
    (new_rank0, new_follower), = replica_pids(count=1)
    assert {new_rank0, new_follower}.isdisjoint({rank0, follower})
    r = httpx.post(url + GEN, json=request, timeout=120)
    assert r.status_code == 200 and abs(pixels(r.json()["data"][0]["b64_json"]) - single_process_pixels(3)).max() <= 1


def test_autoscaling_adds_a_replica_under_load_and_drains_one_as_the_load_falls(cluster):
    """--autoscale 1:2 aiming at 1 ongoing request per replica (Ray Serve's metrics sped up, as a Serve config file
    may): 6 clients make it 2 replicas; one client alone (below the target of 2 replicas) makes it 1 again while
    that client keeps sending -- the replica going away finishes what it holds: every request is answered 200."""
    fast = {"autoscaling_config": {"metrics_interval_s": 0.5, "look_back_period_s": 2.0}}
    url = deploy(["--autoscale", "1:2", "--target-ongoing-requests", "1", "--upscale-delay", "0",
                  "--downscale-delay", "2", *REPLICA_FLAGS], cluster, replica=fast)
    body = lambda i: {"prompt": prompt(i), "size": "64x64", "num_inference_steps": 8, "seed": i}  # noqa: E731
    states = {}

    def replicas_are(count: int):
        def reached() -> bool:
            states.update(health(url).get("replicas") or {})
            return states.get("running") == count and not states.get("starting") and not states.get("stopping")
        return reached

    t0 = time.monotonic()
    up = load(url, 2000, 6, body, until=lambda: replicas_are(2)() or time.monotonic() - t0 > 90)
    assert states["running"] == 2, states
    t1 = time.monotonic()
    down = load(url, 2000, 1, body, until=lambda: replicas_are(1)() or time.monotonic() - t1 > 90)
    assert states["running"] == 1 and not states["stopping"], states
    assert set(up.statuses()) == {"200"} and set(down.statuses()) == {"200"}
    assert not up.errors and not down.errors


def test_the_serve_ray_command_deploys_on_a_cluster_and_a_sigterm_deletes_its_application(cluster):
    """``omni-accel serve --ray --ray-address ADDR`` on the running cluster: it serves, and SIGTERM deletes its
    application (replicas drained) and exits 0, leaving the cluster it did not start running."""
    import subprocess

    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-m", "omni_accel", "serve", "--ray", "--ray-address", address,
                             "--port", str(cluster), *REPLICA_FLAGS], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # keep the pipe drained
    try:
        t0 = time.monotonic()
        while not any("omni-accel serve: Ray Serve" in line for line in lines):
            assert proc.poll() is None and time.monotonic() - t0 < 120, "".join(lines[-20:])
            time.sleep(0.2)
        url = f"http://127.0.0.1:{cluster}"
        r = httpx.post(url + GEN, json={"prompt": prompt(1), "size": "64x64", "num_inference_steps": 2}, timeout=60)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "omni-accel" not in serve.status().applications
        assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2  # the cluster lives on
    finally:
        if proc.poll() is None:
            proc.kill()
