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

``--quack CONFIGS`` adds the CuTe DSL GEMMs of the ``quack-kernels`` package (the kernels FlashAttention-4 is built
beside) as ways ``quack_<tile>_<pp|coop>_c<cluster>`` for the shapes of at least 4,096 rows: its plain GEMM with the
bias in the epilogue, its ``gemm_act`` with the tanh GELU, its in-place accumulation. ``single_qkv_mlp`` (not in the
step sum) is the single block's q / k / v and MLP input projections as one GEMM of 21,504 columns, the GELU then
applied to the MLP's columns by a separate kernel: whether fewer, larger GEMMs pay for losing the GELU epilogue.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_fp8_epilogues import finish, kernel_parser, kernel_result  # noqa: E402
from benchmarks.bench_transformer import ClockLog, log, measure_sustained_gemm  # noqa: E402
from benchmarks.timing import capture_graph, graph_rounds_ms, package_version, write_result  # noqa: E402

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
# not in the step sum (0 calls): q / k / v and the MLP input projection of a single block as one GEMM, the GELU on the
# MLP's 12,288 columns as a separate pass (a GEMM epilogue applies to every column)
FUSION_GEMMS = [("single_qkv_mlp", 4608, 3072, 21504, "bias_gelu_tail", 0)]
GELU_TAIL_FROM = 9216
TINY_GEMMS = [("tiny", 64, 128, 256, "bias", 1)]
# quack's Hopper tiles (omni_accel.kernels.quack_gemm's names); "default" is quack's own default config
# (on Hopper "default" is 128x192_pp_c2x1: the 2026-12-07 file times that kernel twice, 1-5 % apart)
QUACK_CONFIGS = "256x128_coop_c2x1,256x192_coop_c2x1,128x256_coop_c2x1,128x192_pp_c2x1"
QUACK_MIN_ROWS = 4096


def reference(x, w_t, bias, start, epilogue: str) -> torch.Tensor:
    product = x.float() @ w_t.float()
    if epilogue == "accumulate":
        return start.float() + product
    product = product + bias.float()
    if epilogue == "bias_gelu_tail":
        product[:, GELU_TAIL_FROM:] = F.gelu(product[:, GELU_TAIL_FROM:], approximate="tanh")
        return product
    return F.gelu(product, approximate="tanh") if epilogue == "gelu_bias" else product


def gelu_tail_(out: torch.Tensor) -> torch.Tensor:
    """The fused GEMM's MLP columns through the tanh GELU, in place (what its epilogue cannot do)."""
    torch.ops.aten.gelu_(out[:, GELU_TAIL_FROM:], approximate="tanh")
    return out


class EagerReps:
    """``reps`` calls of ``fn`` behind a graph's ``replay`` (for a way whose kernels a capture refuses)."""

    def __init__(self, fn, reps: int):
        self.fn, self.reps = fn, reps

    def replay(self) -> None:
        for _ in range(self.reps):
            self.fn()


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return round(float((out.float() - want).norm() / want.norm()), 6)


