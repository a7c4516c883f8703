"""Throughput of `omni-accel serve --ray` with 1, 2 ... replicas on one machine.

    python benchmarks/bench_ray_throughput.py                  # CPU: the built-in model, 1 vs 2 replicas
    python benchmarks/bench_ray_throughput.py --device cuda --model ./FLUX.1-dev --size 1024 --steps 28 \\
        --replicas 1 2 4 8 --requests 64 --concurrency 32 --replica-cpus 4

Starts a local Ray cluster, and for each replica count deploys the application (on CPU the machine's cores are
split evenly between the replicas -- each replica's torch threads are its share; on GPUs one GPU per replica),
warms every replica up, then sends ``--requests`` image requests from ``--concurrency`` clients and measures
images/s. Writes benchmarks/results/bench_ray_throughput_<device>.json: the GPU and CPU counts, each row's replicas,
threads per replica, images/s, latency p50 / p95, and the speed-up of each row over the first.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.ray_load import (deploy, describe_replicas, free_port, load, prompt, start_cluster,  # noqa: E402
                                 wait_running)
from benchmarks.timing import write_result  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--size", type=int, default=128, help="image side (the built-in model is trained at 128)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default=None, help="a diffusers pipeline folder (default: the built-in model)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per replica)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local cluster (default: all)")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs per replica (default on CPU: the cluster's CPUs / replicas; on GPUs: 1)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="more omni-accel serve flags for every replica (e.g. --extra --compile on)")
    p.add_argument("--out", default=None,
                   help="default: benchmarks/results/bench_ray_throughput_<device>.json")
    return p.parse_args(argv)


def gpu_count() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def measure(args, replicas: int, port: int, cpus: float) -> dict:
    per_replica = args.replica_cpus or (cpus / replicas if args.device == "cpu" else 1.0)
    flags = ["--replicas", str(replicas), "--device", args.device, "--replica-cpus", f"{per_replica:g}",
             "--max-queue", str(args.concurrency), "--max-concurrency", "4", *args.extra]
    if args.model:
        flags += ["--model", args.model]
    url = deploy(flags, port)
    assert wait_running(url, replicas, 600) is not None, "the replicas did not start"
    described = describe_replicas(count=replicas)
    body = lambda i: {"prompt": prompt(i), "size": f"{args.size}x{args.size}",  # noqa: E731
                      "num_inference_steps": args.steps, "seed": i}
    load(url, 4 * replicas, 2 * replicas, body)  # warm-up: first calls of every replica
    outcome = load(url, args.requests, args.concurrency, body)
    latencies = sorted(a[2] for a in outcome.answers if a[0] == 200)
    images = outcome.images()
    return {"replicas": replicas, "cpus_per_replica": per_replica, "gpus_per_replica": 1 if args.device != "cpu" else 0,
            "threads_per_replica": sorted({d["threads"] for d in described}), "statuses": outcome.statuses(),
            "images": images, "seconds": round(outcome.seconds, 3), "images_per_s": round(images / outcome.seconds, 3),
            "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
            "latency_p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 3) if latencies else None,
            "load_average_after": os.getloadavg()}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"bench_ray_throughput_{args.device}.json")
    start_cluster(num_cpus=args.num_cpus)
    import ray
    from ray import serve

    cpus = ray.cluster_resources().get("CPU", os.cpu_count())
    result = {"command": " ".join(["python benchmarks/bench_ray_throughput.py", *sys.argv[1:]]),
              "host": platform.node(), "cpus": cpus, "gpus": gpu_count(), "device": args.device,
              "model": args.model or "built-in", "size": args.size, "steps": args.steps, "requests": args.requests,
              "concurrency": args.concurrency, "load_average_before": os.getloadavg(), "rows": []}
    port = free_port()
    try:
        for replicas in args.replicas:
            row = measure(args, replicas, port, cpus)
            row["speedup_over_first"] = round(row["images_per_s"] / result["rows"][0]["images_per_s"], 3) \
                if result["rows"] else 1.0
            result["rows"].append(row)
            write_result(out, result)
            print(f"{replicas} replica(s): {row['images_per_s']} images/s, p50 {row['latency_p50_s']} s "
                  f"(x{row['speedup_over_first']})", flush=True)
            time.sleep(2)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
