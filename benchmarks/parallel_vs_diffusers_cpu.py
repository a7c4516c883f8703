"""omni_accel's sequence parallelism vs diffusers' own context parallelism, on CPU with gloo (2 ranks).

    python benchmarks/parallel_vs_diffusers_cpu.py [--out benchmarks/results/parallel_vs_diffusers_cpu.json]

Relaunches itself under ``torchrun --nproc_per_node=2`` (gloo, CPU). For each case, the tiny FLUX.1 pipeline
(``omni_accel.testing.tiny_pipeline("flux")``) runs single-process first (the reference), then with
``omni_accel.accelerate(pipe, sp=2)``, then with diffusers'
``pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))``. Whatever diffusers does --
an image, or an exception -- is recorded, not asserted. Rank 0 writes the rows with the torch / diffusers versions
and the token counts of each case. tests/test_parallel.py runs the same ``compare_rows`` in its 2-rank launch and
asserts our side.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script (and by each torchrun rank): the benchmarks package sits under ROOT

from benchmarks.timing import write_result  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "parallel_vs_diffusers_cpu.json")

# (label, tiny-flux overrides): text tokens = max_sequence_length; image tokens = (height / 16) x (width / 16)
CASES = (
    ("even-12txt-6img", dict(max_sequence_length=12)),
    ("odd-11txt-6img", {}),
    ("odd-image-12txt-15img", dict(max_sequence_length=12, height=48, width=80)),
)


def _shape(pipe, kwargs: dict) -> dict:
    """Token counts and heads of one case (what decides whether an equal split is possible)."""
    cfg = pipe.transformer.config
    return dict(text_tokens=kwargs["max_sequence_length"],
                image_tokens=(kwargs["height"] // 16) * (kwargs["width"] // 16),
                heads=cfg.num_attention_heads, head_dim=cfg.attention_head_dim,
                blocks=cfg.num_layers + cfg.num_single_layers, steps=kwargs["num_inference_steps"])


def _diffusers_cp_pipeline(build, row: dict):
    """A fresh pipeline with diffusers' enable_parallelism as shipped; if that fails, another fresh one (the failed
    call may have left hooks behind) with torch.accelerator.device_count patched to 1 -- diffusers computes
    ``rank % device_count()``, a ZeroDivisionError without a GPU. None when diffusers refuses both."""
    import torch
    from diffusers import ContextParallelConfig

    pipe = build()
    try:
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        row["diffusers_as_is"] = "enabled"
        return pipe
    except Exception as exc:
        row["diffusers_as_is"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    pipe = build()
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        row["diffusers_workaround"] = "enabled with torch.accelerator.device_count patched to 1"
        return pipe
    except Exception as exc:
        row["diffusers_workaround"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return None
    finally:
        torch.accelerator.device_count = real


def _timed(pipe, kwargs: dict):
    """(output, seconds of a second call): the first call pays one-off costs (group setup, allocator)."""
    from omni_accel.testing import run

    run(pipe, kwargs)
    started = time.perf_counter()
    out = run(pipe, kwargs)
    return out, round(time.perf_counter() - started, 3)


def compare_rows() -> list[dict]:
    """One row per case: our max abs diff vs single process, diffusers' outcome. Call on every rank of a 2-rank
    torchrun launch (both sides run collectives). The seconds are of a tiny model on CPU: they show that both ran,
    not which is faster."""
    import omni_accel
    from omni_accel.testing import run, tiny_pipeline

    rows = []
    for label, overrides in CASES:
        pipe, kwargs = tiny_pipeline("flux", **overrides)
        row = dict(case=label, **_shape(pipe, kwargs))
        reference = run(pipe, kwargs)
        omni_accel.accelerate(pipe, sp=2)
        ours, row["ours_s"] = _timed(pipe, kwargs)
        omni_accel.restore(pipe)
        row["ours_max_abs_diff"] = float((ours - reference).abs().max())
        # a fresh pipeline: diffusers' parallelism hooks have no undo
        pipe = _diffusers_cp_pipeline(lambda: tiny_pipeline("flux", **overrides)[0], row)
        if pipe is not None:
            try:
                theirs, row["diffusers_s"] = _timed(pipe, kwargs)
                row["diffusers_max_abs_diff"] = float((theirs - reference).abs().max())
            except Exception as exc:
                row["diffusers_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rows.append(row)
    return rows


def _versions() -> dict:
    import diffusers
    import torch

    return dict(torch=torch.__version__, diffusers=diffusers.__version__, python=platform.python_version(),
                machine=platform.machine(), cpu_threads_per_rank=torch.get_num_threads())


def _run_ranks(out: str) -> None:
    import torch

    import omni_accel.distributed as dist_util

    torch.set_num_threads(1)
    dist_util.init(backend="gloo")
    rows = compare_rows()
    if dist_util.is_main_process():
        result = dict(generated_by="python benchmarks/parallel_vs_diffusers_cpu.py", backend="gloo",
                      world_size=dist_util.world_size(), ulysses_degree=2,
                      model="tiny FLUX.1 (omni_accel.testing.tiny_pipeline('flux'), random weights, fp32)",
                      max_abs_diff="of the output image vs the same pipeline in one process",
                      **_versions(), rows=rows)
        write_result(out, result)
        print(json.dumps(result, indent=1))
    dist_util.shutdown()


def main() -> int:
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else DEFAULT_OUT
    sys.path.insert(0, ROOT)
    from omni_accel.distributed import torchrun_env

    if torchrun_env():
        _run_ranks(out)
        return 0
    # not under torchrun yet: start the two ranks (each runs this file again)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--out", out]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
