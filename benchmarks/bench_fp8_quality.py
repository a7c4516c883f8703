"""FP8 and int8 image quality on the trained built-in model against bf16, same seeds: quant="fp8" (per-token
activation scales), "fp8_weight_only", static activation scales, static scales + FP8 attention, and quant="int8".

    python benchmarks/bench_fp8_quality.py --out benchmarks/results/fp8_quality.json      # CPU, a few minutes

The built-in model runs in bf16 (the dtype FP8 replaces on a GPU); ``fp8`` uses PyTorch's CPU ``_scaled_mm`` —
the same e4m3 arithmetic as the GPU path (row-wise scales, bf16 output), not its speed. Prompts: held-out captions
(triples never seen in training). PSNR / SSIM per image against the bf16 image of the same prompt and seed.

- ``fp8_static``: ``quant_config={"activations": "static"}``; the calibrating first call uses a caption seen in
  training, not one of the test prompts, so the scales meet the test images as they would a user's later prompts.
- ``fp8_static_fp8attn``: the same plus FP8 attention with the arithmetic of cuDNN's FP8 SDPA (e4m3 q / smoothed k /
  v, e4m3 probabilities and output, per-tensor scales), which the op emulates on the CPU. The built-in model's heads
  are 32 wide, so the route's head-dim filter (64 / 128, the GPU kernel's) is widened for this row: it measures
  what the arithmetic does to a trained model's images, not a GPU speed. Its attention quantizes q / k / v with
  per-call scales.
- ``fp8_static_promoted``: ``fp8_static`` with ``quant_config["fast_accum"]=False`` (FP8 GEMMs that promote their
  partial sums to fp32, against the default fast accumulation). Only a GPU's GEMMs differ: run it and ``fp8_static``
  with ``--device cuda``.
- ``fp8attn``: bf16 linears and only the attention in FP8 (cuDNN's arithmetic, per-call scales): what the FP8
  attention costs on its own.
- ``int8``: ``quant="int8"`` (int8 W8A8, a scale per token and per output channel; PyTorch's CPU ``_int_mm``, the
  same integer arithmetic as the GPU's) -- the more precise 8-bit format for the linears.
- ``int8_fp8attn``: ``int8`` plus FP8 attention with cuDNN's arithmetic (per-call scales), as ``fp8attn`` does.
- ``sage`` / ``int8_sage``: bf16 / int8 linears with ``attention="sage"``: SageAttention's own GPU kernel (int8
  Q K^T, FP8 P V on Hopper; the built-in model's 32-wide heads are zero-padded to 64 by the package, which changes
  no score). GPU only (``--device cuda``, the ``sageattention`` package): unlike the ``fp8attn`` rows, this is the
  shipped kernel's arithmetic, not an emulation.
- ``table`` / ``int8_table``: bf16 / int8 linears with the AdaLN modulation linears computed once per pipeline call
  (the modulation table that ``compile=True`` applies, here without compiling): what its rounding does to images.
- ``int8_modulation`` / ``fp8_static_modulation``: ``int8`` / ``fp8_static`` with the AdaLN modulation linears'
  weights in int8 too (``quant_config={"modulation": "int8"}``).
- ``fp8_static_fp8attn_static``: the same with static attention scales (what ``attention="fp8"`` does beside static
  linears): each attention module's q / k / v descales and K mean calibrated on the same first call.
- ``int8_requant_g16`` / ``int8_requant_g64``: ``int8`` with the feed-forward's hidden state (the input of each dual
  block's two down projections, and the MLP part of each single block's ``proj_out`` input) rounded twice, as a
  GEMM epilogue that quantizes its own tile could produce it: first to int8 with one scale per row and group of 16 /
  64 columns (the producing GEMM's tile width; FLUX.1-dev's 12,288-wide hidden state in 256-wide tiles has 48
  groups, the built-in model's 1,024-wide one 64 / 16), then requantized to the row's own scale, which the
  per-token int8 GEMM takes. The attention part of ``proj_out``'s input is rounded once, to the same row scale.
  Emulated on the input of those layers (``requantized_hidden``); the question is whether the extra rounding keeps
  the quality bound, not a speed. Their ``layer_output_rel_err_max`` is measured on the already requantized input,
  so it leaves the extra rounding out.

What a PSNR figure means here, from a change that loses nothing (a row, not FP8): ``fp32`` renders with the model in
float32, more precise than the bf16 reference. Some held-out captions sit where the sampler's path is unstable, so a
change of rounding moves their image more than others'; this row shows how far bf16's own rounding moves them.

    # what FP8 does to caption adherence (omni_accel.builtin.metric) and how often an image falls below 30 dB, over
    # the 100 captions of bench_builtin_adherence.py (a tail that 16 captions cannot show), and a picture of each
    # mode's two worst held-out captions beside their bf16 images
    python benchmarks/bench_fp8_quality.py --modes fp8_static,fp8_static_fp8attn,fp8_static_fp8attn_static \
        --adherence 100 --worst-png benchmarks/results/fp8_quality_worst.png \
        --out benchmarks/results/fp8_quality_adherence.json

    # only some rows (the bf16 reference always runs); the second calibrates on another training caption
    python benchmarks/bench_fp8_quality.py --modes fp8_static_fp8attn,fp8_static_fp8attn_static \
        --out benchmarks/results/fp8_quality_attention_scales.json
    python benchmarks/bench_fp8_quality.py --modes fp8_static_fp8attn,fp8_static_fp8attn_static \
        --calibration-seed 8 --out benchmarks/results/fp8_quality_attention_scales_cal8.json

    # int8 linears against FP8 ones, over the 16 held-out captions and the 100 adherence captions
    python benchmarks/bench_fp8_quality.py --modes fp8,int8,int8_fp8attn,fp32 --adherence 100 \
        --out benchmarks/results/int8_quality.json
    # the AdaLN modulation linears' weights in int8 beside int8 and static FP8 linears
    python benchmarks/bench_fp8_quality.py --modes int8,int8_modulation,fp8_static,fp8_static_modulation \
        --out benchmarks/results/modulation_int8_quality.json
    # the feed-forward's hidden state rounded per group in the producing GEMM, then requantized per row
    python benchmarks/bench_fp8_quality.py --modes int8,int8_requant_g16,int8_requant_g64,fp32 --adherence 100 \
        --out benchmarks/results/int8_requant_hidden_quality.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import omni_accel  # noqa: E402
from benchmarks.timing import write_result  # noqa: E402
from omni_accel.builtin import BUILTIN_DEFAULTS, dataset as ds, load_builtin  # noqa: E402
from omni_accel.cache.metrics import psnr, ssim  # noqa: E402
from omni_accel.kernels.cudnn_fp8_attention import AttentionScales  # noqa: E402


def images(pipe, prompts: list[str], seed: int) -> torch.Tensor:
    out = []
    for i, prompt in enumerate(prompts):
        g = torch.Generator("cpu").manual_seed(seed + i)
        img = pipe(prompt, generator=g, output_type="pt", **BUILTIN_DEFAULTS).images
        out.append(img.float().cpu())
    return torch.cat(out)


def _route_fp8_attention(pipe, static_scales: bool):
    """FP8 attention with cuDNN's arithmetic (emulated by the op on the CPU) on every attention call; with
    ``static_scales`` each attention module observes the next call and freezes with the linears' scales."""
    from omni_accel.kernels import fp8_attention

    widened, fp8_attention._HEAD_DIMS = fp8_attention._HEAD_DIMS, fp8_attention.INTERPRETED_HEAD_DIMS
    undos = [fp8_attention.route_transformer(pipe.transformer, "cudnn")]
    if static_scales:
        scales, undo_scales = fp8_attention.attach_attention_scales(pipe.transformer, "transformer")
        for module_scales in scales.values():
            module_scales.observe()
        undos.append(undo_scales)

    def restore() -> None:
        for undo in reversed(undos):
            undo()
        fp8_attention._HEAD_DIMS = widened

    return restore


