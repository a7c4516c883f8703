"""Fit a TeaCache profile for one model: rescale coefficients and the threshold that meets a target PSNR.

    profile = omni_accel.cache.calibrate(pipe, prompts, target_psnr=30, steps=28)
    omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"profile": profile})   # or a saved JSON path

1. Uncached reference runs (tea_cache with threshold 0 = every step computed) record, per forward and CFG
   branch, the relative L1 change of the modulated input and of the transformer output from the previous step.
2. ``np.polyfit(rel_in, rel_out, 4)``: the rescale polynomial, highest power first (np.poly1d order).
3. Threshold search on the same prompts: grow the threshold geometrically until the PSNR against the references
   (the worst prompt's by default, ``criterion="min"``; or the mean over the prompts) drops below the target, then
   bisect; the largest threshold that meets the target wins.
"""

from __future__ import annotations

import datetime
import json
import math
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import AccelError
from .metrics import psnr, ssim


def _images(out) -> torch.Tensor:
    images = out.frames if hasattr(out, "frames") else out.images
    if isinstance(images, list):
        images = torch.stack([torch.as_tensor(np.asarray(i)) for i in images])
    return torch.as_tensor(images).detach().float().cpu()


def _generate(pipe, prompts: Sequence[str], call_kwargs: dict, seed: int, batch_size: int) -> torch.Tensor:
    outs = []
    for i in range(0, len(prompts), batch_size):
        chunk = list(prompts[i:i + batch_size])
        kw = dict(call_kwargs, prompt=chunk, output_type="pt")
        kw["generator"] = torch.Generator("cpu").manual_seed(seed + i)
        outs.append(_images(pipe(**kw)))
    return torch.cat(outs)


def run_cached(pipe, prompts, call_kwargs, cache_config: dict, seed: int = 0, batch_size: int = 8,
               recorder: list | None = None) -> tuple[torch.Tensor, dict]:
    """Images and the summed per-call cache counters of one tea_cache setting (the pipeline is restored)."""
    import omni_accel

    omni_accel.accelerate(pipe, cache="tea_cache", cache_config=cache_config)
    counters: dict[str, int] = {}
    try:
        if recorder is not None:
            pipe.omni_accel.cache_controller.recorder = recorder
        outs = []
        for i in range(0, len(prompts), batch_size):
            outs.append(_generate(pipe, prompts[i:i + batch_size], call_kwargs, seed + i, batch_size))
            last = pipe.omni_accel.last_call.as_dict()
            for k, v in last.items():
                if k.startswith("cache.") and isinstance(v, int):
                    counters[k] = counters.get(k, 0) + v
            counters["transformer_forwards"] = counters.get("transformer_forwards", 0) + last["transformer_forwards"]
    finally:
        omni_accel.restore(pipe)
    return torch.cat(outs), counters


def fit_coefficients(records: list[dict], degree: int = 4) -> tuple[list[float], dict]:
    pts = [(r["rel_in"], r["rel_out"]) for r in records if r["rel_in"] is not None and r["rel_out"] is not None]
    if len(pts) < degree + 2:
        raise AccelError(f"calibration recorded only {len(pts)} step changes; use more steps or prompts.")
    x = np.array([p[0] for p in pts], dtype=np.float64)
    y = np.array([p[1] for p in pts], dtype=np.float64)
    coef = np.polyfit(x, y, degree)
    pred = np.poly1d(coef)(x)
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-12
    return [float(c) for c in coef], {"points": len(pts), "rel_in_range": [float(x.min()), float(x.max())],
                                       "rel_out_range": [float(y.min()), float(y.max())],
                                       "r2": 1 - ss_res / ss_tot}


def evaluate(pipe, prompts, call_kwargs, refs, coefficients, threshold, seed=0, batch_size=8,
             warmup_steps=1, final_steps=1) -> dict:
    cfg = {"coefficients": list(coefficients), "threshold": float(threshold), "warmup_steps": warmup_steps,
           "final_steps": final_steps}
    imgs, counters = run_cached(pipe, prompts, call_kwargs, cfg, seed=seed, batch_size=batch_size)
    p, s = psnr(imgs, refs), ssim(imgs, refs)
    finite = [v if math.isfinite(v) else 100.0 for v in p]
    return {
        "threshold": float(threshold),
        "psnr_mean": float(np.mean(finite)), "psnr_min": float(np.min(finite)),
        "ssim_mean": float(np.mean(s)), "ssim_min": float(np.min(s)),
        "computed": counters.get("cache.computed", 0), "reused": counters.get("cache.reused", 0),
        "block_forwards": counters.get("cache.block_forwards", 0),
    }


