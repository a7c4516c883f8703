"""Seeded random LoRA adapters for the tiny pipelines (what a trained adapter looks like, in diffusers' format)."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

# suffixes of the linears diffusers' LoRA training scripts target in DiT attention / feed-forward layers
DEFAULT_TARGETS = ("*attn.to_q", "*attn.to_k", "*attn.to_v", "*attn.to_out.0", "*attn.add_q_proj",
                   "*attn.add_k_proj", "*attn.add_v_proj", "*attn.to_add_out", "*ff.net.2")


def random_lora(pipe: Any, rank: int = 4, seed: int = 0, std: float = 0.2,
                targets: tuple[str, ...] = DEFAULT_TARGETS, component: str = "transformer") -> dict[str, torch.Tensor]:
    """A state dict ``pipe.load_lora_weights`` takes: ``lora_A`` / ``lora_B`` of rank ``rank`` for every linear of
    ``pipe.<component>`` matching ``targets``, both random (a fresh peft adapter has B = 0: no effect to test)."""
    generator = torch.Generator().manual_seed(seed)
    model = getattr(pipe, component)
    state = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not any(fnmatch.fnmatchcase(name, t) for t in targets):
            continue
        dtype = module.weight.dtype
        a = torch.randn(rank, module.in_features, generator=generator) * std
        b = torch.randn(module.out_features, rank, generator=generator) * std
        state[f"{component}.{name}.lora_A.weight"] = a.to(dtype)
        state[f"{component}.{name}.lora_B.weight"] = b.to(dtype)
    if not state:
        raise ValueError(f"no linear of pipe.{component} matches {targets}")
    return state
