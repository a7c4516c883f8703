"""Per-kernel benchmark of omni_accel's fused Triton kernels on FLUX.1-dev block shapes.

    # on one GPU (the lead's H200 run)
    python benchmarks/bench_kernels.py --out benchmarks/results/bench_kernels_h200.json
    # smoke test on the CPU, seconds (the Triton column needs TRITON_INTERPRET=1 set before the run)
    python benchmarks/bench_kernels.py --device cpu --tiny --no-compile --out /tmp/bench_kernels.json

Shapes (bf16, batch 1): 4608 tokens = 4096 image + 512 text, C = 3072, 24 heads x 128. Every row times, on the same
inputs, three ways of computing one thing:
- ``eager``: what diffusers runs without kernels=True -- the layer's own op sequence (AdaLN: ``F.layer_norm`` then
  ``* (1 + scale) + shift``; FLUX Q/K norm: ``torch.nn.RMSNorm``; Qwen / Z-Image Q/K norm: diffusers ``RMSNorm``;
  rotary: diffusers ``apply_rotary_emb``; gated residual: ``x + gate[:, None] * y``),
- ``compile``: ``torch.compile`` of that same function (Inductor's fusion of it, alone),
- ``triton``: omni_accel.kernels.fused with the Triton backend.
``max_abs_err_*`` is against the same formula in float32 on the same bf16 inputs. Timing on CUDA:
``triton.testing.do_bench`` (median, L2 flushed between runs) or CUDA events when triton is absent; on CPU the median
of a perf_counter loop. A failing row records its error and the run goes on. ``flux_step_estimate`` adds up, over
the modules kernels=True replaces in one FLUX.1-dev forward (19 dual + 38 single blocks), the per-call time saved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import sample_ms, write_result  # noqa: E402
from omni_accel.kernels import fused  # noqa: E402

FLUX = dict(img=4096, txt=512, dim=3072, heads=24, head_dim=128, dual=19, single=38)
TINY = dict(img=32, txt=5, dim=48, heads=3, head_dim=16, dual=1, single=2)


def _time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Milliseconds per call."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=max(iters, 20), return_mode="median"))
        except ImportError:
            pass
    fn()
    return statistics.median(sample_ms(fn, device, iters))


# ------------------------------------------------------------------------------------------------------ cases
def _case_layernorm_modulate(shape: dict, tokens: int, device, dtype, gen):
    c = shape["dim"]
    x = torch.randn(1, tokens, c, device=device, generator=gen).to(dtype)
    emb = torch.randn(1, 6 * c, device=device, generator=gen).to(dtype)
    shift, scale = emb.chunk(6, dim=1)[:2]  # the strided chunks AdaLayerNormZero hands over

    def eager():
        return F.layer_norm(x, (c,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]

    def exact():
        return F.layer_norm(x.float(), (c,), eps=1e-6) * (1 + scale.float()[:, None]) + shift.float()[:, None]

    return eager, (lambda: fused.layernorm_modulate(x, scale, shift, 1e-6)), exact, tuple(x.shape)


def _qk(shape: dict, tokens: int, device, dtype, gen):
    # q as FluxAttnProcessor hands it to norm_q: a Linear output (B, S, H*D) unflattened to (B, S, H, D)
    return torch.randn(1, tokens, shape["heads"] * shape["head_dim"], device=device, generator=gen).to(dtype) \
        .unflatten(-1, (shape["heads"], shape["head_dim"]))


def _case_rms_norm_torch(shape: dict, tokens: int, device, dtype, gen):
    q = _qk(shape, tokens, device, dtype, gen)
    norm = torch.nn.RMSNorm(shape["head_dim"], eps=1e-6).to(device=device, dtype=dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape["head_dim"], device=device, generator=gen))

    return (lambda: norm(q)), (lambda: fused.rms_norm(q, norm.weight, 1e-6, q.dtype)), \
        (lambda: fused.rms_norm_ref(q.float(), norm.weight.float(), 1e-6, torch.float32)), tuple(q.shape)


def _case_rms_norm_diffusers(shape: dict, tokens: int, device, dtype, gen):
    from diffusers.models.normalization import RMSNorm

    q = _qk(shape, tokens, device, dtype, gen)
    norm = RMSNorm(shape["head_dim"], eps=1e-6).to(device=device, dtype=dtype).requires_grad_(False)
    return (lambda: norm(q)), (lambda: fused.rms_norm(q, norm.weight, 1e-6, dtype)), \
        (lambda: fused.rms_norm_ref(q.float(), norm.weight.float(), 1e-6, torch.float32)), tuple(q.shape)


def _case_rms_norm_rope(shape: dict, tokens: int, device, dtype, gen):
    from diffusers.models.embeddings import apply_rotary_emb

    q = _qk(shape, tokens, device, dtype, gen)
    d = shape["head_dim"]
    weight = (1 + 0.1 * torch.randn(d, device=device, generator=gen)).to(dtype)
    angles = torch.rand(tokens, d // 2, device=device, generator=gen) * 6.28
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)  # fp32, as FluxPosEmbed

    def eager():  # norm_q, then the processor's rotary embedding
        return apply_rotary_emb(F.rms_norm(q, (d,), weight, 1e-6), (cos, sin), sequence_dim=1)

    def exact():
        return fused.rope_ref(fused.rms_norm_ref(q.float(), weight.float(), 1e-6, torch.float32), cos, sin)

    return eager, (lambda: fused.rms_norm_rope(q, weight, 1e-6, cos, sin)), exact, tuple(q.shape)


def _case_gated_residual(shape: dict, tokens: int, device, dtype, gen):
    c = shape["dim"]
    x = torch.randn(1, tokens, c, device=device, generator=gen).to(dtype)
    y = torch.randn(1, tokens, c, device=device, generator=gen).to(dtype)
    gate = torch.randn(1, 3 * c, device=device, generator=gen).to(dtype).chunk(3, dim=1)[2]

    return (lambda: x + gate[:, None] * y), (lambda: fused.gated_residual(x, gate, y)), \
        (lambda: x.float() + gate.float()[:, None] * y.float()), tuple(x.shape)


def rows_for(shape: dict) -> list[dict]:
    """(row name, case builder, tokens, calls per FLUX forward with kernels=True -- 0 = not installed)."""
    img, txt, dual, single = shape["img"], shape["txt"], shape["dual"], shape["single"]
    joint = img + txt
    return [
        # AdaLayerNormZero norm1 (image) + norm_out; norm1_context (text); AdaLayerNormZeroSingle (joint)
        dict(name="layernorm_modulate", tokens=joint, build=_case_layernorm_modulate, calls=single,
             site="single_transformer_blocks.*.norm"),
        dict(name="layernorm_modulate", tokens=img, build=_case_layernorm_modulate, calls=dual + 1,
             site="transformer_blocks.*.norm1, norm_out"),
        dict(name="layernorm_modulate", tokens=txt, build=_case_layernorm_modulate, calls=dual,
             site="transformer_blocks.*.norm1_context"),
        dict(name="rms_norm_qk (vs torch.nn.RMSNorm)", tokens=joint, build=_case_rms_norm_torch, calls=2 * single,
             site="single_transformer_blocks.*.attn.norm_q/k"),
        dict(name="rms_norm_qk (vs torch.nn.RMSNorm)", tokens=img, build=_case_rms_norm_torch, calls=2 * dual,
             site="transformer_blocks.*.attn.norm_q/k"),
        dict(name="rms_norm_qk (vs torch.nn.RMSNorm)", tokens=txt, build=_case_rms_norm_torch, calls=2 * dual,
             site="transformer_blocks.*.attn.norm_added_q/k"),
        dict(name="rms_norm_qk (vs diffusers RMSNorm)", tokens=joint, build=_case_rms_norm_diffusers, calls=0,
             site="Qwen-Image / Z-Image / SD3.5 Q/K norms (same shape here)"),
        dict(name="rms_norm_rope", tokens=joint, build=_case_rms_norm_rope, calls=0,
             site="not installed (RoPE lives inside the attention processor)"),
        dict(name="gated_residual", tokens=joint, build=_case_gated_residual, calls=0,
             site="not installed (inline in the block forwards)"),
    ]


def _max_err(out, exact) -> float:
    return (out.float() - exact.float()).abs().max().item()


def run_row(spec: dict, shape: dict, device, dtype, iters: int, compile_: bool) -> dict:
    row = dict(kernel=spec["name"], tokens=spec["tokens"], site=spec["site"], calls_per_flux_forward=spec["calls"],
               dtype=str(dtype).replace("torch.", ""))
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        eager, triton_fn, exact_fn, x_shape = spec["build"](shape, spec["tokens"], device, dtype, gen)
        row["shape"] = list(x_shape)
        with torch.no_grad():
            exact = exact_fn()
            row["eager_ms"] = _time(eager, device, iters)
            row["max_abs_err_eager"] = _max_err(eager(), exact)
            if compile_:
                try:
                    compiled = torch.compile(eager, dynamic=False)
                    row["compile_ms"] = _time(compiled, device, iters)
                    row["max_abs_err_compile"] = _max_err(compiled(), exact)
                except Exception as exc:  # a compile failure costs this column only
                    row["compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
            if fused.uses_triton(device):
                with fused.use_backend("triton"):
                    row["triton_ms"] = _time(triton_fn, device, iters)
                    row["max_abs_err_triton"] = _max_err(triton_fn(), exact)
            else:
                row["triton_note"] = "Triton not used on this device (CPU needs TRITON_INTERPRET=1)"
        if row.get("triton_ms"):
            row["speedup_vs_eager"] = round(row["eager_ms"] / row["triton_ms"], 3)
            if row.get("compile_ms"):
                row["speedup_vs_compile"] = round(row["compile_ms"] / row["triton_ms"], 3)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()[-2000:]
    return row


def step_estimate(rows: list[dict]) -> dict:
    """Milliseconds per FLUX forward that kernels=True saves against eager (and against compiled eager)."""
    out = {"eager_minus_triton_ms": 0.0, "compile_minus_triton_ms": 0.0, "installed_calls": 0, "complete": True}
    for r in rows:
        if not r["calls_per_flux_forward"]:
            continue
        if "triton_ms" not in r:
            out["complete"] = False
            continue
        out["installed_calls"] += r["calls_per_flux_forward"]
        out["eager_minus_triton_ms"] += r["calls_per_flux_forward"] * (r["eager_ms"] - r["triton_ms"])
        if "compile_ms" in r:
            out["compile_minus_triton_ms"] += r["calls_per_flux_forward"] * (r["compile_ms"] - r["triton_ms"])
        else:
            out["complete"] = False
    for k in ("eager_minus_triton_ms", "compile_minus_triton_ms"):
        out[k] = round(out[k], 4)
    return out


def environment(device: torch.device) -> dict:
    import diffusers

    env = {"torch": torch.__version__, "diffusers": diffusers.__version__, "python": platform.python_version(),
           "machine": platform.machine(), "device": str(device), "kernel_backend": fused.get_backend(),
           "triton_interpreted": fused.interpreted()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 100; tiny 3)")
    ap.add_argument("--out", default="bench_kernels.json")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU; use --device cpu --tiny", file=sys.stderr)
        return 2
    shape = TINY if args.tiny else FLUX
    iters = args.iters or (3 if args.tiny else 100)
    dtype = torch.bfloat16
    result = {"benchmark": "bench_kernels", "shapes": dict(shape, batch=1), "dtype": "bfloat16",
              "env": environment(device), "rows": []}
    for spec in rows_for(shape):
        row = run_row(spec, shape, device, dtype, iters, compile_=not args.no_compile)
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        result["flux_step_estimate"] = step_estimate(result["rows"])
        result["errors"] = [f"{r['kernel']} @ {r['tokens']}: {r['error']}" for r in result["rows"] if "error" in r]
        write_result(args.out, result)  # after every row: a crash later keeps what was measured
    print(json.dumps(result["flux_step_estimate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
