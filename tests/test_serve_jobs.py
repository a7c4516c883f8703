"""The job mechanism of omni-accel serve (omni_accel/serve/jobs.py) on its own: batching keys, progress,
cancellation, drain, Retry-After and the metrics family labelled by route. No model, no HTTP: a few seconds."""

from __future__ import annotations

import re
import threading
import time

import pytest

from omni_accel.serve.jobs import (CANCELLED, COMPLETED, Aborted, Job, JobKind, JobQueue, QueueFull, ShuttingDown)
from omni_accel.serve.metrics import ServeMetrics
from test_serve import wait_until


class Echo(JobKind):
    name = "echo"

    def spec(self, batch):
        return {"names": [job.params for job in batch]}

    def finish(self, batch, output, seconds):
        return [f"{job.params}: {len(batch)} in the call" for job in batch]


class Steps:
    """An executor that runs ``steps`` steps of ``seconds`` each, reports progress and stops when told to; it waits
    for ``gate`` before its first call so that jobs can pile up."""

    def __init__(self, steps=4, seconds=0.02):
        self.steps, self.seconds, self.calls = steps, seconds, []
        self.gate = threading.Event()

    def __call__(self, spec, control):
        self.gate.wait(10)
        self.calls.append(spec["names"])
        for i in range(self.steps):
            if control():
                raise Aborted()
            time.sleep(self.seconds)
            control.progress(i + 1, self.steps)
        return None


def metric(metrics: ServeMetrics, name: str, **labels) -> float:
    text = metrics.render().decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}\{{{re.escape(wanted)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def queue():
    executor, metrics = Steps(), ServeMetrics()
    q = JobQueue("test", executor, max_queue=8, max_batch=3, metrics=metrics)
    yield q, executor, metrics
    executor.gate.set()
    q.stop(5)


def test_jobs_batch_only_with_equal_keys_and_report_progress(queue):
    """Equal keys of one kind share a call (up to max_batch); another key -- another LoRA adapter, another image
    size -- never does; None runs alone. Every job ends at progress 100 with its own result."""
    q, executor, metrics = queue
    kind = Echo()
    jobs = [q.submit(Job(kind=kind, route="/r", params="a1", key="lora-a"))]
    assert wait_until(lambda: q.running == 1)  # a1 is taken alone before the others come
    jobs += [q.submit(Job(kind=kind, route="/r", params=name, key=key))
             for name, key in [("b1", "lora-b"), ("a2", "lora-a"), ("n1", None), ("a3", "lora-a"), ("a4", "lora-a")]]
    executor.gate.set()
    results = [job.future.result(10) for job in jobs]
    assert executor.calls == [["a1"], ["b1"], ["a2", "a3", "a4"], ["n1"]]
    assert results[2] == "a2: 3 in the call" and results[1] == "b1: 1 in the call"
    assert all(job.status == COMPLETED and job.progress == 100 for job in jobs)
    assert metric(metrics, "omni_accel_jobs_total", route="/r", outcome="completed") == 6
    assert metric(metrics, "omni_accel_jobs_queued", route="/r") == 0


def test_cancel_drops_a_queued_job_and_aborts_a_call_whose_jobs_all_left(queue):
    q, executor, metrics = queue
    executor.steps, executor.seconds = 200, 0.01
    kind = Echo()
    running = q.submit(Job(kind=kind, route="/r", params="running"))
    waiting = q.submit(Job(kind=kind, route="/r", params="waiting"))
    executor.gate.set()
    assert wait_until(lambda: running.progress >= 2)  # progress moves while it runs
    assert q.cancel(waiting, "deleted") == "queued" and waiting.status == CANCELLED
    assert q.cancel(running, "deleted") == "running"
    assert q.cancel(running, "deleted") is None  # counted once
    assert wait_until(lambda: running.status == CANCELLED) and running.progress < 100
    assert executor.calls == [["running"]]  # the cancelled queued job never ran
    assert metric(metrics, "omni_accel_cancelled_requests_total", reason="deleted", stage="queued") == 1
    assert metric(metrics, "omni_accel_cancelled_requests_total", reason="deleted", stage="running") == 1
    assert metric(metrics, "omni_accel_jobs_total", route="/r", outcome="cancelled") == 2


def test_full_queue_refuses_with_the_running_calls_remaining_time_and_drain_ends_the_queue(queue):
    q, executor, metrics = queue
    executor.steps, executor.seconds = 10, 0.1  # 1 s a call
    kind = Echo()
    executor.gate.set()
    q.submit(Job(kind=kind, route="/r", params="measured", cost=2.0)).future.result(10)
    running = q.submit(Job(kind=kind, route="/r", params="running", cost=2.0))
    assert wait_until(lambda: q.running == 1)
    waiting = [q.submit(Job(kind=kind, route="/r", params=f"w{i}", cost=2.0)) for i in range(q.max_queue)]
    with pytest.raises(QueueFull) as refused:
        q.submit(Job(kind=kind, route="/r2", params="one too many"))
    assert refused.value.retry_after == 1  # <= 1 s of the running call is left
    assert metric(metrics, "omni_accel_jobs_total", route="/r2", outcome="rejected") == 1
    assert metric(metrics, "omni_accel_jobs_queued", route="/r") == q.max_queue
    q.drain()
    assert all(job.status == CANCELLED and job.future.cancelled() for job in waiting)  # at once
    with pytest.raises(ShuttingDown):
        q.submit(Job(kind=kind, route="/r", params="late"))
    assert q.wait_idle(5) and running.status == COMPLETED
    assert metric(metrics, "omni_accel_jobs_queued", route="/r") == 0