def shape_rows(device, spec, count: int, iters: int, reps: int, rounds: int, quack: list[str] = ()) -> list[dict]:
    """torch's call and each candidate, captured once, then timed in ``rounds`` rounds; each round replays every way
    in turn, starting one later each round, so that a drift of the clocks during the shape's run reaches all ways
    alike: ``vs_torch`` is the median over rounds of torch's time in the round over the way's."""
    from omni_accel.kernels import cublaslt, gemm_tuning, quack_gemm

    name, m, k, n, epilogue, calls = spec
    gen = torch.Generator("cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w_t = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, torch.bfloat16).t()
    bias = (torch.randn(n, generator=gen) * 0.1).to(device, torch.bfloat16)
    start = torch.randn(m, n, generator=gen).to(device, torch.bfloat16)
    out = start.clone()
    want = reference(x, w_t, bias, start, epilogue)
    base = {"gemm": name, "shape": [m, k, n], "epilogue": epilogue, "calls_per_step": calls}
    tail = epilogue == "bias_gelu_tail"
    lt_epilogue = gemm_tuning.lt_epilogue("bias" if tail else epilogue)
    if tail:
        ways = {"torch": (lambda: gelu_tail_(gemm_tuning.torch_call(x, w_t, bias, "bias", out)), {})}
    else:
        ways = {"torch": (lambda: gemm_tuning.torch_call(x, w_t, bias, epilogue, out), {})}
    for algo in cublaslt.algorithms(m, n, k, torch.bfloat16, lt_epilogue, count, device.index or 0):
        def run(algo=algo):
            target = out if epilogue == "accumulate" else torch.empty(m, n, device=device, dtype=torch.bfloat16)
            result = cublaslt.matmul(x, w_t, bias if "bias" in lt_epilogue else None, target, algo, lt_epilogue,
                                     accumulate=epilogue == "accumulate")
            return gelu_tail_(result) if tail else result
        ways[f"algo_{algo.rank}"] = (run, {"waves": round(algo.waves, 3), "workspace": algo.workspace_size,
                                          "config": algo.config})
    for tile in quack if m >= QUACK_MIN_ROWS else ():
        try:
            config = quack_gemm.config(tile, device)
        except Exception as exc:  # noqa: BLE001 -- no quack, or a config it cannot take: that way's row says why
            ways[f"quack_{tile}"] = (None, {"error": f"{type(exc).__name__}: {exc}"[:300]})
            continue

        def run_quack(config=config):
            result = quack_gemm.linear(x, w_t, bias, "bias" if tail else epilogue, out, config)
            return gelu_tail_(result) if tail else result
        ways[f"quack_{tile}"] = (run_quack, {"config": str(config)})
    rows: dict[str, dict] = {}
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for way, (fn, extra) in ways.items():
        row = rows[way] = {**base, "way": way, **extra}
        if fn is None:
            continue
        try:
            out.copy_(start)
            began = time.perf_counter()
            result = fn()
            torch.cuda.synchronize(device)
            row["first_call_s"] = round(time.perf_counter() - began, 3)  # a quack way compiles in it
            row["rel_err"] = rel_err(result, want)
            out.copy_(start)
        except Exception as exc:  # noqa: BLE001 -- one candidate that fails costs its row
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        try:
            graphs[way] = capture_graph(fn, reps)
        except Exception as exc:  # noqa: BLE001 -- a capture refused: the way is timed as eager calls
            torch.cuda.synchronize()
            row["eager_timed"] = f"{type(exc).__name__}: {exc}"[:200]
            graphs[way] = EagerReps(fn, reps)
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
    torch_us = {row["gemm"]: row["us_graph"] for row in rows if row["way"] == "torch" and "us_graph" in row}
    if {"single_qkv", "single_mlp_gelu", "single_qkv_mlp"} <= set(torch_us):  # the fusion's verdict, torch's calls
        separate = torch_us["single_qkv"] + torch_us["single_mlp_gelu"]
        summary["single_fusion"] = {"separate_us": round(separate, 2), "fused_us": torch_us["single_qkv_mlp"],
                                    "fused_speedup": round(separate / torch_us["single_qkv_mlp"], 4)}
    summary["step_ms_torch"] = round(summary["step_ms_torch"], 3)
    summary["step_ms_best"] = round(summary["step_ms_best"], 3)
    return summary


def main(argv=None) -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--count", type=int, default=8, help="candidates asked of cuBLASLt's heuristic per shape")
    parser.add_argument("--warm-s", type=float, default=3.0, help="seconds of 8192^3 GEMMs before the first row")
    parser.add_argument("--gemms", default="", help="comma-separated GEMM names (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every way in turn per shape")
    parser.add_argument("--quack", nargs="?", const=QUACK_CONFIGS, default="",
                        help="also time quack-kernels' GEMMs on these configs (comma-separated, e.g. "
                             f"256x128_coop_c2x1; bare --quack: {QUACK_CONFIGS})")
    args = parser.parse_args(argv)
    from omni_accel.errors import AccelError
    from omni_accel.kernels import quack_gemm

    tiles = [tile for tile in args.quack.split(",") if tile]
    try:
        for tile in tiles:
            quack_gemm.check_name(tile)
    except AccelError as exc:
        parser.error(f"--quack: {exc}")
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error(f"--device {args.device}: cuBLASLt's algorithms need a CUDA GPU; run with --device cuda")
    if args.count < 1 or args.rounds < 1 or args.warm_s < 0:
        parser.error(f"--count {args.count} / --rounds {args.rounds} / --warm-s {args.warm_s}: give at least one "
                     "candidate and one round, and >= 0 seconds")
    specs = TINY_GEMMS if args.tiny else FLUX_GEMMS + FUSION_GEMMS
    if args.gemms:
        wanted = args.gemms.split(",")
        unknown = sorted(set(wanted) - {s[0] for s in specs})
        if unknown:
            parser.error(f"--gemms: unknown {unknown}; choose from {[s[0] for s in specs]}")
        specs = [s for s in specs if s[0] in wanted]
    clocks = ClockLog(args.log_clocks)
    result = kernel_result("bench_gemm_algos", device)
    if args.quack:
        result["env"].update({package: package_version(package) for package in ("quack-kernels", "nvidia-cutlass-dsl")})
    torch.randn(8, 8, device=device, dtype=torch.bfloat16) @ torch.randn(8, 8, device=device, dtype=torch.bfloat16)
    if args.warm_s:
        result["warm_up"] = measure_sustained_gemm(device, clocks, args.warm_s)
    clocks.mark()
    for spec in specs:
        result["rows"] += shape_rows(device, spec, args.count, args.iters, args.reps, args.rounds, tiles)
        result["summary"] = summarize(result["rows"])
        write_result(args.out, result)
    log(str(result["summary"]))
    return finish(result, clocks, args.out)


if __name__ == "__main__":
    sys.exit(main())
