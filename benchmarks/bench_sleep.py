"""Sleep / wake: memory released and wake latency, and the output after waking against the one before sleeping.

    python benchmarks/bench_sleep.py                                   # built-in model, CPU: RSS (spill file)
    python benchmarks/bench_sleep.py --device cuda --dtype bfloat16 --compile on --out benchmarks/results/bench_sleep_gpu.json

CPU: process RSS before sleep, asleep, awake (psutil). GPU: torch.cuda.memory_allocated / memory_reserved at the
same three points, and the process RSS (the pinned host copy). ``--repeat`` sleep/wake cycles, medians reported.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import write_result  # noqa: E402


def memory(device: str) -> dict:
    import psutil

    gc.collect()
    out = {"rss_bytes": psutil.Process().memory_info().rss}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        out.update(gpu_allocated_bytes=torch.cuda.memory_allocated(), gpu_reserved_bytes=torch.cuda.memory_reserved())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="diffusers folder (default: the built-in model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--compile", default="off", choices=["off", "on"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/bench_sleep_cpu.json")
    args = ap.parse_args(argv)

    import omni_accel
    from omni_accel.builtin import BUILTIN_DEFAULTS, load_builtin

    pipe = load_builtin(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    omni_accel.accelerate(pipe, compile=args.compile == "on")
    kwargs = dict(BUILTIN_DEFAULTS, prompt="a large red star in the top left on a blue background",
                  num_inference_steps=args.steps, output_type="pt")

    def call() -> torch.Tensor:
        with torch.inference_mode():
            out = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0)).images
        return out.float().cpu()

    before = call()
    cycles = []
    for _ in range(args.repeat):
        awake = memory(args.device)
        slept = omni_accel.sleep(pipe)
        asleep = memory(args.device)
        woke = omni_accel.wake_up(pipe)
        after = call()
        cycles.append({"sleep": slept, "wake_s": woke["seconds"], "awake": awake, "asleep": asleep,
                       "rss_released_bytes": awake["rss_bytes"] - asleep["rss_bytes"],
                       "gpu_released_bytes": awake.get("gpu_allocated_bytes", 0) - asleep.get("gpu_allocated_bytes", 0),
                       "output_equal": bool(torch.equal(after, before))})
        print(f"released {slept['released_bytes'] / 2**20:.1f} MiB of tensors ({slept['where']}), RSS -"
              f"{cycles[-1]['rss_released_bytes'] / 2**20:.1f} MiB, GPU -{cycles[-1]['gpu_released_bytes'] / 2**20:.1f}"
              f" MiB; sleep {slept['seconds'] * 1e3:.1f} ms, wake {woke['seconds'] * 1e3:.1f} ms; same output: "
              f"{cycles[-1]['output_equal']}", flush=True)
    result = {"args": vars(args), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "cycles": cycles,
              "summary": {"tensor_bytes": cycles[0]["sleep"]["released_bytes"], "where": cycles[0]["sleep"]["where"],
                          "rss_released_bytes_median": statistics.median(c["rss_released_bytes"] for c in cycles),
                          "gpu_released_bytes_median": statistics.median(c["gpu_released_bytes"] for c in cycles),
                          "sleep_s_median": statistics.median(c["sleep"]["seconds"] for c in cycles),
                          "wake_s_median": statistics.median(c["wake_s"] for c in cycles),
                          "output_equal_every_cycle": all(c["output_equal"] for c in cycles)}}
    print(result["summary"], flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
