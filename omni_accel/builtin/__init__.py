"""The project's small built-in text-to-image model (a stock diffusers FluxPipeline).

    from omni_accel.builtin import load_builtin, BUILTIN_DEFAULTS
    pipe = load_builtin()                       # FluxPipeline, fp32, CPU
    image = pipe("a large red star in the top left on a blue background", **BUILTIN_DEFAULTS).images[0]

It draws one shape (circle, square, triangle, star, ring) in one of 8 named colors, small or large,
in a 3x3 grid position, on a background of another named color; see docs/builtin_model.md.
Retrain with ``python -m omni_accel.builtin.train --out omni_accel/builtin/model --device cuda``.
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import AccelError

# Default generation settings (the CLI uses them). guidance_embeds=False in this model, so FluxPipeline
# ignores guidance_scale; it is kept for the CLI's sake. max_sequence_length=32 keeps the T5 sequence
# short (2.7x faster on CPU than FluxPipeline's default 512; the T5 encoder is causal, so the caption's
# embedding does not depend on the padding, and the transformer was trained on both 32 and 512).
# True classifier-free guidance is available (10 % caption dropout in training): add
# true_cfg_scale=4.0, negative_prompt=[""] * batch  (twice the compute).
BUILTIN_DEFAULTS: dict = {
    "height": 128,
    "width": 128,
    "num_inference_steps": 20,
    "guidance_scale": 1.0,
    "max_sequence_length": 32,
}

_COMPONENTS = ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "transformer", "vae")
_FIX = "re-install omni-accel (the model ships inside the package) or pass --model PATH to a FluxPipeline folder"


def builtin_model_path() -> str:
    """Absolute path of the shipped diffusers folder (omni_accel/builtin/model)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")


def builtin_lora_path() -> str:
    """Absolute path of the shipped LoRA adapter of the built-in model (omni_accel/builtin/lora): it swaps the
    shape and background colours of the caption. ``pipe.load_lora_weights(builtin_lora_path())``; trained by
    ``python -m omni_accel.builtin.train_lora`` (docs/builtin_model.md)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora")


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


def load_builtin(path: str | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load the built-in model (or the FluxPipeline folder at `path`) as a diffusers pipeline.

    Raises AccelError naming the folder and the fix when it is missing or corrupt."""
    path = os.path.abspath(path or builtin_model_path())
    _check_folder(path)
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder and the fix named
        raise AccelError(f"could not load the model folder {path!r} ({type(e).__name__}: {e}); {_FIX}") from e
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


__all__ = ["BUILTIN_DEFAULTS", "builtin_lora_path", "builtin_model_path", "load_builtin"]