def calibrate(
    pipe: Any,
    prompts: Sequence[str],
    target_psnr: float = 30.0,
    steps: int = 28,
    *,
    call_kwargs: dict | None = None,
    seed: int = 0,
    batch_size: int = 8,
    warmup_steps: int = 2,
    final_steps: int = 1,
    criterion: str = "min",
    max_evals: int = 12,
    output: str | None = None,
    progress: bool = False,
) -> dict:
    """Fit a TeaCache profile for ``pipe`` on ``prompts``; see the module docstring. ``criterion``: the "min"
    (worst prompt's, the default) or the "mean" PSNR over the prompts must reach ``target_psnr``. ``progress``
    shows a bar over the reference run and the threshold trials. Returns the profile dict (and writes ``output``)."""
    from ..pipelines import adapter_for

    if "omni_accel" in vars(pipe):
        raise AccelError("calibrate() needs a plain pipeline; call omni_accel.restore(pipe) first.")
    if criterion not in ("mean", "min"):
        raise AccelError(f"criterion={criterion!r} is not known. Use 'mean' or 'min'.")
    prompts = list(prompts)
    if not prompts:
        raise AccelError("calibrate() needs at least one prompt.")
    adapter = adapter_for(pipe)
    kw = dict(call_kwargs or {}, num_inference_steps=steps)
    records: list[dict] = []
    bar = tqdm(total=1 + max_evals, desc="calibrating (reference, then threshold trials)", unit="run",
               disable=not progress)
    refs, ref_counters = run_cached(pipe, prompts, kw, {"threshold": 0.0, "coefficients": [1.0, 0.0]},
                                    seed=seed, batch_size=batch_size, recorder=records)
    bar.update(1)
    coefficients, fit = fit_coefficients(records)
    key = "psnr_mean" if criterion == "mean" else "psnr_min"

    def ev(threshold: float) -> dict:
        result = evaluate(pipe, prompts, kw, refs, coefficients, threshold, seed, batch_size, warmup_steps,
                          final_steps)
        bar.update(1)
        bar.set_postfix(threshold=f"{threshold:.4g}", psnr=f"{result[key]:.2f}")
        return result

    # start near one step's rescaled change, grow x2 until the target fails, then bisect
    rescaled = [max(float(np.poly1d(coefficients)(r["rel_in"])), 0.0) for r in records if r["rel_in"] is not None]
    t = max(float(np.median(rescaled)) if rescaled else 0.05, 1e-4)
    trials, good, bad = [], None, None
    while len(trials) < max_evals:
        r = ev(t)
        trials.append(r)
        if r[key] >= target_psnr:
            good = r
            if bad is not None:
                break
            if r["reused"] == 0 and len(trials) > 6:
                break
            t *= 2
        else:
            bad = r
            if good is not None:
                break
            t /= 2
            if t < 1e-6:
                break
    while good is not None and bad is not None and len(trials) < max_evals:
        mid = math.sqrt(good["threshold"] * bad["threshold"])
        r = ev(mid)
        trials.append(r)
        if r[key] >= target_psnr:
            good = r
        else:
            bad = r
        if bad["threshold"] / good["threshold"] < 1.08:
            break
    bar.close()
    if good is None:
        good = {"threshold": 0.0, "psnr_mean": float("inf"), "psnr_min": float("inf"), "ssim_mean": 1.0,
                "ssim_min": 1.0, "computed": ref_counters.get("cache.computed", 0), "reused": 0,
                "block_forwards": ref_counters.get("cache.block_forwards", 0)}
    plain_blocks = ref_counters.get("cache.block_forwards", 0)
    profile = {
        "family": adapter.family,
        "pipeline": type(pipe).__name__,
        "model": str(getattr(getattr(pipe, "config", None), "_name_or_path", "") or ""),
        "coefficients": coefficients,
        "threshold": good["threshold"],
        "target_psnr": float(target_psnr),
        "criterion": criterion,
        "measured_psnr": good[key],
        "measured_psnr_mean": good["psnr_mean"],
        "measured_psnr_min": good["psnr_min"],
        "measured_ssim_mean": good["ssim_mean"],
        "measured_ssim_min": good["ssim_min"],
        "block_forward_ratio": (plain_blocks / good["block_forwards"]) if good["block_forwards"] else None,
        "steps": steps,
        "warmup_steps": warmup_steps,
        "final_steps": final_steps,
        "prompts": len(prompts),
        "call_kwargs": {k: v for k, v in kw.items() if isinstance(v, (int, float, str, bool))},
        "fit": fit,
        "search": trials,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if output:
        with open(output, "w") as fh:
            json.dump(profile, fh, indent=2)
    return profile
