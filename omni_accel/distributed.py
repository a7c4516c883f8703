"""``omni_accel.distributed``: process group from the torchrun environment, the parallel mesh, shutdown.

A thin re-export of ``omni_accel.parallel.mesh`` (see docs/parallelism.md). Every rank runs the whole pipeline call
on identical inputs and returns the same images as rank 0; only rank 0 needs to save them.
"""

from .parallel.mesh import (  # noqa: F401
    DEFAULT_TIMEOUT_S,
    ParallelMesh,
    all_to_all_uneven,
    gather_uneven,
    get_mesh,
    init,
    rank,
    shutdown,
    split_sizes,
    torchrun_env,
    world_size,
)


def is_main_process() -> bool:
    """True on rank 0 (and without torch.distributed): the process that should write files."""
    return rank() == 0
