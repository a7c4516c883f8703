"""Tiny random-weight Z-Image pipeline: ``z_image`` (ZImagePipeline, Qwen3 text encoder).

Sizes: transformer dim 32 (2 heads x 16, RoPE axes 4/6/6), 1 noise-refiner + 1 context-refiner + 1 main layer;
Qwen3 of width 16 with 2 layers (the pipeline reads hidden_states[-2]); an AutoencoderKL of 4 levels x 8 channels
(vae_scale_factor 8; the transformer patchifies 2x2, so height/width are multiples of 16 and the image has
(H/16)*(W/16) tokens before Z-Image pads every part to a multiple of 32).

Default call: 32x48 pixels -> 6 image tokens; the caption is the ChatML-templated prompt, 29 tokens (odd; the
empty negative prompt of CFG gives 19); guidance_scale=4.0 runs batched CFG (one forward on a doubled batch per
step). ``height=48, width=80`` gives 15 (odd) image tokens; ``guidance_scale=0.0`` runs without CFG (Turbo).
Overrides: call-kwarg keys replace them; other keys go to the ZImageTransformer2DModel config.
"""

from __future__ import annotations

import torch

from .tokenizers import tiny_tokenizer

PROMPT = "a red fox."  # 10 bytes + 19 template tokens = 29
LATENT_CHANNELS = 4
TEXT_WIDTH = 16


def _qwen3(seed: int, tokenizer):
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=300, hidden_size=TEXT_WIDTH, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3Model(config).eval()


def _vae(seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4,
        sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        shift_factor=0.1159, scaling_factor=0.3611,
    ).eval()


def _transformer(seed: int, **config):
    from diffusers import ZImageTransformer2DModel

    cfg = dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=32, n_layers=1,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=TEXT_WIDTH,
        rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6], axes_lens=[256, 32, 32],
    )
    cfg.update(config)
    torch.manual_seed(seed)
    return ZImageTransformer2DModel(**cfg).eval()


def build(family: str = "z_image", seed: int = 0, **overrides):
    """(pipe, call_kwargs) for ``family`` "z_image" (ZImagePipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    if family != "z_image":
        raise ValueError(f"tiny_z_image builds 'z_image', not {family!r}")
    call_kwargs = dict(
        prompt=PROMPT, num_inference_steps=2, height=32, width=48, guidance_scale=4.0, max_sequence_length=64,
        output_type="pt",
    )
    for key in [k for k in overrides if k in call_kwargs or k in ("negative_prompt", "cfg_truncation")]:
        call_kwargs[key] = overrides.pop(key)

    tokenizer = tiny_tokenizer("qwen2", model_max_length=128)
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(seed),
        text_encoder=_qwen3(seed, tokenizer),
        tokenizer=tokenizer,
        transformer=_transformer(seed, **overrides),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe, call_kwargs
