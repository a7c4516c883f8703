"""Where the first call of an accelerated transformer goes: setup (each pass of accelerate()), the calibrating
forward of static FP8 scales, the compiling forward, the forward that captures the CUDA graph, then a warm one.

    # one config per process, on a cold inductor / Triton cache (a fresh folder): what a new machine pays
    python benchmarks/bench_first_call.py --models flux --configs ours_fp8_fp8attn_fa \\
        --out benchmarks/results/bench_first_call_h200_flux.json
    # the same on a tiny config on the CPU (what tests/test_bench_smoke.py runs)
    python benchmarks/bench_first_call.py --device cpu --tiny --configs ours_bf16 --out /tmp/first_call.json
    # a machine handed the first one's compiles: save after the first run, load on a fresh cache in the second
    python benchmarks/bench_first_call.py --models flux --configs ours_fp8_fp8attn_fa --save-compile-cache flux.cc
    python benchmarks/bench_first_call.py --models flux --configs ours_fp8_fp8attn_fa --load-compile-cache flux.cc
    # only the host-memory copies (no model)
    python benchmarks/bench_first_call.py --configs "" --host-copy-gib 4 --out /tmp/host_copy.json

Configs are bench_peers.py's rows (the same setup code). Per config: seconds of the plain eager forward that
precedes it (CUDA context, cuBLAS), of ``accelerate()`` with ``report()["setup_s"]`` (per pass), of the calibration
forward, and of forwards 1-3; ``first_call_s`` = setup + calibration + forward 1 (bench_peers' definition), and
``until_steady_s`` adds forward 2 (the CUDA graph's warm-up and capture). Rows run on the library's own inductor
options (a row's inductor field is for step-time A/B runs in bench_peers) with the row's A/B switches, e.g.
``ours_fp8_fp8attn_fa_splitstreams`` for FLUX's first single-stream block compiled apart. Dynamo / inductor's own phase times
(``torch._dynamo.utils.compile_times``) and, with ``--cprofile``, the host functions that took the longest
(cumulative and own time) come with each row; cProfile slows Python-heavy compilation, so its row's seconds are
not the figures to quote. ``--host-copy-gib`` adds a measurement of moving that many GiB of bf16 weights to host
memory, pageable and pinned (what the quant pass does with the original weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="flux", help="one of bench_peers' models: flux, wan81, qwen_image")
    ap.add_argument("--configs", default="ours_fp8_fp8attn_fa", help="comma list of bench_peers rows")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke test)")
    ap.add_argument("--blocks", type=int, default=0, help="blocks per stack (0 = all), as in bench_peers")
    ap.add_argument("--warm-cache", action="store_true",
                    help="use the machine's inductor / Triton caches instead of a fresh folder per run")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="profile the host with cProfile and keep its N top functions (slows compilation)")
    ap.add_argument("--host-copy-gib", type=float, default=0.0,
                    help="also time moving this many GiB of bf16 weights to host memory, pageable and pinned")
    ap.add_argument("--load-compile-cache", default=None, metavar="PATH",
                    help="omni_accel.load_compile_cache(PATH) before the first row: a machine given a saved cache")
    ap.add_argument("--save-compile-cache", default=None, metavar="PATH",
                    help="omni_accel.save_compile_cache(PATH) after the last row, for a later --load-compile-cache")
    ap.add_argument("--out", default="benchmarks/results/bench_first_call.json")
    args = ap.parse_args(argv)
    if args.blocks < 0:
        ap.error(f"--blocks {args.blocks}: give the number of blocks to keep per stack (>= 1), or 0 for all")
    if args.host_copy_gib < 0:
        ap.error(f"--host-copy-gib {args.host_copy_gib}: give the size to copy in GiB (> 0), or 0 for no copy test")
    if args.cprofile < 0:
        ap.error(f"--cprofile {args.cprofile}: give how many functions to keep (>= 1), or 0 for no profile")
    return args


def cold_caches() -> str:
    """Point inductor and Triton at a fresh folder (before torch compiles anything): a first run's compile."""
    folder = tempfile.mkdtemp(prefix="omni_accel_first_call_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    return folder


def main(argv=None) -> int:
    args = parse_args(argv)
    cache_folder = None if args.warm_cache else cold_caches()

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import bench_peers as bp
    from benchmarks.bench_transformer import build_pipeline, build_transformer, ensure_adapters, log, make_inputs
    from benchmarks.timing import write_result

    device = torch.device(args.device)
    configs = [c for c in args.configs.split(",") if c]  # "" = no rows (--host-copy-gib alone)
    unknown = [c for c in configs if c not in bp.ROWS] + ([args.models] if args.models not in bp.SPECS else [])
    if unknown:
        print(f"error: unknown model/config {unknown}; models: {list(bp.SPECS)}, configs: {list(bp.ROWS)}",
              file=sys.stderr)
        return 2
    import diffusers

    import omni_accel

    ensure_adapters()
    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "diffusers": diffusers.__version__, "omni_accel": omni_accel.__version__,
           "cpu_count": os.cpu_count(), "inductor_cache": "cold (fresh folder)" if cache_folder else "warm"}
    result = {"benchmark": "bench_first_call", "env": env, "model": args.models, "rows": []}
    if args.load_compile_cache:
        t0 = time.perf_counter()
        result["compile_cache_loaded"] = omni_accel.load_compile_cache(args.load_compile_cache)
        result["compile_cache_load_s"] = round(time.perf_counter() - t0, 2)
    if args.host_copy_gib:
        result["host_copy"] = host_copy(torch, device, args.host_copy_gib)
        log(f"host copy: {result['host_copy']}")
    if not configs:
        write_result(args.out, result)
        return 0
    spec = bp.with_blocks(bp.SPECS[args.models](args.tiny), args.blocks)
    result["shape"] = spec["shape"]
    t0 = time.perf_counter()
    transformer = build_transformer(spec, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    pipe = build_pipeline(spec, transformer)
    inputs = make_inputs(spec, device, transformer.dtype)
    result["build_s"] = round(time.perf_counter() - t0, 2)
    for name in configs:
        reason = bp.skip_reason(bp.ROWS[name], device)
        if reason:
            result["rows"].append({"config": name, "skipped": reason})
            continue
        log(f"{name} ...")
        result["rows"].append(first_call_row(torch, bp.ROWS[name], spec, pipe, inputs, device, args))
        log(f"{name}: {result['rows'][-1]['phases_s']}")
        write_result(args.out, result)
    if args.save_compile_cache:
        result["compile_cache_saved_bytes"] = omni_accel.save_compile_cache(args.save_compile_cache)
    write_result(args.out, result)
    return 0


def first_call_row(torch, row, spec, pipe, inputs, device, args) -> dict:
    """One row on the library's own inductor options (a row's ``inductor`` field is for step-time A/B runs) and
    with the row's A/B switches."""
    from benchmarks.bench_peers import library_switches

    with library_switches(row) as switches:
        return {**_first_call_row(torch, row, spec, pipe, inputs, device, args), **switches}


def _first_call_row(torch, row, spec, pipe, inputs, device, args) -> dict:
    from benchmarks.bench_peers import sync
    from omni_accel.kernels import quant

    def timed(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            fn()
        sync(device)
        return round(time.perf_counter() - t0, 3)

    torch._dynamo.reset()
    profiler = start_profile(args.cprofile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phases = {"plain_forward": timed(lambda: pipe.transformer(**inputs))}
    plain_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = fingerprint(torch, pipe.transformer)
    holder = {}
    phases["setup"] = timed(lambda: holder.update(zip(("fn", "undo"), row.setup(pipe, pipe.transformer, inputs,
                                                                                   spec["model"]))))
    fn, undo = holder["fn"], holder["undo"]
    report = pipe.omni_accel.report() if "omni_accel" in vars(pipe) else {}
    if row.calibrates:
        phases["calibration_forward"] = timed(fn)
        quant.freeze_activation_scales(pipe)
    for i in (1, 2, 3):
        phases[f"forward_{i}"] = timed(fn)
    first_call = phases["setup"] + phases.get("calibration_forward", 0) + phases["forward_1"]
    entry = {"config": row.name, "phases_s": phases, "first_call_s": round(first_call, 2),
             "until_steady_s": round(first_call + phases["forward_2"], 2),
             "setup_s_by_pass": report.get("setup_s"), "compile_times": compile_times(torch)}
    if device.type == "cuda":
        entry["peak_gib_plain_forward"] = round(plain_peak, 3)
        entry["peak_gib_setup_and_first_calls"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    if "omni_accel" in vars(pipe):
        entry["cuda_graphs"] = pipe.omni_accel.report().get("cuda_graphs")
    if profiler is not None:
        entry["cprofile"] = stop_profile(profiler, args.cprofile)
    undo()
    entry["restored_exactly"] = fingerprint(torch, pipe.transformer) == before
    return entry


def fingerprint(torch, module) -> list:
    """Per parameter: name, device, and the float64 sum of its values (what restore() must give back)."""
    with torch.no_grad():
        return [(name, str(p.device), float(p.double().sum())) for name, p in module.named_parameters()]


def compile_times(torch) -> dict:
    """Dynamo / inductor's accumulated seconds per phase ({} if this torch does not keep them)."""
    try:
        table = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    except Exception:  # noqa: BLE001 -- the helper's signature changes across torch versions; timings are optional
        return {}
    names, values = table
    return {n: round(float(v), 3) for n, v in zip(names, values) if n}


def start_profile(top: int):
    if not top:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def stop_profile(profiler, top: int) -> dict:
    import pstats

    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{os.path.basename(path)}:{line}:{func}", "calls": calls,
                     "own_s": round(own, 3), "cumulative_s": round(cumulative, 3)})
    return {"by_cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:top],
            "by_own": sorted(rows, key=lambda r: -r["own_s"])[:top]}


def host_copy(torch, device, gib: float) -> dict:
    """Seconds to move ``gib`` GiB of bf16 weight-shaped tensors (3072 x 12288) to host memory, several ways: one
    thread or a pool of threads, pageable or pinned memory, and pageable memory first touched by torch's own
    parallel fill (the page faults of fresh host memory, not the PCIe copy, are what a pageable copy waits on).
    The pinned rows with threads run after the one-thread row has freed its blocks into torch's caching host
    allocator, so they time the copy alone, not a new pinned allocation."""
    from concurrent.futures import ThreadPoolExecutor

    if device.type != "cuda":
        return {"skipped": "needs a GPU"}
    count = max(1, int(gib * 2**30 / (3072 * 12288 * 2)))
    weights = [torch.randn(3072, 12288, device=device, dtype=torch.bfloat16) for _ in range(count)]
    torch.cuda.synchronize(device)
    out = {"tensors": count, "gib": round(count * 3072 * 12288 * 2 / 2**30, 2), "torch_threads": torch.get_num_threads()}

    def pageable(w):
        with torch.cuda.stream(torch.cuda.Stream(device)):
            return w.to("cpu")

    def pinned(w):
        host = torch.empty(w.shape, dtype=w.dtype, pin_memory=True)
        host.copy_(w)
        return host

    def touched(w):
        host = torch.empty(w.shape, dtype=w.dtype)
        host.zero_()  # first touch: torch's intra-op threads fault the pages in
        host.copy_(w)
        return host

    for name, fn in (("pageable", pageable), ("pinned", pinned), ("touched", touched)):
        for threads in (1, 4, 8, 16):
            if name == "touched" and threads > 1:
                continue  # its parallelism is torch's own
            t0 = time.perf_counter()
            if threads == 1:
                kept = [fn(w) for w in weights]
            else:
                with ThreadPoolExecutor(threads) as pool:
                    kept = list(pool.map(fn, weights))
            torch.cuda.synchronize(device)
            out[f"{name}_{threads}_threads_s"] = round(time.perf_counter() - t0, 3)
            assert torch.equal(kept[-1], weights[-1].cpu())
            del kept
    return out


if __name__ == "__main__":
    sys.exit(main())
