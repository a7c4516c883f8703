"""Multi-GPU serving: rank 0 serves HTTP and fans every batch out to all ranks.

Under ``torchrun --nproc_per_node=N omni-accel serve ...`` (or ``python -m omni_accel serve``) every rank loads
and accelerates the same pipeline (with the parallel degrees of the flags, e.g. ``--sp 2``). Rank 0 runs the HTTP
server and the batching worker; for each batch its worker broadcasts the batch spec (plain data: prompts, seeds,
size, steps, reference images) with ``torch.distributed.broadcast_object_list`` and then calls the pipeline; the
other ranks sit in ``follower_loop``, receive the same spec and make the same call, so the collectives inside the
parallel passes line up. Only rank 0 answers. When idle, rank 0 broadcasts a ping every ``PING_S`` seconds so the
followers' wait never reaches the process-group timeout; on shutdown it broadcasts a stop.
"""

from __future__ import annotations

import logging
import os

from .engine import LoadedModel, run_spec

logger = logging.getLogger("omni_accel.serve")

PING_S = float(os.environ.get("OMNI_ACCEL_SERVE_PING_S", "30"))
PING = {"op": "ping"}
STOP = {"op": "stop"}


def _broadcast(obj=None):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0's executor: broadcast, then run. Only one thread (the engine worker) issues collectives while
    serving; ``stop`` is called after that thread has ended."""

    def __init__(self, model: LoadedModel):
        self.model = model
        self.batches = 0

    def execute(self, spec: dict, should_abort=None):  # abort is not possible: every rank must finish the call
        _broadcast(spec)
        self.batches += 1
        return run_spec(self.model, spec)

    def ping(self) -> None:
        _broadcast(PING)

    def stop(self) -> None:
        _broadcast(STOP)


def follower_loop(model: LoadedModel) -> int:
    """Ranks > 0: run every broadcast batch until rank 0 says stop. Returns the number of batches run."""
    import torch.distributed as dist

    batches = 0
    logger.info("omni_accel.serve: rank %d waiting for work from rank 0", dist.get_rank())
    while True:
        spec = _broadcast()
        op = spec.get("op") if isinstance(spec, dict) else None
        if op == "stop":
            return batches
        if op == "ping":
            continue
        try:
            run_spec(model, spec)
        except Exception:  # noqa: BLE001 -- rank 0 raised the same (identical inputs) and answered the client
            logger.exception("omni_accel.serve: rank %d: the pipeline call failed", dist.get_rank())
        batches += 1
        logger.info("omni_accel.serve: rank %d ran batch %d (%d images)", dist.get_rank(), batches,
                    len(spec.get("prompts", ())))
