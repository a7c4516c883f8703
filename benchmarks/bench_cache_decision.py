"""What one TeaCache decision costs on a GPU: the metric math, and the one device->host boolean read per step.

    python benchmarks/bench_cache_decision.py [--out results/cache_decision_gpu.json]

A FLUX.1-dev-1024^2-shaped modulated input (1 x 4096 x 3072, bf16) and a stand-in for the step's transformer work
(matmuls of the same width queued before the decision). Variant "read": bool(acc < thr) every step (what
tea_cache does); "no read": the accumulator stays on the device (what a device-side select would need)."""
import json
import sys
import time

import torch

coefs = [498.65, -283.78, 55.86, -3.82, 0.264]


def horner(c, x):
    y = torch.zeros_like(x)
    for v in c:
        y = y * x + v
    return y


def main():
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    dev = torch.device("cuda")
    m = torch.randn(1, 4096, 3072, device=dev, dtype=torch.bfloat16)
    prev = torch.randn_like(m)
    w = torch.randn(3072, 3072, device=dev, dtype=torch.bfloat16)
    coef = torch.tensor(coefs, device=dev, dtype=torch.float64)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def decision(read):
        means = torch.stack([(m - prev).abs().mean(), prev.abs().mean()]).float()
        acc = horner(coef, (means[0] / (means[1] + 1e-8)).double()).clamp_min(0)
        return bool(acc < 0.4) if read else acc

    def work(n):
        x = m[0]
        for _ in range(n):
            x = x @ w
        return x

    def ms_per_call(fn, warmup: int, iters: int) -> float:
        """Mean milliseconds of ``fn()`` after ``warmup`` calls, the GPU synchronised around the timed loop."""
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / iters * 1e3

    for read in (True, False):  # decision alone
        res[f"decision_only_ms_{'read' if read else 'no_read'}"] = ms_per_call(lambda: decision(read), 10, 200)
    for n in (8, 64):  # queued step work of n matmuls, then the decision
        for read in (True, False):
            res[f"step_{n}_matmuls_ms_{'read' if read else 'no_read'}"] = ms_per_call(
                lambda: (work(n), decision(read)), 3, 30)
        torch.cuda.synchronize()
        res[f"step_{n}_matmuls_ms_no_decision"] = ms_per_call(lambda: work(n), 0, 30)
    res = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}
    print(json.dumps(res, indent=1))
    if out:
        with open(out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
