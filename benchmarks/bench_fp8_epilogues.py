"""The FP8 stack's two largest non-GEMM costs on FLUX.1-dev shapes, each computed several ways on the same inputs.

    python benchmarks/bench_fp8_epilogues.py --out benchmarks/results/bench_fp8_epilogues_h200.json   # one GPU
    TRITON_INTERPRET=1 python benchmarks/bench_fp8_epilogues.py --device cpu --tiny --out /tmp/epi.json  # smoke

1. The single-stream block's MLP epilogue feeding ``proj_out``: ``cat([attention output, gelu(mlp + bias)])`` cast to
   e4m3 with the layer's static scale (4608 x 15360 values per call, 38 calls per step). Ways:
   - ``inductor``: torch.compile of the expression as the compiled block runs it (the library's inductor options);
   - ``inductor_nd``: the same with ``triton.prefer_nd_tiling``;
   - ``inductor_concat``: the cast pushed into each input of the concatenation and inductor told to realise the
     concatenation in place (``max_complex_pointwise_cat_inputs=1``), so each input's kernel writes its own slice;
   - ``triton``: the library's kernel (``omni_accel.kernels.epilogue_triton.concat_gelu``, what ``compile=True``
     puts there through its graph pass) over 2-D tiles (each tile in one input: no per-element branch), for a few
     tile shapes. The result file of 2026-12-04 (``bench_fp8_epilogues_h200_20261204.json``) was written by this
     script's first form, which held its own copy of the kernel and also timed it with the hardware's approximate
     tanh (``triton_tanh``: 56-64 us, not faster than the sigmoid form's 54; dropped); its ``triton_sigmoid`` rows
     are this kernel. ``inductor_concat`` needs an inductor option torch 2.11 does not have (those rows record it).
   The same with a bf16 output (the bf16 stack) where the attention output is bf16 too.
1c. The int8 stack's version of 1 (``--cases int8``): the bf16 concatenation quantized per row to int8 for the int8
   ``proj_out``: inductor alone, the library's bf16 kernel followed by inductor's quantization, and the library's one
   kernel that writes the int8 rows and their scales (``epilogue_triton.concat_gelu_int8``): its one-pass form (the
   row in registers) for a few warp counts, its two-pass form for a few tiles.
1b. FP8 attention's q and k with static scales: the fused projection's bias, RMSNorm per head, the interleaved rotary
   embedding, K's mean subtracted, the cast (4608 x 24 rows of 128 per call, 38 + 19 calls per step): ``inductor``
   (torch.compile of the expression) against the library's kernel (``epilogue_triton.qk_norm_rope``, one launch
   for q and one for k), which swaps each pair in registers. The 2026-12-04 result file's ``triton`` rows come from
   this script's first form: its own kernel doing q and k in one launch, over four tile sizes (8 rows x 4 warps:
   43.9 us for both).
   Also with bf16 outputs and no mean or cast (``qk_norm_rope_bf16``): the int8 stack's q and k for bf16 attention.
1e. ``--cases ceiling``: the same bytes moved by PyTorch's vectorized cast (bf16 -> int8) or a strided bf16 copy at
   each row-wise kernel's shape, the memory's ceiling for that kernel (``cast_ceiling`` / ``copy_ceiling`` rows).
2. The FP8 GEMMs' scaling: ``torch._scaled_mm`` with row-wise scales (a per-token activation scale, what the library
   passes today even for a static scale) against per-tensor scales, at every FLUX linear shape.

Timing: CUDA events around ``--reps`` back-to-back calls (median of ``--iters`` such groups: ``us``), and on a GPU
the same calls replayed from one CUDA graph (``us_graph``: no host launch in the figure, which a kernel shorter than
its launch needs; the AdaLN and q / k cases cycle through input copies larger than L2); the rows' clocks and power
come from nvidia-smi (``--log-clocks``). ``max_abs_err`` of every way is against the float32 formula.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_transformer import ClockLog, log  # noqa: E402
from benchmarks.timing import back_to_back_ms, graph_ms, rotation_copies, write_result  # noqa: E402

from diffusers.models import embeddings  # noqa: E402

from omni_accel.compiler import _TWO_SQRT_2_OVER_PI as K_GELU, _pair_swap_rotary, sigmoid_gelu  # noqa: E402
from omni_accel.kernels.cudnn_fp8_attention import _static_e4m3 as static_cast  # noqa: E402

FP8 = torch.float8_e4m3fn
# the library's pair-swap rotary, what compile=True gives FLUX's attention processors
PAIR_SWAP_ROTARY = _pair_swap_rotary(embeddings.apply_rotary_emb)


def timed_ms(fn, device: torch.device, iters: int, reps: int) -> dict:
    for _ in range(3):
        fn()
    groups = back_to_back_ms(fn, device, reps, iters)
    return {"us": round(statistics.median(groups) * 1e3, 2), "us_min": round(min(groups) * 1e3, 2)}


def measure(rows: list, entry: dict, fn, check, moved: int, device, iters: int, reps: int,
            graph_calls: list | None = None) -> None:
    """Run ``fn`` once for ``check(output) -> {error figures}``, time it, append ``entry`` (an error costs its row).
    ``us`` is a call among ``reps`` launched back to back, which for a kernel shorter than its launch times the
    host; on a GPU, ``us_graph`` is a call replayed from one CUDA graph of ``graph_calls`` (default: ``fn`` ``reps``
    times; give calls on input copies that together exceed L2 where one input would fit in it)."""
    try:
        entry.update(check(fn()))
        entry.update(timed_ms(fn, device, iters, reps))
        entry["gb_per_s"] = round(moved / (entry["us"] * 1e-6) / 1e9, 1)
        if device.type == "cuda":
            try:
                entry["us_graph"] = round(graph_ms(graph_calls or [fn] * reps, iters) * 1e3, 2)
                entry["gb_per_s_graph"] = round(moved / (entry["us_graph"] * 1e-6) / 1e9, 1)
            except Exception as exc:  # noqa: BLE001 -- a way that cannot be captured keeps its launched timing
                entry["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    except Exception as exc:  # noqa: BLE001 -- one failing way costs its row only
        entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
    log(str(entry))
    rows.append(entry)


def inductor_options(device: torch.device) -> dict:
    """The library's inductor options for compiled blocks on this device (without its graph pass: the ``inductor``
    rows time inductor's own kernels)."""
    from omni_accel import compiler

    base = dict(compiler.CUDA_INDUCTOR_OPTIONS) if device.type == "cuda" else {}
    if device.type == "cuda" and not compiler.inductor_has_pdl():
        base.pop("triton.enable_pdl", None)
    return base


