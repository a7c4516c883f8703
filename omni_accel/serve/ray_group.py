"""Multi-GPU replicas on Ray Serve: one replica is a group of G processes in the replica's placement group, with
``torch.distributed`` initialised across them (NCCL on GPUs, gloo on CPU). Rank 0 is the Serve replica itself and
answers; ranks 1..G-1 are Ray actors in the group's other bundles that sit in ``follower_loop`` -- exactly the
torchrun server's split (serve/distributed.py): rank 0's queue workers broadcast each call's spec, then every rank
makes the call.

Set-up follows vLLM's Ray executor: each rank reports its node and GPU ids; the ranks of one node see all of the
group's GPUs on that node (``CUDA_VISIBLE_DEVICES``; NCCL's peer-to-peer paths need the peers visible) and pick
their own by ``LOCAL_RANK``; rank 0's node address and a free port there are the rendezvous; then every rank loads
and accelerates the same pipelines with the same flags.

A dead rank ends its group: the followers are owned by rank 0, so Ray kills them with it; a follower that dies ends
its ``follow`` call, which rank 0 watches -- it then ends its jobs (the ingress resends those that had not started,
503 for the others) and fails its health check, and Serve replaces the whole replica.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Callable

import ray

logger = logging.getLogger("omni_accel.serve")


def device_plan(places: list[tuple[str, list[str]]]) -> list[tuple[str | None, int]]:
    """(CUDA_VISIBLE_DEVICES, LOCAL_RANK) of each rank from its (node id, Ray GPU ids). Ranks of one node see every
    GPU of the group on that node and take theirs by index; a rank without GPUs gets (None, 0)."""
    on_node: dict[str, set[str]] = {}
    for node, gpus in places:
        on_node.setdefault(node, set()).update(str(g) for g in gpus)
    plan = []
    for node, gpus in places:
        if not gpus:
            plan.append((None, 0))
            continue
        visible = sorted(on_node[node], key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g))
        plan.append((",".join(visible), visible.index(str(gpus[0]))))
    return plan


def rank_env(rank: int, world: int, master: tuple[str, int], visible: str | None, local_rank: int) -> dict:
    """The torchrun-style environment of one rank (what ``omni_accel.distributed.init`` reads)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank), "MASTER_ADDR": master[0],
           "MASTER_PORT": str(master[1])}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def place() -> tuple[str, list[str]]:
    """This process's (Ray node id, GPU ids)."""
    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


def setup_rank(args, env: dict):
    """Join the group (the environment of ``rank_env``) and load the served models as ``serve`` does."""
    from .. import distributed as odist
    from .server import load_models

    os.environ.update(env)
    odist.init()
    return load_models(args)


class RankProcess:
    """Ranks 1..G-1 of a replica (a Ray actor in a bundle of the replica's placement group)."""

    def __init__(self, args):
        self.args = args
        self.models = None

    def place(self) -> tuple[str, list[str]]:
        return place()

    def setup(self, env: dict) -> int:
        self.models = setup_rank(self.args, env)
        return os.getpid()

    def follow(self) -> int:
        """Run rank 0's broadcast calls until it says stop (the number of calls)."""
        from .distributed import follower_loop

        return follower_loop(self.models.runners())


class RankGroup:
    """Rank 0's side of a multi-process replica: starts and sets up the followers, joins the process group, loads
    the models here, and watches the followers (``on_broken(why)`` when one goes away)."""

    def __init__(self, args, world: int, resources: dict, on_broken: Callable[[str], None]):
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .distributed import Leader

        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("a multi-process replica needs its placement group (the deployment's "
                               "placement_group_bundles); build it with omni_accel.serve.ray_app.build")
        actor = ray.remote(RankProcess)
        self.followers = [actor.options(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                                            placement_group=group, placement_group_bundle_index=rank)).remote(args)
                          for rank in range(1, world)]
        places = [place()] + ray.get([f.place.remote() for f in self.followers])
        host = ray.util.get_node_ip_address()
        master = (host, free_port(host))
        envs = [rank_env(rank, world, master, *where) for rank, where in enumerate(device_plan(places))]
        setups = [f.setup.remote(env) for f, env in zip(self.followers, envs[1:])]
        self.models = setup_rank(args, envs[0])  # the rendezvous and the warm-up's collectives meet the followers'
        self.pids = [os.getpid()] + ray.get(setups)
        self.loops = [f.follow.remote() for f in self.followers]
        self.leader = Leader(self.models.runners())
        self.broken: str | None = None
        self.stopping = False
        self.on_broken = on_broken
        threading.Thread(target=self._watch, name="omni-accel-rank-watch", daemon=True).start()
        logger.info("omni_accel.serve: replica group of %d ranks up (pids %s)", world, self.pids)

    def _watch(self) -> None:
        ready, _ = ray.wait(self.loops, num_returns=1)
        if self.stopping:
            return
        rank = self.loops.index(ready[0]) + 1
        try:
            ray.get(ready[0])
            why = f"rank {rank} of the replica's group left its loop"
        except Exception as exc:  # noqa: BLE001 -- typically ActorDiedError
            why = f"rank {rank} of the replica's group died ({type(exc).__name__})"
        self.broken = why
        logger.error("omni_accel.serve: %s; ending this replica's jobs so that Ray Serve replaces it", why)
        self.on_broken(why)

    def stop(self) -> None:
        """Tell the followers to stop (not when the group is broken: the broadcast would wait for a dead rank)."""
        from .. import distributed as odist

        self.stopping = True
        if self.broken is None:
            self.leader.stop()
            ready, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=30)
            if len(ready) == len(self.loops):
                odist.shutdown()
        for follower in self.followers:
            ray.kill(follower)


__all__ = ["RankGroup", "RankProcess", "device_plan", "rank_env"]
