"""FP8 pieces on FLUX.1-dev block shapes: bf16 GEMM vs row-wise-scaled e4m3 ``_scaled_mm``, and the per-token
activation quantization (PyTorch expression eager, torch.compile of it, the Triton kernel).

    python benchmarks/bench_fp8_gemm.py --out benchmarks/results/bench_fp8_gemm_h200.json   # one GPU
    python benchmarks/bench_fp8_gemm.py --device cpu --tiny --out /tmp/fp8.json              # CPU smoke test

Shapes: M = 4608 tokens (4096 image + 512 text) for the single-stream blocks, M = 4096 / 512 for the two streams of
the dual blocks; (K, N) of every distinct block linear. Timing: CUDA events, median of ``--iters`` after warm-up.
``quant_bytes_equal`` is the fraction of e4m3 bytes the Triton kernel writes identically to the PyTorch expression
(they should be all: both compute x / scale in fp32 and round to nearest even).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import sample_ms, write_result  # noqa: E402
from omni_accel.kernels import fp8  # noqa: E402

# (name, M, K, N): FLUX.1-dev block linears (dim 3072, MLP 12288; single block: qkv 3x, proj_mlp, proj_out 15360 in)
FLUX_SHAPES = (
    ("single.to_qkv(each)", 4608, 3072, 3072),
    ("single.proj_mlp", 4608, 3072, 12288),
    ("single.proj_out", 4608, 15360, 3072),
    ("dual.img.ff.up", 4096, 3072, 12288),
    ("dual.img.ff.down", 4096, 12288, 3072),
    ("dual.txt.ff.up", 512, 3072, 12288),
)
TINY_SHAPES = (("tiny", 64, 128, 256),)


def timed(fn, device, iters: int) -> float:
    for _ in range(3):
        fn()
    return statistics.median(sample_ms(fn, device, iters))


def row(name, m, k, n, device, iters) -> dict:
    g = torch.Generator("cpu").manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, torch.bfloat16)
    w_fp8, w_scale = fp8.quantize_rows_torch(w)
    w_scale = w_scale.reshape(1, -1).contiguous()
    x_fp8, x_scale = fp8.quantize_rows_torch(x)
    flops = 2.0 * m * k * n
    out = {"shape": name, "M": m, "K": k, "N": n}
    bf16_ms = timed(lambda: x @ w.t(), device, iters)
    mm_ms = timed(lambda: torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale,
                                           out_dtype=torch.bfloat16), device, iters)
    compiled = torch.compile(fp8.quantize_rows_torch, dynamic=False)
    q_eager_ms = timed(lambda: fp8.quantize_rows_torch(x), device, iters)
    q_compile_ms = timed(lambda: compiled(x), device, iters)
    out.update(bf16_gemm_ms=round(bf16_ms, 4), bf16_tflops=round(flops / bf16_ms / 1e9, 1),
               fp8_gemm_ms=round(mm_ms, 4), fp8_tflops=round(flops / mm_ms / 1e9, 1),
               fp8_gemm_speedup=round(bf16_ms / mm_ms, 3),
               quant_torch_eager_ms=round(q_eager_ms, 4), quant_torch_compile_ms=round(q_compile_ms, 4))
    if device.type == "cuda" and fp8._triton_quantizer() is not None:
        q_triton_ms = timed(lambda: fp8.quantize_rows(x), device, iters)
        q, s = fp8.quantize_rows(x)
        out.update(quant_triton_ms=round(q_triton_ms, 4), quant_triton_vs_eager=round(q_eager_ms / q_triton_ms, 2),
                   quant_bytes_equal=(q.view(torch.uint8) == x_fp8.view(torch.uint8)).float().mean().item(),
                   quant_scales_equal=bool(torch.equal(s, x_scale)))
    exact = (x.float() @ w.float().t())
    got = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16).float()
    out["fp8_rel_err"] = ((got - exact).norm() / exact.norm()).item()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default="bench_fp8_gemm.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    iters = args.iters or (3 if args.tiny else 50)
    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    rows = []
    for spec in TINY_SHAPES if args.tiny else FLUX_SHAPES:
        try:
            rows.append(row(*spec, device, iters))
        except Exception as exc:  # noqa: BLE001 -- one failing shape must not lose the others
            rows.append({"shape": spec[0], "error": repr(exc)})
        print(json.dumps(rows[-1]), flush=True)
    write_result(args.out, {"env": env, "iters": iters, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
