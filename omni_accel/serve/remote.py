"""Jobs whose model runs in another process: the ingress side (``RemoteQueue``) and the replica side
(``replica_events``) of one small protocol, so that a model served by replicas (Ray Serve: serve/ray_app.py) keeps
the one job mechanism of serve/jobs.py.

The ingress runs the single server's routes unchanged: they validate, make jobs of the same kinds and hand them to a
``RemoteQueue``, which admits them as a ``JobQueue`` does -- bounded (``QueueFull`` with Retry-After), refused once
draining (``ShuttingDown``), cancellable, counted in the same metrics -- but has no worker: it sends each job's
plain fields to a replica (``send``) and settles the job from the replica's events. The replica rebuilds the job
with its own kind and submits it to its own ``JobQueue``, the one that batches, runs, aborts and measures, and
reports back (``replica_events``): started, progress, stream items (speech chunks), then the result, the failure or
the cancellation. The ingress's kind takes the result in (``JobKind.accept``: a video into the ingress's store).

Failures. A replica lost (its process died, or it drained away) before it reported the job's start: the job is sent
once more (the router picks a live replica); after its start, or lost a second time: 503 + Retry-After. Both are
safe because a job is a pure function of its fields (the seed is drawn on the ingress), so a job that had in fact
started just before its replica died costs a second run, never a different answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import time
from typing import Any, AsyncIterator, Callable

from .errors import ApiError, queue_full_error
from .jobs import (CANCELLED, COMPLETED, FAILED, IN_PROGRESS, QUEUED, WAITING, Job, JobQueue, QueueFull,
                   ShuttingDown, Stream)

logger = logging.getLogger("omni_accel.serve")

POLL_S = 0.1  # how often a replica looks at a running job's status and progress


class ReplicaLost(Exception):
    """The replica running a job went away before the job ended (it died, or drained away); ``started``: whether it
    had reported the job's start."""

    def __init__(self, why: str, started: bool):
        super().__init__(why)
        self.started = started


# ------------------------------------------------------------------------------------------------ replica side
def job_fields(job: Job) -> dict:
    """What a replica needs to rebuild ``job`` with its own kind (plain data)."""
    return {"kind": job.kind.name, "route": job.route, "params": job.params, "cost": job.cost, "key": job.key,
            "id": job.id, "streamed": job.stream is not None}


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself; else a RuntimeError naming it (the ingress maps either)."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc):
            return exc
    except Exception:  # noqa: BLE001 -- unpicklable arguments: send its words instead
        pass
    return RuntimeError(f"{type(exc).__name__}: {exc}")


async def replica_events(queue: JobQueue, fields: dict, poll_s: float = POLL_S) -> AsyncIterator[dict]:
    """Run one job of ``fields`` on ``queue`` (this replica's own queue) and yield its events (``{"event": ...}``):
    ``progress`` (the job started; 0-100) and ``item`` (a stream's), then one of ``done`` (the kind's result, the
    queue's measured seconds per cost), ``failed`` (the exception), ``cancelled`` (``started``: whether it had) or
    ``refused`` (the queue was full: its Retry-After). If the caller goes away (the generator is cancelled or
    closed), the job is cancelled like a disconnected client's."""
    kind = queue.kinds[fields["kind"]]
    job = Job(kind=kind, route=fields["route"], params=fields["params"], cost=fields["cost"], key=fields["key"],
              id=fields["id"], stream=Stream() if fields["streamed"] else None)
    try:
        queue.submit(job)
    except QueueFull as exc:
        yield {"event": "refused", "retry_after": exc.retry_after}
        return
    except ShuttingDown:
        yield {"event": "cancelled", "started": False}
        return
    waiter = asyncio.wrap_future(job.future)
    reported = (QUEUED, 0)
    try:
        ended = False
        while not ended:
            item = WAITING
            if job.stream is not None:  # a stream ends with END, or with the job's failure / cancellation
                try:
                    item = await job.stream.get(poll_s)
                except Exception:  # noqa: BLE001 -- the job failed or was cancelled: its future says which
                    item = Stream.END
                ended = item is Stream.END
            else:
                await asyncio.wait({waiter}, timeout=poll_s)
                ended = waiter.done()
            if (job.status, job.progress) != reported and job.status in (IN_PROGRESS, COMPLETED):
                reported = (job.status, job.progress)
                yield {"event": "progress", "progress": job.progress}
            if item is not WAITING and item is not Stream.END:
                yield {"event": "item", "item": item}
        await asyncio.wait({waiter})
        yield final_event(queue, job)
    except (asyncio.CancelledError, GeneratorExit):
        queue.cancel(job, "disconnect")
        raise


