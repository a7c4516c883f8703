"""Stable Diffusion 3 / 3.5 (SD3Transformer2DModel): MMDiT with two CLIPs and T5."""

from .base import (CacheRegion, KernelSites, ModelAdapter, SequenceInput, SequenceRegion, ShardArg,
                   TeaCacheSpec)

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
    # AdaLN modulation linears (one token per sample) stay bf16 under quant
    quant_skip=("*.norm1.linear", "*.norm1_context.linear"),
    notes=(
        "Batched CFG: with guidance_scale > 1 the pipeline concatenates [uncond, cond] and runs one transformer "
        "forward on batch 2B per step; skip_guidance_layers (SD3.5 SLG) adds a third forward on the steps it "
        "covers. The transformer's last block is context_pre_only (no text output). "
        "TeaCache: transformer_blocks.0.norm1 (AdaLayerNormZero, or SD35AdaLayerNormZeroX for dual-attention "
        "blocks) returns the modulated image tokens as the first element of its output tuple. "
        "text_encoder_3 (T5) is optional; without it the T5 part of the prompt states is zeros."
    ),
    extra={
        # cfg_parallel=2 splits the doubled batch over the two CFG ranks (omni_accel/parallel/cfg.py) when
        # guidance_scale > 1 (do_classifier_free_guidance); an absent negative prompt encodes "" (no refusal)
        "cfg_threshold": 1.0,
        "cfg_needs_negative": False,
        "pos_embed_module": "pos_embed",
        # tp: diffusers has no _tp_plan for SD3; same layout as FLUX.1's dual-stream blocks (SD3.5's attn2 too).
        # Blocks without a module (the context_pre_only last block: no to_add_out / ff_context) are skipped.
        "tp_plan": {
            **{f"transformer_blocks.*.{a}.{p}": "colwise" for a in ("attn", "attn2") for p in ("to_q", "to_k", "to_v")},
            **{f"transformer_blocks.*.{a}.to_out.0": "rowwise" for a in ("attn", "attn2")},
            **{f"transformer_blocks.*.attn.{p}": "colwise" for p in ("add_q_proj", "add_k_proj", "add_v_proj")},
            "transformer_blocks.*.attn.to_add_out": "rowwise",
            **{f"transformer_blocks.*.{ff}.net.0.proj": "colwise" for ff in ("ff", "ff_context")},
            **{f"transformer_blocks.*.{ff}.net.2": "rowwise" for ff in ("ff", "ff_context")},
        },
        # JointAttnProcessor2_0 reshapes by attn.heads: each tp rank holds heads / tp of them (qk-norms are
        # per head, so they need nothing)
        "tp_heads": ("transformer_blocks.*.attn", "transformer_blocks.*.attn2"),
    },
    # kernels=True: AdaLayerNormZero norm1 / norm1_context (the last block's AdaLayerNormContinuous context norm
    # too; SD3.5's SD35AdaLayerNormZeroX norm1 is left alone), the Q/K RMSNorms when qk_norm="rms_norm" (SD3.5),
    # and the output norm
    kernels=(
        KernelSites("transformer_blocks", ("norm1", "norm1_context", "attn.norm_q", "attn.norm_k",
                                           "attn.norm_added_q", "attn.norm_added_k", "attn2.norm_q",
                                           "attn2.norm_k")),
        KernelSites("", ("norm_out",)),
    ),
)
