"""One job mechanism for every route of ``omni-accel serve``: admission, queue, batching, cancellation, progress,
streams, drain and metrics.

A ``Job`` is one request's work: its ``kind`` (a ``JobKind``: which jobs may share a pipeline call, how a batch
becomes the call's plain-data *spec*, and how the call's output becomes each job's result), the ``route`` that
labels its metrics, its ``cost`` (the unit of Retry-After estimates), a batching ``key`` (equal keys of one kind
may share a call: images of one shape, never two LoRA adapters; None runs alone), a cancel event, ``progress``
0-100, its result (a future) and, for streamed kinds, a ``Stream`` of items.

A ``JobQueue`` per served model admits jobs into a bounded queue -- full: ``QueueFull`` carrying an honest
retry-after (the running call's expected remaining time); draining: ``ShuttingDown`` -- and owns the model's one
worker thread (a pipeline is not safe to call from two threads). The worker takes the oldest job and every queued
job of the same kind and key that ``kind.fits`` into the call, up to ``max_batch`` jobs, and calls
``executor(spec, control)``: the model's pipeline call, or under torchrun rank 0's broadcast-then-call
(serve/distributed.py). ``control`` (a ``JobControl``) is callable -- True once every job of the call was
cancelled, so the pipeline stops at its next step -- and carries ``progress(done, total)`` and ``emit(item)``.
A call that fails with several jobs in it is run again one job at a time, so one request's values fail only it.

Handlers wait with ``await_job`` (deadline, client disconnect, shutdown and failures mapped to OpenAI errors);
job-style routes (``/v1/videos``) keep the job and let clients poll it instead.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from .errors import ApiError, pipeline_failure, queue_full_error, shutting_down_error, timeout_error

logger = logging.getLogger("omni_accel.serve")

POLL_S = 0.25  # how often a waiting handler checks its deadline and whether its client is still there
QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"


class Aborted(Exception):
    """Raised inside a pipeline call (its step callback) when every job of the call was cancelled."""


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"queue full, retry after {retry_after}s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """Raised by ``submit`` once the queue drains or stops."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its job was cancelled)."""


# ------------------------------------------------------------------------------------------------ job
class JobKind:
    """What the mechanism needs to know about one kind of job; a route subclasses it."""

    name = "job"
    what = "the pipeline"  # the subject of failure messages: "<what> refused the request: ..."

    def fits(self, batch: list["Job"], job: "Job") -> bool:
        """May ``job`` join ``batch`` (same kind and key already checked) -- e.g. images per call."""
        return True

    def spec(self, batch: list["Job"]) -> dict:
        """The plain data of one call for ``batch`` (what a distributed server broadcasts)."""
        raise NotImplementedError

    def finish(self, batch: list["Job"], output: Any, seconds: float) -> list:
        """Each job's result from the call's ``output`` (worker thread: encoding belongs here)."""
        return [output] * len(batch)


_END = object()  # a stream's end
WAITING = object()  # nothing came within the wait


class Stream:
    """The items a running job emits (speech chunks), handed from the worker thread to the asyncio handler that
    created it. Ends with END, or with the job's exception."""

    END = _END

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:  # any thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    async def get(self, timeout: float) -> Any:
        """The next item, ``Stream.END``, or ``WAITING`` when nothing came within ``timeout`` s; the job's exception
        is raised here."""
        try:
            item = await asyncio.wait_for(self._items.get(), max(timeout, 0.0))
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return WAITING
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass(eq=False)
class Job:
    kind: JobKind
    route: str
    params: Any  # the kind's request (plain data)
    cost: float = 1.0
    key: Hashable | None = None
    stream: Stream | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    status: str = QUEUED
    progress: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    error: BaseException | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancel_event: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    @property
    def done(self) -> bool:
        return self.status in (COMPLETED, FAILED, CANCELLED)


