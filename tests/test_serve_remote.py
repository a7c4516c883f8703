"""The ingress / replica protocol of serve/remote.py without Ray: a RemoteQueue (the ingress side) wired in-process
to replica_events over a real JobQueue (the replica side), plus the --ray flags. No model, no cluster: seconds."""

from __future__ import annotations

import asyncio
import base64
import os
import sys

import pytest

from omni_accel.serve.errors import ApiError, pipeline_failure
from omni_accel.serve.jobs import (CANCELLED, COMPLETED, FAILED, Aborted, Job, JobKind, JobQueue, QueueFull,
                                   ShuttingDown, Stream)
from omni_accel.serve.metrics import ServeMetrics
from omni_accel.serve.remote import RemoteQueue, replica_events
from test_serve_jobs import Echo, Steps, metric
from test_speech import omni_path  # noqa: F401 -- the tiny Qwen2.5-Omni folder (a module fixture)


class Died(Exception):
    """What the transport raises when the replica's process is gone (Ray: ActorDiedError)."""


class Link:
    """``send`` of a RemoteQueue: runs ``replica_events`` on the replica's queue in a task of its own (as a Ray Serve
    replica does) and hands the events over; ``cancel()`` cancels that task, as Ray cancels the replica's call.
    ``die_before``: for the first sends, the replica dies before it runs anything; ``die_after_start``: it dies
    right after reporting the job's start."""

    def __init__(self, replica: JobQueue, die_before: int = 0, die_after_start: bool = False):
        self.replica, self.die_before, self.die_after_start = replica, die_before, die_after_start
        self.sends = 0

    def __call__(self, fields: dict):
        self.sends += 1
        return _Call(self, fields, dead=self.sends <= self.die_before)


class _Call:
    def __init__(self, link: Link, fields: dict, dead: bool):
        self.link, self.fields, self.dead = link, fields, dead
        self.events: asyncio.Queue = asyncio.Queue()
        self.task = None if dead else asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self):
        async for event in replica_events(self.link.replica, self.fields, poll_s=0.01):
            await self.events.put(event)
        await self.events.put(None)

    def cancel(self):
        if self.task is not None:
            self.task.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.dead:
            if self.task is not None:
                self.task.cancel()  # the process is gone: its jobs with it
            raise Died("replica process gone")
        event = await self.events.get()
        if event is None:
            raise StopAsyncIteration
        self.dead = self.link.die_after_start and event["event"] == "progress"  # gone once it started
        return event


def wired(executor=None, *, kind=None, capacity=10, **link):
    """(ingress RemoteQueue, replica JobQueue, link, executor, ingress metrics)."""
    executor = executor or Steps()
    kind = kind or Echo()
    replica = JobQueue("r", executor, max_queue=50, max_batch=3)
    replica.kinds[kind.name] = kind
    replica.accepts_results = False  # as on a Ray Serve replica
    template = JobQueue("r", None, max_queue=8, max_batch=3, metrics=ServeMetrics())
    template.kinds[kind.name] = type(kind)()
    connection = Link(replica, **link)
    ingress = RemoteQueue(template, connection, capacity=lambda: capacity, lost=(Died,))
    return ingress, replica, connection, executor, template.metrics


async def settled(job: Job, timeout: float = 10.0):
    await asyncio.wait_for(asyncio.wrap_future(job.future), timeout)


