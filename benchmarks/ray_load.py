"""Shared by the Ray Serve benchmarks (bench_ray_failover.py, bench_ray_throughput.py) and their CI test: a local
Ray cluster, the omni-accel application on it, the replicas' process ids, and a closed-loop load of image requests.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GEN = "/v1/images/generations"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_cluster(num_cpus: float | None = None, address: str | None = None) -> None:
    """A local Ray cluster (``num_cpus``; no dashboard), or the running one at ``address``."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level="WARNING")
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING")


def deploy(argv: list[str], port: int, replica: dict | None = None) -> str:
    """Run the application of ``omni-accel serve --ray`` flags ``argv`` (replacing the one running) behind Serve's
    HTTP proxy on ``port`` (started once per cluster); returns its URL once every replica is up."""
    from ray import serve

    from omni_accel.serve.ray_app import APP_NAME, application

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    if APP_NAME in serve.status().applications:  # free its resources first: the new one may need them all
        serve.delete(APP_NAME)
    serve.run(application(argv, replica=replica), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def describe_replicas(count: int = 1, timeout: float = 60.0) -> list[dict]:
    """``describe()`` of ``count`` distinct replicas (pid, its ranks' pids, torch threads ...), asked through Serve's
    handle until that many have answered."""
    from ray import serve

    from omni_accel.serve.ray_app import APP_NAME, REPLICA

    handle = serve.get_deployment_handle(REPLICA, app_name=APP_NAME)
    seen: dict[int, dict] = {}
    end = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < end:
        described = handle.describe.remote().result(timeout_s=30)
        seen[described["pid"]] = described
    return list(seen.values())


def replica_pids(count: int = 1, timeout: float = 60.0) -> list[list[int]]:
    """The process ids of ``count`` distinct replicas (each: its ranks' pids, rank 0 first)."""
    return [described["pids"] for described in describe_replicas(count, timeout)]


def health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def wait_running(url: str, replicas: int, timeout: float, after_loss: bool = False) -> float | None:
    """Seconds until /health reports ``replicas`` running and none starting (None: not within ``timeout``);
    ``after_loss``: first until it reports one missing (a replica just killed may still count as running)."""
    t0 = time.monotonic()
    lost = not after_loss
    while time.monotonic() - t0 < timeout:
        states = health(url).get("replicas") or {}
        full = states.get("running") == replicas and not states.get("starting")
        if lost and full:
            return time.monotonic() - t0
        lost = lost or (bool(states) and not full)
        time.sleep(0.1)
    return None


@dataclass
class Outcome:
    """What a load run saw: per request (status, had Retry-After, seconds, answered at)."""

    answers: list = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)  # no HTTP answer at all, by exception type
    seconds: float = 0.0

    def statuses(self) -> dict:
        return dict(Counter(str(status) for status, *_ in self.answers))

    def images(self, per_request: int = 1) -> int:
        return per_request * sum(1 for status, *_ in self.answers if status == 200)


async def _load(url: str, requests: int, concurrency: int, body: Callable[[int], dict], timeout_s: float,
                on_answer: Callable[[int], None] | None, headers: dict | None,
                until: Callable[[], bool] | None) -> Outcome:
    outcome = Outcome()
    counter = iter(range(requests))
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        async def worker():
            for i in counter:
                if until is not None and until():
                    return
                start = time.monotonic()
                try:
                    r = await client.post(url + GEN, json=body(i))
                    outcome.answers.append((r.status_code, "retry-after" in r.headers, time.monotonic() - start,
                                            time.monotonic() - t0, _code(r)))
                except httpx.HTTPError as exc:
                    outcome.errors[type(exc).__name__] += 1
                if on_answer is not None:
                    on_answer(len(outcome.answers) + sum(outcome.errors.values()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    outcome.seconds = time.monotonic() - t0
    return outcome


def _code(response) -> str | None:
    try:
        return (response.json().get("error") or {}).get("code")
    except ValueError:
        return None


def load(url: str, requests: int, concurrency: int, body: Callable[[int], dict], *, timeout_s: float = 300.0,
         on_answer: Callable[[int], None] | None = None, headers: dict | None = None,
         until: Callable[[], bool] | None = None) -> Outcome:
    """``requests`` image requests from ``concurrency`` clients, each sending its next as soon as it has an answer
    (``body(i)`` of request i); ``on_answer(count)`` after each answer; the clients stop early once ``until()``."""
    return asyncio.run(_load(url, requests, concurrency, body, timeout_s, on_answer, headers, until))


def prompt(i: int) -> str:
    colors, shapes = ("red", "green", "yellow", "white"), ("circle", "square", "star")
    return f"a {colors[i % 4]} {shapes[i % 3]} in the center on a blue background"
