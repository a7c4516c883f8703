"""Tiny Stable Diffusion 3 pipeline ("sd3"), random weights, built offline: CLIP-L + CLIP-G stand-ins + T5.

Call overrides: any key of the returned call kwargs (``height=12, width=20`` gives 3 x 5 = 15 image tokens, an odd
count); every other key goes to the SD3Transformer2DModel config (e.g. ``num_layers=3``,
``dual_attention_layers=(0,)`` for the SD3.5 block layout).
The text sequence is 77 CLIP tokens + ``max_sequence_length`` T5 tokens (77 + 16 = 93 by default, odd).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AccelError
from .tokenizers import tiny_tokenizer

FAMILIES = ("sd3",)
CLIP_DIM = 32
T5_DIM = 2 * CLIP_DIM  # the two CLIP states are concatenated and zero-padded to the T5 width
PROMPT = "a tiny red fox"
NEGATIVE_PROMPT = "blurry"


def _clip(tokenizer, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=300, hidden_size=CLIP_DIM, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, projection_dim=CLIP_DIM, hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(config).eval()


def _t5(seed: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=300, d_model=T5_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval()


def build(family: str = "sd3", seed: int = 0, **overrides: Any):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    if family not in FAMILIES:
        raise AccelError(f"tiny_sd3 builds {', '.join(FAMILIES)}, not {family!r}.")
    call_kwargs: dict[str, Any] = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE_PROMPT,
        guidance_scale=5.0,
        num_inference_steps=2,
        height=32,
        width=32,
        max_sequence_length=16,
        output_type="pt",
    )
    transformer_config = dict(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=T5_DIM, caption_projection_dim=32, pooled_projection_dim=2 * CLIP_DIM, out_channels=4,
        pos_embed_max_size=16,
    )
    for key, value in overrides.items():
        (call_kwargs if key in call_kwargs else transformer_config)[key] = value

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(**transformer_config).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1, latent_channels=4,
        norm_num_groups=2, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
        scaling_factor=1.5035,
    ).eval()
    torch.manual_seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    clip_tokenizer = tiny_tokenizer("clip", model_max_length=77)
    text_encoder = _clip(clip_tokenizer, seed)
    text_encoder_2 = _clip(clip_tokenizer, seed + 1)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tiny_tokenizer("clip", model_max_length=77),
        text_encoder_3=_t5(seed), tokenizer_3=tiny_tokenizer("t5", model_max_length=256),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe, call_kwargs
