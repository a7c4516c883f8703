"""``omni-accel bench``: the plain pipeline and the accelerated one, timed side by side in one process.

    omni-accel bench --model /models/FLUX.1-dev --compile on --quant fp8 --steps 28 --out flux_fp8.json
    torchrun --nproc_per_node=2 -m omni_accel bench --model /models/Qwen-Image --sp 2 --out qwen_sp2.json

Both rows use the same model, prompt, seed, size and steps, and every timed run is a whole pipeline call (text
encoding, denoising, VAE decode). Warm-up calls come first and are reported apart as ``cold_s``: they pay for
compile, autotuning, CUDA-graph capture and lazy initialisation. The plain pipeline's first warm-up call runs under
torch's ``FlopCounterMode``, so TFLOP/s is the plain call's FLOPs over each row's time. A step cache that skips
work therefore shows a higher *effective* rate. Rows follow the row format of ``benchmarks/results/`` (model,
config, world_size, ms_per_step, tflops, peak_mem_gib, gpu, torch, diffusers, shape). They add the run times, the
speed-up, and the accelerated output's max abs difference and PSNR against the plain output.

Under torchrun every rank runs both pipelines (the parallel passes need all ranks in every call); rank 0 prints and
writes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import statistics
import time
from typing import Any

from .cli import (CliError, _accel_config, _call_kwargs, _check_attention_early, _check_sampling_args,
                  _load_pipeline_quietly, _resolve_device, _torch_dtype, add_acceleration_arguments,
                  add_model_arguments, call_parameters, under_torchrun)

logger = logging.getLogger("omni_accel.bench")

DEFAULT_PROMPT = "a red circle on a blue background"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"the text prompt (default {DEFAULT_PROMPT!r})")
    add_model_arguments(p)
    add_acceleration_arguments(p)
    b = p.add_argument_group("benchmark")
    b.add_argument("--warmup", type=int, default=1,
                   help="untimed calls before the timed ones, per pipeline (default 1; compile wants 2)")
    b.add_argument("--repeats", type=int, default=3, help="timed calls per pipeline; the median is reported")
    b.add_argument("--no-baseline", action="store_true",
                   help="time only the accelerated pipeline (no speed-up, no output comparison, no TFLOP/s)")
    b.add_argument("--out", default=None, metavar="JSON", help="write the rows and the run's facts to this file")
    b.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    return under_torchrun(lambda: _bench(args))


def _check_bench_args(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise CliError(f"--repeats {args.repeats} is invalid: it must be >= 1 (the median of the timed calls).")
    if args.warmup < 0:
        raise CliError(f"--warmup {args.warmup} is invalid: it must be >= 0.")
    if args.out is not None and os.path.isdir(args.out):
        raise CliError(f"--out {args.out!r} is a folder; give a file path such as {args.out}/bench.json.")


def _bench(args: argparse.Namespace) -> int:
    import torch

    import omni_accel
    from .distributed import is_main_process, world_size

    _check_bench_args(args)
    _check_sampling_args(args)
    device = _resolve_device(args.device)
    dtype = _torch_dtype(args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32"))
    config = _accel_config(args, device)  # AccelError on bad values, before any loading
    _check_attention_early(args.attention, device, dtype)
    pipe, defaults, source = _load_pipeline_quietly(args, device, dtype)
    kwargs = _call_kwargs(pipe, args, defaults)
    if "output_type" in kwargs:
        kwargs["output_type"] = "pt"  # tensors in [0, 1]: compared without a PIL round trip
    steps = kwargs.get("num_inference_steps") or _default_of(pipe, "num_inference_steps")
    quiet = not is_main_process()

    plain = None
    if not args.no_baseline:
        plain = _plain_runs(pipe, kwargs, args, device, quiet)
    omni_accel.accelerate(pipe, config=config)
    try:
        accelerated = _timed_runs(pipe, kwargs, args, torch.device(device), "accelerated", quiet)
        report = pipe.omni_accel.report()
    finally:
        omni_accel.restore(pipe)
    if quiet:
        return 0
    result = _result(args, kwargs, source, dtype, device, steps, world_size(), plain, accelerated, report, config)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    print(json.dumps(result, default=str) if args.json else format_table(result))
    return 0


def _default_of(pipe, name: str) -> Any:
    param = call_parameters(pipe).get(name)
    return None if param is None or param.default is param.empty else param.default


def _plain_runs(pipe, kwargs: dict, args: argparse.Namespace, device: str, quiet: bool) -> dict:
    """The stock pipeline on the device. With --offload the weights were loaded to the host: they go to the device
    for the plain runs (when they fit) and back to the host before the offload pass takes over."""
    import torch

    if not args.offload:
        return _timed_runs(pipe, kwargs, args, torch.device(device), "plain", quiet, count_flops=True)
    try:
        pipe.to(device)
        return _timed_runs(pipe, kwargs, args, torch.device(device), "plain", quiet, count_flops=True)
    except torch.OutOfMemoryError as exc:
        logger.warning("the plain pipeline does not fit on %s without offload: %s", device, exc)
        return {"error": f"does not fit on {device} without offload ({str(exc).splitlines()[0]})"}
    finally:
        pipe.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _timed_runs(pipe, kwargs: dict, args: argparse.Namespace, device, label: str, quiet: bool,
                count_flops: bool = False) -> dict:
    import torch
    from tqdm.auto import tqdm

    flops, cold, times = None, [], []
    total = args.warmup + args.repeats
    with tqdm(total=total, desc=f"{label} calls", disable=quiet, leave=False) as bar:
        for i in range(total):
            timed = i >= args.warmup
            if i == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            counting = count_flops and i == 0 and args.warmup > 0
            seconds, output, counted = _one_call(pipe, kwargs, args.seed, device, counting)
            flops = counted if counting else flops
            (times if timed else cold).append(seconds)
            bar.update(1)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"times": times, "cold": cold, "output": output, "flops": flops, "peak_mem_gib": peak}


def _one_call(pipe, kwargs: dict, seed: int, device, count_flops: bool) -> tuple[float, Any, int | None]:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    call = dict(kwargs, generator=torch.Generator("cpu").manual_seed(seed))  # a fresh generator: equal inputs
    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) if count_flops else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode(), counter if counter is not None else contextlib.nullcontext():
        result = pipe(**call)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    from .testing import output_tensor

    return seconds, output_tensor(result), counter.get_total_flops() if counter is not None else None


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Q K^T and P V of CPU SDPA (one aten op that FlopCounterMode does not know): 2 FLOPs per multiply-add."""
    *batch, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * math.prod(batch) * s_q * s_k * (d + d_v)


