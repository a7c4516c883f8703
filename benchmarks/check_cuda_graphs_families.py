"""compile="max"'s CUDA graphs on real hardware, every family: outputs, captures per signature, restore.

The CI tests replay through a CPU stand-in; this script checks the real capture on a GPU. For each tiny pipeline of
omni_accel.testing (true CFG in qwen_image, and in qwen_image_two_signatures with a negative prompt of another
length, so two graphs; batched CFG in sd3; two transformers in wan22) it runs, in one process:

  eager -> compile=True -> compile="max" (3 calls: eager, capture, replay) -> restore

and records the max abs difference of the compile="max" outputs against compile=True (the graphs replay the same
compiled kernels, so this should be ~0) and against eager, the graph counters from report(), and whether restore()
gives back the eager output exactly. Exit status 1 when a case fails a check.

Both compiles run with the library's inductor options and graph pass (compile_options is the same for True and
"max"). `--dtype bfloat16` runs the pipelines in bf16, where the graph pass's 16-bit forms (the MLP's GELU in the
GEMM, the concatenation-free proj_out) are the ones captured; tolerances follow the dtype.

    python benchmarks/check_cuda_graphs_families.py --out benchmarks/results/check_cuda_graphs_families_h200.json
    python benchmarks/check_cuda_graphs_families.py --dtype bfloat16 --cases flux,qwen_image,wan \
        --out benchmarks/results/check_cuda_graphs_bf16_h100_20261206.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import omni_accel  # noqa: E402
from benchmarks.timing import write_result  # noqa: E402
from omni_accel.testing import run, tiny_pipeline  # noqa: E402

# name -> (tiny family, call overrides). The tiny qwen_image negative prompt has the prompt's token count (one
# signature); "blurry" is 9 text tokens shorter, so each step's two true-CFG forwards need two graphs.
CASES = {name: (name, {}) for name in
         ["flux", "flux_kontext", "flux2", "qwen_image", "qwen_image_edit", "wan", "wan22", "sd3", "z_image"]}
CASES["qwen_image_two_signatures"] = ("qwen_image", {"negative_prompt": "blurry"})
COMPILE_TOLERANCE = 1e-3  # fp32, compiled vs eager (fused reductions reorder sums)
# graphs vs compile=True: the same kernels, but inductor re-picks each reduction's launch config by timing after the
# dynamo reset between the two, which may reorder a sum; a stale or overwritten graph buffer is off by O(1)
GRAPHS_TOLERANCE = 1e-5
# in bf16 each of those differences is a few bf16 steps (2^-8 relative) of O(1) latents instead of float32's
TOLERANCES = {torch.float32: (COMPILE_TOLERANCE, GRAPHS_TOLERANCE), torch.bfloat16: (5e-2, 2e-2)}


def graph_stats(pipe) -> list[dict]:
    applied = pipe.omni_accel.report()["applied"]
    return [dict(a["graph_stats"], component=a.get("component")) for a in applied if a.get("cuda_graphs")]


def accelerated_runs(pipe, kwargs, calls: int, **knobs) -> tuple[list[torch.Tensor], list[dict]]:
    omni_accel.accelerate(pipe, attention="auto", **knobs)
    try:
        outs = [run(pipe, kwargs) for _ in range(calls)]
        stats = graph_stats(pipe)
    finally:
        omni_accel.restore(pipe)
        torch._dynamo.reset()
    return outs, stats


def check_case(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> dict:
    family, overrides = CASES[name]
    pipe, kwargs = tiny_pipeline(family)
    kwargs.update(overrides)
    pipe.to(device, dtype)
    compile_tolerance, graphs_tolerance = TOLERANCES[dtype]
    t0 = time.perf_counter()
    eager = run(pipe, kwargs)
    compiled, _ = accelerated_runs(pipe, kwargs, 2, compile=True)
    graphed, stats = accelerated_runs(pipe, kwargs, 3, compile="max")
    restored = run(pipe, kwargs)
    diff_vs_compile = max((g - compiled[-1]).abs().max().item() for g in graphed)
    diff_vs_eager = max((g - eager).abs().max().item() for g in graphed)
    replays = sum(s["replays"] for s in stats)
    row = {
        "case": name, "family": family, "call_overrides": overrides, "shape": list(eager.shape), "graph_stats": stats,
        "max_abs_diff_max_vs_compile": diff_vs_compile, "max_abs_diff_max_vs_eager": diff_vs_eager,
        "restore_exact": bool(torch.equal(restored, eager)), "seconds": round(time.perf_counter() - t0, 1),
    }
    failures = []
    if not stats or replays == 0:
        failures.append("no graph replay")
    if diff_vs_compile > graphs_tolerance:
        failures.append(f"graphs differ from compile=True by {diff_vs_compile:.3g} > {graphs_tolerance}")
    if diff_vs_eager > compile_tolerance:
        failures.append(f"graphs differ from eager by {diff_vs_eager:.3g} > {compile_tolerance}")
    if not row["restore_exact"]:
        failures.append("restore() output differs from eager")
    row["failures"] = failures
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the pipelines' dtype")
    ap.add_argument("--out", default="benchmarks/results/check_cuda_graphs_families.json")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    if not torch.cuda.is_available():
        print("this check needs a CUDA GPU (CUDA graphs do not exist on CPU; CI covers the CPU stand-in)")
        return 2
    device = torch.device("cuda")
    import diffusers

    from omni_accel.kernels import epilogue_fusion

    result = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "diffusers": diffusers.__version__,
              "dtype": args.dtype, "rows": []}
    for name in args.cases.split(","):
        before = dict(epilogue_fusion.REWRITES)
        row = check_case(name, device, getattr(torch, args.dtype))
        # what the graph pass replaced in this case's compiles (none where inductor's cache served a graph)
        row["epilogue_rewrites"] = epilogue_fusion.rewrites_since(before)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    result["failed"] = [r["case"] for r in result["rows"] if r["failures"]]
    write_result(args.out, result)
    print("failed:", result["failed"] or "none")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