async def until(condition, timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


def test_jobs_run_batched_on_the_replica_queue_with_progress_and_results():
    """Jobs admitted on the ingress run on the replica's own JobQueue: equal keys share one call there, progress
    and results come back, and the ingress counts them in the usual metrics."""

    async def main():
        ingress, replica, _, executor, metrics = wired()
        kind = ingress.kinds["echo"]
        first = ingress.submit(Job(kind=kind, route="/r", params="first"))
        assert await until(lambda: ingress.running == 1)  # started on the replica (its worker waits at the gate)
        jobs = [ingress.submit(Job(kind=kind, route="/r", params=f"a{i}", key="k")) for i in range(3)]
        assert await until(lambda: replica.queue_depth == 3) and ingress.queue_depth == 3
        executor.gate.set()
        for job in [first, *jobs]:
            await settled(job)
        assert executor.calls == [["first"], ["a0", "a1", "a2"]]  # batched by the replica's queue
        assert [job.future.result() for job in jobs] == [f"a{i}: 3 in the call" for i in range(3)]
        assert all(job.status == COMPLETED and job.progress == 100 for job in jobs)
        assert ingress.queue_depth == ingress.running == 0
        assert metric(metrics, "omni_accel_jobs_total", route="/r", outcome="completed") == 4
        assert ingress.seconds_per_cost("echo") is not None  # measured on the replica, known to the ingress
        replica.stop(5)

    asyncio.run(main())


class Talk(JobKind):
    """A streamed kind (speech-like): the call emits items, the job's result is None."""

    name = "talk"

    def spec(self, batch):
        return {"words": batch[0].params}


def test_stream_items_reach_the_ingress_job_in_order():
    def speak(spec, control):
        for word in spec["words"]:
            control.emit(word)
        return None

    async def main():
        ingress, replica, *_ = wired(speak, kind=Talk())
        job = ingress.submit(Job(kind=ingress.kinds["talk"], route="/t", params=["one", "two", "three"],
                                 stream=Stream()))
        words = []
        while (item := await job.stream.get(5)) is not Stream.END:
            words.append(item)
        assert words == ["one", "two", "three"] and job.status == COMPLETED
        replica.stop(5)

    asyncio.run(main())


def test_cancel_on_the_ingress_cancels_on_the_replica():
    """A queued job cancelled on the ingress never runs on the replica; a running one is aborted there at its next
    step (its call's only job left)."""

    async def main():
        executor = Steps(steps=500, seconds=0.01)
        ingress, replica, _, _, metrics = wired(executor)
        kind = ingress.kinds["echo"]
        running = ingress.submit(Job(kind=kind, route="/r", params="running"))
        waiting = ingress.submit(Job(kind=kind, route="/r", params="waiting", key="other"))
        executor.gate.set()
        assert await until(lambda: running.progress >= 1)  # progress crosses over while it runs
        assert ingress.cancel(waiting, "disconnect") == "queued" and waiting.status == CANCELLED
        assert ingress.cancel(running, "timeout") == "running" and running.status == CANCELLED
        assert await until(lambda: replica.running == 0 and replica.queue_depth == 0)
        assert executor.calls == [["running"]]  # the cancelled queued job never ran; the running call stopped
        assert metric(metrics, "omni_accel_cancelled_requests_total", reason="timeout", stage="running") == 1
        replica.stop(5)

    asyncio.run(main())


def test_a_full_system_refuses_with_retry_after_and_a_drain_ends_admission():
    async def main():
        executor = Steps(steps=10, seconds=0.05)
        ingress, replica, _, _, metrics = wired(executor, capacity=2)
        kind = ingress.kinds["echo"]
        executor.gate.set()
        await settled(ingress.submit(Job(kind=kind, route="/r", params="measure")))
        held = [ingress.submit(Job(kind=kind, route="/r", params=f"h{i}")) for i in range(2)]
        with pytest.raises(QueueFull) as refused:
            ingress.submit(Job(kind=kind, route="/r", params="one too many"))
        assert refused.value.retry_after >= 1
        assert metric(metrics, "omni_accel_jobs_total", route="/r", outcome="rejected") == 1
        for job in held:
            await settled(job)
        ingress.drain()
        with pytest.raises(ShuttingDown):
            ingress.submit(Job(kind=kind, route="/r", params="late"))
        replica.stop(5)

    asyncio.run(main())


@pytest.mark.parametrize("deaths, after_start, resent, outcome", [
    (1, False, 1, COMPLETED),  # gone before it started: sent once more, answered
    (2, False, 1, FAILED),  # gone twice before it started: 503
    (0, True, 0, FAILED),  # gone after it started: 503, never sent again
])
def test_a_lost_replica_resends_an_unstarted_job_once_else_503_with_retry_after(deaths, after_start, resent,
                                                                                 outcome):
    async def main():
        executor = Steps()
        ingress, replica, link, *_ = wired(executor, die_before=deaths, die_after_start=after_start)
        executor.gate.set()
        job = ingress.submit(Job(kind=ingress.kinds["echo"], route="/r", params="x"))
        await asyncio.wait({asyncio.wrap_future(job.future)}, timeout=10)
        assert job.status == outcome and ingress.resent == resent
        if outcome == FAILED:
            error = pipeline_failure(job.error)
            assert error.status == 503 and error.code == "replica_unavailable"
            assert int(error.headers["Retry-After"]) >= 1
            assert ("while it ran" in error.message) == after_start
        assert ingress.queue_depth == ingress.running == 0
        replica.stop(5)

    asyncio.run(main())


class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")

    def __reduce__(self):
        raise TypeError("no")


@pytest.mark.parametrize("raised, status, text", [
    (ValueError("height must be divisible by 16"), 400, "refused the request: height must be divisible by 16"),
    (Unpicklable(1, 2), 500, "RuntimeError: Unpicklable: 1/2"),
])
def test_a_failure_on_the_replica_is_answered_as_the_single_server_answers_it(raised, status, text):
    def fail(spec, control):
        raise raised

    async def main():
        ingress, replica, *_ = wired(fail)
        job = ingress.submit(Job(kind=ingress.kinds["echo"], route="/r", params="x"))
        await asyncio.wait({asyncio.wrap_future(job.future)}, timeout=10)
        error = pipeline_failure(job.error)
        assert job.status == FAILED and error.status == status and text in error.message
        replica.stop(5)

    asyncio.run(main())


class Stored(Echo):
    """A kind whose jobs' results are taken in where the job lives (videos: the ingress's store)."""

    name = "stored"

    def __init__(self):
        self.store = {}

    def accept(self, job, result):
        self.store[job.id] = result
        return "stored"


def test_the_ingress_kind_takes_the_result_in():
    async def main():
        executor = Steps()
        ingress, replica, *_ = wired(executor, kind=Stored())
        executor.gate.set()
        job = ingress.submit(Job(kind=ingress.kinds["stored"], route="/v", params="clip"))
        await settled(job)
        assert job.future.result() == "stored"
        assert ingress.kinds["stored"].store == {job.id: "clip: 1 in the call"}
        assert replica.kinds["stored"].store == {}  # the replica's kind instance never kept it
        replica.stop(5)

    asyncio.run(main())


def test_an_aborted_call_on_the_replica_cancels_the_ingress_job_as_a_drained_replica():
    """The replica ended a job without our asking (its group broke, or it drained): resent when not started."""

    def abort(spec, control):
        raise Aborted()

    async def main():
        ingress, replica, link, *_ = wired(abort)
        job = ingress.submit(Job(kind=ingress.kinds["echo"], route="/r", params="x"))
        await asyncio.wait({asyncio.wrap_future(job.future)}, timeout=10)
        assert job.status == FAILED and pipeline_failure(job.error).status == 503
        assert link.sends == 1  # it had started: not sent again
        replica.stop(5)

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ flags
def device_plan_cases():
    return [
        ([("n1", ["0"]), ("n1", ["1"])], [("0,1", 0), ("0,1", 1)]),
        ([("n1", ["3"]), ("n1", ["1"]), ("n2", ["0"])], [("1,3", 1), ("1,3", 0), ("0", 0)]),
        ([("n1", []), ("n1", [])], [(None, 0), (None, 0)]),
    ]


@pytest.mark.parametrize("places, plan", device_plan_cases())
def test_device_plan_shows_each_node_its_group_gpus_and_picks_by_local_rank(places, plan):
    from omni_accel.serve.ray_group import device_plan, rank_env

    assert device_plan(places) == plan
    env = rank_env(1, 2, ("10.0.0.1", 29500), *plan[1])
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "29500"
    assert ("CUDA_VISIBLE_DEVICES" in env) == (plan[1][0] is not None)


def serve_cli(capsys, *argv: str) -> tuple[int, str]:
    from omni_accel.cli import main

    code = main(["serve", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "2"], "error: --replicas: Ray Serve flag(s); add --ray to serve through Ray Serve"),
    (["--ray", "--autoscale", "3:1"], "error: --autoscale '3:1' is invalid: it needs 0 <= MIN <= MAX and MAX >= 1."),
    (["--ray", "--autoscale", "two"], "error: --autoscale 'two' is not MIN:MAX"),
    (["--ray", "--replicas", "0"], "error: --replicas 0 is invalid: it must be >= 1"),
    (["--ray", "--gpus-per-replica", "2"], "error: the parallel degrees make a group of 1 process(es) but "
                                           "--gpus-per-replica is 2: set --gpus-per-replica 1, or degrees whose "
                                           "product is 2 (e.g. --sp 2)."),
    (["--ray", "--target-ongoing-requests", "2"], "error: --target-ongoing-requests / --upscale-delay / "
                                                   "--downscale-delay apply to --autoscale MIN:MAX"),
    (["--ray", "--enable-sleep-mode"], "error: --enable-sleep-mode is not offered with --ray: use --autoscale 0:N "
                                       "instead"),
])
def test_bad_ray_flags_are_refused_before_anything_starts(capsys, argv, message):
    code, err = serve_cli(capsys, *argv)
    assert code != 0 and message in err, err