# ------------------------------------------------------------------------------------- 1. concat + GELU + cast
# (the library's own sigmoid GELU and static cast: the expression its compiled blocks hand inductor)
def epilogue_graph(attn, attn_scale, h, bias, inverse):
    """What the compiled single block computes: the attention output dequantized (FP8 attention) or as it is, the
    MLP's GELU, the concatenation, the static cast (or none: bf16)."""
    a = (attn.float() * attn_scale).to(torch.bfloat16) if attn.dtype == FP8 else attn
    g = sigmoid_gelu(h + bias)
    x = torch.cat([a, g], dim=-1)
    return x if inverse is None else static_cast(x, inverse)


def epilogue_pushed(attn, attn_scale, h, bias, inverse):
    """The same values with the cast applied to each input before the concatenation."""
    def cast(x):
        return x if inverse is None else static_cast(x, inverse)

    a = (attn.float() * attn_scale).to(torch.bfloat16) if attn.dtype == FP8 else attn
    return torch.cat([cast(a), cast(sigmoid_gelu(h + bias))], dim=-1)


def epilogue_exact(attn, attn_scale, h, bias, inverse):
    a = attn.float() * attn_scale if attn.dtype == FP8 else attn.float()
    hf = h.float() + bias.float()
    g = 0.5 * hf * (1.0 + torch.tanh((K_GELU / 2) * (hf + 0.044715 * hf ** 3)))
    x = torch.cat([a, g], dim=-1)
    return x if inverse is None else x * inverse


