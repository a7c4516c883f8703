"""The project's small built-in models: text-to-image (a stock diffusers FluxPipeline) and text-to-video (a stock
WanPipeline).

    from omni_accel.builtin import load_builtin, BUILTIN_DEFAULTS
    pipe = load_builtin()                       # FluxPipeline, fp32, CPU, 128x128 by default
    image = pipe("a large red star in the top left on a blue background", **BUILTIN_DEFAULTS).images[0]

    from omni_accel.builtin import load_builtin_video, BUILTIN_VIDEO_DEFAULTS, BUILTIN_VIDEO_FPS
    pipe = load_builtin_video()                 # WanPipeline, fp32, CPU
    frames = pipe("a red circle moving from left to right on a blue background", **BUILTIN_VIDEO_DEFAULTS).frames[0]

The image model draws one shape (circle, square, triangle, star, ring) in one of 8 named colors, small or large,
in a 3x3 grid position, on a background of another named color; the video model moves such a shape across the frame
in one of four directions. See docs/builtin_model.md and docs/builtin_video_model.md.
Retrain with ``python -m omni_accel.builtin.train --out omni_accel/builtin/model --device cuda`` and
``python -m omni_accel.builtin.train_video --out omni_accel/builtin/video_model --seed 0``.
"""
from __future__ import annotations

import json
import os
from typing import Any

from ..errors import AccelError

# The one size the model was trained at (64 image tokens): other sizes draw noise and grids.
TRAINED_SIZE = 128

# The model's call defaults -- the one place every entry point (generate, bench, serve, demo, calibrate) takes
# them from, through call_defaults(pipe). guidance_embeds=False in this model,
# so FluxPipeline ignores guidance_scale; it is kept for the CLI's sake. max_sequence_length=32 keeps the T5
# sequence short (2.7x faster on CPU than FluxPipeline's default 512; the T5 encoder is causal, so the caption's
# embedding does not depend on the padding, and the transformer was trained on both 32 and 512).
# True classifier-free guidance is available (10 % caption dropout in training): add
# true_cfg_scale=4.0, negative_prompt=[""] * batch  (twice the compute).
BUILTIN_DEFAULTS: dict = {
    "height": TRAINED_SIZE,
    "width": TRAINED_SIZE,
    "num_inference_steps": 20,
    "guidance_scale": 1.0,
    "max_sequence_length": 32,
}

# The built-in video model (WanPipeline, 64x64, 17 frames = 5 latent frames). guidance_scale 1.0 = one transformer
# forward per step (the CPU budget: a clip in well under 20 s on 2 cores); it was trained with 10 % empty captions,
# so classifier-free guidance (guidance_scale > 1, twice the compute) is available. max_sequence_length=16 holds
# every caption (<= 13 tokens); WanPipeline's default of 226 also works (trained on both).
BUILTIN_VIDEO_DEFAULTS: dict = {
    "height": 64,
    "width": 64,
    "num_frames": 17,
    "num_inference_steps": 20,
    "guidance_scale": 1.0,
    "max_sequence_length": 16,
}
BUILTIN_VIDEO_FPS = 8  # frames per second of the files written from it: 17 frames = about 2 s

_COMPONENTS = ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "transformer", "vae")
_WEIGHTS = ("text_encoder", "text_encoder_2", "transformer", "vae")  # the components holding .safetensors
_FIX = "re-install omni-accel (the model ships inside the package) or pass --model PATH to a FluxPipeline folder"
_VIDEO_FIX = ("train it with `python -m omni_accel.builtin.train_video --out {path} --seed 0` (one GPU, about 6 "
              "minutes) or pass --model PATH to a WanPipeline folder")


def builtin_model_path() -> str:
    """Absolute path of the shipped diffusers folder (omni_accel/builtin/model)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")


def builtin_lora_path() -> str:
    """Absolute path of the shipped LoRA adapter of the built-in model (omni_accel/builtin/lora): it swaps the
    shape and background colours of the caption. ``pipe.load_lora_weights(builtin_lora_path())``; trained by
    ``python -m omni_accel.builtin.train_lora`` (docs/builtin_model.md)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora")


def builtin_video_model_path() -> str:
    """Absolute path of the built-in video model's diffusers folder (omni_accel/builtin/video_model)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "video_model")


def _check_folder(path: str, fix: str = _FIX, what: str = "built-in model") -> None:
    if not os.path.isdir(path):
        raise AccelError(f"{what} folder {path!r} does not exist; {fix}")
    index = os.path.join(path, "model_index.json")
    try:
        with open(index, encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or "_class_name" not in meta:
            raise ValueError("no _class_name")
    except FileNotFoundError:
        raise AccelError(f"{what} folder {path!r} has no model_index.json; {fix}") from None
    except (OSError, ValueError) as e:
        raise AccelError(f"{what} folder {path!r} is corrupt: unreadable model_index.json ({e}); {fix}") from None
    listed = [c for c in _COMPONENTS if c in meta and meta[c] and meta[c][0]]
    missing = [c for c in listed if not os.path.isdir(os.path.join(path, c))]
    if missing:
        raise AccelError(f"{what} folder {path!r} is incomplete: missing {missing}; {fix}")
    from safetensors import safe_open

    for c in (c for c in _WEIGHTS if c in listed):
        d = os.path.join(path, c)
        files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
        if not files:
            raise AccelError(f"{what} folder {path!r} is incomplete: no .safetensors weights in {d!r}; {fix}")
        for fn in files:
            try:
                with safe_open(os.path.join(d, fn), framework="pt") as sf:
                    sf.keys()
            except Exception as e:  # noqa: BLE001 - any read failure means a corrupt file
                raise AccelError(f"{what} folder {path!r} is corrupt: cannot read "
                                 f"{os.path.join(c, fn)!r} ({type(e).__name__}: {e}); {fix}") from None


def _loaded_from(pipe: Any, folder: str) -> bool:
    source = getattr(getattr(pipe, "config", None), "_name_or_path", None)
    try:
        return bool(source) and os.path.samefile(source, folder)
    except OSError:  # a hub id or a folder that is gone
        return False


def is_builtin(pipe: Any) -> bool:
    """True when ``pipe`` was loaded from the shipped image model's folder (by ``load_builtin`` or
    ``from_pretrained``)."""
    return _loaded_from(pipe, builtin_model_path())


def is_builtin_video(pipe: Any) -> bool:
    """True when ``pipe`` was loaded from the built-in video model's folder."""
    return _loaded_from(pipe, builtin_video_model_path())


