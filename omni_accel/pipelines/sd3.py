"""Stable Diffusion 3 / 3.5 (SD3Transformer2DModel): MMDiT with two CLIPs and T5."""

from .base import CacheRegion, SequenceRegion, ShardArg, ModelAdapter, SequenceInput, TeaCacheSpec

ADAPTER = ModelAdapter(
    family="sd3",
    description="Stable Diffusion 3 / 3.5 text-to-image (joint-attention MMDiT, CLIP-L + CLIP-G + T5-XXL)",
    transformer_classes=("SD3Transformer2DModel",),
    pipeline_classes=(
        "StableDiffusion3Pipeline",
        "StableDiffusion3Img2ImgPipeline",
        "StableDiffusion3InpaintPipeline",
    ),
    block_lists=("transformer_blocks",),
    sequence_inputs=(
        # transformer forward: the latent image [B, C, H, W] (tokens are H/2 x W/2 after PatchEmbed; dim 2 is the
        # row axis, the outer token axis) and the joint CLIP+T5 states [B, 77 + T5 length, 4096]
        SequenceInput("hidden_states", dim=2, kind="image"),
        SequenceInput("encoder_hidden_states", dim=1, kind="text"),
        # every block: image tokens [B, S_img, dim] and text tokens [B, S_txt, dim]; no rotary embedding
        # (absolute sin-cos positions are added once in pos_embed)
        SequenceInput("hidden_states", dim=1, kind="image", where="block"),
        SequenceInput("encoder_hidden_states", dim=1, kind="text", where="block"),
    ),
    cfg="batched_cfg",
    cfg_scale_arg="guidance_scale",
    negative_prompt_arg="negative_prompt",
    transformer_names=("transformer",),
    text_encoder_names=("text_encoder", "text_encoder_2", "text_encoder_3"),
    vae_name="vae",
    # JointAttnProcessor2_0 (and the SD3.5 dual-attention attn2) call F.scaled_dot_product_attention directly
    attention_via_dispatcher=False,
    edit_pipelines=(),
    # the last block (context_pre_only) returns (None, hidden_states): TeaCache keeps the None on reuse
    teacache=TeaCacheSpec(
        modulated_input="transformer_blocks.0.norm1",
        coefficients=(),
        modulated_args=("hidden_states",),
        modulated_kwargs=(("emb", "temb"),),
        regions=(CacheRegion("transformer_blocks", outputs=("encoder_hidden_states", "hidden_states")),),
    ),
    # sp: joint attention over cat(image, text) without rotary embeddings; the last block (context_pre_only)
    # returns None for the text stream.
    sequence_parallel=(
        SequenceRegion(
            block_list="transformer_blocks",
            args=(
                ShardArg("hidden_states", dim=1, stream="image"),
                ShardArg("encoder_hidden_states", dim=1, stream="text"),
            ),
            outputs=("text", "image"),
        ),
    ),
    notes=(
        "Batched CFG: with guidance_scale > 1 the pipeline concatenates [uncond, cond] and runs one transformer "
        "forward on batch 2B per step; skip_guidance_layers (SD3.5 SLG) adds a third forward on the steps it "
        "covers. The transformer's last block is context_pre_only (no text output). "
        "TeaCache: transformer_blocks.0.norm1 (AdaLayerNormZero, or SD35AdaLayerNormZeroX for dual-attention "
        "blocks) returns the modulated image tokens as the first element of its output tuple. "
        "text_encoder_3 (T5) is optional; without it the T5 part of the prompt states is zeros."
    ),
    extra={"pos_embed_module": "pos_embed"},
)
