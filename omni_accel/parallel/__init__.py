"""Parallelism: the process mesh (torchrun env -> cfg x ring x ulysses x tp) and the passes that use it.

    torchrun --nproc_per_node=4 script.py      # in script.py:
    pipe = omni_accel.accelerate(pipe, sp=2, cfg_parallel=2)   # initialises the process group itself
    image = pipe(prompt=..., negative_prompt=..., generator=torch.Generator().manual_seed(0)).images[0]
    if omni_accel.distributed.rank() == 0: image.save("out.png")   # every rank holds the same image
    omni_accel.distributed.shutdown()

Sub-modules: mesh (process group, mesh, uneven collectives), attention (Ulysses / ring / USP), sequence (the
sp pass), cfg (the cfg_parallel pass), tp (the tp pass), vae (the vae_parallel pass).
"""

from .mesh import (
    ParallelMesh,
    gather_uneven,
    get_mesh,
    init,
    rank,
    shutdown,
    split_sizes,
    torchrun_env,
    world_size,
)

__all__ = ["ParallelMesh", "gather_uneven", "get_mesh", "init", "rank", "shutdown", "split_sizes", "torchrun_env",
           "world_size"]
