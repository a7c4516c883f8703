"""Can FLUX's modulation GEMVs hide behind the blocks' GEMMs on a second stream? Serial against overlapped, bf16.

    python benchmarks/bench_side_stream_gemv.py --log-clocks --out benchmarks/results/side_stream_gemv.json

Every FLUX block starts with AdaLN modulation linears on ``silu(temb)``: one row, 3,072 in, 18,432 out per stream of a
dual block and 9,216 out per single block -- 6.4 GB of weights per step read by GEMVs that take about 3 ms of a bf16
step, bound by memory. They depend on the timestep embedding only, not on the hidden states, so they could run on a
second stream while the previous block's GEMMs (bound by the tensor cores) run. At the power cap the GEMVs' memory
traffic still costs power, so whether the overlap saves time is a measurement, not a given.

Rows (each one CUDA graph of ``--blocks`` block-like units, timed in ``--rounds`` alternating rounds):
- ``gemms``: each unit's GEMMs alone (a dual block's image stream: q/k/v, out, MLP up with GELU, MLP down);
- ``serial``: each unit's two modulation GEMVs, then its GEMMs, on one stream (what a compiled forward runs);
- ``overlapped``: unit i's GEMMs on the main stream while unit i+1's GEMVs run on a side stream (forked and joined
  with events, as a prefetching pass would), unit 0's GEMVs first.
``hidden_fraction`` = (serial - overlapped) / (serial - gemms): the share of the GEMVs' time the overlap hides.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_fp8_epilogues import finish, kernel_parser, kernel_result  # noqa: E402
from benchmarks.bench_transformer import ClockLog, log, measure_sustained_gemm  # noqa: E402
from benchmarks.timing import capture_graph, graph_rounds_ms, write_result  # noqa: E402


def make_unit(device, rows: int, dim: int, mlp: int, mod_out: int, gen: torch.Generator) -> dict:
    def weight(out_f, in_f):
        return (torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5).to(device, torch.bfloat16)

    return {"qkv": weight(3 * dim, dim), "out": weight(dim, dim), "up": weight(mlp, dim), "down": weight(dim, mlp),
            "mod": [weight(mod_out, dim), weight(mod_out, dim)],
            "x": torch.randn(rows, dim, generator=gen).to(device, torch.bfloat16)}


def gemms(unit: dict) -> torch.Tensor:
    x = unit["x"]
    torch.mm(x, unit["qkv"].t())
    h = torch.mm(x, unit["out"].t())
    g = torch.nn.functional.gelu(torch.mm(h, unit["up"].t()), approximate="tanh")
    return torch.mm(g, unit["down"].t())


def gemvs(unit: dict, emb: torch.Tensor) -> list[torch.Tensor]:
    return [torch.mm(emb, w.t()) for w in unit["mod"]]


def ways(units: list[dict], emb: torch.Tensor) -> dict:
    side = torch.cuda.Stream()

    def only_gemms():
        for unit in units:
            gemms(unit)

    def serial():
        for unit in units:
            gemvs(unit, emb)
            gemms(unit)

    def overlapped():
        main = torch.cuda.current_stream()
        gemvs(units[0], emb)
        for i, unit in enumerate(units):
            if i + 1 < len(units):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    gemvs(units[i + 1], emb)
            gemms(unit)
            if i + 1 < len(units):
                main.wait_stream(side)

    return {"gemms": only_gemms, "serial": serial, "overlapped": overlapped}


def main(argv=None) -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--blocks", type=int, default=8, help="block-like units per graph")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm-s", type=float, default=3.0, help="seconds of 8192^3 GEMMs before the first row")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error(f"--device {args.device}: streams and CUDA graphs need a CUDA GPU; run with --device cuda")
    if args.blocks < 2 or args.rounds < 1 or args.warm_s < 0:
        parser.error(f"--blocks {args.blocks} / --rounds {args.rounds} / --warm-s {args.warm_s}: give at least two "
                     "units, one round and >= 0 seconds")
    rows, dim, mlp, mod_out = (256, 256, 1024, 1536) if args.tiny else (4096, 3072, 12288, 18432)
    gen = torch.Generator("cpu").manual_seed(0)
    units = [make_unit(device, rows, dim, mlp, mod_out, gen) for _ in range(args.blocks)]
    emb = torch.randn(1, dim, generator=gen).to(device, torch.bfloat16)
    clocks = ClockLog(args.log_clocks)
    result = kernel_result("bench_side_stream_gemv", device)
    result["shape"] = {"rows": rows, "dim": dim, "mlp": mlp, "modulation_out": mod_out, "units": args.blocks}
    if args.warm_s:
        result["warm_up"] = measure_sustained_gemm(device, clocks, args.warm_s)
    clocks.mark()
    graphs = {name: capture_graph(fn) for name, fn in ways(units, emb).items()}
    per_round = graph_rounds_ms(graphs, args.iters, args.rounds)
    for name in graphs:
        ms = statistics.median(per_round[name])
        result["rows"].append({"way": name, "ms_per_unit": round(ms / args.blocks, 4),
                               "ms_rounds": [round(t, 3) for t in per_round[name]]})
        log(str(result["rows"][-1]))
    by = {row["way"]: row["ms_per_unit"] for row in result["rows"]}
    gemv_ms = by["serial"] - by["gemms"]
    result["summary"] = {"gemv_ms_per_unit": round(gemv_ms, 4),
                         "saved_ms_per_unit": round(by["serial"] - by["overlapped"], 4),
                         "hidden_fraction": round((by["serial"] - by["overlapped"]) / gemv_ms, 3) if gemv_ms > 0
                         else None}
    log(str(result["summary"]))
    write_result(args.out, result)
    return finish(result, clocks, args.out)


if __name__ == "__main__":
    sys.exit(main())
