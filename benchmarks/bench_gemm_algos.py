"""Every algorithm cuBLASLt offers for FLUX.1-dev's bf16 GEMMs, against the one torch's call gets, under sustained load.

    python benchmarks/bench_gemm_algos.py --log-clocks --out benchmarks/results/gemm_algos.json

For a linear with a bias (and for the GELU epilogue) torch runs the first entry of cuBLASLt's heuristic list; its
plain and accumulating products let cuBLAS choose. The heuristic models a GPU at full clocks; a GPU at its power cap
may run another tile shape faster. For each GEMM of a FLUX step (shape, epilogue, calls per step) this times torch's
own call (``torch``) and each of the heuristic's ``--count`` candidates through ``omni_accel.kernels.cublaslt``
(``algo_<rank>``), each as one CUDA graph of ``--reps`` calls, after ``--warm-s`` seconds of dense GEMMs. The clocks of
a GPU at its power cap drift by 10-30 % within seconds, so the ways of one shape are timed in ``--rounds`` rounds,
every way in turn, and each way's ``vs_torch`` is the median of its paired ratios to torch's call in the same round.
Each row has its error against the float32 product. The summary weighs each shape by its calls per step: the step's
GEMM time with torch's calls and with the best candidate wherever it beats torch (an upper bound: the best of several
noisy ratios is picked).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_fp8_epilogues import finish, kernel_parser, kernel_result  # noqa: E402
from benchmarks.bench_transformer import ClockLog, log, measure_sustained_gemm  # noqa: E402
from benchmarks.timing import capture_graph, graph_rounds_ms, write_result  # noqa: E402

# (name, rows, in, out, epilogue, calls per step) -- FLUX.1-dev at 1024²: 19 dual blocks (4096 image + 512 text
# rows), 38 single blocks (4608 rows); the single blocks' proj_out is two GEMMs (omni_accel::concat_linear)
FLUX_GEMMS = [
    ("single_qkv", 4608, 3072, 9216, "bias", 38),
    ("single_mlp_gelu", 4608, 3072, 12288, "gelu_bias", 38),
    ("single_out_attn", 4608, 3072, 3072, "bias", 38),
    ("single_out_mlp_acc", 4608, 12288, 3072, "accumulate", 38),
    ("image_qkv", 4096, 3072, 9216, "bias", 19),
    ("image_out", 4096, 3072, 3072, "bias", 19),
    ("image_ff_up_gelu", 4096, 3072, 12288, "gelu_bias", 19),
    ("image_ff_down", 4096, 12288, 3072, "bias", 19),
    ("text_qkv", 512, 3072, 9216, "bias", 19),
    ("text_out", 512, 3072, 3072, "bias", 19),
    ("text_ff_up_gelu", 512, 3072, 12288, "gelu_bias", 19),
    ("text_ff_down", 512, 12288, 3072, "bias", 19),
]
TINY_GEMMS = [("tiny", 64, 128, 256, "bias", 1)]


def reference(x, w_t, bias, start, epilogue: str) -> torch.Tensor:
    product = x.float() @ w_t.float()
    if epilogue == "accumulate":
        return start.float() + product
    product = product + bias.float()
    return F.gelu(product, approximate="tanh") if epilogue == "gelu_bias" else product


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return round(float((out.float() - want).norm() / want.norm()), 6)


def shape_rows(device, spec, count: int, iters: int, reps: int, rounds: int) -> list[dict]:
    """torch's call and each candidate, captured once, then timed in ``rounds`` rounds; each round replays every way
    in turn, starting one later each round, so that a drift of the clocks during the shape's run reaches all ways
    alike: ``vs_torch`` is the median over rounds of torch's time in the round over the way's."""
    from omni_accel.kernels import cublaslt, gemm_tuning

    name, m, k, n, epilogue, calls = spec
    gen = torch.Generator("cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w_t = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, torch.bfloat16).t()
    bias = (torch.randn(n, generator=gen) * 0.1).to(device, torch.bfloat16)
    start = torch.randn(m, n, generator=gen).to(device, torch.bfloat16)
    out = start.clone()
    want = reference(x, w_t, bias, start, epilogue)
    base = {"gemm": name, "shape": [m, k, n], "epilogue": epilogue, "calls_per_step": calls}
    lt_epilogue = gemm_tuning.lt_epilogue(epilogue)
    ways = {"torch": (lambda: gemm_tuning.torch_call(x, w_t, bias, epilogue, out), {})}
    for algo in cublaslt.algorithms(m, n, k, torch.bfloat16, lt_epilogue, count, device.index or 0):
        def run(algo=algo):
            target = out if epilogue == "accumulate" else torch.empty(m, n, device=device, dtype=torch.bfloat16)
            return cublaslt.matmul(x, w_t, bias if "bias" in lt_epilogue else None, target, algo, lt_epilogue,
                                   accumulate=epilogue == "accumulate")
        ways[f"algo_{algo.rank}"] = (run, {"waves": round(algo.waves, 3), "workspace": algo.workspace_size,
                                          "config": algo.config})
    rows: dict[str, dict] = {}
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for way, (fn, extra) in ways.items():
        row = rows[way] = {**base, "way": way, **extra}
        try:
            out.copy_(start)
            row["rel_err"] = rel_err(fn(), want)
            graphs[way] = capture_graph(fn, reps)
        except Exception as exc:  # noqa: BLE001 -- one candidate that fails costs its row
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    per_round = {way: [ms * 1e3 / reps for ms in times]
                 for way, times in graph_rounds_ms(graphs, iters, rounds).items()}
    for way in graphs:
        row = rows[way]
        row["us_graph"] = round(statistics.median(per_round[way]), 2)
        row["us_rounds"] = [round(t, 2) for t in per_round[way]]
        row["tflops"] = round(2 * m * n * k / (row["us_graph"] * 1e-6) / 1e12, 1)
        if "torch" in per_round:
            row["vs_torch"] = round(gemm_tuning.paired_ratio(per_round["torch"], per_round[way]), 4)
        log(str({key: row[key] for key in ("gemm", "way", "us_graph", "vs_torch", "rel_err") if key in row}))
    return list(rows.values())


def summarize(rows: list[dict]) -> dict:
    """Per shape: the candidate with the largest paired ratio over torch's call; per step: torch's time and the time
    with that candidate wherever it beats torch, weighted by the calls per step."""
    summary = {"shapes": {}, "step_ms_torch": 0.0, "step_ms_best": 0.0}
    for name in dict.fromkeys(row["gemm"] for row in rows):
        timed = [row for row in rows if row["gemm"] == name and "vs_torch" in row]
        torch_row = next((row for row in timed if row["way"] == "torch"), None)
        candidates = [row for row in timed if row["way"] != "torch"]
        if torch_row is None or not candidates:
            continue
        best = max(candidates, key=lambda row: row["vs_torch"])
        calls = torch_row["calls_per_step"]
        summary["shapes"][name] = {"torch_us": torch_row["us_graph"], "best": best["way"],
                                   "best_us": best["us_graph"], "vs_torch": best["vs_torch"]}
        summary["step_ms_torch"] += torch_row["us_graph"] * calls / 1e3
        summary["step_ms_best"] += torch_row["us_graph"] / max(best["vs_torch"], 1.0) * calls / 1e3
    summary["step_ms_torch"] = round(summary["step_ms_torch"], 3)
    summary["step_ms_best"] = round(summary["step_ms_best"], 3)
    return summary


def main(argv=None) -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--count", type=int, default=8, help="candidates asked of cuBLASLt's heuristic per shape")
    parser.add_argument("--warm-s", type=float, default=3.0, help="seconds of 8192^3 GEMMs before the first row")
    parser.add_argument("--gemms", default="", help="comma-separated GEMM names (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every way in turn per shape")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error(f"--device {args.device}: cuBLASLt's algorithms need a CUDA GPU; run with --device cuda")
    if args.count < 1 or args.rounds < 1 or args.warm_s < 0:
        parser.error(f"--count {args.count} / --rounds {args.rounds} / --warm-s {args.warm_s}: give at least one "
                     "candidate and one round, and >= 0 seconds")
    specs = TINY_GEMMS if args.tiny else FLUX_GEMMS
    if args.gemms:
        wanted = args.gemms.split(",")
        unknown = sorted(set(wanted) - {s[0] for s in specs})
        if unknown:
            parser.error(f"--gemms: unknown {unknown}; choose from {[s[0] for s in specs]}")
        specs = [s for s in specs if s[0] in wanted]
    clocks = ClockLog(args.log_clocks)
    result = kernel_result("bench_gemm_algos", device)
    torch.randn(8, 8, device=device, dtype=torch.bfloat16) @ torch.randn(8, 8, device=device, dtype=torch.bfloat16)
    if args.warm_s:
        result["warm_up"] = measure_sustained_gemm(device, clocks, args.warm_s)
    clocks.mark()
    for spec in specs:
        result["rows"] += shape_rows(device, spec, args.count, args.iters, args.reps, args.rounds)
        result["summary"] = summarize(result["rows"])
        write_result(args.out, result)
    log(str(result["summary"]))
    return finish(result, clocks, args.out)


if __name__ == "__main__":
    sys.exit(main())
