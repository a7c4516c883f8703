"""FP8 and int8 pieces on FLUX.1-dev block shapes: bf16 GEMM vs row-wise-scaled e4m3 ``_scaled_mm`` vs int8
``_int_mm`` (int32 out), the per-token activation quantization (PyTorch expression eager, torch.compile of it, the
Triton kernel), and whole quantized linears compiled (``Fp8Linear`` / ``Int8Linear``: quantize the activation,
multiply, rescale; Inductor picks among cuBLAS and its Triton GEMM templates and fuses the rescale where it can);
then the AdaLN modulation linears' matrix-vector products, bf16 against int8 weights only (``quant_config=
{"modulation": "int8"}``; Inductor's reduction and omni_accel's Triton GEMV), with the bandwidth each reaches.

    python benchmarks/bench_fp8_gemm.py --log-clocks --out benchmarks/results/bench_fp8_gemm_h200.json   # one GPU
    python benchmarks/bench_fp8_gemm.py --device cpu --tiny --out /tmp/fp8.json              # CPU smoke test
    python benchmarks/bench_fp8_gemm.py --int8-autotune --log-clocks --out ...  # + int8 under max-autotune

Shapes: M = 4608 tokens (4096 image + 512 text) for the single-stream blocks, M = 4096 / 512 for the two streams of
the dual blocks; (K, N) of every distinct block linear. Timing: CUDA events, median of ``--iters`` after warm-up.
``quant_bytes_equal`` is the fraction of e4m3 bytes the Triton kernel writes identically to the PyTorch expression
(they should be all: both compute x / scale in fp32 and round to nearest even). Each warp-specialized int8 tile is
also timed with ``int8_gemm_triton.SPLIT_TAIL`` (rows ``..._splittail``) on the shapes whose last wave it splits.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import back_to_back_ms, graph_ms, rotation_copies, sample_ms, write_result  # noqa: E402
from benchmarks.bench_transformer import ClockLog  # noqa: E402
from omni_accel.kernels import fp8, int8  # noqa: E402

# (name, M, K, N): FLUX.1-dev block linears (dim 3072, MLP 12288; single block: qkv 3x, proj_mlp, proj_out 15360 in)
FLUX_SHAPES = (
    ("single.to_qkv(each)", 4608, 3072, 3072),
    ("single.proj_mlp", 4608, 3072, 12288),
    ("single.proj_out", 4608, 15360, 3072),
    ("dual.img.ff.up", 4096, 3072, 12288),
    ("dual.img.ff.down", 4096, 12288, 3072),
    ("dual.txt.ff.up", 512, 3072, 12288),
    ("dual.txt.qkv", 512, 3072, 9216),
    ("dual.txt.out", 512, 3072, 3072),
    ("dual.txt.ff.down", 512, 12288, 3072),
)
TINY_SHAPES = (("tiny", 64, 128, 256),)
# (name, M, K, N): FLUX.1-dev's AdaLN modulation linears, one token per sample: matrix-vector products
MODULATION_SHAPES = (("dual.norm1.linear (AdaLN)", 1, 3072, 18432), ("single.norm.linear (AdaLN)", 1, 3072, 9216))
TINY_MODULATION_SHAPES = (("tiny_gemv", 1, 128, 256),)


def timed(fn, device, iters: int) -> float:
    for _ in range(3):
        fn()
    return statistics.median(sample_ms(fn, device, iters))


def row(name, m, k, n, device, iters, autotune: bool = False, int8_configs: tuple[str, ...] = ()) -> dict:
    g = torch.Generator("cpu").manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, torch.bfloat16)
    w_fp8, w_scale = fp8.quantize_rows_torch(w)
    w_scale = w_scale.reshape(1, -1).contiguous()
    x_fp8, x_scale = fp8.quantize_rows_torch(x)
    flops = 2.0 * m * k * n
    out = {"shape": name, "M": m, "K": k, "N": n}
    bf16_ms = timed(lambda: x @ w.t(), device, iters)
    def scaled_mm():
        return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)

    mm_ms = timed(scaled_mm, device, iters)
    if device.type == "cuda":  # beside the int8 rows' back-to-back figures
        out["fp8_gemm_b2b_ms"] = round(statistics.median(back_to_back_ms(scaled_mm, device, 20, 5)), 4)
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
    out.update(int8_rows(x, w, exact, flops, bf16_ms, device, iters, autotune, int8_configs))
    return out


def int8_rows(x, w, exact, flops, bf16_ms, device, iters, autotune: bool = False,
              int8_configs: tuple[str, ...] = ()) -> dict:
    """int8 beside the FP8 figures: the raw GEMM, and the FP8 and int8 linears compiled whole (activation
    quantization and rescale included), the comparison that decides between the two formats. ``autotune`` adds the
    int8 linear under max-autotune, where Inductor may take its Triton int8 GEMM template, which fuses the rescale
    into the GEMM (cuBLAS's ``_int_mm`` writes int32 sums, which a second kernel reads back)."""
    w_int8, w_scale = int8.quantize_rows_int8(w)
    x_int8, x_scale = int8.quantize_rows_int8(x)
    int_mm_ms = timed(lambda: torch._int_mm(x_int8, w_int8.t()), device, iters)
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=w.dtype)
    linear.weight.data.copy_(w)
    out = {"int8_gemm_ms": round(int_mm_ms, 4), "int8_tops": round(flops / int_mm_ms / 1e9, 1),
           "int8_gemm_speedup": round(bf16_ms / int_mm_ms, 3)}
    out.update(int8_rescale_rows(x_int8, x_scale, w_int8, w_scale.reshape(1, -1).contiguous(), flops, device, iters,
                                 int8_configs))
    fp8_layer = fp8.Fp8Linear(linear, "w8a8", fast_accum=True)
    layers = [("fp8", fp8_layer, None), ("int8", int8.Int8Linear(linear), None)]
    if autotune:
        layers.append(("int8_autotuned", int8.Int8Linear(linear), "max-autotune-no-cudagraphs"))
    for name, layer, mode in layers:
        compiled = torch.compile(layer, dynamic=False, mode=mode)
        ms = timed(lambda c=compiled: c(x), device, iters)
        got = compiled(x).float()
        out.update({f"{name}_linear_compiled_ms": round(ms, 4),
                    f"{name}_linear_compiled_speedup": round(bf16_ms / ms, 3),
                    f"{name}_linear_rel_err": ((got - exact).norm() / exact.norm()).item()})
    return out


