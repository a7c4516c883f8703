"""The bf16 MLP's GELU inside cuBLAS's GEMM epilogue, against the GEMM + a separate GELU kernel, at FLUX.1-dev shapes.

    python benchmarks/bench_gemm_gelu.py --log-clocks --iters 30 --reps 40 --out benchmarks/results/gemm_gelu.json
    python benchmarks/bench_gemm_gelu.py --device cpu --tiny --out /tmp/gemm_gelu.json                     # smoke

cuBLASLt can apply the tanh GELU to the float32 accumulator before the one rounding to 16 bits (its GELU_BIAS
epilogue, which torch reaches through ``torch._addmm_activation(bias, x, w.t(), use_gelu=True)``). The compiled bf16
block instead writes the GEMM's output, and a second kernel reads it back for the bias and the GELU: 113 MB each way
per FLUX block at 4608 x 12288.

Cases (bf16, the FLUX shapes of one block):
1. ``ff_up``: a dual-stream block's feed-forward up-projection + GELU, image (4096 rows) and text (512 rows) stream:
   - ``gemm_only``: ``torch.addmm`` with the bias, no GELU (the floor);
   - ``inductor``: torch.compile of ``sigmoid_gelu(F.linear(x, w, b))`` with the library's inductor options (what the
     compiled block runs: cuBLAS, then inductor's GELU kernel);
   - ``cublaslt_gelu``: ``omni_accel::linear_gelu`` (what ``compile=True``'s graph pass puts there on a GPU:
     ``torch._addmm_activation(..., use_gelu=True)``).
2. ``single``: a single-stream block's ``proj_out(cat([attention, gelu(proj_mlp(x))]))`` (4608 rows):
   - ``concat_kernel``: ``proj_mlp`` without its bias, the library's concatenation + bias + GELU kernel
     (``epilogue_triton.concat_gelu``, what ``compile=True`` puts there on a GPU), then ``proj_out``;
   - ``split``: ``proj_mlp`` with the GELU in its epilogue, then ``proj_out`` as two GEMMs over the two halves of its
     input, the second adding into the first's output in place (no concatenation is written): the library's
     ``omni_accel::linear_gelu`` and ``omni_accel::concat_linear``, what the graph pass puts there;
   - ``split_copy``: the same with the second GEMM out of place (torch copies the first's output in front of it);
   - ``gemms_only``: the two GEMMs of ``concat_kernel`` with no epilogue kernel (the floor).
Each way's kernels (torch.profiler names of one call) are in its row, so that the file shows whether the GELU ran
inside the GEMM. ``max_abs_err`` / ``rel_err`` are against the float32 formula; timing as in bench_fp8_epilogues.py
(``us``: back to back, ``us_graph``: one CUDA graph of ``--reps`` calls).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_fp8_epilogues import (finish, inductor_options, kernel_parser, kernel_result,  # noqa: E402
                                             measure)
from benchmarks.bench_transformer import ClockLog, measure_sustained_gemm  # noqa: E402
from benchmarks.timing import write_result  # noqa: E402

from omni_accel.compiler import sigmoid_gelu  # noqa: E402
from omni_accel.kernels import epilogue_fusion  # noqa: E402,F401 -- registers the omni_accel ops

linear_gelu, concat_linear = torch.ops.omni_accel.linear_gelu, torch.ops.omni_accel.concat_linear


def gelu_exact(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h.float(), approximate="tanh")


def kernel_names(fn, device: torch.device) -> list[str]:
    """The GPU kernels one call of ``fn`` launches, in order (empty off a GPU)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:120] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def errors(out: torch.Tensor, want: torch.Tensor) -> dict:
    diff = (out.float() - want).abs()
    return {"max_abs_err": float(diff.max()), "rel_err": float(diff.norm() / want.norm())}


def ff_up_rows(device, rows_by_stream: dict, dim: int, mlp: int, iters: int, reps: int) -> list[dict]:
    gen = torch.Generator("cpu").manual_seed(0)
    w = (torch.randn(mlp, dim, generator=gen) / dim ** 0.5).to(device, torch.bfloat16)
    b = (torch.randn(mlp, generator=gen) * 0.1).to(device, torch.bfloat16)
    compiled = torch.compile(lambda x: sigmoid_gelu(F.linear(x, w, b)), dynamic=False,
                             options=inductor_options(device))
    rows: list[dict] = []
    for stream, tokens in rows_by_stream.items():
        x = torch.randn(tokens, dim, generator=gen).to(device, torch.bfloat16)
        want = gelu_exact(x.float() @ w.float().t() + b.float())
        moved = (x.numel() + w.numel() + tokens * mlp) * 2
        ways = {"gemm_only": lambda: torch.addmm(b, x, w.t()),
                "inductor": lambda: compiled(x),
                "cublaslt_gelu": lambda: linear_gelu(x, w.t(), b)}
        for way, fn in ways.items():
            entry = {"case": "ff_up", "stream": stream, "way": way, "shape": [tokens, dim, mlp],
                     "kernels": kernel_names(fn, device)}
            check = (lambda out: {}) if way == "gemm_only" else (lambda out: errors(out, want))
            measure(rows, entry, fn, check, moved, device, iters, reps)
    return rows


