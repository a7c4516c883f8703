"""Tiny random LLMs and pipelines whose text encoders vLLM can load (head size >= 32), built offline.

    path = save_tiny_llm(tmp_path / "llm", arch="qwen3")   # config.json + model.safetensors + tokenizer
    pipe, kwargs = tiny_pipeline_for_vllm("z_image")        # the tiny pipeline with a 64-wide Qwen3 encoder

The stock tiny pipelines (omni_accel.testing) have 16-wide text encoders with head size 8, below vLLM's minimum;
these swap in encoders of width 64 (2 heads x 32) and widen the transformer's text input to match.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..testing.tokenizers import tiny_tokenizer

WIDTH = 64
HEADS = 2
HEAD_DIM = 32
VOCAB = 320  # the byte-level qwen2 tokenizer has 263 tokens


def _qwen_config(arch: str, tokenizer, *, hidden_size=WIDTH, num_layers=2, heads=HEADS, kv_heads=1,
                 head_dim=HEAD_DIM, intermediate_size=128, max_position_embeddings=2048):
    from transformers import Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_position_embeddings, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    if arch == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    if arch == "qwen2":
        if hidden_size != heads * head_dim:
            raise ValueError("qwen2 has head_dim = hidden_size / num_attention_heads")
        return Qwen2Config(**common)
    raise ValueError(f"arch={arch!r}: use 'qwen2' or 'qwen3'")


def save_tiny_llm(path: str | os.PathLike, arch: str = "qwen2", seed: int = 0, **sizes: Any) -> str:
    """Write a tiny random causal LM (``arch`` "qwen2" or "qwen3", head size 32) and its byte-level tokenizer."""
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    tokenizer = tiny_tokenizer("qwen2", model_max_length=sizes.get("max_position_embeddings", 2048))
    config = _qwen_config(arch, tokenizer, **sizes)
    torch.manual_seed(seed)
    model = (Qwen3ForCausalLM if arch == "qwen3" else Qwen2ForCausalLM)(config).eval()
    path = str(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_qwen25_vl(tokenizer, seed: int = 0, num_layers: int = 2):
    """A Qwen2.5-VL text encoder of width 64 (2 heads x 32: vLLM needs head size >= 32), as Qwen-Image holds."""
    from ..testing.tiny_qwen_image import tiny_qwen25_vl as build

    return build(tokenizer, seed, width=WIDTH, heads=HEADS, kv_heads=1, intermediate=128, num_layers=num_layers,
                 vocab=VOCAB, mrope_section=(4, 6, 6))


def tiny_qwen3(tokenizer, seed: int = 0, num_layers: int = 3):
    """A bare Qwen3Model of width 64 (2 heads x 32), as Z-Image holds."""
    from transformers import Qwen3Model

    torch.manual_seed(seed)
    return Qwen3Model(_qwen_config("qwen3", tokenizer, num_layers=num_layers, max_position_embeddings=512)).eval()


def tiny_pipeline_for_vllm(family: str, seed: int = 0, **overrides: Any) -> tuple[Any, dict]:
    """omni_accel.testing.tiny_pipeline(family) with a vLLM-loadable text encoder (families: qwen_image, z_image)."""
    from ..testing import tiny_pipeline

    if family == "qwen_image":
        pipe, kwargs = tiny_pipeline("qwen_image", seed=seed, joint_attention_dim=WIDTH, **overrides)
        pipe.register_modules(text_encoder=tiny_qwen25_vl(pipe.tokenizer, seed))
    elif family == "z_image":
        pipe, kwargs = tiny_pipeline("z_image", seed=seed, cap_feat_dim=WIDTH, **overrides)
        pipe.register_modules(text_encoder=tiny_qwen3(pipe.tokenizer, seed))
    else:
        raise ValueError(f"family={family!r}: tiny vLLM-loadable pipelines exist for qwen_image and z_image")
    return pipe, kwargs