def call_defaults(pipe: Any) -> dict:
    """The keyword arguments omni-accel's commands call ``pipe`` with when the user gives none: the built-in
    models' trained settings for them, nothing for other pipelines (their own defaults apply)."""
    if is_builtin(pipe):
        return dict(BUILTIN_DEFAULTS)
    return dict(BUILTIN_VIDEO_DEFAULTS) if is_builtin_video(pipe) else {}


def off_trained_size(pipe: Any, height: int | None, width: int | None) -> str | None:
    """The warning for a call of the built-in model at a size it was not trained at (None when all is well)."""
    height = height or getattr(pipe, "default_sample_size", 0) * getattr(pipe, "vae_scale_factor", 0)
    width = width or getattr(pipe, "default_sample_size", 0) * getattr(pipe, "vae_scale_factor", 0)
    if not is_builtin(pipe) or (height, width) == (TRAINED_SIZE, TRAINED_SIZE):
        return None
    return (f"the built-in model was trained at {TRAINED_SIZE}x{TRAINED_SIZE} only; at {width}x{height} it draws "
            f"noise and grids. Call it with height={TRAINED_SIZE}, width={TRAINED_SIZE} "
            "(omni_accel.builtin.BUILTIN_DEFAULTS).")


def load_builtin(path: str | None = None, dtype: Any = None, device: Any = "cpu", *, torch_dtype: Any = None):
    """Load the built-in model (or the FluxPipeline folder at `path`) as a diffusers pipeline whose plain call,
    ``pipe(prompt)``, renders at the trained 128x128 (FluxPipeline's own default would be 1024x1024).

    ``dtype`` (alias ``torch_dtype``, as in diffusers) defaults to float32. Raises AccelError naming the folder and
    the fix when it is missing or corrupt."""
    dtype = _resolve_dtype(dtype, torch_dtype)
    path = os.path.abspath(path or builtin_model_path())
    _check_folder(path)
    return _load(path, dtype, device, _FIX)


def load_builtin_video(path: str | None = None, dtype: Any = None, device: Any = "cpu", *, torch_dtype: Any = None):
    """Load the built-in video model (or the WanPipeline folder at `path`) as a diffusers pipeline.

    Raises AccelError naming the folder and the fix when it is missing (the weights are trained by
    ``omni_accel.builtin.train_video``, not downloaded) or corrupt."""
    dtype = _resolve_dtype(dtype, torch_dtype)
    path = os.path.abspath(path or builtin_video_model_path())
    fix = _VIDEO_FIX.format(path=path)
    _check_folder(path, fix, "built-in video model")
    return _load(path, dtype, device, fix)


def _load(path: str, dtype: Any, device: Any, fix: str):
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder and the fix named
        raise AccelError(f"could not load the model folder {path!r} ({type(e).__name__}: {e}); {fix}") from e
    if fix == _FIX:
        # FluxPipeline's default size is default_sample_size x vae_scale_factor, with default_sample_size fixed at
        # 128 latent pixels in its __init__ (no config value reaches it): set the instance's to the trained size
        pipe.default_sample_size = TRAINED_SIZE // pipe.vae_scale_factor
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _resolve_dtype(dtype: Any, torch_dtype: Any):
    import torch

    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise AccelError(f"load_builtin got dtype={dtype!r} and torch_dtype={torch_dtype!r}; give one of them.")
    chosen = dtype if dtype is not None else torch_dtype if torch_dtype is not None else torch.float32
    if isinstance(chosen, str):
        named = getattr(torch, chosen.removeprefix("torch."), None)
        chosen = named if isinstance(named, torch.dtype) else chosen
    if not isinstance(chosen, torch.dtype) or not chosen.is_floating_point:
        raise AccelError(f"load_builtin dtype={chosen!r} is not a floating-point torch dtype; use torch.float32, "
                         "torch.bfloat16 or torch.float16.")
    return chosen


__all__ = ["BUILTIN_DEFAULTS", "BUILTIN_VIDEO_DEFAULTS", "BUILTIN_VIDEO_FPS", "TRAINED_SIZE", "builtin_lora_path",
           "builtin_model_path", "builtin_video_model_path", "call_defaults", "is_builtin", "is_builtin_video", "load_builtin",
           "load_builtin_video", "off_trained_size"]
