"""The project's small built-in text-to-image model (a stock diffusers FluxPipeline).

    from omni_accel.builtin import load_builtin, BUILTIN_DEFAULTS
    pipe = load_builtin()                       # FluxPipeline, fp32, CPU, 128x128 by default
    image = pipe("a large red star in the top left on a blue background", **BUILTIN_DEFAULTS).images[0]

It draws one shape (circle, square, triangle, star, ring) in one of 8 named colors, small or large,
in a 3x3 grid position, on a background of another named color; see docs/builtin_model.md.
Retrain with ``python -m omni_accel.builtin.train --out omni_accel/builtin/model --device cuda``.
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

_COMPONENTS = ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "transformer", "vae")
_FIX = "re-install omni-accel (the model ships inside the package) or pass --model PATH to a FluxPipeline folder"


def builtin_model_path() -> str:
    """Absolute path of the shipped diffusers folder (omni_accel/builtin/model)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")


def _check_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise AccelError(f"built-in model folder {path!r} does not exist; {_FIX}")
    index = os.path.join(path, "model_index.json")
    try:
        with open(index, encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or "_class_name" not in meta:
            raise ValueError("no _class_name")
    except FileNotFoundError:
        raise AccelError(f"built-in model folder {path!r} has no model_index.json; {_FIX}") from None
    except (OSError, ValueError) as e:
        raise AccelError(f"built-in model folder {path!r} is corrupt: unreadable model_index.json ({e}); {_FIX}") from None
    missing = [c for c in _COMPONENTS if c in meta and meta[c] and meta[c][0] and not os.path.isdir(os.path.join(path, c))]
    if missing:
        raise AccelError(f"built-in model folder {path!r} is incomplete: missing {missing}; {_FIX}")
    from safetensors import safe_open

    for c in ("text_encoder", "text_encoder_2", "transformer", "vae"):
        d = os.path.join(path, c)
        files = [f for f in os.listdir(d) if f.endswith(".safetensors")] if os.path.isdir(d) else []
        if not files:
            raise AccelError(f"built-in model folder {path!r} is incomplete: no .safetensors weights in {d!r}; {_FIX}")
        for fn in files:
            try:
                with safe_open(os.path.join(d, fn), framework="pt") as sf:
                    sf.keys()
            except Exception as e:  # noqa: BLE001 - any read failure means a corrupt file
                raise AccelError(f"built-in model folder {path!r} is corrupt: cannot read "
                                 f"{os.path.join(c, fn)!r} ({type(e).__name__}: {e}); {_FIX}") from None


def is_builtin(pipe: Any) -> bool:
    """True when ``pipe`` was loaded from the shipped folder (by ``load_builtin`` or ``from_pretrained``)."""
    source = getattr(getattr(pipe, "config", None), "_name_or_path", None)
    try:
        return bool(source) and os.path.samefile(source, builtin_model_path())
    except OSError:  # a hub id or a folder that is gone
        return False


def call_defaults(pipe: Any) -> dict:
    """The keyword arguments omni-accel's commands call ``pipe`` with when the user gives none: the built-in
    model's trained settings for the built-in model, nothing for other pipelines (their own defaults apply)."""
    return dict(BUILTIN_DEFAULTS) if is_builtin(pipe) else {}


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
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder and the fix named
        raise AccelError(f"could not load the model folder {path!r} ({type(e).__name__}: {e}); {_FIX}") from e
    # FluxPipeline's default size is default_sample_size x vae_scale_factor, with default_sample_size fixed at 128
    # latent pixels in its __init__ (no config value reaches it): set the instance's to the trained size
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


__all__ = ["BUILTIN_DEFAULTS", "TRAINED_SIZE", "builtin_model_path", "call_defaults", "is_builtin", "load_builtin",
           "off_trained_size"]