def epilogue_rows(device, tokens: int, dim: int, mlp: int, iters: int, reps: int, interpreted: bool) -> list[dict]:
    from omni_accel.kernels import epilogue_triton

    gen = torch.Generator("cpu").manual_seed(0)
    rows = []
    for out_fp8 in (True, False):
        h = (torch.randn(tokens, mlp, generator=gen) * 2).to(device, torch.bfloat16)
        bias = (torch.randn(mlp, generator=gen) * 0.1).to(device, torch.bfloat16)
        attn_f = torch.randn(tokens, dim, generator=gen) * 3
        attn_scale = torch.tensor(0.02, device=device)
        attn = (attn_f / 0.02).clamp(-448, 448).to(FP8).to(device) if out_fp8 else attn_f.to(device, torch.bfloat16)
        inverse = torch.tensor(448.0 / 16.0, device=device) if out_fp8 else None
        args = (attn, attn_scale, h, bias, inverse)
        exact = epilogue_exact(*args)
        out_kind = "fp8" if out_fp8 else "bf16"

        moved = sum(t.numel() * t.element_size() for t in (attn, h, bias)) + \
            tokens * (dim + mlp) * (1 if out_fp8 else 2)

        def record(way: str, fn, **extra):
            entry = {"case": f"concat_gelu_{out_kind}", "way": way, "shape": [tokens, dim + mlp], **extra}
            measure(rows, entry, fn, lambda out: {"max_abs_err": float((out.float() - exact).abs().max())}, moved,
                    device, iters, reps)

        base = inductor_options(device)
        variants = [("inductor", epilogue_graph, base),
                    ("inductor_nd", epilogue_graph, {**base, "triton.prefer_nd_tiling": True}),
                    ("inductor_concat", epilogue_pushed, {**base, "max_complex_pointwise_cat_inputs": 1})]
        for way, fn, options in variants:
            torch._dynamo.reset()
            try:
                compiled = torch.compile(fn, dynamic=False, options=options)
            except Exception as exc:  # noqa: BLE001 -- an option this torch does not know
                rows.append({"case": f"concat_gelu_{out_kind}", "way": way, "error": repr(exc)[:300]})
                continue
            record(way, lambda c=compiled: c(*args), options=options)
        a3 = attn.reshape(tokens, 1, dim)
        a_scale = attn_scale if out_fp8 else None  # a bf16 attention output is taken as it is
        out_dtype = FP8 if out_fp8 else torch.bfloat16
        for tile in ((1, 1024, 4), (2, 1024, 8), (4, 512, 4), (8, 256, 4), (16, 256, 8)):
            if tile[1] > dim:
                continue
            record("triton", lambda t=tile: epilogue_triton.concat_gelu(a3, a_scale, h, bias, inverse, out_dtype,
                                                                        tile=t),
                   rows=tile[0], block=tile[1], warps=tile[2])
            if interpreted:
                break
    return rows


# ---------------------------------------------------------------- 1c. concat + GELU -> int8 row quantization
def int8_epilogue_rows(device, tokens: int, dim: int, mlp: int, iters: int, reps: int,
                       interpreted: bool) -> list[dict]:
    """The int8 stack's single-block epilogue: bf16 attention output and GELU concatenated, quantized per row for
    the int8 ``proj_out``. Ways: ``inductor`` (torch.compile of the whole expression, no graph pass),
    ``bf16_then_inductor`` (the library's bf16 kernel, then inductor's quantization: what ``compile=True`` ran
    before), ``triton_int8_one_pass`` (``epilogue_triton.concat_gelu_int8``'s default kernel, the row in registers,
    for a few warp counts), ``triton_int8`` (its two-pass kernel, for a few tiles). Errors are against
    quantize_rows_int8 of the float32 formula rounded to bf16 (int8 steps, scale relative)."""
    from omni_accel.kernels import epilogue_triton
    from omni_accel.kernels.int8 import quantize_rows_int8

    gen = torch.Generator("cpu").manual_seed(1)
    h = (torch.randn(tokens, mlp, generator=gen) * 2).to(device, torch.bfloat16)
    bias = (torch.randn(mlp, generator=gen) * 0.1).to(device, torch.bfloat16)
    attn = (torch.randn(tokens, dim, generator=gen) * 3).to(device, torch.bfloat16)
    want_q, want_scale = quantize_rows_int8(epilogue_exact(attn, None, h, bias, None).to(torch.bfloat16))
    moved = sum(t.numel() * t.element_size() for t in (attn, h, bias)) + tokens * (dim + mlp) + tokens * 4
    rows = []

    def check(out) -> dict:
        return int8_errors(out, want_q, want_scale)

    def record(way: str, fn, **extra):
        entry = {"case": "concat_gelu_int8", "way": way, "shape": [tokens, dim + mlp], **extra}
        measure(rows, entry, fn, check, moved, device, iters, reps)

    def whole(attn, h, bias):
        return quantize_rows_int8(epilogue_graph(attn, None, h, bias, None))

    torch._dynamo.reset()
    compiled = torch.compile(whole, dynamic=False, options=inductor_options(device))
    record("inductor", lambda: compiled(attn, h, bias))
    quantize = torch.compile(quantize_rows_int8, dynamic=False, options=inductor_options(device))
    a3 = attn.reshape(tokens, 1, dim)
    record("bf16_then_inductor",
           lambda: quantize(epilogue_triton.concat_gelu(a3, None, h, bias, None, torch.bfloat16)))
    for warps, gelu_tanh, reciprocal in ((4, False, False), (8, False, False), (16, False, False), (8, False, True),
                                         (8, True, False), (8, True, True), (16, True, True)):
        if interpreted and (warps != 8 or gelu_tanh != reciprocal):  # the interpreter: the two ends only
            continue
        record("triton_int8_one_pass", lambda w=warps, t=gelu_tanh, r=reciprocal: epilogue_triton.concat_gelu_int8(
            a3, None, h, bias, torch.bfloat16, row_warps=w, gelu_tanh=t, reciprocal=r),
            warps=warps, gelu_tanh=gelu_tanh, reciprocal=reciprocal)
    for tile in ((1, 1024, 1024, 4), (1, 512, 512, 4), (2, 1024, 1024, 8), (1, 1024, 2048, 8), (4, 256, 256, 4)):
        if max(tile[1], tile[2]) > dim:
            continue
        record("triton_int8", lambda t=tile: epilogue_triton.concat_gelu_int8(a3, None, h, bias, torch.bfloat16,
                                                                              tile=t),
               rows=tile[0], a_block=tile[1], h_block=tile[2], warps=tile[3])
        if interpreted:
            break
    rows += gelu_int8_rows(device, tokens - 512 if tokens > 512 else tokens, mlp, iters, reps, interpreted)
    return rows


