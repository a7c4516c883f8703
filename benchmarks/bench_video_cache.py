"""Step caches on the built-in video model: block forwards saved, and PSNR / SSIM of every frame against the
uncached clip, for tea_cache, mag_cache and cache_dit at their defaults.

    python benchmarks/bench_video_cache.py [--prompts 8] [--steps 20] [--model PATH]
    python benchmarks/bench_video_cache.py --tiny      # the code path on a tiny random Wan (seconds; for the tests)

Prompts: held-out captions (every direction of the first held-out triples, video_dataset.HELDOUT_TRIPLES), one
batched call per method at BUILTIN_VIDEO_DEFAULTS, fixed seed. mag_cache at its defaults calibrates on its first call:
that call runs on training-distribution captions (seed 7), not on the measured ones. A block counts as executed
when its self-attention runs (a torch pre-hook on ``block.attn1``), whichever cache skips it. Per clip: PSNR / SSIM
of each frame against the plain clip (omni_accel.cache.metrics); per method: mean and worst over all frames of all
clips, the worst clip's mean, wall time. Writes benchmarks/results/bench_video_cache.json.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import omni_accel  # noqa: E402
from benchmarks.timing import write_result  # noqa: E402
from omni_accel.cache.metrics import psnr, ssim  # noqa: E402

METHODS = ("tea_cache", "mag_cache", "cache_dit")
CALIBRATION_SEED = 7


def install_counter(pipe) -> list[int]:
    box = [0]

    def count(module, args, kwargs=None):
        box[0] += 1

    for block in pipe.transformer.blocks:
        block.attn1.register_forward_pre_hook(count)
    return box


def builtin_setup(args):
    from omni_accel.builtin import BUILTIN_VIDEO_DEFAULTS, load_builtin_video
    from omni_accel.builtin import video_dataset as vds
    from omni_accel.builtin.train_video import heldout_captions

    pipe = load_builtin_video(args.model)
    call = dict(BUILTIN_VIDEO_DEFAULTS, num_inference_steps=args.steps or BUILTIN_VIDEO_DEFAULTS["num_inference_steps"])
    prompts = heldout_captions()[:args.prompts]
    calibration = vds.captions_of(vds.sample_params(2, torch.Generator().manual_seed(CALIBRATION_SEED)))
    return pipe, call, prompts, calibration, args.model or "built-in video model"


def tiny_setup(args):
    from omni_accel.testing import tiny_pipeline

    pipe, kwargs = tiny_pipeline("wan", num_layers=4)
    call = {k: v for k, v in kwargs.items() if k not in ("prompt", "output_type")}
    call["num_inference_steps"] = args.steps or 6
    prompts = [kwargs["prompt"], "a dog runs on sand"][:args.prompts]
    return pipe, call, prompts, ["a bird over water"], "tiny random Wan (omni_accel.testing, 4 blocks)"


def generate(pipe, prompts: list[str], call: dict, seed: int = 0) -> torch.Tensor:
    """Clips as float (n, F, H, W, 3) in [0, 1]."""
    frames = pipe(list(prompts), generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **call).frames
    return torch.as_tensor(np.asarray(frames)).float()


def frame_scores(clips: torch.Tensor, refs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """PSNR (capped at 100 dB for identical frames) and SSIM per frame: arrays (clips, frames)."""
    n, f = clips.shape[:2]
    flat, ref = clips.reshape(n * f, *clips.shape[2:]), refs.reshape(n * f, *refs.shape[2:])
    p = np.array([v if math.isfinite(v) else 100.0 for v in psnr(flat, ref)]).reshape(n, f)
    return p, np.array(ssim(flat, ref)).reshape(n, f)


def measure(method: str, pipe, prompts, call, refs, box, plain_blocks: int, calibration: list[str]) -> dict:
    omni_accel.accelerate(pipe, cache=method)
    try:
        if method == "mag_cache":  # its default: calibrate on the first call -- on other captions
            generate(pipe, calibration, call, seed=1)
        box[0] = 0
        t0 = time.perf_counter()
        clips = generate(pipe, prompts, call)
        wall = time.perf_counter() - t0
        report = pipe.omni_accel.report()
    finally:
        omni_accel.restore(pipe)
    p, s = frame_scores(clips, refs)
    applied = [a for a in report["applied"] if a["pass"] == "cache"][0]
    return {"method": method, "settings": {k: v for k, v in applied.items() if k not in ("pass",)},
            "transformer_forwards": report["last_call"]["transformer_forwards"], "block_forwards": box[0],
            "block_forwards_saved": round(1 - box[0] / plain_blocks, 4), "reduction": round(plain_blocks / box[0], 2),
            "wall_s": round(wall, 2), "psnr_mean": round(float(p.mean()), 2), "psnr_worst_frame": round(float(p.min()), 2),
            "psnr_worst_clip": round(float(p.mean(1).min()), 2), "ssim_mean": round(float(s.mean()), 4),
            "ssim_worst_frame": round(float(s.min()), 4),
            "psnr_per_frame": p.round(2).tolist(), "ssim_per_frame": s.round(4).tolist(),
            "cache_report": {k: v for k, v in report.get("cache", {}).items() if k != "branches"}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="default: the model's (20 for the built-in one)")
    ap.add_argument("--model", default=None, help="WanPipeline folder (default: the built-in video model)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Wan instead: checks the code path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "bench_video_cache.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe, call, prompts, calibration, model = (tiny_setup if args.tiny else builtin_setup)(args)
    pipe.set_progress_bar_config(disable=True)
    box = install_counter(pipe)
    generate(pipe, prompts[:1], dict(call, num_inference_steps=2))  # warm-up: one-off costs stay out of the rows
    box[0] = 0
    t0 = time.perf_counter()
    refs = generate(pipe, prompts, call)
    plain = {"method": "plain", "transformer_forwards": None, "block_forwards": box[0], "block_forwards_saved": 0.0,
             "reduction": 1.0, "wall_s": round(time.perf_counter() - t0, 2)}
    rows = [plain]
    result = {"model": model, "prompts": prompts, "call": call, "frames_per_clip": int(refs.shape[1]), "rows": rows,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0]}
    for method in METHODS:
        rows.append(measure(method, pipe, prompts, call, refs, box, plain["block_forwards"], calibration))
        print({k: v for k, v in rows[-1].items() if not k.endswith("per_frame") and k != "cache_report"}, flush=True)
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
