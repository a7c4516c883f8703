"""Multi-GPU serving: rank 0 serves HTTP and fans every pipeline call out to all ranks.

Under ``torchrun --nproc_per_node=N omni-accel serve ...`` (or ``python -m omni_accel serve``) every rank loads
and accelerates the same pipelines (with the parallel degrees of the flags, e.g. ``--sp 2``). Rank 0 runs the HTTP
server and the job queues' workers; for each call a worker broadcasts the call's spec -- plain data: the job kind
("image", "video"), prompts, seeds, size, steps, reference images -- with
``torch.distributed.broadcast_object_list`` and then makes the call; the other ranks sit in ``follower_loop``,
receive the same spec and make the same call with the runner of its kind, so the collectives inside the parallel
passes line up. Only rank 0 answers. One lock keeps the broadcast-and-call of different queues (an image and a video
model) from interleaving. When idle, rank 0 broadcasts a ping every ``PING_S`` seconds so the followers' wait never
reaches the process-group timeout; on shutdown it broadcasts a stop.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

logger = logging.getLogger("omni_accel.serve")

PING_S = float(os.environ.get("OMNI_ACCEL_SERVE_PING_S", "30"))
PING = {"op": "ping"}
STOP = {"op": "stop"}

Runner = Callable[[dict, Any], Any]  # (spec, control or None) -> the call's output


def _broadcast(obj=None):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0's side: ``executor(kind)`` is the job queue executor that broadcasts, then runs ``runners[kind]``.
    Aborting a call is not possible (every rank must finish it): its queue is built with ``can_abort=False``."""

    def __init__(self, runners: dict[str, Runner]):
        self.runners = runners
        self.calls = 0
        self._lock = threading.Lock()

    def executor(self, kind: str) -> Runner:
        def execute(spec: dict, control=None):
            with self._lock:
                _broadcast(dict(spec, kind=kind))
                self.calls += 1
                return self.runners[kind](spec, control)

        return execute

    def ping(self) -> None:
        with self._lock:
            _broadcast(PING)

    def stop(self) -> None:
        with self._lock:
            _broadcast(STOP)


def follower_loop(runners: dict[str, Runner]) -> int:
    """Ranks > 0: run every broadcast call with the runner of its kind until rank 0 says stop. Returns the number of
    calls run."""
    import torch.distributed as dist

    calls = 0
    logger.info("omni_accel.serve: rank %d waiting for work from rank 0", dist.get_rank())
    while True:
        spec = _broadcast()
        op = spec.get("op") if isinstance(spec, dict) else None
        if op == "stop":
            return calls
        if op == "ping":
            continue
        kind = spec.get("kind", "image")
        try:
            runners[kind](spec, None)
        except Exception:  # noqa: BLE001 -- rank 0 raised the same (identical inputs) and answered the client
            logger.exception("omni_accel.serve: rank %d: the %s call failed", dist.get_rank(), kind)
        calls += 1
        logger.info("omni_accel.serve: rank %d ran batch %d (%s)", dist.get_rank(), calls, kind)