def gelu_int8_rows(device, tokens: int, mlp: int, iters: int, reps: int, interpreted: bool) -> list[dict]:
    """The dual-stream blocks' feed-forward epilogue (image stream): gelu(h + bias) quantized per row for the int8
    ``ff.net.2``, no first input (``concat_gelu_int8`` with ``a=None``), with and without the hardware's tanh and
    the reciprocal scale."""
    from omni_accel.kernels import epilogue_triton
    from omni_accel.kernels.int8 import quantize_rows_int8

    gen = torch.Generator("cpu").manual_seed(2)
    h = (torch.randn(tokens, mlp, generator=gen) * 2).to(device, torch.bfloat16)
    bias = (torch.randn(mlp, generator=gen) * 0.1).to(device, torch.bfloat16)
    want_q, want_scale = quantize_rows_int8(epilogue_exact(h[:, :0], None, h, bias, None).to(torch.bfloat16))
    moved = h.numel() * 2 + mlp * 2 + tokens * mlp + tokens * 4
    rows: list[dict] = []
    for gelu_tanh, reciprocal in ((False, False), (False, True), (True, True)):
        if interpreted and gelu_tanh != reciprocal:
            continue
        entry = {"case": "gelu_int8", "way": "triton_int8_one_pass", "shape": [tokens, mlp], "gelu_tanh": gelu_tanh,
                 "reciprocal": reciprocal}
        measure(rows, entry, lambda t=gelu_tanh, r=reciprocal: epilogue_triton.concat_gelu_int8(
            None, None, h, bias, torch.bfloat16, gelu_tanh=t, reciprocal=r),
            lambda out: int8_errors(out, want_q, want_scale), moved, device, iters, reps)
    return rows


def int8_errors(out, want_q, want_scale) -> dict:
    """An int8 kernel's (values, row scales) against the reference's: largest difference in int8 steps, the share of
    equal values, the largest relative scale error."""
    q, scale = out
    return {"max_int8_diff": int((q.int() - want_q.int()).abs().max()),
            "frac_int8_equal": round(float((q == want_q).float().mean()), 6),
            "max_scale_rel_err": float(((scale - want_scale).abs() / want_scale).max())}


