"""Bounded load test of `omni-accel serve`: N requests, C concurrent, a share of them malformed.

    python benchmarks/bench_serve.py                       # the built-in model, 1000 requests, 32 concurrent
    python benchmarks/bench_serve.py --model /tmp/tiny_flux --requests 50

Starts the server in a subprocess on a free loopback port, fires the requests with httpx (asyncio), and writes
benchmarks/results/bench_serve.json: status counts, p50/p95/p99 latency of the valid requests, throughput,
whether the server crashed, and the server's own metrics (pipeline calls, batch sizes, transformer forwards).
Exit code 1 when the server crashed, a valid request got a 5xx (or no answer), or a malformed one was not a 4xx with
an OpenAI error body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.timing import write_result  # noqa: E402

PROMPTS = [f"a {size} {color} {shape} in the {pos} on a {bg} background"
           for size in ("small", "large") for color in ("red", "green", "yellow")
           for shape in ("circle", "square", "star") for pos in ("center", "top left")
           for bg in ("blue", "white")]
GEN = "/v1/images/generations"


def malformed(i: int, rng: random.Random):
    """(description, request kwargs) of a bad request; all must come back 4xx with an error body."""
    kinds = [
        ("malformed JSON", {"content": b'{"prompt": "x", ', "headers": {"Content-Type": "application/json"}}),
        ("missing prompt", {"json": {"n": 1}}),
        ("size abc", {"json": {"prompt": "x", "size": "abc"}}),
        ("n=0", {"json": {"prompt": "x", "n": 0}}),
        ("steps=100000", {"json": {"prompt": "x", "num_inference_steps": 100000}}),
        ("unknown model", {"json": {"prompt": "x", "model": "dall-e-9"}}),
        ("size not a multiple", {"json": {"prompt": "x", "size": "65x65"}}),
        ("wrong type", {"json": {"prompt": ["x"], "n": "many"}}),
        ("empty body", {"content": b"", "headers": {"Content-Type": "application/json"}}),
        ("n as a float", {"json": {"prompt": "x", "n": 2.0}}),
        ("guidance as a boolean", {"json": {"prompt": "x", "guidance_scale": False}}),
        ("size far too large", {"json": {"prompt": "x", "size": "99999x99999"}}),
        ("cost above the bound", {"json": {"prompt": "x", "size": "256x256", "n": 4, "num_inference_steps": 100}}),
    ]
    return kinds[i % len(kinds)]


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_load(url: str, args) -> list[dict]:
    rng = random.Random(args.seed)
    n_bad = round(args.requests * args.malformed)
    bad_at = set(rng.sample(range(args.requests), n_bad))
    sizes = args.sizes.split(",")
    sem = asyncio.Semaphore(args.concurrency)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.client_timeout, limits=limits) as client:
        async def one(i: int):
            if i in bad_at:
                kind, kwargs = malformed(len([j for j in bad_at if j < i]), rng)
                valid = False
            else:
                kind = "valid"
                kwargs = {"json": {"prompt": rng.choice(PROMPTS), "size": rng.choice(sizes), "n": 1,
                                   "seed": rng.randrange(2**31), "num_inference_steps": args.steps}}
                valid = True
            async with sem:
                t0 = time.perf_counter()
                rec = {"i": i, "kind": kind, "valid": valid}
                try:
                    r = await client.post(GEN, **kwargs)
                    rec["status"] = r.status_code
                    if r.status_code >= 400:
                        try:
                            err = r.json()["error"]
                            rec["error_body_ok"] = set(err) == {"message", "type", "param", "code"}
                        except Exception:  # noqa: BLE001
                            rec["error_body_ok"] = False
                    elif valid:
                        rec["images"] = len(r.json()["data"])
                except httpx.HTTPError as exc:
                    rec["status"] = None
                    rec["exception"] = repr(exc)
                rec["latency_s"] = time.perf_counter() - t0
                results.append(rec)

        await asyncio.gather(*(one(i) for i in range(args.requests)))
    return results


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text

    def val(name):
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return {
        "pipeline_calls": val("omni_accel_pipeline_calls_total"),
        "images_generated": val("omni_accel_images_generated_total"),
        "mean_requests_per_call": (val("omni_accel_batch_requests_sum") / val("omni_accel_batch_requests_count")
                                   if val("omni_accel_batch_requests_count") else None),
        "transformer_forwards": val("omni_accel_transformer_forwards_total"),
        "rejected_429": val("omni_accel_rejected_requests_total"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="pipeline folder (default: the built-in model)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--malformed", type=float, default=0.10, help="share of malformed requests (default 0.10)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sizes", default="64x64,64x64,64x64,128x128", help="comma-separated sizes drawn at random")
    p.add_argument("--max-concurrency", type=int, default=8, help="server batching (--max-concurrency)")
    p.add_argument("--client-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default=None, help="free text stored in the result")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_serve.json"))
    args = p.parse_args(argv)

    port = free_port()
    cmd = [sys.executable, "-m", "omni_accel", "serve", "--port", str(port), "--max-queue", "256",
           "--max-concurrency", str(args.max_concurrency), "--max-batch-images", str(args.max_concurrency)]
    if args.model:
        cmd += ["--model", args.model]
    import tempfile

    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if server.poll() is not None:
                log.seek(0)
                print(log.read()[-5000:], file=sys.stderr)
                return 1
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
            if time.time() - t0 > 180:
                raise TimeoutError("server did not start")
        httpx.post(url + GEN, json={"prompt": "warm-up", "size": "64x64", "num_inference_steps": args.steps},
                   timeout=120)
        load_at_start = os.getloadavg()[0]
        t_start = time.perf_counter()
        results = asyncio.run(run_load(url, args))
        wall = time.perf_counter() - t_start
        crashed = server.poll() is not None
        server_metrics = scrape(url) if not crashed else {}
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)

    valid = [r for r in results if r["valid"]]
    bad = [r for r in results if not r["valid"]]
    ok = [r for r in valid if r.get("status") == 200]
    lat = [r["latency_s"] for r in ok]
    status_counts: dict[str, int] = {}
    for r in results:
        status_counts[str(r.get("status"))] = status_counts.get(str(r.get("status")), 0) + 1
    out = {
        "benchmark": "bench_serve",
        "model": args.model or "built-in (omni-accel-builtin)",
        "served_model": health.get("model"),
        "note": args.note,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_start": load_at_start,
                    "load_avg_1m_at_end": os.getloadavg()[0],
                    "python": platform.python_version()},
        "config": {"requests": args.requests, "concurrency": args.concurrency, "malformed_share": args.malformed,
                   "steps": args.steps, "sizes": args.sizes, "server_max_concurrency": args.max_concurrency},
        "results": {
            "wall_s": round(wall, 2),
            "server_crashed": crashed,
            "status_counts": status_counts,
            "valid_requests": len(valid),
            "valid_ok_200": len(ok),
            "valid_5xx": sum(1 for r in valid if (r.get("status") or 0) >= 500),
            "valid_no_answer": sum(1 for r in valid if r.get("status") is None),
            "malformed_requests": len(bad),
            "malformed_4xx_with_error_body": sum(1 for r in bad if 400 <= (r.get("status") or 0) < 500
                                                 and r.get("error_body_ok")),
            "latency_valid_s": {"p50": percentile(lat, 0.5), "p95": percentile(lat, 0.95),
                                "p99": percentile(lat, 0.99), "mean": statistics.fmean(lat) if lat else None,
                                "max": max(lat) if lat else None},
            "throughput_req_per_s": round(len(results) / wall, 3),
            "throughput_images_per_s": round(sum(r.get("images", 0) for r in ok) / wall, 3),
        },
        "server_metrics": server_metrics,
    }
    for k, v in out["results"]["latency_valid_s"].items():
        if v is not None:
            out["results"]["latency_valid_s"][k] = round(v, 3)
    write_result(args.out, out)
    print(json.dumps(out["results"], indent=1))
    res = out["results"]
    failed = (crashed or res["valid_5xx"] or res["valid_no_answer"]
              or res["malformed_4xx_with_error_body"] != len(bad))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