@functools.cache
def _cpu_attention_flops() -> dict:
    """FlopCounterMode's custom mapping for CPU SDPA (built on first use: importing torch is for the run)."""
    import torch

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return {op: _cpu_sdpa_flops} if op is not None else {}


def _result(args, kwargs: dict, source: str, dtype, device: str, steps: int | None, world: int,
            plain: dict | None, accelerated: dict, report: dict, config) -> dict:
    import diffusers
    import torch

    flops = plain.get("flops") if plain else None
    shape = {k: kwargs[k] for k in ("height", "width", "num_frames") if kwargs.get(k)}
    output = accelerated["output"]
    common = {
        "model": source, "world_size": world, "gpu": _device_name(device), "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "shape": {**shape, "output": list(output.shape), "steps": steps, "dtype": str(dtype).replace("torch.", "")},
    }
    rows = []
    if plain is not None:
        rows.append(_row("plain", plain, steps, flops, common))
    defaults = type(config)().as_dict()
    changed = {k: v for k, v in config.as_dict().items() if k != "device" and v != defaults[k]}
    row = _row(",".join(f"{k}={v}" for k, v in changed.items()) or "defaults", accelerated, steps, flops, common)
    row["accelerate_kwargs"] = changed
    row["applied"] = list(dict.fromkeys(p["pass"] for p in report["applied"]))
    row["transformer_forwards"] = (report.get("last_call") or {}).get("transformer_forwards")
    if report.get("cache"):  # a cached forward still counts as a forward: these say how many were reused
        counted = ("computed", "reused") if "computed" in report["cache"] else ("block_forwards",)  # tea_cache
        row["cache_steps"] = {k: report["cache"][k] for k in ("backend", *counted)}  # counts steps, the others blocks
    if plain is not None and "error" not in plain:
        row["speedup_vs_plain"] = round(statistics.median(plain["times"]) / statistics.median(accelerated["times"]), 4)
        row.update(_difference(accelerated["output"], plain["output"]))
    rows.append(row)
    call = {k: v for k, v in kwargs.items() if k not in ("prompt", "generator", "output_type")}
    return {"prompt": args.prompt, "seed": args.seed, "warmup": args.warmup, "repeats": args.repeats,
            "call_kwargs": call,  # the model's defaults and the flags, as the pipeline got them
            "flops_per_call": flops, "flops_counted_by": "torch FlopCounterMode on the plain call" if flops else None,
            "rows": rows}


