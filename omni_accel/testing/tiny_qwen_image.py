"""Tiny Qwen-Image pipelines: text-to-image, Edit and Edit-Plus, random weights, built offline.

Families: "qwen_image" (QwenImagePipeline), "qwen_image_edit" (QwenImageEditPipeline, one input image),
"qwen_image_edit_plus" (QwenImageEditPlusPipeline, a list of input images). The Edit pipelines get a real
Qwen2VLProcessor assembled here from a Qwen2VLImageProcessor and the byte-level qwen2 tokenizer, so the vision tower
of the tiny Qwen2.5-VL text encoder runs too.

Call overrides: any key of the returned call kwargs (``height=24, width=40`` gives 3x5 = 15 image tokens, an odd
count; for the Edit families, whose tiny VAE is 16x, ``height=96, width=32`` gives 3 x 1 generated tokens); every other key goes to the QwenImageTransformer2DModel config (e.g. ``num_layers=3``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AccelError
from .tokenizers import tiny_tokenizer

FAMILIES = ("qwen_image", "qwen_image_edit", "qwen_image_edit_plus")
TEXT_DIM = 16
# With the byte-level tokenizer the pipeline's template drops its first 34 (64 for Edit) tokens and keeps the
# rest; this prompt makes the kept text of the text-to-image pipeline an odd number of tokens (143). The negative
# prompt has the same byte length, so cond and uncond forwards share one shape (one compiled graph per block).
PROMPT = "a tiny red fox."
NEGATIVE_PROMPT = "blurry and ugly"


def _image_processor():
    try:  # the torchvision-free image processor when torchvision is not installed
        from transformers import Qwen2VLImageProcessorPil as cls
    except ImportError:  # pragma: no cover - older transformers
        from transformers import Qwen2VLImageProcessor as cls
    # the smallest image Qwen2-VL takes (56 x 56: 4 x 4 patches, 4 vision tokens), whatever the input size
    return cls(min_pixels=56 * 56, max_pixels=56 * 56)


def _processor(tokenizer):
    """A Qwen2VLProcessor for images; without torchvision, one that holds no video processor (none is used)."""
    from transformers import Qwen2VLProcessor

    try:
        return Qwen2VLProcessor(image_processor=_image_processor(), tokenizer=tokenizer,
                                chat_template=tokenizer.chat_template)
    except (AttributeError, ValueError, TypeError):  # the video processor's base class needs torchvision

        class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
            def check_argument_for_proper_class(self, argument_name, argument):
                if argument_name == "video_processor" and argument is None:
                    return None
                return super().check_argument_for_proper_class(argument_name, argument)

        return ImageOnlyQwen2VLProcessor(image_processor=_image_processor(), tokenizer=tokenizer,
                                         chat_template=tokenizer.chat_template)


def tiny_qwen25_vl(tokenizer, seed: int = 0, width: int = TEXT_DIM, heads: int = 2, kv_heads: int = 2,
                   intermediate: int = 32, num_layers: int = 1, vocab: int = 300,
                   mrope_section: tuple[int, int, int] = (1, 1, 2)):
    """A tiny random Qwen2.5-VL (text tower + a one-layer vision tower), as Qwen-Image holds.

    ``mrope_section`` must add up to half the head size (``width // heads // 2``).
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": width,
            "intermediate_size": intermediate,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "vocab_size": vocab,
            "max_position_embeddings": 2048,
            "rope_scaling": {"mrope_section": list(mrope_section), "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": width},
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build(family: str = "qwen_image", seed: int = 0, **overrides: Any):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    if family not in FAMILIES:
        raise AccelError(f"tiny_qwen_image builds {', '.join(FAMILIES)}, not {family!r}.")
    edit = family != "qwen_image"
    call_kwargs: dict[str, Any] = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE_PROMPT,
        true_cfg_scale=4.0,
        num_inference_steps=2,
        height=64 if edit else 32,
        width=64 if edit else 32,
        max_sequence_length=512,
        output_type="pt",
    )
    if edit:
        from PIL import Image

        image = Image.new("RGB", (32, 32), (200, 60, 30))
        call_kwargs["image"] = [image, Image.new("RGB", (32, 32), (20, 90, 180))] if family.endswith("plus") else image
    transformer_config = dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_DIM, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    for key, value in overrides.items():
        (call_kwargs if key in call_kwargs else transformer_config)[key] = value

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**transformer_config).eval()
    torch.manual_seed(seed)
    z_dim = 4
    if edit:
        # The Edit pipelines resize every input image to ~1024 x 1024 for the VAE and append its latents to the
        # sequence; a 16x VAE keeps that at 32 x 32 packed reference tokens, and 4 channels with no residual
        # blocks keep the megapixel encode under a second.
        vae_shape = dict(base_dim=4, dim_mult=[1, 1, 1, 1, 1], temperal_downsample=[False, False, True, True],
                         num_res_blocks=0)
    else:
        vae_shape = dict(base_dim=z_dim * 6, dim_mult=[1, 2, 4], temperal_downsample=[False, True], num_res_blocks=1)
    vae = AutoencoderKLQwenImage(
        z_dim=z_dim, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim, **vae_shape
    ).eval()
    torch.manual_seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler()
    tokenizer = tiny_tokenizer("qwen2", model_max_length=2048)
    text_encoder = tiny_qwen25_vl(tokenizer, seed)
    components = dict(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder,
                      tokenizer=tokenizer)
    if family == "qwen_image":
        pipe = QwenImagePipeline(**components)
    else:
        components["processor"] = _processor(tokenizer)
        cls = QwenImageEditPlusPipeline if family.endswith("plus") else QwenImageEditPipeline
        pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe, call_kwargs
