"""``omni-accel serve --ray``: the server's routes as a Ray Serve ingress in front of model replicas.

    omni-accel serve --ray --replicas 2                                    # a local Ray cluster, 2 replicas
    omni-accel serve --ray --autoscale 1:8 --model ./FLUX.1-dev --compile on --ray-address auto
    omni-accel serve --ray --gpus-per-replica 2 --sp 2 --model ./FLUX.1-dev  # each replica a group of 2 GPUs
    serve run omni_accel.serve.ray_app:build model=./FLUX.1-dev replicas=2  # Ray Serve's own CLI (or a config YAML)

Two deployments (docs/ray.md):

* ``OmniAccelReplica``: one replica loads and accelerates the served models exactly as ``omni-accel serve`` does
  (the same flags) and runs each model's own ``JobQueue`` (serve/jobs.py: batching, one worker owning the pipeline,
  abort, Retry-After measurements). Its ``run`` method is the replica side of serve/remote.py: a streamed call that
  runs one job on that queue and reports started / progress / stream items / result. With ``--gpus-per-replica G``
  > 1 a replica is a group of G processes in a placement group (serve/ray_group.py), rank 0 answering.
* ``OmniAccelIngress`` (one replica): the single server's FastAPI app, built by the same ``build_app`` over
  ``RemoteQueue``s instead of local queues -- validation, API key, limits, metrics, video store and every route
  stay here; jobs go to the replicas through a ``DeploymentHandle`` (Ray Serve routes each to a replica with a
  short queue). It holds no pipeline: the models' descriptions come from a replica (``describe``).

Back-pressure: a replica takes at most its queue (``--max-queue``) plus its running batch (``--max-concurrency``)
per model (``max_ongoing_requests``), and the ingress admits at most that many jobs per running replica: beyond,
429 ``queue_full`` with Retry-After, as from a full single server. Autoscaling (``--autoscale MIN:MAX``) is Ray
Serve's on the ongoing requests per replica (queued + running jobs; ``--target-ongoing-requests``); a replica
scaled down first finishes what it holds (``--shutdown-grace``). Failures: Ray Serve restarts a dead replica (its
health check also fails when a rank of its group died); the ingress resends a job once if its replica went away
before starting it, and answers 503 + Retry-After otherwise (serve/remote.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import ray
from ray import serve

from .ray_flags import autoscale_bounds, check_arguments
from .remote import RemoteQueue, replica_events

logger = logging.getLogger("omni_accel.serve")

APP_NAME = "omni-accel"
INGRESS = "OmniAccelIngress"
REPLICA = "OmniAccelReplica"
HEALTH_CHECK_S = 3.0  # how often Ray Serve asks a replica whether it is healthy (3 failures in a row: replaced)
STATES_POLL_S = 1.0  # how often the ingress reads the replicas' states (capacity, /health, /metrics)


# ------------------------------------------------------------------------------------------------ arguments
def parse_arguments(args: Any) -> argparse.Namespace:
    """The serve flags from what ``build`` is given: a Namespace (the CLI), a list of ``omni-accel serve`` argv, or
    Ray Serve's application arguments -- a dict of flag names (dashes or underscores) to values, from ``serve run
    ...:build model=./FLUX.1-dev replicas=2`` or a config file's ``args:`` (true / false for switches; a list
    repeats a flag)."""
    from ..cli import CliError, build_parser

    if isinstance(args, argparse.Namespace):
        parsed = args
    else:
        parser = build_parser()
        argv = list(args) if isinstance(args, (list, tuple)) else argv_of(args or {}, parser)
        try:
            parsed = parser.parse_args(["serve", *argv])
        except SystemExit:
            raise CliError(f"the application arguments {argv} are not omni-accel serve flags (see omni-accel serve "
                           "--help)")
        parsed.verbose = getattr(parsed, "verbose", 0)
    parsed.ray = True
    return parsed


def argv_of(mapping: dict, parser: argparse.ArgumentParser) -> list[str]:
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001 -- argparse has no API
    switches = {action.dest for action in serve_parser._actions if action.nargs == 0}
    argv = []
    for key, value in mapping.items():
        flag = "--" + str(key).replace("_", "-")
        if str(key).replace("-", "_") in switches:
            if str(value).lower() in ("true", "1", "yes", "on", ""):
                argv.append(flag)
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            argv += [flag, str(item)]
    return argv


# ------------------------------------------------------------------------------------------------ deployments
def uses_gpus(args) -> bool:
    """Whether each replica process reserves a GPU: --device cuda..., or no --device on a cluster with GPUs."""
    if args.device is not None:
        return args.device.startswith("cuda")
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def process_resources(args) -> dict:
    resources = {"CPU": args.replica_cpus}
    if uses_gpus(args):
        resources["GPU"] = 1
    return resources


def replica_capacity(args, queue: str) -> int:
    """Jobs of one model a replica holds at once: its queue (--max-queue) and its running batch."""
    return args.max_queue + (args.max_concurrency if queue == "images" else 1)


def replica_requests(args) -> int:
    """Requests one replica takes at once, all its models together (Ray Serve's max_ongoing_requests)."""
    return sum(replica_capacity(args, name) for name in served_queues(args))


def served_queues(args) -> list[str]:
    from .server import speech_only

    names = [] if speech_only(args) else ["images"]
    if args.video_model:
        names.append("videos")
    if getattr(args, "speech_model", None):
        names.append("speech")
    return names


def replica_options(args) -> dict:
    """Ray Serve options of the model replicas: count or autoscaling, resources (a placement group of G bundles
    for a multi-process replica), how many requests one takes, health checks and the drain."""
    resources = process_resources(args)
    options = {
        "name": REPLICA,
        "ray_actor_options": {"num_cpus": resources["CPU"], "num_gpus": resources.get("GPU", 0)},
        "max_ongoing_requests": replica_requests(args),
        "health_check_period_s": HEALTH_CHECK_S,
        "graceful_shutdown_timeout_s": args.shutdown_grace,
        "graceful_shutdown_wait_loop_s": 0.5,
        "max_constructor_retry_count": 3,
    }
    if args.gpus_per_replica > 1:
        options["placement_group_bundles"] = [dict(resources) for _ in range(args.gpus_per_replica)]
        options["placement_group_strategy"] = args.placement_strategy
    if args.autoscale is not None:
        low, high = autoscale_bounds(args.autoscale)
        config = {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1),
                  "target_ongoing_requests": args.target_ongoing_requests or args.max_concurrency}
        if args.upscale_delay is not None:
            config["upscale_delay_s"] = args.upscale_delay
        if args.downscale_delay is not None:
            config["downscale_delay_s"] = args.downscale_delay
        options["autoscaling_config"] = config
    else:
        options["num_replicas"] = args.replicas or 1
    return options