def _row(config: str, runs: dict, steps: int | None, flops: int | None, common: dict) -> dict:
    if "error" in runs:
        return {**common, "config": config, "error": runs["error"]}
    s_per_call = statistics.median(runs["times"])
    return {
        **common, "config": config, "s_per_call": round(s_per_call, 6),
        "ms_per_step": round(s_per_call / steps * 1e3, 4) if steps else None,
        "tflops": float(f"{flops / s_per_call / 1e12:.4g}") if flops else None,  # 4 significant digits at any scale
        "peak_mem_gib": round(runs["peak_mem_gib"], 3) if runs["peak_mem_gib"] is not None else None,
        "runs_s": [round(t, 6) for t in runs["times"]], "cold_s": [round(t, 3) for t in runs["cold"]],
    }


def _difference(output, reference) -> dict:
    if output.shape != reference.shape:
        return {"max_abs_diff_vs_plain": None, "note": f"output shapes differ: {list(output.shape)} vs "
                                                       f"{list(reference.shape)}"}
    diff = (output - reference).abs()
    mse = float((diff ** 2).mean())
    psnr = None if mse == 0 else round(10 * math.log10(1.0 / mse), 2)  # outputs in [0, 1]; None = identical
    return {"max_abs_diff_vs_plain": float(diff.max()), "psnr_db_vs_plain": psnr}


def _device_name(device: str) -> str:
    import platform

    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _short(value: Any) -> Any:
    return f"{value:.4g}" if isinstance(value, float) else value


def format_table(result: dict) -> str:
    headers = ("config", "s/call", "ms/step", "TFLOP/s", "peak GiB", "speed-up", "max |diff|", "PSNR dB")
    lines = []
    for r in result["rows"]:
        if "error" in r:
            lines.append((r["config"], r["error"], "", "", "", "", "", ""))
            continue
        psnr = r.get("psnr_db_vs_plain")
        identical = "max_abs_diff_vs_plain" in r and r["max_abs_diff_vs_plain"] == 0
        lines.append((r["config"], r["s_per_call"], r["ms_per_step"], r["tflops"], r["peak_mem_gib"],
                      r.get("speedup_vs_plain", "" if r["config"] != "plain" else 1.0),
                      r.get("max_abs_diff_vs_plain", ""), "identical" if identical else psnr or ""))
    cells = [tuple("-" if v is None else str(_short(v)) for v in line) for line in [headers, *lines]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    first = result["rows"][0]
    shape = first["shape"]
    output = "x".join(str(n) for n in shape["output"])
    facts = (f"{first['model']} on {first['gpu']}, world size {first['world_size']}: output {output}, "
             f"{shape['steps']} steps, {shape['dtype']}; median of {result['repeats']} timed calls after "
             f"{result['warmup']} warm-up")
    cached = [f"{r['config']}: " + (f"{c['computed']} forwards computed, {c['reused']} reused from the cache"
                                    if "computed" in c else f"{c.get('block_forwards')} block forwards run")
              for r in result["rows"] if (c := r.get("cache_steps")) is not None]
    return "\n".join([facts, *text, *cached])
