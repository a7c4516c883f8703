"""``omni-accel calibrate``: fit a TeaCache profile for a local model (or the built-in one) and write it as JSON.

    omni-accel calibrate --target-psnr 30 -o profile.json                         # the built-in model
    omni-accel calibrate --model PATH --target-psnr 30 [--prompts FILE] [--steps 28] -o profile.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os

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


def _default(name: str):
    """calibrate()'s own default, so the command and the function cannot disagree."""
    from .calibrate import calibrate

    return inspect.signature(calibrate).parameters[name].default


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import DTYPES

    m = p.add_argument_group("model")
    m.add_argument("--model", default=os.environ.get("OMNI_ACCEL_MODEL"),
                   help="local diffusers pipeline folder (env OMNI_ACCEL_MODEL); default: the built-in model "
                        "('builtin' names it too)")
    m.add_argument("--dtype", choices=DTYPES, default=os.environ.get("OMNI_ACCEL_DTYPE"),
                   help="weights dtype (env OMNI_ACCEL_DTYPE; default bfloat16 on cuda, float32 on cpu)")
    m.add_argument("--device", default=os.environ.get("OMNI_ACCEL_DEVICE"),
                   help="cpu or cuda[:N] (env OMNI_ACCEL_DEVICE; default cuda if available, else cpu)")
    c = p.add_argument_group("calibration")
    c.add_argument("--target-psnr", type=float, default=30.0,
                   help="PSNR in dB against the uncached output that the profile's threshold must meet (default 30)")
    c.add_argument("--criterion", choices=("mean", "min"), default=_default("criterion"),
                   help="which PSNR over the prompts must reach the target: min = the worst prompt (default), "
                        "mean = the average")
    c.add_argument("--prompts", default=None, metavar="FILE",
                   help="text file, one prompt per line (default: 8 generic prompts; the built-in model uses "
                        "captions of its training set)")
    c.add_argument("--steps", type=int, default=28,
                   help="denoising steps of the calibration runs; use the step count you will generate with "
                        "(default 28)")
    c.add_argument("--height", type=int, default=None, help="image height in pixels (default: the model's)")
    c.add_argument("--width", type=int, default=None, help="image width in pixels (default: the model's)")
    c.add_argument("--warmup-steps", type=int, default=2,
                   help="steps always computed first (default 2: on short schedules a reused second step can "
                        "change the layout of the image, measured on the built-in model)")
    c.add_argument("--final-steps", type=int, default=1, help="steps always computed last (default 1)")
    c.add_argument("--batch-size", type=int, default=8, help="prompts per pipeline call (default 8)")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")


def run(args) -> int:
    import torch

    from ..cli import CliError, _check_sampling_args, _load_pipeline_quietly, _resolve_device, _torch_dtype
    from . import calibrate

    for name in ("steps", "warmup_steps", "final_steps", "batch_size"):
        floor = 0 if name in ("warmup_steps", "final_steps") else 1
        if getattr(args, name) < floor:
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{flag} {getattr(args, name)} is invalid: it must be >= {floor}.")
    args.frames = None
    _check_sampling_args(args)
    if args.model == "builtin":
        args.model = None
    device = _resolve_device(args.device)
    dtype = _torch_dtype(args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32"))
    pipe, defaults, source = _load_pipeline_quietly(args, device, dtype)
    call_kwargs = {k: v for k, v in defaults.items() if k != "num_inference_steps"}
    for key in ("height", "width"):
        if getattr(args, key):
            call_kwargs[key] = getattr(args, key)
    if args.prompts:
        with open(args.prompts) as fh:
            prompts = [line.strip() for line in fh if line.strip()]
    elif args.model is None:
        from ..builtin import dataset as ds

        prompts = ds.captions_of(ds.sample_params(8, torch.Generator().manual_seed(7), exclude_heldout=True))
    else:
        prompts = DEFAULT_PROMPTS
    profile = calibrate(pipe, prompts, target_psnr=args.target_psnr, steps=args.steps, call_kwargs=call_kwargs,
                        batch_size=args.batch_size, criterion=args.criterion, warmup_steps=args.warmup_steps,
                        final_steps=args.final_steps, output=args.output, progress=True)
    print(json.dumps({k: profile[k] for k in ("family", "threshold", "measured_psnr", "block_forward_ratio")}))
    return 0
