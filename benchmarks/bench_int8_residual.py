"""The block's gated residual (``residual + gate * linear(x)``) in the int8 GEMM's epilogue, against the GEMM and a
separate fused add, at FLUX.1-dev's shapes; every kernel checked bit for bit against the reference over several calls.

    python benchmarks/bench_int8_residual.py --log-clocks --iters 20 --reps 20 --checks 8 \\
        --out benchmarks/results/int8_residual.json
    TRITON_INTERPRET=1 python benchmarks/bench_int8_residual.py --device cpu --tiny --iters 1 --reps 1 --checks 1 \\
        --out /tmp/int8_residual.json                                          # smoke test, Triton's interpreter

The int8 stack's linears whose output a block adds to its hidden state through a gate (the attention's output
projection, the feed-forward's down projection, the single block's ``proj_out``) can take the gated add in the GEMM's
epilogue (``omni_accel::int8_mm_rescale_residual``), so the product is never written and read back. Ways, per shape:
- ``gemm_only``: the plain GEMM (``int8_mm_rescale``, the library's kernel for the shape): the floor;
- ``separate``: the plain GEMM, then the gated add compiled by inductor (what the compiled block runs without the
  fusion);
- ``twin``: ``int8_mm_rescale`` with the residual and no config (the pointer kernel's twin up to ``FEW_ROWS`` rows,
  the persistent TMA kernel's twin above; on Hopper the graph pass itself moves the add only up to ``FEW_ROWS``
  rows, ``int8_gemm_triton.residual_in_gemm``);
- ``ws_io0`` .. ``ws_io3`` (above ``FEW_ROWS`` rows, on Hopper): the warp-specialized kernel's twin with
  ``RESIDUAL_WS_IO`` 0 (residual in and output out through TMA), 1 (output stored through pointers), 2 (residual
  loaded through pointers), 3 (both through pointers).
``mismatches`` counts output values that differ from ``int8_mm_rescale_residual_reference`` (the unfused arithmetic,
product rounded to bf16 first) summed over ``--checks`` calls on fresh residuals, so that a kernel that races on a
few tiles now and then is caught; ``gemm_only`` is checked against ``int8_mm_rescale_reference`` on the same inputs
``--checks`` times (its count is the per-call count times ``--checks`` unless it races). The exit status is 1 when a
way failed (its row has ``error``), 0 otherwise; mismatches are figures, not failures.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_fp8_epilogues import finish, inductor_options, kernel_parser, kernel_result, measure  # noqa: E402
from benchmarks.bench_transformer import ClockLog, measure_sustained_gemm  # noqa: E402

from omni_accel.kernels import fused, int8  # noqa: E402
from omni_accel.kernels import int8_gemm_triton as g  # noqa: E402

# (name, rows, K, N): FLUX.1-dev's gated linears (dim 3072, MLP 12288, 4096 image + 512 text tokens)
FULL_SHAPES = [("image_out", 4096, 3072, 3072), ("image_ff_down", 4096, 12288, 3072),
               ("single_proj_out", 4608, 15360, 3072), ("text_out", 512, 3072, 3072),
               ("text_ff_down", 512, 12288, 3072)]
TINY_SHAPES = [("tiny_many_rows", g.FEW_ROWS + 16, 32, 40), ("tiny_few_rows", 40, 32, 40)]


def operands(rows: int, k: int, n: int, device: torch.device, seed: int):
    gen = torch.Generator("cpu").manual_seed(seed)
    x_int8, x_scale = int8.quantize_rows_int8(torch.randn(rows, k, generator=gen).to(device))
    w_int8, w_scale = int8.quantize_rows_int8(torch.randn(n, k, generator=gen).to(device))
    bias = (torch.randn(n, generator=gen) * 0.1).to(device, torch.bfloat16)
    gate = torch.randn(n, generator=gen).to(device, torch.bfloat16)
    return (x_int8, w_int8, x_scale, w_scale.reshape(1, -1), bias), gate


def mismatches(fn, want_fn, residuals: list) -> dict:
    """Values of ``fn(residual)`` unequal to ``want_fn(residual)``, summed over ``residuals``, and the largest
    difference."""
    wrong, worst = 0, 0.0
    for residual in residuals:
        got, want = fn(residual), want_fn(residual)
        differ = got != want
        wrong += int(differ.sum())
        if differ.any():
            worst = max(worst, float((got.float() - want.float()).abs().max()))
    return {"mismatches": wrong, "checked_values": sum(r.numel() for r in residuals), "max_abs_err": worst}


def shape_rows(name: str, rows: int, k: int, n: int, device, args) -> list[dict]:
    ops, gate = operands(rows, k, n, device, seed=rows + k + n)
    gen = torch.Generator("cpu").manual_seed(1)
    residuals = [(torch.randn(rows, n, generator=gen) * 4).to(device, torch.bfloat16) for _ in range(args.checks)]
    residual = residuals[0]
    add = torch.compile(lambda r, gt, y: r + gt * y, dynamic=False, options=inductor_options(device))

    def reference(r):
        return int8.int8_mm_rescale_residual_reference(*ops, gate, r, torch.bfloat16)

    def fused(config=None, io=None):
        def call(r=residual):
            saved = g.RESIDUAL_WARP_SPECIALIZED, g.RESIDUAL_WS_IO
            if io is not None:
                g.RESIDUAL_WARP_SPECIALIZED, g.RESIDUAL_WS_IO = True, io
            try:
                return g.int8_mm_rescale(*ops, torch.bfloat16, config=config, gate=gate, residual=r)
            finally:
                g.RESIDUAL_WARP_SPECIALIZED, g.RESIDUAL_WS_IO = saved
        return call

    ways = {"gemm_only": lambda r=residual: g.int8_mm_rescale(*ops, torch.bfloat16),
            "separate": lambda r=residual: add(r, gate, g.int8_mm_rescale(*ops, torch.bfloat16)),
            "twin": fused()}
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    if rows > g.FEW_ROWS and (hopper or device.type != "cuda") and g._WS_BUILDABLE:
        ways.update({f"ws_io{io}": fused(g.WS_TILE, io) for io in range(4)})
    moved = ops[0].numel() + ops[1].numel() + 2 * 2 * rows * n  # int8 operands, residual in, output out
    out = []
    for way, fn in ways.items():
        entry = {"shape_name": name, "shape": [rows, k, n], "way": way}
        if way == "gemm_only":
            want = int8.int8_mm_rescale_reference(*ops, torch.bfloat16)
            checks = lambda _out, fn=fn, want=want: mismatches(lambda r: fn(), lambda r: want, residuals)  # noqa: E731
        else:
            checks = lambda _out, fn=fn: mismatches(fn, reference, residuals)  # noqa: E731
        measure(out, entry, fn, checks, moved, device, args.iters, args.reps)
    return out


def main(argv=None) -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--checks", type=int, default=8, help="calls (fresh residuals) each way's output is checked on")
    parser.add_argument("--warm-s", type=float, default=3.0, help="seconds of 8192^3 GEMMs before the first row")
    args = parser.parse_args(argv)
    if args.checks < 1:
        parser.error(f"--checks {args.checks}: give at least 1 call to check each way on")
    if args.iters < 1 or args.reps < 1:
        parser.error(f"--iters {args.iters} --reps {args.reps}: give at least 1 of each")
    if args.warm_s < 0:
        parser.error(f"--warm-s {args.warm_s}: give the seconds of warm-up GEMMs (>= 0), or 0 for none")
    device = torch.device(args.device)
    if device.type != "cuda" and not fused.interpreted():
        parser.error(f"--device {args.device}: the Triton kernels run off a GPU only in Triton's interpreter; set "
                     "TRITON_INTERPRET=1 in the environment")
    clocks = ClockLog(args.log_clocks and device.type == "cuda")
    result = kernel_result("bench_int8_residual", device)
    import triton
    result["env"]["triton"] = triton.__version__
    if device.type == "cuda" and args.warm_s > 0:
        result["warm_up"] = measure_sustained_gemm(device, clocks, args.warm_s)
    clocks.mark()
    for name, rows, k, n in TINY_SHAPES if args.tiny else FULL_SHAPES:
        result["rows"] += shape_rows(name, rows, k, n, device, args)
    finish(result, clocks, args.out)
    return 1 if any("error" in row for row in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
