"""Caption adherence of the built-in model on 100 held-out captions (CPU, default settings).

    python benchmarks/bench_builtin_adherence.py [--n 100] [--model PATH] [--out benchmarks/results/builtin_adherence.json]
    python benchmarks/bench_builtin_adherence.py --vae-recon 200 [--vae PATH] [--out benchmarks/results/builtin_vae_recon.json]

Captions come from the procedural caption space with a seed the training never used (2026); 30 of
them use the (color, shape, background) triples excluded from training (dataset.HELDOUT_TRIPLES).
Each image is generated alone, at omni_accel.builtin.BUILTIN_DEFAULTS, and scored with
omni_accel.builtin.metric (background color, shape color, position/size where given, shape).

--vae-recon N scores instead the VAE's reconstructions of N dataset images (seed 123, size and position
stated): the ceiling of anything the transformer can draw; with a confusion matrix of the shape color,
the color accuracy by size and the mean pixel error on background / shape pixels.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from omni_accel.builtin import BUILTIN_DEFAULTS, builtin_model_path, load_builtin  # noqa: E402
from omni_accel.builtin import dataset as ds  # noqa: E402
from omni_accel.builtin import metric as M  # noqa: E402
from omni_accel.builtin.train import folder_sha256  # noqa: E402

SEED = 2026  # training uses seeds 0 (VAE) and 1 (transformer)


def captions(n: int, n_heldout: int) -> list[tuple[str, bool]]:
    g = torch.Generator().manual_seed(SEED)
    held = ds.captions_of(ds.sample_params(n_heldout, g, only_heldout=True))
    rest = ds.captions_of(ds.sample_params(n - n_heldout, g, exclude_heldout=True))
    return [(c, True) for c in held] + [(c, False) for c in rest]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def vae_recon(n: int, vae_dir: str, out: str) -> dict:
    import numpy as np
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(vae_dir, torch_dtype=torch.float32).eval()
    p = ds.sample_params(n, torch.Generator().manual_seed(123), exclude_heldout=False, p_omit_size=0, p_omit_position=0)
    x, alpha = ds.render(p, BUILTIN_DEFAULTS["height"], return_alpha=True)
    with torch.no_grad():
        rec = torch.cat([vae.decode(vae.encode(x[i:i + 50] * 2 - 1).latent_dist.mode()).sample for i in range(0, n, 50)])
    imgs, gt = ds.to_uint8((rec + 1) / 2), ds.to_uint8(x)
    caps = ds.captions_of(p)
    agg, by_size = collections.defaultdict(list), collections.defaultdict(list)
    names = ds.COLOR_NAMES + ["none"]
    conf = np.zeros((len(ds.COLOR_NAMES), len(names)), dtype=int)
    for i in range(n):
        s = M.score(imgs[i], caps[i])
        for k, v in s.items():
            agg[k].append(v)
        by_size[ds.SIZES[int(p["size"][i])]].append(s["color"])
        got = M.analyze(imgs[i])["color"]
        conf[int(p["color"][i]), names.index(got or "none")] += 1
    err = np.abs(imgs.astype(np.float32) - gt.astype(np.float32)).mean(-1)
    shape_px = alpha[:, 0].numpy() > 0.5
    res = {"vae": os.path.abspath(vae_dir), "n_images": n, "image_seed": 123,
           "fraction_right": {k: round(sum(v) / len(v), 4) for k, v in agg.items()},
           "color_by_size": {k: round(sum(v) / len(v), 4) for k, v in by_size.items()},
           "color_confusion": {"rows_true": ds.COLOR_NAMES, "cols_predicted": names, "counts": conf.tolist()},
           "mean_abs_error_uint8": {"background_pixels": round(float(err[~shape_px].mean()), 2),
                                    "shape_pixels": round(float(err[shape_px].mean()), 2)},
           "torch": torch.__version__, "diffusers": __import__("diffusers").__version__, "platform": platform.platform()}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("fraction_right", "color_by_size", "mean_abs_error_uint8")}))
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--heldout", type=int, default=30, help="how many captions use held-out triples")
    ap.add_argument("--model", default=None, help="model folder (default: the shipped one)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a generation setting, e.g. --set num_inference_steps=10")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "builtin_adherence.json"))
    ap.add_argument("--samples", default=os.path.join("benchmarks", "results", "builtin_adherence_samples.png"))
    ap.add_argument("--vae-recon", type=int, default=0, metavar="N", help="score VAE reconstructions of N dataset images")
    ap.add_argument("--vae", default=None, help="with --vae-recon: an AutoencoderKL folder (default: the model's vae/)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.vae_recon:
        out = args.out if args.out != ap.get_default("out") else os.path.join("benchmarks", "results", "builtin_vae_recon.json")
        return vae_recon(args.vae_recon, args.vae or os.path.join(args.model or builtin_model_path(), "vae"), out)
    settings = dict(BUILTIN_DEFAULTS)
    for kv in args.set:
        k, v = kv.split("=", 1)
        settings[k] = json.loads(v) if v[:1] in "0123456789-[{\"tfn" else v
    t0 = time.time()
    pipe = load_builtin(args.model)
    load_s = time.time() - t0
    caps = captions(args.n, args.heldout)
    pipe(caps[0][0], **{**settings, "num_inference_steps": 2})  # warm-up (not timed)
    agg = {"all": collections.defaultdict(list), "heldout_triples": collections.defaultdict(list),
           "seen_triples": collections.defaultdict(list)}
    rows, times, cpu_times, images = [], [], [], []
    load_before = os.getloadavg()
    for i, (c, held) in enumerate(caps):
        t, cpu = time.perf_counter(), time.process_time()
        img = pipe(c, generator=torch.Generator().manual_seed(i), **settings).images[0]
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - cpu)
        s = M.score(img, c)
        rows.append({"caption": c, "heldout_triple": held, **s, "seconds": round(times[-1], 3)})
        for k, v in s.items():
            agg["all"][k].append(v)
            agg["heldout_triples" if held else "seen_triples"][k].append(v)
        if i < 16:
            images.append((img, c))
        if (i + 1) % 10 == 0:
            print(f"{i + 1}/{len(caps)}  " + "  ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in agg["all"].items())
                  + f"  {sum(times) / len(times):.2f} s/img", flush=True)
    frac = {name: {k: round(sum(v) / len(v), 4) for k, v in a.items()} | {"n": len(a["bg_color"])}
            for name, a in agg.items()}
    res = {
        "model": os.path.abspath(args.model or builtin_model_path()),
        "n_captions": len(caps), "caption_seed": SEED,
        "settings": settings,
        "fraction_right": frac,
        "n_with_position": len(agg["all"].get("position", [])), "n_with_size": len(agg["all"].get("size", [])),
        "targets": {"color": 0.9, "bg_color": 0.9, "position": 0.8},
        "meets_targets": bool(frac["all"]["color"] >= 0.9 and frac["all"]["bg_color"] >= 0.9
                              and frac["all"].get("position", 1.0) >= 0.8),
        # wall time depends on what else runs on the machine; CPU seconds of this process over the threads used is
        # what one image costs on an idle machine of this size
        "seconds_per_image": {"mean": round(sum(times) / len(times), 3), "median": round(percentile(times, 0.5), 3),
                              "p95": round(percentile(times, 0.95), 3), "max": round(max(times), 3)},
        "cpu_seconds_per_image": {"median": round(percentile(cpu_times, 0.5), 3),
                                  "max": round(max(cpu_times), 3)},
        "idle_estimate_seconds_per_image_max": round(max(cpu_times) / torch.get_num_threads(), 3),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "model_sha256": folder_sha256(args.model or builtin_model_path()),
        "load_seconds": round(load_s, 2),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
        "transformers": __import__("transformers").__version__, "python": platform.python_version(),
        "platform": platform.platform(),
        "per_caption": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if args.samples and images:
        from PIL import Image, ImageDraw

        s = settings["width"]
        grid = Image.new("RGB", (4 * (s + 8), 4 * (s + 44)), "white")
        d = ImageDraw.Draw(grid)
        for k, (im, c) in enumerate(images):
            x, y = (k % 4) * (s + 8) + 4, (k // 4) * (s + 44) + 4
            grid.paste(im.resize((s, s)), (x, y))
            w = c.split()
            d.text((x, y + s + 2), "\n".join([" ".join(w[:4]), " ".join(w[4:8]), " ".join(w[8:])]), fill="black")
        grid.save(args.samples)
    print(json.dumps({k: res[k] for k in ("fraction_right", "seconds_per_image", "meets_targets")}, indent=1))
    return res


if __name__ == "__main__":
    main()
