"""Load test of `omni-accel serve --ray` with a replica killed mid-run.

    python benchmarks/bench_ray_failover.py                    # 300 requests, 16 clients, 2 replicas, built-in model
    python benchmarks/bench_ray_failover.py --requests 48 --concurrency 8 --out /tmp/failover.json

Starts a local Ray cluster (``--num-cpus``, no dashboard), deploys the built-in model (``--model PATH`` for another)
as ``--replicas`` replicas behind the ingress, sends ``--requests`` image requests from ``--concurrency`` clients
(each sends its next request when it has an answer) and SIGKILLs one replica's process once ``--kill-at`` of the
requests are answered. Writes benchmarks/results/bench_ray_failover.json: the count of each answer (status, and for
503s whether they carried Retry-After), requests with no answer, the jobs the ingress resent to the other replica,
the seconds from the kill until every replica ran again, and throughput before / after. Exit code 1 when a request
got anything but 200 or 503 + Retry-After (or no answer), or the replica was not back within ``--back-within`` s.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.ray_load import (deploy, free_port, health, load, prompt, replica_pids, start_cluster,  # noqa: E402
                                 wait_running)
from benchmarks.timing import write_result  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kill-at", type=float, default=0.3, help="share of the requests answered before the kill")
    p.add_argument("--size", type=int, default=128, help="image side (the built-in model is trained at 128)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default=None, help="a diffusers pipeline folder (default: the built-in model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-cpus", type=float, default=2)
    p.add_argument("--replica-cpus", type=float, default=None, help="default: --num-cpus / --replicas / 2")
    p.add_argument("--back-within", type=float, default=60.0, help="seconds the killed replica has to come back")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_ray_failover.json"))
    return p.parse_args(argv)


def serve_flags(args) -> list[str]:
    cpus = args.replica_cpus or args.num_cpus / args.replicas / 2
    flags = ["--replicas", str(args.replicas), "--replica-cpus", f"{cpus:g}", "--device", args.device,
             "--max-queue", "32", "--max-concurrency", "4", "--shutdown-grace", "5"]
    return flags + (["--model", args.model] if args.model else [])


def run(args, port: int | None = None) -> dict:
    """The load with one kill; returns the result (also what the CI test checks, on its cluster's ``port``)."""
    start_cluster(num_cpus=args.num_cpus)
    url = deploy(serve_flags(args), port or free_port())
    pids = replica_pids(count=args.replicas)
    victim = pids[0][0]
    kill_after = max(1, int(args.kill_at * args.requests))
    killed = {}

    def on_answer(count: int) -> None:
        if count >= kill_after and not killed:
            killed["at"] = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            killed["back_s"] = None
            threading.Thread(target=lambda: killed.update(back_s=wait_running(url, args.replicas, 300, True)),
                             daemon=True).start()

    body = lambda i: {"prompt": prompt(i), "size": f"{args.size}x{args.size}",  # noqa: E731
                      "num_inference_steps": args.steps, "seed": i}
    t0 = time.monotonic()
    outcome = load(url, args.requests, args.concurrency, body, on_answer=on_answer)
    while "back_s" in killed and killed["back_s"] is None and time.monotonic() - killed["at"] < 300:
        time.sleep(0.25)
    kill_s = killed.get("at", t0) - t0
    answers = outcome.answers
    statuses = outcome.statuses()
    unavailable = [a for a in answers if a[0] == 503]
    bad = [a for a in answers if a[0] not in (200, 503) or (a[0] == 503 and not a[1])]
    before = [a for a in answers if a[3] <= kill_s and a[0] == 200]
    after = [a for a in answers if a[3] > kill_s and a[0] == 200]
    metrics = _metrics(url)
    result = {
        "command": " ".join(["python benchmarks/bench_ray_failover.py", *sys.argv[1:]]),
        "host": platform.node(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "model": args.model or "built-in", "device": args.device, "replicas": args.replicas,
        "requests": args.requests, "concurrency": args.concurrency, "size": args.size, "steps": args.steps,
        "killed_pid": victim, "killed_after_answers": kill_after, "killed_at_s": round(kill_s, 2),
        "statuses": statuses,
        "status_503_with_retry_after": sum(1 for a in unavailable if a[1]),
        "status_503_codes": sorted({a[4] for a in unavailable if a[4]}),
        "no_answer": dict(outcome.errors),
        "other_answers": len(bad),
        "jobs_resent_to_another_replica": metrics.get("omni_accel_jobs_resent_total", 0),
        "replica_back_after_s": None if killed.get("back_s") is None else round(killed["back_s"], 2),
        "replicas_at_the_end": health(url).get("replicas"),
        "wall_s": round(outcome.seconds, 2),
        "images_per_s_before_kill": round(len(before) / kill_s, 3) if kill_s > 0 else None,
        "images_per_s_after_kill": round(len(after) / max(outcome.seconds - kill_s, 1e-9), 3),
    }
    result["ok"] = (not bad and not outcome.errors and result["replica_back_after_s"] is not None
                    and result["replica_back_after_s"] <= args.back_within)
    return result


def _metrics(url: str) -> dict:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name, value in re.findall(r"^(omni_accel_jobs_resent_total)\{[^}]*\} (\S+)$", text, re.M):
        out[name] = out.get(name, 0) + float(value)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    finally:
        from ray import serve

        import ray

        serve.shutdown()
        ray.shutdown()
    write_result(args.out, result)
    print({k: result[k] for k in ("statuses", "status_503_with_retry_after", "no_answer", "other_answers",
                                  "jobs_resent_to_another_replica", "replica_back_after_s", "ok")})
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
