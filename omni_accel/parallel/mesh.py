"""The process mesh: process group from the torchrun environment, cfg x ring x ulysses x tp subgroups, shutdown.

Rank layout (tp fastest, cfg slowest): ``rank = ((c * R + r) * U + u) * T + t``. Every rank of a sequence group
(same c and t) holds one shard of the token sequence, shard index ``r * U + u``; the CFG group pairs the ranks that
hold the same shard in the two CFG branches. Plain ``dist.new_group`` subgroups (not DeviceMesh) because gloo and
NCCL both support them and uneven collectives need nothing more; a DeviceMesh for the tp dimension is built lazily
for torch's tensor-parallel styles.
"""

from __future__ import annotations

import copy
import datetime
import logging
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import AccelError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = float(os.environ.get("OMNI_ACCEL_PG_TIMEOUT", "600"))
_OWNED = {"group": False}  # did omni_accel create the default process group (then shutdown() destroys it)
_MESHES: dict[tuple, "ParallelMesh"] = {}


def torchrun_env() -> bool:
    """True when the torchrun / torch.distributed.launch environment variables are present."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def check_launched(processes: int, degrees: str = "the parallel degrees") -> None:
    """AccelError naming the process count when ``processes`` > 1 are needed and this one was neither started by
    torchrun nor joined a process group itself. ``degrees`` names the knobs that ask for them ("sp=3")."""
    if processes > 1 and not dist.is_initialized() and not torchrun_env():
        raise AccelError(
            f"{degrees} runs on {processes} processes, one per rank: launch with torchrun, e.g. "
            f"`torchrun --nproc_per_node={processes} your_script.py` (no torch.distributed environment was found)."
        )


def init(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group from the torchrun environment (no-op if already initialised).

    Backend: NCCL when CUDA is available, else gloo. ``timeout_s`` (default ``$OMNI_ACCEL_PG_TIMEOUT`` or 600 s)
    bounds every collective: a rank that dies mid-run makes the others fail after at most this long (torchrun
    usually tears the job down sooner: it kills the surviving workers as soon as one exits non-zero).
    """
    if dist.is_initialized():
        return
    check_launched(2)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group(backend, timeout=timeout)
    _OWNED["group"] = True
    logger.info("omni_accel: process group %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())


def shutdown() -> None:
    """Destroy the subgroups and, if omni_accel created it, the default process group. Safe to call twice."""
    _MESHES.clear()
    if dist.is_initialized() and _OWNED["group"]:
        # no barrier: after an error on one rank a barrier would wait for a rank that is gone
        dist.destroy_process_group()
        _OWNED["group"] = False


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


@dataclass
class ParallelMesh:
    """cfg x ring x ulysses x tp over the default group; each rank's coordinates and its subgroups."""

    cfg: int
    ring: int
    ulysses: int
    tp: int
    rank: int
    device: torch.device
    groups: dict = field(default_factory=dict, repr=False)
    ranks_of: dict = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.cfg * self.ring * self.ulysses * self.tp

    @property
    def sp(self) -> int:
        return self.ring * self.ulysses

    def coords(self, rank: int | None = None) -> tuple[int, int, int, int]:
        rank = self.rank if rank is None else rank
        t = rank % self.tp
        u = (rank // self.tp) % self.ulysses
        r = (rank // (self.tp * self.ulysses)) % self.ring
        c = rank // (self.tp * self.ulysses * self.ring)
        return c, r, u, t

    @property
    def cfg_rank(self) -> int:
        return self.coords()[0]

    @property
    def ring_rank(self) -> int:
        return self.coords()[1]

    @property
    def ulysses_rank(self) -> int:
        return self.coords()[2]

    @property
    def tp_rank(self) -> int:
        return self.coords()[3]

    @property
    def sp_rank(self) -> int:
        """Index of this rank's sequence shard in its sequence group (ring-major, ulysses-minor)."""
        _, r, u, _ = self.coords()
        return r * self.ulysses + u

    # -- groups -------------------------------------------------------------------------------------------
    def group(self, name: str):
        """The subgroup of this rank along ``name`` in {"cfg", "ring", "ulysses", "tp", "sequence", "branch",
        "world"} ("branch": ring x ulysses x tp, the ranks of one CFG branch)."""
        return self.groups[name]

    def group_ranks(self, name: str) -> list[int]:
        return self.ranks_of[name]

    @property
    def sequence_group(self):
        """Ranks that share one CFG branch and one tp slice (they hold the shards of one sequence). A cache decision
        must agree over the larger "branch" group (sequence x tp)."""
        return self.groups["sequence"]

    def all_reduce_mean(self, tensor: torch.Tensor, group: str = "world") -> torch.Tensor:
        """Mean of ``tensor`` over ``group`` (returned, the input is untouched): cache decisions made from it are
        identical on every rank."""
        out = tensor.detach().clone()
        if len(self.ranks_of[group]) > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.groups[group])
            out /= len(self.ranks_of[group])
        return out

    def with_branch_over_cfg(self) -> "ParallelMesh":
        """A view of this mesh whose "branch" group is every rank (the cfg group included).

        For batched CFG: one forward carries both CFG branches, split by batch over the cfg group, so a cache
        decision about that forward (TeaCache reduces its metric over "branch") must agree on every rank, and the
        mean of the two half-batch metrics is the whole batch's, as in one process. The cached mesh is untouched.
        """
        view = copy.copy(self)
        view.groups, view.ranks_of = dict(self.groups), dict(self.ranks_of)
        view.groups["branch"], view.ranks_of["branch"] = self.groups["world"], self.ranks_of["world"]
        return view

    def tp_device_mesh(self):
        """A 1-D torch DeviceMesh over this rank's tp group (for torch's tensor-parallel styles)."""
        if "tp_mesh" not in self.groups:
            from torch.distributed.device_mesh import DeviceMesh

            self.groups["tp_mesh"] = DeviceMesh.from_group(self.groups["tp"], self.device.type)
        return self.groups["tp_mesh"]


def _build(cfg: int, ring: int, ulysses: int, tp: int, device: torch.device) -> ParallelMesh:
    mesh = ParallelMesh(cfg, ring, ulysses, tp, rank(), device)
    n = mesh.world_size
    all_coords = [mesh.coords(r) for r in range(n)]
    keys = {  # which coordinates a group holds fixed
        "cfg": (1, 2, 3),
        "ring": (0, 2, 3),
        "ulysses": (0, 1, 3),
        "tp": (0, 1, 2),
        "sequence": (0, 3),
        "branch": (0,),  # ring x ulysses x tp: every rank that works on one CFG branch (caches agree over it)
    }
    for name, fixed in keys.items():
        buckets: dict[tuple, list[int]] = {}
        for r, co in enumerate(all_coords):
            buckets.setdefault(tuple(co[i] for i in fixed), []).append(r)
        # every rank must call new_group for every group, in the same order
        for key in sorted(buckets):
            members = buckets[key]
            group = dist.new_group(members) if n > 1 else None
            if mesh.rank in members:
                mesh.groups[name] = group
                mesh.ranks_of[name] = members
    mesh.groups["world"] = dist.group.WORLD if n > 1 else None
    mesh.ranks_of["world"] = list(range(n))
    return mesh


def get_mesh(cfg: int = 1, ring: int = 1, ulysses: int = 1, tp: int = 1, device: torch.device | None = None,
             ) -> ParallelMesh:
    """The mesh for these degrees (built once per process, then reused). Initialises the process group if needed.

    Raises AccelError -- on every rank alike, because every rank sees the same degrees and world size -- when the
    product of the degrees does not equal the world size.
    """
    n = cfg * ring * ulysses * tp
    if n > 1:
        degrees = ", ".join(f"{k}={v}" for k, v in (("cfg_parallel", cfg), ("ring", ring), ("ulysses", ulysses),
                                                    ("tp", tp)) if v > 1)
        check_launched(n, degrees)
        init()
    ws = world_size()
    if n != ws:
        raise AccelError(
            f"the parallel degrees cfg_parallel={cfg} x ring={ring} x ulysses={ulysses} x tp={tp} = {n} do not "
            f"match the world size {ws}; launch with `torchrun --nproc_per_node={n}` or change the degrees so "
            f"their product is {ws}."
        )
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    key = (cfg, ring, ulysses, tp)
    if key not in _MESHES:
        _MESHES[key] = _build(cfg, ring, ulysses, tp, device)
    return _MESHES[key]


# -- uneven collectives (gloo and NCCL alike) -----------------------------------------------------------------
def split_sizes(length: int, parts: int) -> list[int]:
    """torch.tensor_split's sizes: the first ``length % parts`` shards get one extra token."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def gather_uneven(local: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """All-gather shards of different lengths along ``dim`` (pad to the longest, all_gather, trim, concatenate)."""
    if len(sizes) == 1:
        return local
    longest = max(sizes)
    pad = longest - local.shape[dim]
    if pad:
        shape = list(local.shape)
        shape[dim] = pad
        local = torch.cat([local, local.new_zeros(shape)], dim=dim)
    local = local.contiguous()
    bufs = [torch.empty_like(local) for _ in sizes]
    dist.all_gather(bufs, local, group=group)
    return torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)], dim=dim)


def all_to_all_uneven(chunks: list[torch.Tensor], out_shapes: list[tuple], group) -> list[torch.Tensor]:
    """All-to-all with per-peer shapes: flattened into one ``all_to_all_single`` with split sizes (gloo's list
    ``all_to_all`` insists on equal shapes; ``all_to_all_single`` with splits works on gloo and NCCL)."""
    send = torch.cat([c.reshape(-1) for c in chunks])
    in_splits = [c.numel() for c in chunks]
    out_splits = [math.prod(s) for s in out_shapes]
    recv = send.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    return [piece.view(s) for piece, s in zip(recv.split(out_splits), out_shapes)]