def final_event(queue: JobQueue, job: Job) -> dict:
    if job.status == COMPLETED:
        return {"event": "done", "result": job.future.result(),
                "seconds_per_cost": queue.seconds_per_cost(job.kind.name)}
    if job.status == FAILED:
        return {"event": "failed", "error": portable(job.error)}
    return {"event": "cancelled", "started": job.started_at is not None}


# ------------------------------------------------------------------------------------------------ ingress side
class RemoteQueue(JobQueue):
    """A model's job queue as an ingress sees it when replicas run the model (see the module docstring).

    ``send(fields)`` starts one job on some replica and returns an async iterator of its events (with ``cancel()``
    where the transport has it: a Ray Serve DeploymentResponseGenerator). ``capacity()``: how many jobs may be in
    flight at once (the replicas' queues and running calls: a full system answers 429 like a full single server).
    ``lost``: the exception types that mean "the replica went away". ``restart_s()``: a Retry-After when nothing
    runs to measure one by (no replica alive)."""

    def __init__(self, template: JobQueue, send: Callable[[dict], Any], *, capacity: Callable[[], int],
                 lost: tuple = (), retries: int = 1, restart_s: Callable[[], float] = lambda: 1.0):
        super().__init__(template.name, executor=None, max_queue=template.max_queue, max_batch=template.max_batch,
                         metrics=template.metrics, gauges=template.gauges)
        self.kinds = template.kinds  # the same kinds as the replicas' queues: routes make jobs with them
        self.send = send
        self.capacity = capacity
        self.lost = tuple(lost) + (ReplicaLost,)
        self.retries = retries
        self.restart_s = restart_s
        self.resent = 0  # jobs sent a second time after their replica went away
        self._tasks: dict[Job, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- admission (JobQueue's interface) ------------------------------------------------------------------
    @property
    def max_queue(self) -> int:
        """Waiting places in all (what the 429 message reports): the capacity less the running jobs."""
        return max(0, self.capacity() - len(self._running))

    @max_queue.setter
    def max_queue(self, _value: int) -> None:  # JobQueue.__init__ sets it; the capacity decides here
        pass

    def start(self) -> None:  # no worker: the replicas have theirs
        pass

    def submit(self, job: Job) -> Job:
        """Admit ``job`` and send it to a replica (from the event loop of the handlers)."""
        self._loop = asyncio.get_running_loop()
        super().submit(job)
        self._tasks[job] = self._loop.create_task(self._forward(job))
        return job

    def _full_locked(self) -> bool:
        return len(self._pending) + len(self._running) >= self.capacity()

    def cancel(self, job: Job, reason: str) -> str | None:
        """Cancel ``job`` here and on its replica (its request there is cancelled: queued, it never runs; running,
        its call stops at the next step once all its jobs are cancelled); settled at once."""
        with self._cond:
            if job.done or job.cancelled:
                return None
            job.cancel_event.set()
            stage = "queued" if job.status == QUEUED else "running"
            self._settle_locked(job, CANCELLED)
        if self.metrics is not None:
            self.metrics.cancelled.labels(stage, reason).inc()
        return stage

    def _retry_after_locked(self) -> int:
        """The earliest expected end of a running job (a place frees then), from the replicas' measured seconds per
        cost; the replica start-up time when nothing runs and nothing has been measured."""
        now = time.time()
        ends = [job.started_at + rate * job.cost for job in self._running
                if (rate := self._seconds_per_cost.get(job.kind.name)) is not None and job.started_at is not None]
        if ends:
            return max(1, math.ceil(min(ends) - now))
        return max(1, math.ceil(self.restart_s() if not self._running else 1.0))

    # -- drain ----------------------------------------------------------------------------------------------
    def drain(self) -> None:
        with self._cond:
            self._stopping = True
            for job in list(self._pending):
                job.cancel_event.set()
                self._settle_locked(job, CANCELLED)
            self._cond.notify_all()

    def abandon_running(self) -> int:
        with self._cond:
            running = list(self._running)
            for job in running:
                job.cancel_event.set()
                self._settle_locked(job, CANCELLED)
            return len(running)

    def stop(self, timeout: float | None = 30.0) -> None:
        self.drain()
        self.wait_idle(timeout)
        self.abandon_running()

    # -- one job's journey ------------------------------------------------------------------------------------
    async def _forward(self, job: Job) -> None:
        attempt = 0
        while True:
            try:
                await self._follow(job)
                return
            except asyncio.CancelledError:
                return  # cancelled here (client gone, deleted, drained): settled by whoever cancelled
            except self.lost as exc:
                started = getattr(exc, "started", job.status != QUEUED)
                if not started and attempt < self.retries and not job.done:
                    attempt += 1
                    self.resent += 1
                    if self.metrics is not None:
                        self.metrics.resent.labels(job.route).inc()
                    logger.warning("omni_accel.serve: the replica of %s job %s went away before starting it (%s); "
                                   "sending it to another replica", job.kind.name, job.id, exc)
                    self._requeue(job)
                    continue
                self._fail(job, self._lost_error(exc, started))
                return
            except Exception as exc:  # noqa: BLE001 -- the transport's own failure: the job's 500
                logger.exception("omni_accel.serve: sending %s job %s failed", job.kind.name, job.id)
                self._fail(job, exc)
                return

    async def _follow(self, job: Job) -> None:
        """Send ``job`` once and apply its events until the final one."""
        stream = self.send(job_fields(job))
        answered = False  # a final event came: nothing left to cancel on the replica
        try:
            async for event in stream:
                if job.done:
                    return
                what = event["event"]
                if what == "progress":
                    self._started(job, event["progress"])
                    continue
                if what == "item":
                    if job.stream is not None and not job.cancelled:
                        job.stream.put(event["item"])
                    continue
                answered = True
                if what == "done":
                    await self._done(job, event)
                elif what == "failed":
                    self._fail(job, event["error"])
                elif what == "refused":  # the replica's own queue was full (its bound is wider than ours)
                    self._fail(job, queue_full_error(self.queue_depth, self.max_queue, event["retry_after"]))
                else:  # cancelled, not by us (we would not be listening): the replica drained or its group broke
                    raise ReplicaLost("the replica ended the job (it drained, or its group broke)", event["started"])
                return
            raise ReplicaLost("the replica's answer ended without a result", job.status != QUEUED)
        finally:
            cancel = getattr(stream, "cancel", None)
            if cancel is not None and not answered:
                cancel()

    def _started(self, job: Job, progress: int) -> None:
        with self._cond:
            if job.status == QUEUED and job in self._pending:
                self._pending.remove(job)
                self._running.append(job)
                job.status, job.started_at = IN_PROGRESS, time.time()
                if self.metrics is not None:
                    self.metrics.job_wait.labels(job.route).observe(job.started_at - job.created_at)
                self._gauge()
            job.progress = max(job.progress, progress)

    async def _done(self, job: Job, event: dict) -> None:
        if event.get("seconds_per_cost") is not None:
            self._seconds_per_cost[job.kind.name] = event["seconds_per_cost"]
        self._started(job, 100)
        run_s = time.time() - job.started_at
        status, result, error = await asyncio.to_thread(self._accepted, job, event["result"])
        with self._cond:
            if self.metrics is not None:
                self.metrics.job_run.labels(job.route).observe(run_s)
            self._settle_locked(job, status, result, error)

    def _fail(self, job: Job, error: BaseException) -> None:
        with self._cond:
            self._settle_locked(job, FAILED, error=error)

    def _requeue(self, job: Job) -> None:
        with self._cond:
            if job in self._running:
                self._running.remove(job)
            if job not in self._pending:
                self._pending.append(job)
            job.status = QUEUED
            self._gauge()

    def _lost_error(self, exc: BaseException, started: bool) -> ApiError:
        retry_after = self.retry_after()
        when = "while it ran" if started else "twice before it started"
        return ApiError(503, f"the replica serving this request went away {when} ({type(exc).__name__}); it is "
                             f"being restarted: send the request again (retry after {retry_after} s)",
                        type="server_error", code="replica_unavailable", headers={"Retry-After": str(retry_after)})

    def _settle_locked(self, job: Job, status: str, result: Any = None, error: BaseException | None = None) -> None:
        """End ``job`` (the lock is held): out of the lists, its future / stream / metrics settled, its sending
        task cancelled unless that task is the caller."""
        if job.done:
            return
        for bucket in (self._pending, self._running):
            if job in bucket:
                bucket.remove(job)
        self._end(job, status, result, error)
        self._gauge()
        self._cond.notify_all()
        task = self._tasks.pop(job, None)
        if task is not None and status == CANCELLED and self._loop is not None:
            if _on_loop(self._loop):
                if task is not asyncio.current_task():
                    task.cancel()
            else:
                self._loop.call_soon_threadsafe(task.cancel)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


__all__ = ["RemoteQueue", "ReplicaLost", "job_fields", "portable", "replica_events"]
