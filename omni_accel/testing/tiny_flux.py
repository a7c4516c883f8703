"""Tiny random-weight FLUX.1 pipelines: ``flux`` (FluxPipeline) and ``flux_kontext`` (FluxKontextPipeline).

Sizes: transformer inner dim 32 (2 heads x 16), 1 dual-stream + 1 single-stream block, guidance-embedded like
FLUX.1-dev; CLIP and T5 encoders of width 32 with 1 layer; a 4-level VAE of 8 channels (vae_scale_factor 8, as
in the real model, so height/width must be multiples of 16 and the image has (H/16)*(W/16) tokens).

Default call: 32x48 pixels -> 2*3 = 6 image tokens; text length = max_sequence_length = 11 (odd). Pass
``height=48, width=80`` for an odd image token count (3*5 = 15).
Overrides: keys of the call kwargs (and ``image``, ``negative_prompt``, ``true_cfg_scale``) replace / extend them;
any other key goes to the FluxTransformer2DModel config (e.g. ``num_layers=2``). ``flux_kontext`` adds a random
reference image of the output size, ``max_area`` = height*width and ``_auto_resize=False`` so no resizing happens.
"""

from __future__ import annotations

import numpy as np
import torch

from .tokenizers import tiny_tokenizer

PROMPT = "a red fox"  # 9 bytes: T5 10 tokens with </s>, padded to max_sequence_length 11
LATENT_CHANNELS = 4


def _text_encoders(seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = tiny_tokenizer("clip", model_max_length=16)
    tokenizer_2 = tiny_tokenizer("t5", model_max_length=64)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=300, hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=16, projection_dim=32, hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    torch.manual_seed(seed)
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=300, d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4, relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
        )
    ).eval()
    return text_encoder, tokenizer, text_encoder_2, tokenizer_2


def _vae(seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4,
        sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    ).eval()


def _transformer(seed: int, **config):
    from diffusers import FluxTransformer2DModel

    cfg = dict(
        patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    cfg.update(config)
    torch.manual_seed(seed)
    return FluxTransformer2DModel(**cfg).eval()


def _image(height: int, width: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def build(family: str = "flux", seed: int = 0, **overrides):
    """(pipe, call_kwargs) for ``family`` "flux" (FluxPipeline) or "flux_kontext" (FluxKontextPipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline

    if family not in ("flux", "flux_kontext"):
        raise ValueError(f"tiny_flux builds 'flux' or 'flux_kontext', not {family!r}")
    call_kwargs = dict(
        prompt=PROMPT, num_inference_steps=2, height=32, width=48, guidance_scale=3.5, max_sequence_length=11,
        output_type="pt",
    )
    if family == "flux_kontext":
        # max_area = height*width keeps the requested size (Kontext otherwise rescales to ~1 MPixel), and
        # _auto_resize=False keeps the reference image at its own size instead of a preferred Kontext resolution.
        call_kwargs.update(_auto_resize=False)
    for key in [k for k in overrides if k in call_kwargs or k in ("image", "negative_prompt", "true_cfg_scale")]:
        call_kwargs[key] = overrides.pop(key)
    if family == "flux_kontext":
        call_kwargs["max_area"] = call_kwargs["height"] * call_kwargs["width"]
        call_kwargs.setdefault("image", _image(call_kwargs["height"], call_kwargs["width"], seed))

    text_encoder, tokenizer, text_encoder_2, tokenizer_2 = _text_encoders(seed)
    components = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=_transformer(seed, **overrides),
        image_encoder=None,
        feature_extractor=None,
    )
    cls = FluxKontextPipeline if family == "flux_kontext" else FluxPipeline
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe, call_kwargs