def single_rows(device, tokens: int, dim: int, mlp: int, iters: int, reps: int) -> list[dict]:
    from omni_accel.kernels import epilogue_triton

    gen = torch.Generator("cpu").manual_seed(1)
    x = torch.randn(tokens, dim, generator=gen).to(device, torch.bfloat16)
    attn = torch.randn(tokens, dim, generator=gen).to(device, torch.bfloat16)
    w_mlp = (torch.randn(mlp, dim, generator=gen) / dim ** 0.5).to(device, torch.bfloat16)
    b_mlp = (torch.randn(mlp, generator=gen) * 0.1).to(device, torch.bfloat16)
    w_out = (torch.randn(dim, dim + mlp, generator=gen) / (dim + mlp) ** 0.5).to(device, torch.bfloat16)
    b_out = (torch.randn(dim, generator=gen) * 0.1).to(device, torch.bfloat16)
    hidden = torch.cat([attn.float(), gelu_exact(x.float() @ w_mlp.float().t() + b_mlp.float())], dim=-1)
    want = hidden @ w_out.float().t() + b_out.float()
    cat_ready = hidden.to(torch.bfloat16)

    def concat_kernel():
        h = torch.mm(x, w_mlp.t())
        cat = epilogue_triton.concat_gelu(attn.reshape(tokens, 1, dim), None, h, b_mlp, None, torch.bfloat16)
        return torch.addmm(b_out, cat, w_out.t())

    def split():
        return concat_linear(attn, linear_gelu(x, w_mlp.t(), b_mlp), w_out.t(), b_out)

    def split_copy():  # the same with the second GEMM out of place (a copy of the first's output in front of it)
        g = torch._addmm_activation(b_mlp, x, w_mlp.t(), use_gelu=True)
        return torch.addmm(torch.addmm(b_out, attn, w_out[:, :dim].t()), g, w_out[:, dim:].t())

    def gemms_only():
        torch.mm(x, w_mlp.t())
        return torch.addmm(b_out, cat_ready, w_out.t())

    moved = (x.numel() + attn.numel() + w_mlp.numel() + w_out.numel() + tokens * (dim + mlp) + tokens * dim) * 2
    rows: list[dict] = []
    for way, fn in {"concat_kernel": concat_kernel, "split": split, "split_copy": split_copy,
                    "gemms_only": gemms_only}.items():
        entry = {"case": "single", "way": way, "shape": [tokens, dim, mlp], "kernels": kernel_names(fn, device)}
        measure(rows, entry, fn, lambda out: errors(out, want), moved, device, iters, reps)
    return rows


def main(argv=None) -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--warm-s", type=float, default=3.0, help="seconds of 8192^3 GEMMs before the first row")
    args = parser.parse_args(argv)
    if args.warm_s < 0:
        parser.error(f"--warm-s {args.warm_s}: give the seconds of warm-up GEMMs (>= 0), or 0 for none")
    device = torch.device(args.device)
    text, image, dim, mlp = (16, 48, 64, 256) if args.tiny else (512, 4096, 3072, 12288)
    clocks = ClockLog(args.log_clocks and device.type == "cuda")
    result = kernel_result("bench_gemm_gelu", device)
    if device.type == "cuda":
        result["env"]["blas"] = torch.backends.cuda.preferred_blas_library().name
    if device.type == "cuda" and args.warm_s:
        # a few seconds of dense GEMMs first: the first way timed must not meet a GPU still raising its clocks
        result["warm_up"] = measure_sustained_gemm(device, clocks, args.warm_s)
    clocks.mark()
    result["rows"] += ff_up_rows(device, {"image": image, "text": text}, dim, mlp, args.iters, args.reps)
    write_result(args.out, result)
    result["rows"] += single_rows(device, text + image, dim, mlp, args.iters, args.reps)
    return finish(result, clocks, args.out)


if __name__ == "__main__":
    sys.exit(main())
