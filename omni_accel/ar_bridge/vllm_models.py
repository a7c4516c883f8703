"""vLLM architectures that end without the final norm, for hidden states of an inner layer.

transformers' ``hidden_states[-2]`` (what Z-Image feeds its DiT) is the output of the next-to-last decoder layer,
*before* any norm. vLLM returns only its model's last output, which passes through the final RMSNorm -- and an
RMSNorm is not the identity for any weight (it divides by the token's RMS). So export.py saves a copy of the LLM
cut to the wanted layer with ``architectures = ["OmniAccel<Base>NoNormForCausalLM"]``, and these classes -- the
stock vLLM models with the final norm's forward replaced by the residual add it fuses -- run it. The norm keeps
its parameter, so the checkpoint loads unchanged. Registered in-process (the engine core runs in this process).
"""

from __future__ import annotations

import functools

BASES = {  # export family -> (vLLM module, class)
    "qwen2": ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM"),
    "llama": ("vllm.model_executor.models.llama", "LlamaForCausalLM"),
}


def no_norm_arch(family: str) -> str:
    return f"OmniAccel{BASES[family][1].replace('ForCausalLM', '')}NoNormForCausalLM"


def _identity_norm_class(norm_cls):
    class IdentityFinalNorm(norm_cls):
        """The final norm's place, computing only the fused residual add: out = x (+ residual)."""

        def forward(self, x, residual=None):  # noqa: D401 -- same signature as vLLM's RMSNorm
            if residual is None:
                return x
            out = x + residual
            return out, out

    return IdentityFinalNorm


def _make(base_cls):
    class NoNorm(base_cls):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            norm = getattr(self.model, "norm", None)
            if norm is not None and type(norm).__name__ != "PPMissingLayer":
                norm.__class__ = _identity_norm_class(type(norm))

    NoNorm.__name__ = NoNorm.__qualname__ = "OmniAccel" + base_cls.__name__.replace("ForCausalLM", "NoNormForCausalLM")
    return NoNorm


@functools.cache  # once per process
def register_models() -> None:
    """Register the no-final-norm architectures with vLLM's model registry (once per process)."""
    import importlib

    from vllm import ModelRegistry

    for family, (module, name) in BASES.items():
        base = getattr(importlib.import_module(module), name)
        ModelRegistry.register_model(no_norm_arch(family), _make(base))