# ------------------------------------------------------------------ 1d. AdaLN LayerNorm + modulate -> int8 rows
def layernorm_int8_rows(device, text: int, image: int, dim: int, iters: int, reps: int,
                        interpreted: bool) -> list[dict]:
    """A dual-stream block's AdaLN for the int8 linears: LayerNorm + modulate of the text then image rows, quantized
    per row (``epilogue_triton.layernorm_modulate_int8``), over tiles (rows per program, warps) and with the
    reciprocal scale, by the padded kernel (``triton_int8``) and the parts kernel (``triton_int8_parts``). Errors
    against ``layernorm_modulate_int8_reference``."""
    from omni_accel.kernels import epilogue_triton
    from omni_accel.kernels.epilogue_fusion import layernorm_modulate_int8_reference

    gen = torch.Generator("cpu").manual_seed(3)
    a = (torch.randn(text, dim, generator=gen) * 2).to(device, torch.bfloat16)
    b = (torch.randn(image, dim, generator=gen) * 2).to(device, torch.bfloat16)
    scale, shift = ((torch.randn(dim, generator=gen) * 0.3).to(device, torch.bfloat16) for _ in range(2))
    want_q, want_scale = layernorm_modulate_int8_reference(a, b, scale, shift, 1e-6, torch.bfloat16)
    moved = (text + image) * dim * 3 + (text + image) * 4
    # the graph timing cycles through copies of the rows (28 MB of bf16 at FLUX's size fits in L2)
    copies = [(a, b)] + [(a.clone(), b.clone()) for _ in range(rotation_copies(moved) - 1)] if device.type == "cuda" \
        else [(a, b)]
    rows: list[dict] = []

    def against_padded(out, tile, reciprocal) -> dict:
        """How many int8 values and row scales differ from the padded kernel's at the same tile and flags."""
        q, row_scale = epilogue_triton.layernorm_modulate_int8(a, b, scale, shift, 1e-6, torch.bfloat16,
                                                               reciprocal=reciprocal, tile=tile, parts=False)
        return {"int8_differ_vs_padded": int((out[0] != q).sum()),
                "scales_differ_vs_padded": int((out[1] != row_scale).sum())}

    for tile, reciprocal in (((2, 8), False), ((2, 8), True), ((1, 4), True), ((2, 4), True), ((4, 8), True),
                             ((4, 4), True), ((8, 8), True), ((1, 8), True)):
        entry = {"case": "layernorm_int8", "way": "triton_int8", "shape": [text + image, dim], "rows": tile[0],
                 "warps": tile[1], "reciprocal": reciprocal}
        calls = [lambda a=a, b=b, t=tile, r=reciprocal: epilogue_triton.layernorm_modulate_int8(
            a, b, scale, shift, 1e-6, torch.bfloat16, reciprocal=r, tile=t, parts=False) for a, b in copies]
        measure(rows, entry, calls[0], lambda out: int8_errors(out, want_q, want_scale), moved, device, iters, reps,
                graph_calls=calls)
        if interpreted and reciprocal:
            break
    # the parts kernel (the row as unpadded power-of-two tiles; "parts": [tiles, block], None where the width has no
    # such split and the padded kernel ran), also against the padded kernel at the same tile: its sums add in
    # another order, so a value may move where a float32 sum's last bit crosses a rounding boundary
    for tile, reciprocal in (((2, 4), True), ((2, 4), False), ((1, 4), True), ((2, 8), True), ((4, 4), True),
                             ((4, 8), True), ((8, 8), True)):
        entry = {"case": "layernorm_int8", "way": "triton_int8_parts", "shape": [text + image, dim], "rows": tile[0],
                 "warps": tile[1], "reciprocal": reciprocal, "parts": epilogue_triton.layernorm_parts(dim)}
        calls = [lambda a=a, b=b, t=tile, r=reciprocal: epilogue_triton.layernorm_modulate_int8(
            a, b, scale, shift, 1e-6, torch.bfloat16, reciprocal=r, tile=t, parts=True) for a, b in copies]
        measure(rows, entry, calls[0], lambda out, t=tile, r=reciprocal: {
            **int8_errors(out, want_q, want_scale), **against_padded(out, t, r)}, moved, device, iters, reps,
            graph_calls=calls)
        if interpreted:  # the interpreter: one row
            break
    return rows


