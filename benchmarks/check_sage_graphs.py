"""Is SageAttention right under CUDA graphs and on a non-default stream? One GPU, FLUX's attention shape.

SageAttention launches its CUDA kernels on the legacy default stream, so a CUDA graph captured on its own stream
leaves them out. This script shows the three cases side by side, each checked on inputs *other* than the ones
captured (a replay of the captured inputs hides the fault):

- ``captured``: the package called inside a plain ``torch.cuda.graph`` capture (what the whole-forward graph did
  before it broke the capture around the op);
- ``host_step``: the op inside omni_accel's whole-forward graph (``GraphedForward``), which runs it between graph
  segments (``cuda_graphs.run_outside_graph``);
- ``side_stream``: the op called eagerly with a non-default stream current.

Each gets the relative error against SDPA on the new inputs; SageAttention's own error at this shape is the
``eager`` row. The same for the path that quantizes Q, K and V in the compiled graph
(``sage_attention.PREP_IN_GRAPH``: ``prepared_*`` rows, the quantization compiled by inductor and the package's Hopper
kernel called through ``omni_accel::sage_attention_quantized``), plus ``prepared_vs_package``: its output against
``sageattn``'s on the same inputs (both quantize the same way, so this is the kernel reading our operands as its
own), and ``prepared_vs_operands``: against the float32 attention of the operands it was given. ``prep_kernels_*``:
the same with ``sage_attention.PREP_KERNELS`` (omni_accel's Triton kernels quantize), how many of their operands
equal the PyTorch expressions' (and the largest relative scale difference), the kernel's output on them against SDPA
and against its output on the PyTorch operands with K's mean subtracted in float32 as the kernels do
(``fp32_vs_bf16_smoothed_operands``: what that precision alone moves). Each compiled row starts from a reset
compiler: the switches are read while tracing. Usage::

    python benchmarks/check_sage_graphs.py --out benchmarks/results/check_sage_graphs_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import write_result  # noqa: E402


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _plain_capture_error(block, captured_in, fresh, want) -> float:
    """Warm up on a side stream, capture ``block`` as the whole-forward graph did before (thread-local mode), copy
    new inputs in, replay, and return the error against ``want``."""
    static = [t.clone() for t in captured_in]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_out = block(*static)
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    return rel_err(static_out, want)


def _graphed_error(block, captured_in, fresh, want, device) -> tuple[float, object, dict]:
    """``block`` in omni_accel's whole-forward graph: a warm-up call and the capture on ``captured_in``, then a replay
    on ``fresh``: (its error against ``want``, the graphed forward, its stats)."""
    from omni_accel.cuda_graphs import GraphedForward

    graphed = GraphedForward(block, torch.nn.Linear(1, 1, device=device), device)
    with torch.no_grad():
        graphed(*captured_in)
        graphed(*captured_in)
        err = rel_err(graphed(*fresh), want)
    return err, graphed, dict(graphed.stats)


def _compiled_route_rows(prefix: str, prep_kernels: bool, fresh, want, other, device) -> dict:
    """The compiled route (``sage_attention.prepared_attention`` with ``PREP_KERNELS`` set to ``prep_kernels``)
    between kernels, as in a block: ``{prefix}_eager`` and, under the whole-forward graph on new inputs,
    ``{prefix}_host_step`` / ``{prefix}_graph_stats``."""
    from omni_accel.kernels import sage_attention as sage

    torch._dynamo.reset()  # a fresh trace: the module switches are read while tracing
    prepared = torch.compile(sage.prepared_attention, dynamic=False)

    def block(q, k, v):
        return prepared(q * 1.0, k, v, None) * 2.0

    with mock.patch.object(sage, "PREP_KERNELS", prep_kernels):
        rows = {f"{prefix}_eager": rel_err(block(*fresh), want)}
        rows[f"{prefix}_host_step"], _, rows[f"{prefix}_graph_stats"] = _graphed_error(block, other, fresh, want,
                                                                                     device)
    return rows


def _prepared_rows(fresh, want, other, device) -> dict:
    """The PREP_IN_GRAPH path with the quantization traced into the graph (``PREP_KERNELS`` off): eager, against the
    package and against its own operands, and under the whole-forward graph on new inputs."""
    from omni_accel.kernels import sage_attention as sage

    q, k, v = fresh
    operands = sage._reference_operands(q, k, v)
    kernel_out = sage.sage_attention_quantized(*operands, q.shape[-1] ** -0.5, q.dtype)
    q32, k32, v32 = sage.dequantized(*operands)
    rows = {"prepared_direct_vs_sdpa": rel_err(kernel_out * 2.0, want),
            "prepared_vs_package": rel_err(kernel_out, sage._sage_call(q, k, v, None, False)),
            "prepared_vs_operands": rel_err(kernel_out, sdpa(q32, k32, v32))}
    return {**_compiled_route_rows("prepared", False, fresh, want, other, device), **rows}


def _prep_kernel_rows(fresh, want, other, device) -> dict:
    """The PREP_KERNELS path (omni_accel's Triton kernels quantize Q, K, V): its operands against the PyTorch
    expressions' (int8 and scales equal, V within one e4m3 step), the attention on them against the package's, and
    the compiled route eager and under the whole-forward graph on new inputs."""
    from omni_accel.kernels import sage_attention as sage
    from omni_accel.kernels import sage_prep_triton

    q, k, v = fresh
    got = sage_prep_triton.quantize(q, k, v)
    # the kernels subtract K's mean in float32; the PyTorch expressions on a bf16 K round K - mean to bf16 first
    ref = sage._reference_operands(q, k.float(), v)
    rows = {f"prep_kernels_{name}_equal_frac": (x.float() == y.float()).float().mean().item()
            for name, x, y in zip(("q8", "q_scale", "k8", "k_scale", "v8", "v_scale"), got, ref)}
    rows["prep_kernels_scale_max_rel_diff"] = max(float(((x - y).abs() / y.abs().clamp(min=1e-30)).max())
                                                  for x, y in ((got[1], ref[1]), (got[3], ref[3]), (got[5], ref[5])))

    def attend(operands):
        return sage.sage_attention_quantized(*operands, q.shape[-1] ** -0.5, q.dtype)

    kernel_out = attend(got)
    bf16_smoothed = attend(sage._reference_operands(q, k, v))
    rows["prep_kernels_vs_package"] = rel_err(kernel_out, sage._sage_call(q, k, v, None, False))
    rows["prep_kernels_direct_vs_sdpa"] = rel_err(kernel_out * 2.0, want)
    rows["prep_kernels_vs_fp32_smoothed_operands"] = rel_err(kernel_out, attend(ref))
    rows["fp32_vs_bf16_smoothed_operands"] = rel_err(attend(ref), bf16_smoothed)
    rows.update(_compiled_route_rows("prep_kernels", True, fresh, want, other, device))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4608)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from omni_accel.kernels.sage_attention import _sage_call as sage_package_call
    from omni_accel.kernels.sage_attention import sage_attention

    device = torch.device("cuda")
    shape = (1, args.tokens, args.heads, 128)

    def qkv(seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        return [torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3)]

    def block(q, k, v):  # kernels before and after the op, as in a transformer block
        return sage_attention(q * 1.0, k, v, None) * 2.0

    captured_in, fresh = qkv(0), qkv(1)
    want = sdpa(*fresh) * 2.0
    rows = {"eager": rel_err(block(*fresh), want)}

    # the package called inside a plain capture (what the op did before it ran between graph segments), replayed on
    # new inputs
    def block_captured(q, k, v):
        return sage_package_call(q * 1.0, k, v, None, False) * 2.0

    try:
        rows["captured"] = _plain_capture_error(block_captured, captured_in, fresh, want)
    except Exception as exc:  # noqa: BLE001 -- a failed capture is a result too
        rows["captured"] = f"capture failed: {type(exc).__name__}: {exc}"[:300]
    torch.cuda.synchronize()

    # omni_accel's whole-forward graph: warm-up call, capture, then replays on new inputs
    rows["host_step"], graphed, _ = _graphed_error(block, captured_in, fresh, want, device)
    with torch.no_grad():
        rows["host_step_again"] = rel_err(graphed(*qkv(2)), sdpa(*qkv(2)) * 2.0)
    rows["graph_stats"] = dict(graphed.stats)

    # eager on a side stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = block(*fresh)
    torch.cuda.current_stream().wait_stream(side)
    rows["side_stream"] = rel_err(out, want)
    torch.cuda.synchronize()
    rows.update(_prepared_rows(fresh, want, qkv(2), device))
    rows.update(_prep_kernel_rows(fresh, want, qkv(2), device))

    import sageattention  # noqa: F401 -- its version goes into the result

    from importlib import metadata

    result = {"benchmark": "check_sage_graphs", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "sageattention": metadata.version("sageattention"), "shape_bthd": list(shape),
              "rel_err_vs_sdpa_on_new_inputs": rows}
    print(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