def test_serve_ray_without_ray_names_the_extra(capsys, monkeypatch):
    for name in ("ray", "ray.serve"):
        monkeypatch.setitem(sys.modules, name, None)  # as if Ray were not installed
    code, err = serve_cli(capsys, "--ray")
    assert code != 0
    assert "error: omni-accel serve --ray needs Ray Serve, which is not installed: pip install 'omni-accel[ray]'" in err


def test_ray_serve_application_arguments_are_the_serve_flags():
    """``serve run omni_accel.serve.ray_app:build key=value ...`` and a config file's ``args:`` give the same flags
    as the command line (switches as true/false, lists repeat a flag)."""
    from omni_accel.serve.ray_app import parse_arguments, replica_options

    args = parse_arguments({"replicas": "2", "max_queue": "3", "no-warmup": "true", "compile": "off",
                            "replica-cpus": "0.5", "api_key": "k", "vae_tiling": "false"})
    assert args.ray and args.replicas == 2 and args.max_queue == 3 and args.no_warmup and not args.vae_tiling
    assert args.replica_cpus == 0.5 and args.api_key == "k"
    options = replica_options(args)
    assert options["num_replicas"] == 2 and options["max_ongoing_requests"] == 3 + 4
    assert options["ray_actor_options"]["num_cpus"] == 0.5
    scaled = replica_options(parse_arguments(["--autoscale", "0:4", "--target-ongoing-requests", "2",
                                              "--downscale-delay", "5", "--device", "cpu"]))
    assert scaled["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 1,
                                            "target_ongoing_requests": 2.0, "downscale_delay_s": 5.0}
    group = replica_options(parse_arguments(["--gpus-per-replica", "2", "--sp", "2", "--device", "cpu",
                                             "--placement-strategy", "SPREAD"]))
    assert group["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert group["placement_group_strategy"] == "SPREAD"
    with pytest.raises(Exception, match="are not omni-accel serve flags"):
        parse_arguments({"no_such_flag": "1"})


# ------------------------------------------------------------------------------------------------ the ingress app
def test_the_ingress_app_over_remote_queues_serves_images_and_videos(tmp_path):
    """The app a Ray Serve ingress builds -- the single server's build_app over RemoteQueues, from models described
    without their pipelines (pickled, as they cross to the ingress) -- with in-process replica queues behind it:
    images with the openai client, and a video job polled to completion whose MP4 the ingress's store keeps."""
    import pickle
    import threading

    import openai

    from omni_accel.cli import build_parser
    from omni_accel.serve.server import ServedModels, build_app, make_queues, uvicorn_server, video_store
    from test_serve import free_port, wait_healthy
    from test_serve_videos import load

    dirs = {}
    for family in ("flux", "wan"):
        from omni_accel.testing import tiny_pipeline

        dirs[family] = str(tmp_path / family)
        tiny_pipeline(family)[0].save_pretrained(dirs[family])
    argv, image, video = load(dirs, "wan", "--max-frames", "9", "--max-request-cost", "0.05", "--port",
                              str(free_port()))
    args = build_parser().parse_args(["serve", *argv])
    models = ServedModels(image=image, video=video)
    replica = make_queues(args, models, ServeMetrics(), headroom=8)  # the replica: the pipelines, no store
    for queue in replica.values():
        queue.accepts_results = False
        queue.start()
    described = pickle.loads(pickle.dumps(models.without_pipelines()))
    assert described.image.pipe is None and described.video.pipeline_class == video.pipeline_class
    metrics = ServeMetrics()
    store = video_store(args, described)
    remote = {name: RemoteQueue(template, Link(replica[name]), capacity=lambda: 8)
              for name, template in make_queues(args, described, metrics, store=store).items()}
    app = build_app(args, described, remote, metrics, store=store,
                    replicas=lambda: {"running": 1, "starting": 0, "stopping": 0})
    server = uvicorn_server(app, args, drains=list(remote.values()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{args.port}"
    try:
        assert wait_healthy(url, timeout=30)["replicas"] == {"running": 1, "starting": 0, "stopping": 0}
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        result = client.images.generate(prompt="a red star", size="32x32", extra_body={"seed": 1,
                                                                                     "num_inference_steps": 2})
        assert base64.b64decode(result.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"
        job = client.videos.create_and_poll(prompt="a cat", size="32x32", extra_body={"num_frames": 5,
                                                                                       "num_inference_steps": 2})
        assert job.status == "completed" and job.progress == 100
        mp4 = client.videos.download_content(job.id).content
        assert mp4[4:8] == b"ftyp" and os.path.exists(store.path(job.id))  # kept where the job lives
    finally:
        server.should_exit = True
        thread.join(10)
        for queue in replica.values():
            queue.stop(5)
        store.close()


def test_the_ingress_app_over_remote_queues_speaks_wav_streamed_pcm_and_chats(omni_path):
    """Speech through a speech-only ingress app over a RemoteQueue (the tiny Qwen2.5-Omni on the transformers
    engines in an in-process replica queue): a wav, a PCM stream arriving in several pieces that join into the wav's
    samples (the streaming tolerance of docs/speech.md), and an omni chat answer in text."""
    import io
    import pickle
    import threading
    import wave

    import openai
    import torch

    from omni_accel.ar_bridge.speech import SpeechPipeline
    from omni_accel.cli import build_parser
    from omni_accel.serve.server import ServedModels, build_app, make_queues, uvicorn_server
    from test_serve import free_port, wait_healthy

    args = build_parser().parse_args(["serve", "--speech-model", str(omni_path), "--speech-engine", "transformers",
                                      "--speech-greedy", "--speech-max-codes", "48", "--port", str(free_port())])
    with SpeechPipeline(str(omni_path), engine="transformers") as pipeline:
        models = ServedModels(speech=pipeline)
        replica = make_queues(args, models, ServeMetrics(), headroom=4)
        for queue in replica.values():
            queue.accepts_results = False
            queue.start()
        described = pickle.loads(pickle.dumps(models.without_pipelines()))
        assert described.speech.voices == pipeline.voices
        metrics = ServeMetrics()
        remote = {name: RemoteQueue(template, Link(replica[name]), capacity=lambda: 4)
                  for name, template in make_queues(args, described, metrics).items()}
        server = uvicorn_server(build_app(args, described, remote, metrics), args, drains=list(remote.values()))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{args.port}"
        try:
            wait_healthy(url, timeout=30)
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
            text = "hello there"
            audio = client.audio.speech.create(model="tiny", input=text, voice="Ethan", response_format="wav")
            with wave.open(io.BytesIO(audio.content)) as w:
                whole = torch.frombuffer(bytearray(w.readframes(w.getnframes())), dtype=torch.int16).to(torch.int32)
            with client.audio.speech.with_streaming_response.create(model="tiny", input=text, voice="Ethan",
                                                                    response_format="pcm") as response:
                pieces = list(response.iter_bytes())
            joined = torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.int16).to(torch.int32)
            peak = whole.abs().max().item()
            assert len(pieces) > 1 and joined.shape == whole.shape and peak > 1000
            assert (joined - whole).abs().max().item() <= 1e-3 * peak + 1
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}])
            assert isinstance(reply.choices[0].message.content, str) and reply.usage.completion_tokens > 0
        finally:
            server.should_exit = True
            thread.join(10)
            for queue in replica.values():
                queue.stop(5)