def int8_rescale_rows(x_int8, x_scale, w_int8, w_scale, flops, device, iters, configs: tuple[str, ...] = ()) -> dict:
    """The int8 GEMM with its rescale to bf16, the activation already quantized (what ``fp8_gemm_ms`` is for e4m3):
    cuBLAS's ``_int_mm`` (int32 out) plus a compiled rescale kernel, against the Triton kernel that rescales in its
    epilogue (omni_accel/kernels/int8_gemm_triton.py), one row per tile configuration in ``configs`` (default: every
    shipped one; GPU only)."""
    rescale = torch.compile(lambda acc: (acc.float() * x_scale * w_scale).to(torch.bfloat16), dynamic=False)
    reference = rescale(torch._int_mm(x_int8, w_int8.t()))
    def cublas():
        return rescale(torch._int_mm(x_int8, w_int8.t()))

    ms = timed(cublas, device, iters)
    out = {"int8_gemm_rescale_ms": round(ms, 4), "int8_gemm_rescale_tops": round(flops / ms / 1e9, 1)}
    if device.type != "cuda":
        return out
    # also with calls back to back (the host's launch work hidden behind the GPU's, as in a forward), since the
    # Triton launcher's host time per call is not small beside a 0.1 ms GEMM
    out["int8_gemm_rescale_b2b_ms"] = round(statistics.median(back_to_back_ms(cublas, device, 20, 5)), 4)
    from omni_accel.kernels import int8_gemm_triton

    configs = configs or (*int8_gemm_triton.CONFIGS, *int8_gemm_triton.TMA_CONFIGS, *int8_gemm_triton.WS_CONFIGS)
    # each warp-specialized tile also with its last partial wave split along K (SPLIT_TAIL), where that splits
    runs = [(config, config, False) for config in configs]
    runs += [(f"{config}_splittail", config, True) for config in configs if config in int8_gemm_triton.WS_CONFIGS
             and int8_gemm_triton.ws_plan(x_int8, w_int8, int8_gemm_triton.WS_CONFIGS[config], split_tail=True)[3] > 1]
    for label, config, split_tail in runs:
        def fused(c=config, split=split_tail):
            saved, int8_gemm_triton.SPLIT_TAIL = int8_gemm_triton.SPLIT_TAIL, split
            try:
                return int8_gemm_triton.int8_mm_rescale(x_int8, w_int8, x_scale, w_scale, None, torch.bfloat16, c)
            finally:
                int8_gemm_triton.SPLIT_TAIL = saved
        try:
            same = bool(torch.equal(fused(), reference))
            ms = timed(fused, device, iters)
        except Exception as exc:  # noqa: BLE001 -- a tile that does not fit this GPU must not lose the others
            out[f"int8_triton_{label}_error"] = repr(exc)[:300]
            continue
        b2b_ms = statistics.median(back_to_back_ms(fused, device, 20, 5))
        out.update({f"int8_triton_{label}_ms": round(ms, 4), f"int8_triton_{label}_tops": round(flops / ms / 1e9, 1),
                    f"int8_triton_{label}_b2b_ms": round(b2b_ms, 4),
                    f"int8_triton_{label}_b2b_tops": round(flops / b2b_ms / 1e9, 1),
                    f"int8_triton_{label}_equal": same})
    return out


