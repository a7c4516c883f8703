"""Write a text encoder as a checkpoint vLLM can load: text-only, decoder-only, cut at the wanted layer.

* Qwen2.5-VL (Qwen-Image's encoder) becomes a Qwen2ForCausalLM of its language model. For text the 3-axis
  M-RoPE gives all three axes the same position, which is exactly 1-D RoPE, so the states are unchanged.
* A bare decoder (Z-Image's Qwen3Model) becomes a Qwen3ForCausalLM with tied embeddings (no LM head is used).
* ``layer`` other than -1 keeps only the layers up to it, and names a no-final-norm architecture
  (vllm_models.py), so the model's output is ``hidden_states[layer]`` of the full model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch

from ..errors import AccelError
from .engine import resolve_layer

FAMILY_OF_MODEL_TYPE = {"qwen2": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen2_vl_text": "qwen2", "qwen3": "qwen3",
                        "llama": "llama"}
CAUSAL_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def decoder_of(model: Any):
    """The decoder stack (embed_tokens, layers, norm) inside a CausalLM, a bare model or a VL model."""
    for candidate in (getattr(getattr(model, "model", None), "language_model", None),
                      getattr(model, "language_model", None), getattr(model, "model", None), model):
        if candidate is not None and all(hasattr(candidate, a) for a in ("embed_tokens", "layers", "norm")):
            return candidate
    raise AccelError(f"{type(model).__name__} has no decoder stack (embed_tokens, layers, norm) that vLLM can run; "
                     "use text_encoder='transformers' for this model.")


def _target_config(decoder, keep: int, family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[family]
    src = decoder.config.to_dict()
    rope = dict(src.get("rope_parameters") or {})
    theta = rope.get("rope_theta", src.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") in ("default", "mrope") or "mrope_section" in rope:
        rope = {"rope_type": "default", "rope_theta": theta}  # text-only M-RoPE == 1-D RoPE
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "attention_bias", "head_dim",
            "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id")
    kwargs = {k: src[k] for k in keys if k in src and src[k] is not None}
    if family == "qwen2":
        kwargs.pop("attention_bias", None)
        kwargs.pop("head_dim", None)
    kwargs.update(num_hidden_layers=keep, rope_parameters=rope, tie_word_embeddings=True, use_sliding_window=False)
    return cls(**kwargs)


def export_module(model: Any, layer: int, out_dir: str, tokenizer: Any = None) -> str:
    """Save ``model``'s decoder to ``out_dir`` so that vLLM's last output is the full model's hidden_states[layer]."""
    from safetensors.torch import save_file

    decoder = decoder_of(model)
    model_type = getattr(decoder.config, "model_type", "")
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        raise AccelError(f"the text encoder's decoder is {model_type!r}; the vLLM export knows "
                         f"{', '.join(sorted(FAMILY_OF_MODEL_TYPE))}. Use text_encoder='transformers' for it.")
    keep, normed = resolve_layer(layer, len(decoder.layers))
    config = _target_config(decoder, keep, family)
    from .vllm_models import no_norm_arch

    config.architectures = [CAUSAL_ARCH[family] if normed else no_norm_arch(family)]
    dtype = next(decoder.parameters()).dtype
    config.dtype = dtype
    state = {}
    for name, tensor in decoder.state_dict().items():
        if name.startswith("layers."):
            if int(name.split(".")[1]) >= keep:
                continue
        elif name.startswith("rotary_emb"):
            continue
        state["model." + name] = tensor.detach().to("cpu").contiguous().clone()
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    if tokenizer is None:
        raise AccelError("vLLM loads the tokenizer with the weights: pass the text encoder's tokenizer.")
    tokenizer.save_pretrained(out_dir)
    return out_dir


def needs_export(path: str, layer: int) -> bool:
    """False when vLLM can load ``path`` as it is for ``layer`` (a plain causal LM, last layer)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise AccelError(f"{path!r} has no readable config.json ({exc}); give a checkpoint folder.") from exc
    arch = (cfg.get("architectures") or [""])[0]
    return not (layer == -1 and cfg.get("model_type") in CAUSAL_ARCH and arch.endswith("ForCausalLM"))


def _tokenizer_for(path: str, tokenizer: Any):
    """The tokenizer vLLM needs beside the weights: given, in ``path``, or in a pipeline's ../tokenizer."""
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    for folder in (path, os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer")):
        try:
            return AutoTokenizer.from_pretrained(folder)
        except Exception:  # noqa: BLE001 -- try the next place
            continue
    raise AccelError(f"no tokenizer found in {path!r} or beside it (../tokenizer); pass tokenizer=... .")


def prepare_checkpoint(path: str, layer: int, tokenizer: Any = None) -> tuple[str, str | None]:
    """(folder vLLM loads, temporary folder to delete afterwards or None) for ``path`` and ``layer``."""
    if not needs_export(path, layer):
        return path, None
    from transformers import AutoConfig, AutoModel

    tokenizer = _tokenizer_for(path, tokenizer)

    try:
        config = AutoConfig.from_pretrained(path)
        model = AutoModel.from_pretrained(path, config=config, dtype="auto")
    except Exception as exc:
        raise AccelError(f"could not read {path!r} to prepare it for vLLM ({type(exc).__name__}: {exc}); give a "
                         "checkpoint folder of a decoder-only LLM (or Qwen2.5-VL).") from exc
    tmp = tempfile.mkdtemp(prefix="omni_accel_vllm_")
    try:
        with torch.no_grad():
            export_module(model, layer, tmp, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, tmp
