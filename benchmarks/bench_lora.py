"""Per-request LoRA cost: adapter switch time and per-call overhead against the base pipeline, through the server's
own adapter manager (omni_accel.serve.lora.LoraManager: one hot-swapped slot, scale 0 = base).

    python benchmarks/bench_lora.py                                       # built-in model + its adapter, CPU
    python benchmarks/bench_lora.py --device cuda --dtype bfloat16 --compile on --out benchmarks/results/bench_lora_gpu.json

Rows (each the median of --iters pipeline calls after --warmup calls):
  plain      the pipeline without any LoRA layer
  slot_base  the LoRA slot at scale 0 (a request without an adapter on a server that has adapters)
  adapter    the same adapter every call (no switch)
  switching  the two adapters alternating every call (a hot swap before each call)
and the switch itself (``activate`` alone, median over the switching calls). With --compile on, the dynamo graph
count is read before and after the switching calls: a recompile would show there.
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


def timed_calls(pipe, kwargs: dict, n: int, before_call=None) -> tuple[list[float], list[float]]:
    """(call seconds, before_call seconds) of n calls."""
    calls, hooks = [], []
    for i in range(n):
        t0 = time.perf_counter()
        if before_call is not None:
            before_call(i)
        t1 = time.perf_counter()
        with torch.inference_mode():
            pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0))
        if pipe.device.type == "cuda":
            torch.cuda.synchronize()
        calls.append(time.perf_counter() - t1)
        hooks.append(t1 - t0)
    return calls, hooks


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
    ap.add_argument("--out", default="benchmarks/results/bench_lora_cpu.json")
    args = ap.parse_args(argv)

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
                    "rows": {}}

    def row(name: str, calls: list[float], extra: dict | None = None) -> None:
        result["rows"][name] = {"median_s": round(statistics.median(calls), 5), "min_s": round(min(calls), 5),
                                "calls_s": [round(c, 5) for c in calls], **(extra or {})}
        print(f"{name:10s} median {statistics.median(calls) * 1e3:9.2f} ms/call", flush=True)
        write_result(args.out, result)

    omni_accel.accelerate(pipe, **knobs)
    timed_calls(pipe, kwargs, args.warmup)
    row("plain", timed_calls(pipe, kwargs, args.iters)[0])
    omni_accel.restore(pipe)

    tmp = tempfile.mkdtemp(prefix="bench_lora_")
    first = args.lora or builtin_lora_path()
    other = second_adapter(pipe, os.path.join(tmp, "other"), rank=8)
    manager = LoraManager(pipe, {"first": first, "other": other}, max_loras=2, max_rank=args.max_rank)
    manager.prepare()  # the slot exists before accelerate(): compiled graphs include the LoRA layers
    omni_accel.accelerate(pipe, **knobs)
    choices = [{"name": n, "path": manager.named[n], "scale": 1.0} for n in ("first", "other")]
    timed_calls(pipe, kwargs, args.warmup, lambda i: manager.activate(choices[i % 2]))
    manager.activate(None)
    row("slot_base", timed_calls(pipe, kwargs, args.iters)[0])
    manager.activate(choices[0])
    row("adapter", timed_calls(pipe, kwargs, args.iters)[0])
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    calls, switches = timed_calls(pipe, kwargs, args.iters, lambda i: manager.activate(choices[(i + 1) % 2]))
    row("switching", calls, {"switch_s_median": round(statistics.median(switches), 6),
                             "switch_s": [round(s, 6) for s in switches],
                             "dynamo_graphs_before": graphs, "dynamo_graphs_after": counters["stats"]["unique_graphs"]})
    plain = result["rows"]["plain"]["median_s"]
    result["summary"] = {
        "switch_ms_median": round(statistics.median(switches) * 1e3, 3),
        "overhead_slot_base_pct": round(100 * (result["rows"]["slot_base"]["median_s"] / plain - 1), 2),
        "overhead_adapter_pct": round(100 * (result["rows"]["adapter"]["median_s"] / plain - 1), 2),
        "overhead_switching_pct": round(100 * (statistics.median(calls) / plain - 1), 2),
        "recompiled_on_switch": counters["stats"]["unique_graphs"] != graphs,
    }
    print(result["summary"], flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
