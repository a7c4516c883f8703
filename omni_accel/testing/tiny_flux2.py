"""Tiny random-weight FLUX.2 pipelines: ``flux2`` (Flux2Pipeline, Mistral3 text encoder, guidance-distilled) and
``flux2_klein`` (Flux2KleinPipeline, Qwen3 text encoder, true CFG with two forwards per step when
guidance_scale > 1).

Sizes: transformer inner dim 32 (2 heads x 16, 4-axis RoPE of 4 each), 1 dual-stream + 1 single-stream block;
text encoders of width 16 with 3 layers, whose hidden states 1, 2, 3 are stacked (joint_attention_dim 48, via the
pipelines' ``text_encoder_out_layers`` call argument); an AutoencoderKLFlux2 of 4 levels x 8 channels
(vae_scale_factor 8: height/width multiples of 16, (H/16)*(W/16) image tokens).

Offline notes: Flux2Pipeline's tokenizer is a Pixtral AutoProcessor in the real model; here it is the byte-level
ChatML tokenizer of ``tiny_tokenizer("qwen2")``, which serves the pipeline's batched ``apply_chat_template`` call
(text-only prompts; reference images still go through the VAE, not the processor). Its system message is shortened
on the instance (``pipe.system_message``) so the prompt fits a small ``max_sequence_length``.

Default call: 32x48 pixels -> 6 image tokens; text length = max_sequence_length (41 for flux2, 31 for flux2_klein,
both odd). ``height=48, width=80`` gives 15 (odd) image tokens.
Overrides: call-kwarg keys (and ``image``, ``negative_prompt_embeds``) replace / extend them; ``is_distilled``
goes to Flux2KleinPipeline; other keys go to the Flux2Transformer2DModel config. Reference images must be >= 64 px.
``flux2_klein`` is not in ``TINY_BUILDERS``; build it with ``omni_accel.testing.tiny_flux2.build("flux2_klein")``.
"""

from __future__ import annotations

import torch

from .tokenizers import tiny_tokenizer

PROMPT = "a red fox"
SYSTEM_MESSAGE = "Be exact."
LATENT_CHANNELS = 2
TEXT_WIDTH = 16
TEXT_LAYERS = 3


def _mistral3(seed: int, tokenizer):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=300, hidden_size=TEXT_WIDTH, intermediate_size=37,
            num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            max_position_embeddings=128, rms_norm_eps=1e-5, sliding_window=None,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(
            model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
            image_size=32, patch_size=8, num_channels=3, head_dim=8,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(config).eval()


def _qwen3(seed: int, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=300, hidden_size=TEXT_WIDTH, intermediate_size=37, num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def _vae(seed: int):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    return AutoencoderKLFlux2(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4,
        sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
    ).eval()


def _transformer(seed: int, guidance_embeds: bool, **config):
    from diffusers import Flux2Transformer2DModel

    cfg = dict(
        patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds,
    )
    cfg.update(config)
    torch.manual_seed(seed)
    return Flux2Transformer2DModel(**cfg).eval()


def build(family: str = "flux2", seed: int = 0, **overrides):
    """(pipe, call_kwargs) for ``family`` "flux2" (Flux2Pipeline) or "flux2_klein" (Flux2KleinPipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

    if family not in ("flux2", "flux2_klein"):
        raise ValueError(f"tiny_flux2 builds 'flux2' or 'flux2_klein', not {family!r}")
    klein = family == "flux2_klein"
    call_kwargs = dict(
        prompt=PROMPT, num_inference_steps=2, height=32, width=48, guidance_scale=4.0,
        max_sequence_length=31 if klein else 41, text_encoder_out_layers=(1, 2, 3), output_type="pt",
    )
    for key in [k for k in overrides if k in call_kwargs or k in ("image", "negative_prompt_embeds")]:
        call_kwargs[key] = overrides.pop(key)
    is_distilled = overrides.pop("is_distilled", False)

    tokenizer = tiny_tokenizer("qwen2", model_max_length=128)
    text_encoder = (_qwen3 if klein else _mistral3)(seed, tokenizer)
    components = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_transformer(seed, guidance_embeds=not klein, **overrides),
    )
    if klein:
        pipe = Flux2KleinPipeline(**components, is_distilled=is_distilled)
    else:
        pipe = Flux2Pipeline(**components)
        pipe.system_message = SYSTEM_MESSAGE
    pipe.set_progress_bar_config(disable=True)
    return pipe, call_kwargs
