"""Per-request LoRA cost: adapter switch time and per-call overhead against the base pipeline, through the server's
own adapter manager (omni_accel.serve.lora.LoraManager: one hot-swapped slot, scale 0 = base).

    python benchmarks/bench_lora.py                                       # built-in model + its adapter, CPU
    python benchmarks/bench_lora.py --device cuda --dtype bfloat16 --compile on --out benchmarks/results/bench_lora_gpu.json

Rows (medians of --iters rounds after --warmup rounds; each round runs every row once, interleaved):
  plain      a second copy of the pipeline without any LoRA layer
  slot_base  the LoRA slot at scale 0 (a request without an adapter on a server that has adapters)
  switching  a call right after a switch to the other adapter (the switch's time included)
  adapter    the same adapter again (no switch)
and the switch itself (``activate`` alone). The dynamo graph count is read after the warm-up and at the end: with
--compile on, a recompile on a switch would show there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import write_result  # noqa: E402


def second_adapter(pipe, folder: str, rank: int) -> str:
    """A second adapter on the same modules as the built-in one (seeded random weights), saved like a trained one."""
    from omni_accel.builtin.train_lora import TARGET_MODULES
    from omni_accel.testing.lora import random_lora

    state = random_lora(pipe, rank=rank, seed=3, std=0.05, targets=tuple(f"*{t}" for t in TARGET_MODULES))
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    pipe.save_lora_weights(folder, transformer_lora_layers=state)
    return folder


def timed_call(pipe, kwargs: dict) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0))
    if pipe.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="diffusers folder (default: the built-in model)")
    ap.add_argument("--lora", default=None, help="adapter folder (default: the built-in adapter)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--compile", default="off", choices=["off", "on"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default="benchmarks/results/bench_lora_cpu.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import omni_accel
    from omni_accel.builtin import BUILTIN_DEFAULTS, builtin_lora_path, load_builtin
    from omni_accel.serve.lora import LoraManager

    dtype = getattr(torch, args.dtype)
    pipe = load_builtin(args.model, dtype=dtype, device=args.device)
    kwargs = dict(BUILTIN_DEFAULTS, prompt="a large red star in the top left on a blue background",
                  num_inference_steps=args.steps, output_type="pil")
    knobs = dict(compile=args.compile == "on")
    result: dict = {"args": vars(args), "torch": torch.__version__, "device": str(pipe.device),
                    "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "load_average_at_start": os.getloadavg(), "rows": {}}

    def row(name: str, calls: list[float]) -> None:
        result["rows"][name] = {"median_s": round(statistics.median(calls), 5), "min_s": round(min(calls), 5),
                                "calls_s": [round(c, 5) for c in calls]}
        print(f"{name:10s} median {statistics.median(calls) * 1e3:9.2f} ms/call", flush=True)
        write_result(args.out, result)

    plain = load_builtin(args.model, dtype=dtype, device=args.device)  # a second copy without any LoRA layer
    omni_accel.accelerate(plain, **knobs)
    tmp = tempfile.mkdtemp(prefix="bench_lora_")
    first = args.lora or builtin_lora_path()
    other = second_adapter(pipe, os.path.join(tmp, "other"), rank=8)
    manager = LoraManager(pipe, {"first": first, "other": other}, max_loras=2, max_rank=args.max_rank)
    manager.prepare()  # the slot exists before accelerate(): compiled graphs include the LoRA layers
    omni_accel.accelerate(pipe, **knobs)
    choices = [{"name": n, "path": manager.named[n], "scale": 1.0} for n in ("first", "other")]
    from torch._dynamo.utils import counters

    times: dict[str, list[float]] = {"plain": [], "slot_base": [], "switching": [], "adapter": [], "switch": []}
    graphs = None
    # rounds interleave the rows, so that a change of the machine's load falls on every row alike
    for r in range(args.warmup + args.iters):
        t_plain = timed_call(plain, kwargs)
        manager.activate(None)
        t_base = timed_call(pipe, kwargs)
        t0 = time.perf_counter()
        manager.activate(choices[r % 2])  # the other adapter than the round before: a hot swap
        t_switch = time.perf_counter() - t0
        t_switched = timed_call(pipe, kwargs)
        t_adapter = timed_call(pipe, kwargs)  # the same adapter again: no switch
        if r == args.warmup - 1 or (args.warmup == 0 and r == 0):
            graphs = counters["stats"]["unique_graphs"]
        if r >= args.warmup:
            for key, value in (("plain", t_plain), ("slot_base", t_base), ("switch", t_switch),
                               ("switching", t_switched + t_switch), ("adapter", t_adapter)):
                times[key].append(value)
    for name in ("plain", "slot_base", "adapter", "switching"):
        row(name, times[name])
    base = statistics.median(times["plain"])
    result["summary"] = {
        "switch_ms_median": round(statistics.median(times["switch"]) * 1e3, 3),
        "switch_ms": [round(t * 1e3, 3) for t in times["switch"]],
        **{f"overhead_{name}_pct": round(100 * (statistics.median(times[name]) / base - 1), 2)
           for name in ("slot_base", "adapter", "switching")},
        "dynamo_graphs_after_warmup": graphs, "dynamo_graphs_at_end": counters["stats"]["unique_graphs"],
        "recompiled_on_switch": counters["stats"]["unique_graphs"] != graphs,
        "load_average_at_end": os.getloadavg(),
    }
    print(result["summary"], flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