# ------------------------------------------------------------------------ 1b. Q / K norm + rotary + cast
def qk_graph(qkv, bias, wq, wk, cos, sin, k_mean, inv_q, inv_k, heads: int):
    """What the compiled block computes for FP8 attention's q and k with static scales: the fused projection's bias,
    RMSNorm per head, the interleaved rotary embedding as a pair swap, K's calibrated mean subtracted, the cast."""
    x = qkv + bias
    dim = heads * (qkv.shape[-1] // (3 * heads))
    q, k = (x[:, i * dim:(i + 1) * dim].unflatten(-1, (heads, -1)).unsqueeze(0) for i in (0, 1))
    d = q.shape[-1]
    q = PAIR_SWAP_ROTARY(torch.nn.functional.rms_norm(q, (d,), wq, 1e-6), (cos, sin), sequence_dim=1)
    k = PAIR_SWAP_ROTARY(torch.nn.functional.rms_norm(k, (d,), wk, 1e-6), (cos, sin), sequence_dim=1)
    return static_cast(q, inv_q), static_cast(k.float() - k_mean, inv_k)


def qk_triton(qkv, bias, wq, wk, cos, sin, k_mean, inv_q, inv_k, heads: int, share_rotary: bool | None = None):
    """The library's kernel (what compile=True's graph pass puts there), once for q and once for k;
    ``share_rotary``: see ``epilogue_triton.qk_norm_rope``."""
    from omni_accel.kernels import epilogue_triton

    dim = qkv.shape[-1] // 3
    shape = (1, qkv.shape[0], heads, dim // heads)
    q8 = epilogue_triton.qk_norm_rope(qkv, bias, 0, heads, wq, 1e-6, cos, sin, None, inv_q, share_rotary=share_rotary)
    k8 = epilogue_triton.qk_norm_rope(qkv, bias, dim, heads, wk, 1e-6, cos, sin, k_mean, inv_k,
                                      share_rotary=share_rotary)
    return q8.reshape(shape), k8.reshape(shape)


def qk_graph_float(qkv, bias, wq, wk, cos, sin, k_mean, inv_q, inv_k, heads: int):
    """``qk_graph``'s q and k in float32 before K's mean and the cast (the int8 stack's bf16 attention operands)."""
    x = qkv.float() + bias.float()
    dim = heads * (qkv.shape[-1] // (3 * heads))
    q, k = (x[:, i * dim:(i + 1) * dim].unflatten(-1, (heads, -1)).unsqueeze(0) for i in (0, 1))
    d = q.shape[-1]
    return tuple(PAIR_SWAP_ROTARY(torch.nn.functional.rms_norm(t, (d,), w.float(), 1e-6), (cos, sin), sequence_dim=1)
                 for t, w in ((q, wq), (k, wk)))


def qk_triton_16(qkv, bias, wq, wk, cos, sin, k_mean, inv_q, inv_k, heads: int):
    """The library's kernel with bf16 outputs (what the int8 stack's graph pass runs before cuDNN's attention)."""
    from omni_accel.kernels import epilogue_triton

    dim = qkv.shape[-1] // 3
    return tuple(epilogue_triton.qk_norm_rope(qkv, bias, i * dim, heads, w, 1e-6, cos, sin, None, None,
                                              out_dtype=torch.bfloat16) for i, w in ((0, wq), (1, wk)))


def ceiling_rows(device, tokens: int, dim: int, mlp: int, heads: int, iters: int, reps: int) -> list[dict]:
    """What the GPU's memory allows for the bytes each row-wise kernel above moves: PyTorch's vectorized cast of a
    bf16 tensor to int8 (2 bytes read, 1 written per value) at the AdaLN, GELU and concatenation shapes, and a
    strided bf16 copy (2 + 2) at one q or k's shape, timed like the kernels (graph replay over copies larger than
    L2). A kernel far above its ceiling is limited by something other than DRAM."""
    gen = torch.Generator("cpu").manual_seed(4)
    rows: list[dict] = []
    for case, shape in (("layernorm_int8", (tokens, dim)), ("gelu_int8", (max(tokens - 512, 1), mlp)),
                        ("concat_gelu_int8", (tokens, dim + mlp))):
        x = torch.randn(*shape, generator=gen).to(device, torch.bfloat16)
        moved = x.numel() * 3
        sources = [x] + [x.clone() for _ in range(rotation_copies(moved) - 1)] if device.type == "cuda" else [x]
        entry = {"case": case, "way": "cast_ceiling", "shape": list(shape)}
        measure(rows, entry, lambda: x.to(torch.int8), lambda out: {}, moved, device, iters, reps,
                graph_calls=[lambda s=s: s.to(torch.int8) for s in sources])
    qkv = torch.randn(tokens, 3 * dim, generator=gen).to(device, torch.bfloat16)
    moved = tokens * dim * 4
    sources = [qkv] + [qkv.clone() for _ in range(rotation_copies(moved) - 1)] if device.type == "cuda" else [qkv]
    entry = {"case": "qk_norm_rope_bf16", "way": "copy_ceiling", "shape": [tokens, heads, dim // heads]}
    measure(rows, entry, lambda: qkv[:, :dim].contiguous(), lambda out: {}, moved, device, iters, reps,
            graph_calls=[lambda s=s: s[:, :dim].contiguous() for s in sources])
    return rows


def qk_rows(device, tokens: int, heads: int, d: int, iters: int, reps: int, interpreted: bool) -> list[dict]:
    gen = torch.Generator("cpu").manual_seed(1)
    dim = heads * d
    qkv = torch.randn(tokens, 3 * dim, generator=gen).to(device, torch.bfloat16)
    bias = (torch.randn(3 * dim, generator=gen) * 0.1).to(device, torch.bfloat16)
    wq, wk = ((1 + 0.1 * torch.randn(d, generator=gen)).to(device, torch.bfloat16) for _ in range(2))
    angles = torch.rand(tokens, d // 2, generator=gen) * 6.28
    cos = angles.cos().repeat_interleave(2, -1).to(device)
    sin = angles.sin().repeat_interleave(2, -1).to(device)
    k_mean = (torch.randn(1, 1, heads, d, generator=gen) * 0.3).to(device)
    inv_q, inv_k = torch.tensor(448.0 / 8, device=device), torch.tensor(448.0 / 8, device=device)
    args = (qkv, bias, wq, wk, cos, sin, k_mean, inv_q, inv_k, heads)
    ref_q, ref_k = (t.float() for t in qk_graph(*args))
    moved = qkv.numel() * 2 * 2 // 3 + cos.numel() * 8 + 2 * tokens * dim
    rows = []

    def check(out) -> dict:
        q8, k8 = out  # against the eager expression, in e4m3 steps: a one-step difference is a tie broken otherwise
        return {"max_abs_diff_vs_eager": max(float((q8.float() - ref_q).abs().max()),
                                             float((k8.float() - ref_k).abs().max())),
                "frac_bytes_equal": round(float(((q8.float() == ref_q).float().mean()
                                                 + (k8.float() == ref_k).float().mean()) / 2), 5)}

    def record(way, fn, graph_calls=None, **extra):
        entry = {"case": "qk_norm_rope_fp8", "way": way, "shape": [tokens, heads, d], **extra}
        measure(rows, entry, fn, check, moved, device, iters, reps, graph_calls=graph_calls)

    base = inductor_options(device)
    torch._dynamo.reset()
    compiled = torch.compile(qk_graph, dynamic=False, options=base)
    # the graph timing cycles through copies of the projection's output (85 MB at FLUX's size)
    sources = [qkv] + [qkv.clone() for _ in range(rotation_copies(moved) - 1)] if device.type == "cuda" else [qkv]

    def on_copies(fn, **kwargs) -> list:
        return [lambda s=s: fn(s, *args[1:], **kwargs) for s in sources]

    record("inductor", lambda: compiled(*args), options=base)
    record("triton", lambda: qk_triton(*args), graph_calls=on_copies(qk_triton))
    # the int8 stack's form: 16-bit q and k for bf16 attention (no mean, no cast), checked against the float32
    # expression rounded to bf16
    want16 = [t.to(torch.bfloat16).float() for t in qk_graph_float(*args)]
    entry = {"case": "qk_norm_rope_bf16", "way": "triton", "shape": [tokens, heads, d]}
    measure(rows, entry, lambda: qk_triton_16(*args), lambda out: {
        "max_abs_diff_vs_eager": max(float((o.float() - w).abs().max()) for o, w in zip(out, want16))},
        moved * 3 // 2, device, iters, reps, graph_calls=on_copies(qk_triton_16))
    record("triton_shared_rotary", lambda: qk_triton(*args, share_rotary=True),  # a token's cos / sin loaded once
           graph_calls=on_copies(qk_triton, share_rotary=True))
    record("triton_rotary_per_row", lambda: qk_triton(*args, share_rotary=False),
           graph_calls=on_copies(qk_triton, share_rotary=False))
    return rows


# --------------------------------------------------------------------------------------------- 2. GEMM scales
GEMM_SHAPES = (  # (name, M, K, N) of FLUX.1-dev's block linears (bench_fp8_gemm.py)
    ("single.qkv_mlp", 4608, 3072, 21504),
    ("single.to_qkv", 4608, 3072, 9216),
    ("single.proj_mlp", 4608, 3072, 12288),
    ("single.proj_out", 4608, 15360, 3072),
    ("dual.img.to_out", 4096, 3072, 3072),
    ("dual.img.ff.up", 4096, 3072, 12288),
    ("dual.img.ff.down", 4096, 12288, 3072),
)


def gemm_rows(device, iters: int, reps: int, tiny: bool) -> list[dict]:
    shapes = (("tiny", 64, 128, 256),) if tiny else GEMM_SHAPES
    rows = []
    for name, m, k, n in shapes:
        gen = torch.Generator("cpu").manual_seed(m + k + n)
        x8 = (torch.randn(m, k, generator=gen) * 50).clamp(-448, 448).to(FP8).to(device)
        w8 = (torch.randn(n, k, generator=gen) * 50).clamp(-448, 448).to(FP8).to(device)
        row_scale = torch.full((m, 1), 0.01, device=device)
        col_scale = torch.full((1, n), 0.001, device=device)
        one_a, one_b = torch.tensor(0.01, device=device), torch.tensor(0.001, device=device)
        entry = {"case": "scaled_mm", "shape": name, "M": m, "K": k, "N": n}
        for way, sa, sb in (("rowwise", row_scale, col_scale), ("tensorwise", one_a, one_b)):
            def fn(sa=sa, sb=sb):
                return torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
            try:
                t = timed_ms(fn, device, iters, reps)
                entry[f"{way}_us"] = t["us"]
                entry[f"{way}_tflops"] = round(2.0 * m * k * n / (t["us"] * 1e-6) / 1e12, 1)
            except Exception as exc:  # noqa: BLE001
                entry[f"{way}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        log(str(entry))
        rows.append(entry)
    return rows


def kernel_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the per-kernel benchmarks (this script's and bench_gemm_gelu.py's)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--log-clocks", action="store_true")
    parser.add_argument("--out", required=True)
    return parser


def kernel_result(name: str, device: torch.device) -> dict:
    """A per-kernel benchmark's result file before its rows: the command line and the versions."""
    return {"benchmark": name, "argv": sys.argv[1:],
            "env": {"torch": torch.__version__, "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
            "rows": []}


CASES = ("epilogue", "int8", "layernorm_int8", "layernorm_int8_wan", "qk", "ceiling", "gemm")


def main(argv=None) -> int:
    parser = kernel_parser(__doc__)
    parser.add_argument("--cases", default="epilogue,int8,layernorm_int8,qk,ceiling,gemm",
                        help=f"comma list of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    unknown = [case for case in args.cases.split(",") if case not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    device = torch.device(args.device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    tokens, dim, mlp = (64, 256, 1024) if args.tiny else (4608, 3072, 12288)
    clocks = ClockLog(args.log_clocks and device.type == "cuda")
    result = kernel_result("bench_fp8_epilogues", device)
    try:
        import triton
        result["env"]["triton"] = triton.__version__
    except ImportError:
        pass
    cases = args.cases.split(",")
    clocks.mark()
    if "epilogue" in cases:
        result["rows"] += epilogue_rows(device, tokens, dim, mlp, args.iters, args.reps, interpreted)
        write_result(args.out, result)
    if "int8" in cases:
        result["rows"] += int8_epilogue_rows(device, tokens, dim, mlp, args.iters, args.reps, interpreted)
        write_result(args.out, result)
    if "layernorm_int8" in cases:
        result["rows"] += layernorm_int8_rows(device, *((16, 48) if args.tiny else (512, 4096)), dim, args.iters,
                                              args.reps, interpreted)
        write_result(args.out, result)
    if "layernorm_int8_wan" in cases:  # Wan 2.1 14B at 81 frames: the image stream alone, 5,120 wide
        result["rows"] += layernorm_int8_rows(device, 0, 48 if args.tiny else 32760, 320 if args.tiny else 5120,
                                              args.iters, args.reps, interpreted)
        write_result(args.out, result)
    if "qk" in cases:
        result["rows"] += qk_rows(device, tokens, *((4, 64) if args.tiny else (24, 128)), args.iters, args.reps,
                                  interpreted)
        write_result(args.out, result)
    if "ceiling" in cases:
        result["rows"] += ceiling_rows(device, tokens, dim, mlp, 4 if args.tiny else 24, args.iters, args.reps)
        write_result(args.out, result)
    if "gemm" in cases:
        result["rows"] += gemm_rows(device, args.iters, args.reps, args.tiny)
    return finish(result, clocks, args.out)


def finish(result: dict, clocks: ClockLog, out: str) -> int:
    """Write the result file with the clocks since the benchmark's mark; the exit status."""
    result["clocks"] = clocks.since_mark()
    write_result(out, result)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
