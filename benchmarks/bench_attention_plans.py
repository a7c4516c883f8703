"""Every execution plan cuDNN offers for bf16 attention at DiT shapes, against the one torch's SDPA runs.

    python benchmarks/bench_attention_plans.py --log-clocks --out benchmarks/results/attention_plans.json

torch's cuDNN SDPA builds the first plan of cuDNN's heuristic (mode A) and runs it. This script builds the same
operation graph through NVIDIA's ``nvidia-cudnn-frontend`` package -- q / k / v in the model's (B, S, H, D) memory,
non-causal, no mask, no softmax statistics -- asks heuristic modes A, B and the fallback list for their plans, and
times each plan that builds (``plan_<index>``, with cuDNN's name for it) beside torch's call (``torch_cudnn``, before
and after the plans, to show drift). Every call is replayed from one CUDA graph of ``--reps`` calls, after
``--warm-s`` seconds of dense GEMMs, so the GPU is at the clock a model's step holds. Each row has its largest
difference from torch's output. Shapes: FLUX 1024² (4608 tokens, 24 heads), Qwen-Image 1024² (4352, 24), Wan-14B
480x832 at 81 frames (32760, 40); head dim 128.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_fp8_epilogues import finish, kernel_parser, kernel_result, timed_ms  # noqa: E402
from benchmarks.bench_transformer import ClockLog, log, measure_sustained_gemm  # noqa: E402
from benchmarks.timing import graph_ms, write_result  # noqa: E402

SHAPES = {"flux": (4608, 24, 128), "qwen_image": (4352, 24, 128), "wan81": (32760, 40, 128)}
TINY_SHAPES = {"tiny": (256, 2, 64)}
_UID = {"q": 1, "k": 2, "v": 3, "o": 4}


def torch_cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def build_graph(s: int, h: int, d: int, modes: list):
    """cuDNN's bf16 SDPA on (B, S, H, D) memory with every plan of the heuristic ``modes``."""
    import cudnn

    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32)
    dims, strides = (1, h, s, d), (s * h * d, d, h * d, 1)
    q, k, v = (graph.tensor(uid=_UID[n], dim=dims, stride=strides, data_type=bf16) for n in ("q", "k", "v"))
    o, _stats = graph.sdpa(q=q, k=k, v=v, generate_stats=False, attn_scale=d ** -0.5, use_causal_mask=False)
    o.set_uid(_UID["o"]).set_output(True).set_dim(dims).set_stride(strides).set_data_type(bf16)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans(modes)
    graph.check_support()
    return graph


def plans_graph(s: int, h: int, d: int):
    """(the graph with heuristic modes A, B and the fallback list, the modes used): without B where cuDNN refuses it
    for SDPA."""
    import cudnn

    try:
        return build_graph(s, h, d, [cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK]), "A,B,FALLBACK"
    except Exception as exc:  # noqa: BLE001 -- a graph plans once: build a new one without mode B
        log(f"heuristic modes A + B + fallback refused ({exc!r}); A + fallback")
        return build_graph(s, h, d, [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]), "A,FALLBACK"


def shape_rows(device, name: str, shape: tuple, iters: int, reps: int) -> list[dict]:
    import cudnn

    s, h, d = shape
    gen = torch.Generator("cpu").manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    flops = 4 * s * s * d * h
    want = torch_cudnn(q, k, v)
    base = {"shape_name": name, "shape": [1, s, h, d]}
    rows: list[dict] = []

    def timed(way: str, fn, extra: dict) -> None:
        row = {**base, "way": way, **extra}
        try:
            row["max_abs_diff_vs_torch"] = float((fn().float() - want.float()).abs().max())
            try:
                row["us_graph"] = round(graph_ms([fn] * reps, iters) * 1e3, 2)
            except Exception as exc:  # noqa: BLE001 -- a plan that cannot be captured is timed launched
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
                row["us_graph"] = timed_ms(fn, device, iters, reps)["us"]
            row["tflops"] = round(flops / (row["us_graph"] * 1e-6) / 1e12, 1)
        except Exception as exc:  # noqa: BLE001 -- a plan that fails costs its row
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        log(str(row))
        rows.append(row)

    timed("torch_cudnn", lambda: torch_cudnn(q, k, v), {})
    graph, modes = plans_graph(s, h, d)
    base["heuristic_modes"] = modes  # the rows after this one record which modes listed the plans
    handle = cudnn.create_handle()
    for index in range(graph.get_execution_plan_count()):
        extra = {"plan_index": index}
        try:
            extra["plan_name"] = graph.get_plan_name_at_index(index)
            graph.build_plan_at_index(index)
            workspace = torch.empty(max(graph.get_workspace_size_plan_at_index(index), 1), dtype=torch.uint8,
                                    device=device)
        except Exception as exc:  # noqa: BLE001 -- plans that do not build are listed with cuDNN's reason
            rows.append({**base, "way": f"plan_{index}", **extra, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue

        def run(index=index, workspace=workspace):
            out = torch.empty_like(q)
            cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
            graph.execute_plan_at_index({_UID["q"]: q, _UID["k"]: k, _UID["v"]: v, _UID["o"]: out}, workspace,
                                        index, handle=handle)
            return out

        timed(f"plan_{index}", run, {**extra, "workspace": workspace.numel()})
    timed("torch_cudnn_again", lambda: torch_cudnn(q, k, v), {})
    return rows


def main(argv=None) -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--warm-s", type=float, default=3.0, help="seconds of 8192^3 GEMMs before the first row")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error(f"--device {args.device}: cuDNN's attention plans need a CUDA GPU; run with --device cuda")
    if args.warm_s < 0:
        parser.error(f"--warm-s {args.warm_s}: give the seconds of warm-up GEMMs (>= 0), or 0 for none")
    table = TINY_SHAPES if args.tiny else SHAPES
    unknown = sorted(set(args.shapes.split(",")) - set(table)) if not args.tiny else []
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {sorted(table)}")
    names = list(table) if args.tiny else args.shapes.split(",")
    clocks = ClockLog(args.log_clocks)
    result = kernel_result("bench_attention_plans", device)
    try:
        import cudnn
        result["env"].update(cudnn_frontend=cudnn.__version__, cudnn_backend=cudnn.backend_version())
    except ImportError:
        parser.error("the 'nvidia-cudnn-frontend' package (import name cudnn) is not installed: pip install "
                     "nvidia-cudnn-frontend")
    if args.warm_s:
        result["warm_up"] = measure_sustained_gemm(device, clocks, args.warm_s)
    clocks.mark()
    for name in names:
        result["rows"] += shape_rows(device, name, table[name], args.iters, args.reps)
        write_result(args.out, result)
    return finish(result, clocks, args.out)


if __name__ == "__main__":
    sys.exit(main())