def ingress_options(args) -> dict:
    most = autoscale_bounds(args.autoscale)[1] if args.autoscale else (args.replicas or 1)
    in_flight = most * replica_requests(args)
    return {"name": INGRESS, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": args.max_connections or 4 * in_flight + 64,
            "graceful_shutdown_timeout_s": args.shutdown_grace + 5, "graceful_shutdown_wait_loop_s": 0.5}


@serve.deployment(name=REPLICA)
class ModelReplica:
    """One model replica (see the module docstring)."""

    def __init__(self, args):
        from .metrics import ServeMetrics
        from .server import load_models, load_speech, make_queues

        t0 = time.monotonic()
        logging.getLogger("omni_accel").setLevel(logging.INFO if getattr(args, "verbose", 0) else logging.WARNING)
        self.args = args
        self.group = None
        leader = None
        if args.gpus_per_replica > 1:
            from .ray_group import RankGroup

            self.group = RankGroup(args, args.gpus_per_replica, process_resources(args), self._group_broken)
            models, leader = self.group.models, self.group.leader
        else:
            models = load_models(args)
        self.models = load_speech(args, models, warmup=True)
        self.metrics = ServeMetrics()  # this replica's own (pipeline calls, forwards); the ingress counts requests
        # wide enough never to refuse: the replica's bound is Ray Serve's max_ongoing_requests, the system's the
        # ingress's admission
        self.queues = make_queues(args, self.models, self.metrics, leader=leader,
                                  headroom=replica_requests(args) - args.max_queue)
        for queue in self.queues.values():
            queue.accepts_results = False  # the ingress owns the jobs (a video goes to its store)
            queue.start()
        self.load_s = time.monotonic() - t0
        logger.info("omni_accel.serve: replica ready in %.1f s (pid %d)", self.load_s, os.getpid())

    def describe(self) -> dict:
        """What the ingress builds its routes from: the models without their pipelines."""
        import torch

        return {"models": self.models.without_pipelines(), "load_s": self.load_s, "pid": os.getpid(),
                "pids": self.group.pids if self.group is not None else [os.getpid()],
                "threads": torch.get_num_threads()}

    async def run(self, queue: str, fields: dict):
        """Run one job on this replica's queue (a streamed call: serve/remote.py's events)."""
        async for event in replica_events(self.queues[queue], fields):
            yield event

    def check_health(self) -> None:
        if self.group is not None and self.group.broken is not None:
            raise RuntimeError(self.group.broken)
        for name, queue in self.queues.items():
            if not queue.healthy:
                raise RuntimeError(f"the worker thread of the {name} queue died")

    def _group_broken(self, why: str) -> None:
        """A rank died: end every job here now (the ingress resends those not started), then fail health checks."""
        for queue in self.queues.values():
            queue.drain()
            queue.abandon_running()

    def __del__(self):
        group = getattr(self, "group", None)
        broken = group is not None and group.broken is not None
        for queue in getattr(self, "queues", {}).values():
            queue.stop(timeout=0 if broken else 30)  # a broken group's call may never return
        if group is not None:
            group.stop()
        speech = getattr(getattr(self, "models", None), "speech", None)
        if speech is not None:
            speech.close()