def gemv_row(name, m, k, n, device, iters) -> dict:
    """A modulation linear: bf16 (cuBLAS's GEMV) against the int8 weight-only layer compiled (one reduction kernel
    that reads the int8 weight) and, on a GPU, with the Triton GEMV (``int8.TRITON_GEMV``), with the bandwidth each
    reaches on its weight bytes."""
    g = torch.Generator("cpu").manual_seed(m + k + n)
    linear = torch.nn.Linear(k, n, bias=True).to(device, torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_((torch.randn(n, k, generator=g) / k**0.5).to(device, torch.bfloat16))
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    bf16_ms = timed(lambda: linear(x), device, iters)
    compiled = torch.compile(int8.Int8WeightOnlyLinear(linear), dynamic=False)
    int8_ms = timed(lambda: compiled(x), device, iters)
    got = compiled(x).float()
    row = {"shape": name, "M": m, "K": k, "N": n, "bf16_gemv_ms": round(bf16_ms, 4),
           "bf16_gemv_gbs": round(2 * n * k / bf16_ms / 1e6, 1), "int8_weight_only_compiled_ms": round(int8_ms, 4),
           "int8_weight_only_gbs": round(n * k / int8_ms / 1e6, 1),
           "int8_weight_only_speedup": round(bf16_ms / int8_ms, 3),
           "int8_weight_only_rel_err": ((got - exact).norm() / exact.norm()).item()}
    if device.type == "cuda":  # the Triton GEMV (int8.TRITON_GEMV), the layer called eagerly
        layer = int8.Int8WeightOnlyLinear(linear)
        saved, int8.TRITON_GEMV = int8.TRITON_GEMV, True
        try:
            gemv_ms = timed(lambda: layer(x), device, iters)
            got = layer(x).float()
        finally:
            int8.TRITON_GEMV = saved
        from omni_accel.kernels.int8_gemm_triton import GEMV_KERNEL

        row.update({"int8_triton_gemv_kernel": GEMV_KERNEL,
                    "int8_triton_gemv_ms": round(gemv_ms, 4), "int8_triton_gemv_gbs": round(n * k / gemv_ms / 1e6, 1),
                    "int8_triton_gemv_speedup": round(bf16_ms / gemv_ms, 3),
                    "int8_triton_gemv_rel_err": ((got - exact).norm() / exact.norm()).item()})
        row.update(gemv_kernel_rows(x, linear, layer, exact, n * k, iters))
    return row


def gemv_kernel_rows(x, linear, layer, exact, weight_bytes: int, iters: int) -> dict:
    """cuBLAS's bf16 GEMV against each of omni_accel's int8 GEMV kernels (int8_gemm_triton.GEMV_KERNELS: the
    tensor-core kernel's tiles and the reduction kernel), each replayed from a CUDA graph. Each graph cycles through
    copies of the weight that together exceed the L2 cache, as a forward's 76 different modulation weights do: one
    weight read 20 times would be served from L2 (an int8 3072 x 9216 weight fits, its bf16 original does not)."""
    from omni_accel.kernels import int8_gemm_triton as g

    copies = rotation_copies(weight_bytes)  # int8 bytes; the bf16 copies are twice as large
    weights = [linear.weight.clone() for _ in range(copies)]
    bf16_ms = graph_ms([lambda w=w: torch.nn.functional.linear(x, w, linear.bias) for w in weights], iters)
    del weights
    out = {"bf16_gemv_graph_ms": round(bf16_ms, 4), "bf16_gemv_graph_gbs": round(2 * weight_bytes / bf16_ms / 1e6, 1),
           "gemv_graph_weight_copies": copies}
    int8_weights = [layer.weight_int8.clone() for _ in range(copies)]
    for kernel in g.GEMV_KERNELS:
        ms = graph_ms([lambda w=w, kernel=kernel: g.int8_gemv(x, w, layer.weight_scale, kernel=kernel)
                       for w in int8_weights], iters)
        got = g.int8_gemv(x, layer.weight_int8, layer.weight_scale, kernel=kernel).float() + linear.bias.float()
        out.update({f"int8_gemv_{kernel}_graph_ms": round(ms, 4),
                    f"int8_gemv_{kernel}_graph_gbs": round(weight_bytes / ms / 1e6, 1),
                    f"int8_gemv_{kernel}_speedup": round(bf16_ms / ms, 3),
                    f"int8_gemv_{kernel}_rel_err": ((got - exact).norm() / exact.norm()).item()})
    return out


def _int8_configs(names: str) -> tuple[str, ...]:
    from omni_accel.kernels import int8_gemm_triton as g

    known = (*g.CONFIGS, *g.TMA_CONFIGS, *g.WS_CONFIGS)
    wanted = tuple(name for name in names.split(",") if name)
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise SystemExit(f"--int8-configs: unknown tile {unknown}; choose from {', '.join(known)}")
    return wanted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--log-clocks", action="store_true",
                    help="sample SM clock and power with nvidia-smi beside every shape (GPU only)")
    ap.add_argument("--int8-autotune", action="store_true",
                    help="also time the int8 linear compiled with max-autotune (Inductor's Triton int8 GEMM, rescale "
                         "fused; tens of seconds of autotuning per shape)")
    ap.add_argument("--int8-configs", default="",
                    help="comma list of the int8 Triton tiles to time (int8_gemm_triton.CONFIGS, TMA_CONFIGS, "
                         "WS_CONFIGS names; default: all)")
    ap.add_argument("--modulation-only", action="store_true",
                    help="only the AdaLN modulation linears' GEMVs (skip the block GEMMs)")
    ap.add_argument("--out", default="bench_fp8_gemm.json")
    args = ap.parse_args(argv)
    int8_configs = _int8_configs(args.int8_configs)
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
    clocks = ClockLog(enabled=args.log_clocks and device.type == "cuda")
    try:
        shapes = [(functools.partial(row, autotune=args.int8_autotune, int8_configs=int8_configs), spec)
                  for spec in (TINY_SHAPES if args.tiny else FLUX_SHAPES) if not args.modulation_only]
        shapes += [(gemv_row, spec) for spec in (TINY_MODULATION_SHAPES if args.tiny else MODULATION_SHAPES)]
        for measure, spec in shapes:
            clocks.mark()
            try:
                rows.append(measure(*spec, device, iters))
            except Exception as exc:  # noqa: BLE001 -- one failing shape must not lose the others
                rows.append({"shape": spec[0], "error": repr(exc)})
            rows[-1].update(clocks.since_mark())
            print(json.dumps(rows[-1]), flush=True)
            write_result(args.out, {"env": env, "iters": iters, "rows": rows})  # a crash later keeps these
    finally:
        clocks.stop()
    write_result(args.out, {"env": env, "iters": iters, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