def _linear_stats(pipe) -> dict:
    """The FP8 linears' counts and errors, from report() and the per-layer error measurement."""
    (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "quant"]
    layer_out = [v["output_rel_err"] for v in omni_accel.kernels.quant.quant_error_report(pipe).values()]
    return {"layers": applied["layers"], "skipped": len(applied["skipped"]),
            "weight_rel_err_max": applied["weight_rel_err_max"],
            "layer_output_rel_err_max": max(e for e in layer_out if e is not None)}


def adherence(got: torch.Tensor, captions: list[str], reference: torch.Tensor | None = None,
              reference_verdicts: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """Caption adherence of ``got`` (omni_accel.builtin.metric: background, colour, shape, size / position where the
    caption states them) over many captions; with the bf16 ``reference`` images and their ``reference_verdicts``
    also the PSNR tail and how many verdicts FP8 turned right -> wrong and wrong -> right."""
    from omni_accel.builtin import metric

    verdicts = [metric.score(image.numpy(), caption) for image, caption in zip(got, captions)]
    keys = sorted({key for v in verdicts for key in v})
    summary = {"captions": len(captions),
               "fraction_right": {k: round(sum(v[k] for v in verdicts if k in v)
                                           / sum(k in v for v in verdicts), 4) for k in keys},
               "all_right": round(sum(all(v.values()) for v in verdicts) / len(verdicts), 4)}
    if reference is not None:
        p = psnr(got, reference)
        summary.update({"psnr_below_30_db": sum(x < 30 for x in p), "psnr_below_35_db": sum(x < 35 for x in p),
                        "psnr_min": round(min(p), 2), "psnr_median": round(sorted(p)[len(p) // 2], 2),
                        "psnr": [round(x, 2) for x in p]})
    if reference_verdicts is not None:
        pairs = [(r[k], v[k]) for r, v in zip(reference_verdicts, verdicts) for k in v]
        summary["verdicts_right_to_wrong"] = sum(r and not g for r, g in pairs)
        summary["verdicts_wrong_to_right"] = sum(g and not r for r, g in pairs)
    return summary, verdicts


MODES = ("fp8", "fp8_weight_only", "fp8_static", "fp8_static_fp8attn", "fp8_static_fp8attn_static",
         "fp8_static_promoted", "fp8attn", "int8", "int8_fp8attn", "int8_modulation", "fp8_static_modulation",
         "sage", "int8_sage", "fp32", "int8_requant_g16", "int8_requant_g64", "table", "int8_table")
GPU_ONLY = ("sage", "int8_sage")  # SageAttention has CUDA kernels only
LOSSLESS = ("fp32",)  # reference-noise rows: no FP8 anywhere


def _modulation_table(pipe):
    """The modulation table (modulation_table.py, what ``compile=True`` applies) on the accelerated ``pipe``; the
    undo. The rows ``table`` / ``int8_table`` measure what its rounding (one GEMM over a call's steps against a GEMV
    per step) does to the images, without compiling."""
    from omni_accel.modulation_table import use_modulation_table
    from omni_accel.pipelines import adapter_for

    count, undo = use_modulation_table(pipe, pipe.transformer, adapter_for(pipe).modulation_prefetch, pipe.omni_accel)
    if not count:
        raise SystemExit("the built-in model's family declares no modulation table")
    return undo


def requantized_hidden(x: torch.Tensor, group: int, skip: int = 0) -> torch.Tensor:
    """``x`` (..., C) with its columns from ``skip`` on rounded to int8 per row and group of ``group`` columns, then
    requantized to the row's int8 scale (max |row| / 127 over all C columns), and its first ``skip`` columns left as
    they are (the per-token quantization after it rounds them to that scale once): returned dequantized, in x's dtype,
    on the grid of the row's scale, so that the layer's own per-token quantization reproduces the twice-rounded
    integers."""
    from omni_accel.kernels.int8 import INT8_MAX, quantize_rows_int8

    xf = x.float().reshape(-1, x.shape[-1])
    hidden = xf[:, skip:]
    if hidden.shape[-1] % group:
        raise ValueError(f"requantized_hidden: {hidden.shape[-1]} columns are not a multiple of group={group}")
    _, row_scale = quantize_rows_int8(xf)  # the per-token scale over the whole row
    group_int8, group_scale = quantize_rows_int8(hidden.reshape(-1, group))  # each group of a row as a row
    once = (group_int8.float() * group_scale).reshape(hidden.shape)
    twice = torch.round(once / row_scale).clamp(-INT8_MAX, INT8_MAX) * row_scale
    return torch.cat([xf[:, :skip], twice], dim=-1).reshape(x.shape).to(x.dtype)


def hidden_state_hooks(transformer, group: int) -> list:
    """Forward pre-hooks on the linears that read a FLUX-family transformer's feed-forward hidden state (the dual
    blocks' ``ff.net.2`` / ``ff_context.net.2``, the single blocks' ``proj_out``, whose first ``dim`` input columns
    are the attention output), replacing their input by ``requantized_hidden``; returns the handles."""
    dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    handles = []
    for name, module in transformer.named_modules():
        if name.endswith(("ff.net.2", "ff_context.net.2")) or (name.startswith("single_transformer_blocks.")
                                                               and name.endswith(".proj_out")):
            skip = dim if name.endswith("proj_out") else 0
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, skip=skip: (requantized_hidden(args[0], group, skip), *args[1:])))
    return handles


def worst_png(worst: list, path: str) -> list[dict]:
    """One line per (mode, caption): the bf16 image, the mode's, and a label; returns what each line shows."""
    from PIL import Image, ImageDraw

    from omni_accel.builtin import metric

    size, label_width = 128, 360
    sheet = Image.new("RGB", (2 * size + label_width, len(worst) * size), "white")
    draw, lines = ImageDraw.Draw(sheet), []
    for row, (mode, caption, p, bf16, fp8) in enumerate(worst):
        meets = [all(metric.score(image.numpy(), caption).values()) for image in (bf16, fp8)]
        for column, image in enumerate((bf16, fp8)):
            pixels = (image.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8")
            sheet.paste(Image.fromarray(pixels).resize((size, size)), (column * size, row * size))
        text = (f"{mode}\n{caption}\nPSNR {p:.1f} dB\nmeets its caption: bf16 (left) {'yes' if meets[0] else 'no'}, "
                f"FP8 (right) {'yes' if meets[1] else 'no'}")
        draw.text((2 * size + 6, row * size + 6), text, fill="black")
        lines.append({"mode": mode, "caption": caption, "psnr": round(p, 2), "bf16_meets_caption": meets[0],
                      "fp8_meets_caption": meets[1]})
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    sheet.save(path)
    return lines


def _lossless(mode: str, pipe, prompts: list[str], many: list[str], args) -> tuple:
    """The held-out images (and the adherence captions' images) of a lossless change of the bf16 reference: the
    same model in float32."""
    other = load_builtin(dtype=torch.float32).to(args.device)
    t0 = time.perf_counter()
    got = images(other, prompts, args.seed)
    seconds = time.perf_counter() - t0
    return got, images(other, many, 0) if many else None, seconds


def _adherence_captions(n: int) -> list[str]:
    if not n:
        return []
    from benchmarks.bench_builtin_adherence import captions

    return [caption for caption, _ in captions(n, round(0.3 * n))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=None,
                    help=f"comma list of {', '.join(MODES)} (default: all that run on --device; "
                         f"{', '.join(GPU_ONLY)} need cuda)")
    ap.add_argument("--calibration-seed", type=int, default=7,
                    help="picks the training caption the static rows calibrate on")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU's own FP8 GEMMs (fast_accum differs "
                                                    "there only; the fp8attn rows need head dims 64 / 128 on a GPU)")
    ap.add_argument("--adherence", type=int, default=0, metavar="N",
                    help="also score caption adherence and the PSNR tail over N captions (bench_builtin_adherence.py's "
                         "caption set: 30 %% held-out triples)")
    ap.add_argument("--worst-png", default=None, metavar="PATH",
                    help="a PNG of each mode's two worst captions: the bf16 image beside the mode's, with the PSNR and "
                         "whether each image meets its caption (omni_accel.builtin.metric)")
    ap.add_argument("--out", default="benchmarks/results/fp8_quality.json")
    args = ap.parse_args(argv)
    modes = args.modes.split(",") if args.modes else [m for m in MODES
                                                       if args.device != "cpu" or m not in GPU_ONLY]
    if any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    if args.device == "cpu" and any(m in GPU_ONLY for m in modes):
        ap.error(f"--modes {args.modes!r}: {', '.join(m for m in modes if m in GPU_ONLY)} run SageAttention's CUDA "
                 "kernel; add --device cuda (with the sageattention package installed) or leave them out")
    if args.adherence < 0:
        ap.error(f"--adherence {args.adherence}: give a number of captions >= 0 (0 skips the adherence rows)")
    torch.manual_seed(0)
    pipe = load_builtin(dtype=torch.bfloat16).to(args.device)
    g = torch.Generator().manual_seed(2027)
    prompts = ds.captions_of(ds.sample_params(args.prompts, g, only_heldout=True))
    t0 = time.perf_counter()
    reference = images(pipe, prompts, args.seed)
    rows = {"bf16": {"seconds": round(time.perf_counter() - t0, 2)}}
    many = _adherence_captions(args.adherence)
    if many:
        many_reference = images(pipe, many, 0)
        rows["bf16"]["adherence"], reference_verdicts = adherence(many_reference, many)
    calibration_prompt = ds.captions_of(ds.sample_params(1, torch.Generator().manual_seed(args.calibration_seed)))[0]
    worst = []  # (mode, caption, psnr, bf16 image, mode's image) for --worst-png
    for mode in modes:
        if mode in LOSSLESS:
            got, many_got, seconds = _lossless(mode, pipe, prompts, many, args)
            p, s = psnr(got, reference), ssim(got, reference)
            rows[mode] = {"psnr_min": round(min(p), 2), "psnr_mean": round(sum(p) / len(p), 2),
                          "ssim_min": round(min(s), 4), "ssim_mean": round(sum(s) / len(s), 4),
                          "seconds": round(seconds, 2), "psnr": [round(x, 2) for x in p]}
            if many:
                rows[mode]["adherence"], _ = adherence(many_got, many, many_reference, reference_verdicts)
            print(mode, {k: v for k, v in rows[mode].items() if k != "psnr"}, flush=True)
            continue
        quant_mode = "fp8_weight_only" if mode == "fp8_weight_only" else "int8" if mode.startswith("int8") else "fp8"
        quant_config = {"measure_error": True}
        if mode.startswith("fp8_static"):
            quant_config["activations"] = "static"
        if mode.endswith("_promoted"):
            quant_config["fast_accum"] = False
        if mode.endswith("_modulation"):
            quant_config["modulation"] = "int8"
        linears = mode not in ("fp8attn", "sage", "table")  # bf16 linears, only the attention 8-bit (or the table)
        attention = "sage" if mode.endswith("sage") else "auto"
        table = mode == "table" or mode.endswith("_table")
        if linears:
            omni_accel.accelerate(pipe, quant=quant_mode, quant_config=quant_config, attention=attention)
        elif attention != "auto" or table:
            omni_accel.accelerate(pipe, attention=attention)
        undo_table = _modulation_table(pipe) if table else None
        undo_route = _route_fp8_attention(pipe, mode.endswith("_static")) if "fp8attn" in mode else None
        hooks = hidden_state_hooks(pipe.transformer, int(mode.rsplit("_g", 1)[1])) if "_requant_g" in mode else []
        if mode.startswith("fp8_static"):
            images(pipe, [calibration_prompt], args.seed + 1000)  # observes; the next call freezes the scales
        t0 = time.perf_counter()
        got = images(pipe, prompts, args.seed)
        seconds = time.perf_counter() - t0
        many_got = images(pipe, many, 0) if many else None
        linear_stats = _linear_stats(pipe) if linears else {}
        attention_states = [m.activations for m in pipe.transformer.modules() if isinstance(m, AttentionScales)]
        if undo_route is not None:
            undo_route()
        if undo_table is not None:
            undo_table()
        for handle in hooks:
            handle.remove()
        if linears or attention != "auto" or table:
            omni_accel.restore(pipe)
        p, s = psnr(got, reference), ssim(got, reference)
        for i in sorted(range(len(p)), key=p.__getitem__)[:2]:
            worst.append((mode, prompts[i], p[i], reference[i], got[i]))
        rows[mode] = {"psnr_min": round(min(p), 2), "psnr_mean": round(sum(p) / len(p), 2),
                      "ssim_min": round(min(s), 4), "ssim_mean": round(sum(s) / len(s), 4), **linear_stats,
                      "seconds": round(seconds, 2), "psnr": [round(x, 2) for x in p]}
        if many:
            rows[mode]["adherence"], _ = adherence(many_got, many, many_reference, reference_verdicts)
        if mode.startswith("fp8_static"):
            rows[mode]["calibration_prompt"] = calibration_prompt
        if hooks:
            rows[mode]["requantized_layers"] = len(hooks)
        if attention_states:
            rows[mode]["attention_scales"] = {state: attention_states.count(state) for state in set(attention_states)}
        print(mode, {k: v for k, v in rows[mode].items() if k != "psnr"}, flush=True)
    import diffusers
    import numpy
    import transformers

    result = {"model": "built-in (omni_accel/builtin/model)", "dtype": "bfloat16", "settings": BUILTIN_DEFAULTS,
              "prompts": prompts, "seed": args.seed, "adherence_captions": many, "rows": rows,
              "env": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                      "transformers": transformers.__version__, "numpy": numpy.__version__,
                      "python": platform.python_version(), "machine": platform.machine(), "device": args.device,
                      "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                      # the CPU's vector unit (bf16 matmuls round differently across them) and the threads used
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}}
    if args.worst_png:
        result["worst_png"] = worst_png(worst, args.worst_png)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
