"""Tiny Wan pipelines, random weights, built offline.

Families: "wan" (Wan 2.1 text-to-video, WanPipeline), "wan_i2v" (Wan 2.1 image-to-video: CLIP vision image encoder,
image_dim + added K/V projections in cross-attention, 36 input channels), "wan22" (Wan 2.2 A14B layout: WanPipeline
with transformer + transformer_2 and boundary_ratio, the experts switching at the second of two steps).

Call overrides: any key of the returned call kwargs (``num_frames=9, height=48, width=16`` gives 3 x 3 x 1 = 9 video
tokens, an odd count); every other key goes to the WanTransformer3DModel config (of both experts for "wan22").
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AccelError
from .tokenizers import tiny_tokenizer

FAMILIES = ("wan", "wan_i2v", "wan22")
TEXT_DIM = 16
PROMPT = "a cat walks on grass"  # 20 bytes + </s> = 21 tokens (odd)
NEGATIVE_PROMPT = "static, blurry"
# WanAttnProcessor splits the I2V context at 512 text tokens (hardcoded), so I2V keeps the full length.
I2V_TEXT_LEN = 512


def _text_encoder(seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=300, d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    return UMT5EncoderModel(config).eval()


def _image_encoder(seed: int):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    try:  # the torchvision-free processor when torchvision is not installed
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:  # pragma: no cover - older transformers
        from transformers import CLIPImageProcessor

    config = CLIPVisionConfig(
        hidden_size=8, projection_dim=8, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=8,
    )
    torch.manual_seed(seed)
    encoder = CLIPVisionModel(config).eval()
    processor = CLIPImageProcessor(crop_size={"height": 32, "width": 32}, size={"shortest_edge": 32})
    return encoder, processor


def build(family: str = "wan", seed: int = 0, **overrides: Any):
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )

    if family not in FAMILIES:
        raise AccelError(f"tiny_wan builds {', '.join(FAMILIES)}, not {family!r}.")
    i2v = family == "wan_i2v"
    call_kwargs: dict[str, Any] = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE_PROMPT,
        guidance_scale=5.0,
        num_inference_steps=2,
        height=32,
        width=32,
        num_frames=5,
        max_sequence_length=I2V_TEXT_LEN if i2v else 21,
        output_type="pt",
    )
    if i2v:
        from PIL import Image

        call_kwargs["image"] = Image.new("RGB", (32, 32), (120, 200, 40))
    transformer_config = dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36 if i2v else 16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )
    if i2v:
        transformer_config.update(image_dim=8, added_kv_proj_dim=24)
    for key, value in overrides.items():
        (call_kwargs if key in call_kwargs else transformer_config)[key] = value
    transformer_config.setdefault("added_kv_proj_dim", None)

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**transformer_config).eval()
    transformer_2 = None
    if family == "wan22":
        torch.manual_seed(seed + 1)  # a second expert with its own weights
        transformer_2 = WanTransformer3DModel(**transformer_config).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    torch.manual_seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    tokenizer = tiny_tokenizer("t5", model_max_length=I2V_TEXT_LEN)
    text_encoder = _text_encoder(seed)
    components = dict(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder,
                      tokenizer=tokenizer)
    if i2v:
        image_encoder, image_processor = _image_encoder(seed)
        pipe = WanImageToVideoPipeline(**components, image_encoder=image_encoder, image_processor=image_processor)
    elif family == "wan22":
        # 2 steps: t = 1000 (>= 0.875 * 1000) runs transformer, the second, low-noise step runs transformer_2
        pipe = WanPipeline(**components, transformer_2=transformer_2, boundary_ratio=0.875)
    else:
        pipe = WanPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe, call_kwargs
