"""compile="max" with and without its CUDA graphs on a launch-bound pipeline: the built-in model on the GPU.

The FLUX-shaped transformer at 1024² is GPU-bound (bench_transformer.py: graphs neither help nor hurt there); a small
DiT whose kernels finish faster than Python can launch them is where a replayed graph should pay. One process:
compile=True, compile="max" with OMNI_ACCEL_CUDA_GRAPHS=0, compile="max" with graphs, each the same 20-step
pipeline call (latents out), timed after warm-up; outputs compared with the compile=True ones, and the graph
counters from report() recorded so the file shows that replays happened.

    python benchmarks/bench_cuda_graphs.py --out benchmarks/results/bench_cuda_graphs_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import omni_accel  # noqa: E402
from benchmarks.timing import write_result  # noqa: E402
from omni_accel.builtin import BUILTIN_DEFAULTS, load_builtin  # noqa: E402

CONFIGS = [("compile", dict(compile=True), "1"), ("max_no_graphs", dict(compile="max"), "0"),
           ("max", dict(compile="max"), "1")]


def timed_calls(pipe, call: dict, device: torch.device, repeats: int) -> tuple[torch.Tensor, list[float]]:
    times, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).images
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return out, times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/bench_cuda_graphs.json")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    pipe = load_builtin(dtype=torch.bfloat16, device=device)
    steps = BUILTIN_DEFAULTS["num_inference_steps"]
    call = dict(prompt="a red circle on a blue background", height=BUILTIN_DEFAULTS["height"],
                width=BUILTIN_DEFAULTS["width"], num_inference_steps=steps, output_type="latent",
                max_sequence_length=BUILTIN_DEFAULTS["max_sequence_length"])
    result = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "model": "omni_accel built-in",
              "call": {k: v for k, v in call.items() if k != "prompt"}, "dtype": "bfloat16", "rows": []}
    reference = None
    for name, knobs, graphs_env in CONFIGS:
        os.environ["OMNI_ACCEL_CUDA_GRAPHS"] = graphs_env
        try:
            omni_accel.accelerate(pipe, attention="auto", **knobs)
        finally:
            os.environ.pop("OMNI_ACCEL_CUDA_GRAPHS", None)
        try:
            t0 = time.perf_counter()
            timed_calls(pipe, call, device, 2)  # compile / autotune / capture
            cold = time.perf_counter() - t0
            out, times = timed_calls(pipe, call, device, args.repeats)
            report = pipe.omni_accel.report()
        finally:
            omni_accel.restore(pipe)
            torch._dynamo.reset()
        reference = out if reference is None else reference
        graph_records = [a for a in report["applied"] if "cuda_graphs" in a]
        row = {"config": name, "accelerate_kwargs": knobs, "s_per_call": round(statistics.median(times), 4),
               "ms_per_step": round(statistics.median(times) / steps * 1e3, 3), "cold_s": round(cold, 1),
               "max_abs_diff_vs_compile": (out.float() - reference.float()).abs().max().item(),
               "cuda_graphs": graph_records, "transformer_forwards": report["last_call"]["transformer_forwards"]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    base = result["rows"][0]["s_per_call"]
    for row in result["rows"]:
        row["speedup_vs_compile"] = round(base / row["s_per_call"], 3)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
