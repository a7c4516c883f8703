"""Sleep mode of ``omni-accel serve`` (vLLM's routes): ``POST /sleep?level=1``, ``POST /wake_up``,
``GET /is_sleeping``, allowed with ``--enable-sleep-mode``.

Sleeping and waking are jobs of the served model's own job queue (``SleepKind``), so they run on its worker between
pipeline calls -- never under one -- after the requests queued before them, and under torchrun on every rank (the
spec is broadcast like a call's). ``omni_accel.sleep`` does the work (weights to pinned host memory on a GPU, to a
file on a CPU; vLLM engines through their own sleep).

A request that arrives while the model sleeps wakes it first (``SleepGate``); the response then carries the wake
time as ``Server-Timing: wake;dur=<ms>``. With ``--no-auto-wake`` it gets 503 with ``Retry-After`` instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .errors import ApiError, bad_request
from .jobs import Job, JobKind, JobQueue, await_job, submit_or_raise

logger = logging.getLogger("omni_accel.serve")

SLEEP_LEVELS = (1,)


class SleepKind(JobKind):
    """A sleep or wake-up of the queue's model: never batched, cost ~0 (it does not count in Retry-After)."""

    name = "sleep"
    what = "sleep mode"

    def job(self, action: str, level: int = 1, route: str = "/sleep") -> Job:
        return Job(kind=self, route=route, params={"action": action, "level": level}, cost=1e-6, key=None)

    def spec(self, batch: list[Job]) -> dict:
        return {"kind": self.name, **batch[0].params}


def run_sleep(target: Any, spec: dict) -> dict:
    """The sleep / wake of one spec on this rank (also the followers' runner under torchrun)."""
    import omni_accel

    if spec["action"] == "sleep":
        if omni_accel.is_sleeping(target):
            return {"was_sleeping": True, "released_bytes": 0, "seconds": 0.0}
        return omni_accel.sleep(target, level=spec["level"])
    return omni_accel.wake_up(target)


class Sleeper:
    """The sleep state of one queue's model. Wraps the queue's executor: sleep specs go to ``run`` (``run_sleep``
    here, or rank 0's broadcast-then-run), and a call that finds the model asleep wakes it first (a request that
    slipped past the gate while a sleep was queued)."""

    def __init__(self, queue: JobQueue, target: Any, run: Callable[[dict, Any], Any] | None = None):
        self.queue = queue
        self.target = target
        self.run = run or (lambda spec, control=None: run_sleep(target, spec))
        self.kind = SleepKind()
        self.last_wake_s = 1.0
        queue.kinds[self.kind.name] = self.kind
        inner = queue.executor

        def execute(spec: dict, control: Any) -> Any:
            if spec.get("kind") == SleepKind.name:
                return self.run(spec, control)
            if self.sleeping:
                self.run({"kind": SleepKind.name, "action": "wake", "level": 1}, control)
            return inner(spec, control)

        queue.executor = execute

    @property
    def sleeping(self) -> bool:
        import omni_accel

        return omni_accel.is_sleeping(self.target)

    async def change(self, action: str, request: Request | None, level: int = 1, timeout_s: float = 600.0) -> dict:
        job = submit_or_raise(self.queue, self.kind.job(action, level, "/sleep" if action == "sleep" else "/wake_up"))
        if request is None:
            return await asyncio.wrap_future(job.future)
        return await await_job(self.queue, job, request, timeout_s)


class SleepGate:
    """ASGI layer in front of the routes: a POST to /v1/... while a model sleeps wakes it first (Server-Timing:
    wake;dur=ms on the answer) or, with auto_wake off, is answered 503 + Retry-After."""

    def __init__(self, app, sleepers: list[Sleeper], auto_wake: bool):
        self.app, self.sleepers, self.auto_wake = app, sleepers, auto_wake

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/")
                or not any(s.sleeping for s in self.sleepers)):
            return await self.app(scope, receive, send)
        if not self.auto_wake:
            retry = max(1, math.ceil(max(s.last_wake_s for s in self.sleepers)))
            err = ApiError(503, "the model is asleep (POST /sleep) and this server does not wake it for requests "
                                "(--no-auto-wake); POST /wake_up first", type="server_error", code="model_asleep",
                           headers={"Retry-After": str(retry)})
            return await JSONResponse(err.body(), status_code=503, headers=err.headers)(scope, receive, send)
        t0 = time.perf_counter()
        try:
            for sleeper in self.sleepers:
                if sleeper.sleeping:
                    await sleeper.change("wake", None)
        except ApiError as err:
            return await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
        wake_ms = (time.perf_counter() - t0) * 1e3
        for sleeper in self.sleepers:
            sleeper.last_wake_s = wake_ms / 1e3
        logger.info("omni_accel.serve: woke up for %s in %.1f ms", scope.get("path"), wake_ms)

        async def send_with_timing(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                headers.append((b"server-timing", f"wake;dur={wake_ms:.1f}".encode()))
                message = dict(message, headers=headers)
            await send(message)

        return await self.app(scope, receive, send_with_timing)


def install(api: FastAPI, sleepers: list[Sleeper], *, enabled: bool) -> None:
    """The three routes on ``api`` (the gate is added around the app by ``gate``)."""

    def check_enabled() -> None:
        if not enabled:
            raise bad_request("sleep mode is off on this server; start it with --enable-sleep-mode", None,
                              "sleep_mode_disabled")

    @api.post("/sleep", summary="Put the served models to sleep (weights off the device; vLLM's route)")
    async def sleep(request: Request, level: int = 1):
        check_enabled()
        if level not in SLEEP_LEVELS:
            raise bad_request(f"level={level} is not supported; use level=1 (weights to host memory, or to a file "
                              "on a CPU, and back on /wake_up)", "level")
        reports = [await s.change("sleep", request, level) for s in sleepers]
        return {"is_sleeping": True, "level": level, "released_bytes": sum(r.get("released_bytes", 0) for r in reports),
                "seconds": round(sum(r.get("seconds", 0.0) for r in reports), 6)}

    @api.post("/wake_up", summary="Wake the served models up")
    async def wake_up(request: Request):
        check_enabled()
        reports = [await s.change("wake", request) for s in sleepers]
        seconds = sum(r.get("seconds", 0.0) for r in reports)
        if any(r.get("was_sleeping") for r in reports):
            for sleeper in sleepers:
                sleeper.last_wake_s = seconds
        return {"is_sleeping": False, "seconds": round(seconds, 6)}

    @api.get("/is_sleeping", summary="Whether the served models sleep")
    async def is_sleeping():
        return {"is_sleeping": any(s.sleeping for s in sleepers)}


def add_sleep_mode(app, api: FastAPI, sleepers: list[Sleeper], *, enabled: bool, auto_wake: bool) -> None:
    """The routes on ``api`` and the gate inside ``app`` (the guard middleware: authentication and body limits stay
    outermost)."""
    install(api, sleepers, enabled=enabled)
    if enabled:
        app.app = SleepGate(app.app, sleepers, auto_wake)
