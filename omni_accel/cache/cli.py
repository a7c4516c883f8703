"""``omni-accel calibrate``: fit a TeaCache profile for a local model (the lead wires it into omni_accel/cli.py).

    omni-accel calibrate --model PATH --target-psnr 30 [--prompts FILE] [--steps 28] -o profile.json
"""

from __future__ import annotations

import argparse
import json

DEFAULT_PROMPTS = [
    "a photo of a red apple on a wooden table",
    "a watercolor painting of a lighthouse at dawn",
    "a small blue car parked in front of a yellow house",
    "a portrait of an old man with a grey beard",
    "a bowl of ramen with steam rising",
    "a snowy mountain range under a clear sky",
    "a cat sleeping on a stack of books",
    "a neon sign reading OPEN in a rainy street",
]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="fit a TeaCache profile (coefficients + threshold) for a model")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="diffusers pipeline folder (or 'builtin')")
    p.add_argument("--target-psnr", type=float, default=30.0, help="PSNR (dB) against uncached output to meet")
    p.add_argument("--prompts", default=None, help="text file, one prompt per line (default: 8 generic prompts; "
                                                   "the built-in model uses captions of its training set)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--criterion", choices=("mean", "min"), default="min",
                   help="which PSNR over the prompts must reach the target (default: the worst prompt)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="steps always computed first (default 2: on short schedules a reused second step can "
                        "change the layout of the image, measured on the built-in model)")
    p.add_argument("--final-steps", type=int, default=1, help="steps always computed last (default 1)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default=None)
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")


def run(args) -> int:
    import torch
    from diffusers import DiffusionPipeline

    from . import calibrate

    call_kwargs: dict = {}
    if args.model == "builtin":
        from ..builtin import BUILTIN_DEFAULTS, load_builtin

        pipe = load_builtin()
        call_kwargs.update({k: v for k, v in BUILTIN_DEFAULTS.items() if k in ("height", "width")})
        call_kwargs["max_sequence_length"] = 32
    else:
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.float32)
    if args.device:
        pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    if args.prompts:
        with open(args.prompts) as fh:
            prompts = [line.strip() for line in fh if line.strip()]
    elif args.model == "builtin":
        from ..builtin import dataset as ds

        prompts = ds.captions_of(ds.sample_params(8, torch.Generator().manual_seed(7), exclude_heldout=True))
    else:
        prompts = DEFAULT_PROMPTS
    for key in ("height", "width"):
        if getattr(args, key):
            call_kwargs[key] = getattr(args, key)
    profile = calibrate(pipe, prompts, target_psnr=args.target_psnr, steps=args.steps, call_kwargs=call_kwargs,
                        batch_size=args.batch_size, criterion=args.criterion, warmup_steps=args.warmup_steps,
                        final_steps=args.final_steps, output=args.output)
    print(json.dumps({k: profile[k] for k in ("family", "threshold", "measured_psnr", "block_forward_ratio")}))
    return 0