@serve.deployment(name=INGRESS)
@serve.ingress()
class Ingress:
    """The routes of ``omni-accel serve`` over the replicas (see the module docstring)."""

    async def __init__(self, replicas, args):
        from .metrics import ServeMetrics
        from .server import build_app, make_queues, video_store

        self.args = args
        self.handle = replicas
        described = await replicas.describe.remote()
        self.load_s = described["load_s"]
        self.states = {"running": 1, "starting": 0, "stopping": 0}
        models = described["models"]
        self.metrics = ServeMetrics()
        self.store = video_store(args, models)
        templates = make_queues(args, models, self.metrics, store=self.store)  # never started: kinds and bounds
        self.queues = {name: RemoteQueue(template, self._sender(name), capacity=self._capacity(name),
                                         lost=lost_replica_errors(), restart_s=lambda: self.load_s)
                       for name, template in templates.items()}
        self.asgi = build_app(args, models, self.queues, self.metrics, store=self.store,
                              world_size=args.gpus_per_replica, replicas=lambda: dict(self.states))
        self.app_name = serve.get_replica_context().app_name
        self._poller = asyncio.get_running_loop().create_task(self._poll_states())

    def __serve_build_asgi_app__(self):
        return self.asgi

    def _sender(self, queue: str):
        stream = self.handle.options(stream=True)
        return lambda fields: stream.run.remote(queue, fields)

    def _capacity(self, queue: str):
        per_replica = replica_capacity(self.args, queue)
        return lambda: max(1, self.states["running"]) * per_replica

    async def _poll_states(self) -> None:
        while True:
            try:
                self.states = await asyncio.to_thread(replica_states, self.app_name)
            except Exception as exc:  # noqa: BLE001 -- keep the last known states; the next poll may work
                logger.warning("omni_accel.serve: could not read the replicas' states: %r", exc)
            await asyncio.sleep(STATES_POLL_S)

    async def __del__(self):
        if not hasattr(self, "queues"):  # the constructor failed
            return
        self._poller.cancel()
        for queue in self.queues.values():
            queue.drain()  # video jobs still queued end as cancelled; requests in flight were waited for by Serve
        deadline = time.monotonic() + self.args.shutdown_grace
        while any(q.running for q in self.queues.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for queue in self.queues.values():
            queue.abandon_running()
        if self.store is not None:
            self.store.close()


def lost_replica_errors() -> tuple:
    """The exceptions by which a DeploymentHandle call says that its replica went away."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (ActorDiedError, ActorUnavailableError, RayActorError)


def replica_states(app_name: str) -> dict[str, int]:
    """The model replicas by state: running, starting (starting, restarting, updating), stopping."""
    status = serve.status().applications[app_name].deployments[REPLICA]
    out = {"running": 0, "starting": 0, "stopping": 0}
    for state, count in status.replica_states.items():
        name = str(getattr(state, "value", state)).upper()
        key = "running" if name == "RUNNING" else "stopping" if name in ("STOPPING", "STOPPED") else "starting"
        out[key] += count
    return out


def build(args: Any = None) -> serve.Application:
    """The Ray Serve application of the serve flags (a Namespace, argv, or Ray Serve's application arguments: see
    ``parse_arguments``) -- ``serve run omni_accel.serve.ray_app:build model=... replicas=2``."""
    return application(args)


def application(args: Any, replica: dict | None = None) -> serve.Application:
    """``build`` with ``replica`` options over the flags' (as a Serve config file's ``deployments:`` section would
    give, e.g. a faster ``autoscaling_config``)."""
    from .server import _check_args

    args = parse_arguments(args)
    _check_args(args)
    check_arguments(args)
    options = replica_options(args)
    for key, value in (replica or {}).items():
        options[key] = {**options[key], **value} if isinstance(value, dict) and key in options else value
    return Ingress.options(**ingress_options(args)).bind(ModelReplica.options(**options).bind(args), args)


# ------------------------------------------------------------------------------------------------ CLI
def run(args) -> int:
    """``omni-accel serve --ray``: deploy on the cluster (a new local one by default), serve until SIGTERM /
    SIGINT, then delete the application (replicas drain) and stop what this command started."""
    check_arguments(args)  # before a cluster starts (server.run checked the other flags)
    own_cluster = not ray.is_initialized() and args.ray_address is None and not os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        ray.init(address=args.ray_address, logging_level=logging.WARNING)
    app = build(args)  # with the cluster known: replicas reserve GPUs when it has them (and --device says none)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": args.host, "port": args.port, "keep_alive_timeout_s": args.idle_timeout})
    serve.run(app, name=APP_NAME, route_prefix="/")
    scale = f"{args.autoscale} replicas (autoscaling)" if args.autoscale else f"{args.replicas or 1} replica(s)"
    print(f"omni-accel serve: Ray Serve, {scale} of {args.gpus_per_replica} process(es) each, on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    while not stop.wait(1.0):  # a timed wait: signals are handled between waits
        pass
    print("omni-accel serve: stopping (replicas finish what they hold)", file=sys.stderr, flush=True)
    serve.delete(APP_NAME)
    if own_cluster:
        serve.shutdown()
        ray.shutdown()
    return 0