class JobControl:
    """Handed to the executor with a call's spec. Call it to learn whether to stop (every job of the call was
    cancelled and the queue may abort); ``progress`` and ``emit`` report to the call's jobs."""

    def __init__(self, batch: list[Job], can_abort: bool):
        self.batch = batch
        self.can_abort = can_abort
        self.cancel_event = threading.Event()  # set when every job of the call is cancelled (and it may abort)

    def __call__(self) -> bool:
        return self.cancel_event.is_set()

    def check(self) -> None:
        if self.can_abort and all(job.cancelled for job in self.batch):
            self.cancel_event.set()

    def progress(self, done: int, total: int) -> None:
        value = max(0, min(100, int(100 * done / max(total, 1))))
        for job in self.batch:
            job.progress = max(job.progress, value)

    def emit(self, item: Any) -> None:
        for job in self.batch:
            if job.stream is not None and not job.cancelled:
                job.stream.put(item)


# ------------------------------------------------------------------------------------------------ queue
class JobQueue:
    """The bounded queue and the one worker thread of a served model (see the module docstring).

    ``executor(spec, control)`` runs one call; ``on_idle`` is called when no work came for ``idle_s`` (rank 0's
    ping under torchrun); ``can_abort=False`` (torchrun: every rank must finish a call) never stops a call early.
    ``gauges`` are extra (queued, running) gauges kept for one route family's older metric names."""

    def __init__(self, name: str, executor: Callable[[dict, JobControl], Any], *, max_queue: int = 32,
                 max_batch: int = 1, metrics: Any = None, gauges: tuple | None = None, on_idle: Callable | None = None,
                 idle_s: float = 30.0, can_abort: bool = True):
        self.name = name
        self.executor = executor
        self.max_queue = max_queue
        self.max_batch = max(1, max_batch)
        self.metrics = metrics
        self.gauges = gauges
        self.on_idle = on_idle
        self.idle_s = idle_s
        self.can_abort = can_abort
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._control: JobControl | None = None
        self._running_since = 0.0
        self._stopping = False
        self._seconds_per_cost: dict[str, float] = {}  # measured per kind (running average)
        self._routes: set[str] = set()
        self.kinds: dict[str, JobKind] = {}  # the kinds of job this queue's model runs, by name
        self._threads = None
        self._thread: threading.Thread | None = None

    # -- admission ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker (idempotent; ``submit`` starts it too). It adopts the starting thread's torch thread
        count: a new thread starts with OpenMP's default, and vLLM's CPU kernels check that they run with the count
        their engine planned with."""
        with self._cond:
            if self._thread is not None:
                return
            import torch

            self._threads = torch.get_num_threads()
            self._thread = threading.Thread(target=self._loop, name=f"omni-accel-serve-{self.name}", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> Job:
        """Admit ``job`` (QueueFull, ShuttingDown); its future / stream / status tell the rest."""
        self.start()
        with self._cond:
            if self._stopping:
                raise ShuttingDown()
            if len(self._pending) >= self.max_queue:
                retry_after = self._retry_after_locked()
                self._count(job.route, "rejected")
                if self.metrics is not None:
                    self.metrics.rejected.inc()
                raise QueueFull(retry_after)
            self._pending.append(job)
            self._gauge()
            self._cond.notify_all()
        return job

    def cancel(self, job: Job, reason: str) -> str | None:
        """Cancel ``job`` (``reason``: disconnect, timeout, deleted, shutdown): dropped if still queued ("queued"),
        its cancel event set if running ("running": the call stops at its next step once all its jobs are
        cancelled); None if it is done or was cancelled before (counted once)."""
        with self._cond:
            if job.done or job.cancelled:
                return None
            job.cancel_event.set()
            if job.status == QUEUED:
                with contextlib.suppress(ValueError):
                    self._pending.remove(job)
                self._end(job, CANCELLED)
                self._gauge()
                stage = "queued"
            else:
                stage = "running"
                if self._control is not None:
                    self._control.check()
        if self.metrics is not None:
            self.metrics.cancelled.labels(stage, reason).inc()
        return stage

    def retry_after(self) -> int:
        """Seconds until the queue has a free place: the running call's expected remaining time (when it ends, the
        worker takes the next batch off the queue), from the measured seconds per unit of cost of its kind; 1 s
        before anything was measured."""
        with self._cond:
            return self._retry_after_locked()

    def _retry_after_locked(self) -> int:
        rates = [self._seconds_per_cost.get(job.kind.name) for job in self._running]
        if not self._running or None in rates:
            return 1
        expected = sum(rate * job.cost for rate, job in zip(rates, self._running))
        return max(1, math.ceil(expected - (time.monotonic() - self._running_since)))

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def stopping(self) -> bool:
        return self._stopping

    # -- drain ----------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Stop admitting and end every queued job at once (cancelled: its handler answers 503); a running call
        goes on (``wait_idle``, then ``abandon_running``)."""
        with self._cond:
            self._stopping = True
            for job in list(self._pending):
                job.cancel_event.set()
                self._end(job, CANCELLED)
            self._pending.clear()
            self._gauge()
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` s (None: as long as it takes) for the running call to end; True when none runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._running:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(0.1 if remaining is None else min(remaining, 0.1))
        return True

    def abandon_running(self) -> int:
        """End the running call's jobs now (cancelled: 503) and let the call abort at its next step where it can."""
        with self._cond:
            for job in self._running:
                job.cancel_event.set()
                self._end(job, CANCELLED)
            if self._control is not None:
                self._control.check()
            return len(self._running)

    def stop(self, timeout: float | None = 30.0) -> None:
        self.drain()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _end(self, job: Job, status: str, result: Any = None, error: BaseException | None = None) -> None:
        """Settle ``job`` once (caller holds the lock or is the worker): status, future, stream, metrics."""
        if job.done:
            return
        job.status, job.finished_at, job.error = status, time.time(), error
        if status == COMPLETED:
            job.progress = 100
            job.future.set_result(result)
        elif status == FAILED:
            job.future.set_exception(error)
        else:
            job.future.cancel()
        if job.stream is not None:
            job.stream.put(Stream.END if status == COMPLETED else error if status == FAILED else ShuttingDown())
        self._count(job.route, status)

    def _count(self, route: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.jobs.labels(route, outcome).inc()

    def _gauge(self) -> None:
        if self.metrics is None:
            return
        queued = collections.Counter(job.route for job in self._pending)
        running = collections.Counter(job.route for job in self._running)
        self._routes.update(queued, running)
        for route in self._routes:  # every route this queue has seen, so that a drained one reads 0
            self.metrics.jobs_queued.labels(route).set(queued[route])
            self.metrics.jobs_running.labels(route).set(running[route])
        if self.gauges is not None:
            self.gauges[0].set(len(self._pending))
            self.gauges[1].set(len(self._running))

    # -- the worker -------------------------------------------------------------------------------------------
    def _take_batch(self) -> list[Job]:
        first = self._pending.popleft()
        batch = [first]
        if first.key is not None:
            for job in list(self._pending):
                if len(batch) >= self.max_batch:
                    break
                if job.kind is first.kind and job.key == first.key and first.kind.fits(batch, job):
                    self._pending.remove(job)
                    batch.append(job)
        now = time.time()
        for job in batch:
            job.status, job.started_at = IN_PROGRESS, now
            if self.metrics is not None:
                self.metrics.job_wait.labels(job.route).observe(now - job.created_at)
        return batch

    def _loop(self) -> None:
        import torch

        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    if not self._cond.wait(self.idle_s) and self.on_idle is not None and not self._pending:
                        break
                if self._stopping:
                    return
                batch = None
                if self._pending:
                    batch = self._take_batch()
                    self._running, self._running_since = batch, time.monotonic()
                    self._control = JobControl(batch, self.can_abort)
                    self._gauge()
            if batch is None:
                try:
                    self.on_idle()
                except Exception:  # noqa: BLE001
                    logger.exception("omni_accel.serve: idle hook failed")
                continue
            self._run(batch, self._control)
            with self._cond:
                self._running, self._control = [], None
                self._gauge()
                self._cond.notify_all()

    def _run(self, batch: list[Job], control: JobControl) -> None:
        kind = batch[0].kind
        t0 = time.perf_counter()
        try:
            output = self.executor(kind.spec(batch), control)
            seconds = time.perf_counter() - t0
            results = kind.finish(batch, output, seconds)
        except Aborted:
            logger.info("omni_accel.serve: a call of %d %s job(s) aborted: all cancelled", len(batch), kind.name)
            with self._cond:
                for job in batch:
                    self._end(job, CANCELLED)
            return
        except BaseException as exc:  # noqa: BLE001 -- settle every job of the call, keep serving
            if len(batch) > 1:
                # one request's values may have made the call fail: run each alone so that only its own fails
                logger.warning("omni_accel.serve: a call of %d %s jobs failed (%r); running them one by one",
                               len(batch), kind.name, exc)
                for job in batch:
                    if not job.done:
                        self._run([job], JobControl([job], self.can_abort))
                return
            with self._cond:
                if batch[0].cancelled:  # it failed on its way out (cancelled mid-call): nobody waits for an answer
                    self._end(batch[0], CANCELLED)
                    return
                logger.exception("omni_accel.serve: %s call failed", kind.name)
                self._end(batch[0], FAILED, error=exc)
            return
        rate = seconds / max(sum(job.cost for job in batch), 1e-9)
        old = self._seconds_per_cost.get(kind.name)
        self._seconds_per_cost[kind.name] = rate if old is None else 0.7 * old + 0.3 * rate
        with self._cond:
            for job, result in zip(batch, results):
                if self.metrics is not None:
                    self.metrics.job_run.labels(job.route).observe(seconds)
                self._end(job, CANCELLED if job.cancelled else COMPLETED, result)


# ------------------------------------------------------------------------------------------------ handlers
async def await_job(queue: JobQueue, job: Job, request: Any, timeout_s: float, *,
                    deadline: float | None = None) -> Any:
    """Submit-side wait of a request handler: the job's result -- or, for a streamed job, its first item --
    while watching the deadline (``timeout_s`` after ``deadline - timeout_s``; 504) and the client (gone:
    ClientGone, the job cancelled). A job cancelled by the drain is a 503; a failure is mapped by
    ``pipeline_failure``."""
    loop = asyncio.get_running_loop()
    deadline = deadline if deadline is not None else loop.time() + timeout_s
    waiter = None if job.stream is not None else asyncio.wrap_future(job.future)
    while True:
        wait_s = max(0.0, min(POLL_S, deadline - loop.time()))
        if waiter is None:
            try:
                item = await job.stream.get(wait_s)
            except ShuttingDown:
                raise shutting_down_error()
            except Exception as exc:  # noqa: BLE001 -- the pipeline's own failure
                raise pipeline_failure(exc, job.kind.what) from exc
            if item is not WAITING:
                return item
        else:
            await asyncio.wait({waiter}, timeout=wait_s)
            if waiter.done():
                break
        if loop.time() >= deadline:
            queue.cancel(job, "timeout")
            raise timeout_error(timeout_s)
        if await request.is_disconnected() and queue.cancel(job, "disconnect") is not None:
            logger.info("omni_accel.serve: client disconnected; cancelled its %s job", job.kind.name)
            raise ClientGone()
    if waiter.cancelled():
        if queue.stopping:
            raise shutting_down_error()
        raise ApiError(503, "the request was cancelled (the work was aborted)", type="server_error", code="cancelled")
    exc = waiter.exception()
    if exc is not None:
        raise pipeline_failure(exc, job.kind.what)
    return waiter.result()


def queue_full(queue: JobQueue, exc: QueueFull, what: str = "requests") -> ApiError:
    return queue_full_error(queue.queue_depth, queue.max_queue, exc.retry_after, what=what)


def submit_or_raise(queue: JobQueue, job: Job, what: str = "requests") -> Job:
    """``queue.submit`` with its refusals as OpenAI errors (429 + Retry-After, 503)."""
    try:
        return queue.submit(job)
    except ShuttingDown:
        raise shutting_down_error()
    except QueueFull as exc:
        raise queue_full(queue, exc, what)
