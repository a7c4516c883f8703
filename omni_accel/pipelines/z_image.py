"""Z-Image (Turbo / base / Omni): ZImageTransformer2DModel, a single-stream DiT. Image tokens and caption tokens are
first refined separately (noise_refiner, context_refiner), then concatenated into one sequence for the main
``layers``; 3-axis RoPE as complex ``freqs_cis``."""

from .base import (CacheRegion, KernelSites, ModelAdapter, SequenceInput, SequenceRegion, ShardArg,
                   TeaCacheSpec)

ADAPTER = ModelAdapter(
    family="z_image",
    description="Z-Image text-to-image, img2img, inpaint, ControlNet and Omni editing (ZImageTransformer2DModel)",
    transformer_classes=("ZImageTransformer2DModel",),
    pipeline_classes=(
        "ZImagePipeline",
        "ZImageImg2ImgPipeline",
        "ZImageInpaintPipeline",
        "ZImageControlNetPipeline",
        "ZImageControlNetInpaintPipeline",
        "ZImageOmniPipeline",
    ),
    # Execution order of ZImageTransformer2DModel.forward. siglip_refiner exists only when the model is built with
    # siglip_feat_dim (Omni); it is None otherwise and blocks_of() skips it (see extra["optional_block_lists"]).
    block_lists=("noise_refiner", "context_refiner", "siglip_refiner", "layers"),
    sequence_inputs=(
        # transformer forward: x and cap_feats are LISTS of per-sample tensors without a batch dim.
        # x[i]: (C, F=1, H, W) latent; its tokens are the 2x2 patches in row-major (F, H, W) order, so dim 2 (H)
        # is the sequence axis to split on (in steps of patch_size). cap_feats[i]: (L_i, cap_feat_dim), unpadded.
        SequenceInput("x", dim=2, kind="image"),
        SequenceInput("cap_feats", dim=0, kind="text"),
        # block forward (positional: x, attn_mask, freqs_cis, adaln_input, noise_mask, ...). In `layers` x is the
        # unified sequence [image, text] (Omni: [text, image, siglip]), each part padded to a multiple of 32;
        # in the refiners it is the image-only (noise_refiner) or text-only (context_refiner) sequence.
        SequenceInput("x", dim=1, kind="image", where="block"),
        SequenceInput("freqs_cis", dim=1, kind="rope", where="block", order=("image", "text")),
        SequenceInput("attn_mask", dim=1, kind="mask", where="block"),  # (B, S) bool, None when no padding
        SequenceInput("noise_mask", dim=1, kind="mask", where="block"),  # Omni only: per-token noisy/clean
    ),
    # One transformer forward per step on a doubled batch (latents.repeat(2), prompt + negative embeddings) when
    # guidance_scale > 0 -- note the threshold is 0, not 1; Z-Image-Turbo runs with guidance_scale=0.0.
    cfg="batched_cfg",
    cfg_scale_arg="guidance_scale",
    negative_prompt_arg="negative_prompt",
    text_encoder_names=("text_encoder",),  # Qwen3 (hidden_states[-2])
    # ZSingleStreamAttnProcessor calls dispatch_attention_fn (on the classic Attention module).
    attention_via_dispatcher=True,
    edit_pipelines=("ZImageOmniPipeline",),
    # AdaLN is applied inline (attention_norm1(x) * (1 + scale)); attention_norm1 of the first main layer is the
    # nearest module to the modulated input of the joint sequence. Coefficients: to be calibrated.
    # TeaCache skips only the main `layers` (the refiners are a few blocks and run on every step); layers take and
    # return the unified sequence x (called positionally; matched by the block signature).
    teacache=TeaCacheSpec(
        modulated_input="layers.0.attention_norm1",
        coefficients=(),
        modulated_args=("x",),
        regions=(CacheRegion("layers", outputs=("x",)),),
    ),
    # sp: only the main `layers` run on shards (the refiners see the streams before Z-Image pads and concatenates
    # them); layers are called positionally (x, attn_mask, freqs_cis, adaln_input[, noise_mask, ...]) on the
    # unified sequence, which is split as one joint stream with its mask and rotary table.
    sequence_parallel=(
        SequenceRegion(
            block_list="layers",
            args=(
                ShardArg("x", dim=1, stream="joint", position=0),
                ShardArg("attn_mask", dim=1, stream="joint", position=1, every_block=True),
                ShardArg("freqs_cis", dim=1, stream="joint", position=2, every_block=True),
                ShardArg("noise_mask", dim=1, stream="joint", position=4, every_block=True),
            ),
            outputs=("joint",),
        ),
    ),
    # AdaLN modulation linears (one token per sample) stay bf16 under quant
    quant_skip=("*.adaLN_modulation.0",),
    notes=(
        "Only `noise_refiner` and `layers` are timestep-modulated (context_refiner and siglip_refiner are not). "
        "Every part of the sequence (image patches, caption tokens) is padded to a multiple of 32 "
        "(SEQ_MULTI_OF) with learned pad tokens; the caption length is the true token count of the chat-templated "
        "prompt (no max-length padding). CFG doubles the batch of the single forward; cfg_truncation can turn it "
        "off for late steps. The transformer returns a list of per-sample outputs."
    ),
    extra={
        "cfg_threshold": 0.0,
        "optional_block_lists": ("siglip_refiner",),
        "modulated_block_lists": ("noise_refiner", "layers"),
        "unified_order": {"default": ("image", "text"), "ZImageOmniPipeline": ("text", "image", "siglip")},
        "seq_multiple_of": 32,
        # tp: diffusers has no _tp_plan for Z-Image. Every block (refiners and main layers) splits its attention by
        # heads and its SwiGLU FFN (w2(silu(w1 x) * w3 x)) by hidden units; the qk-norms are per head. The FFN
        # width is int(dim / 3 * 8), which must divide by tp.
        "tp_plan": {
            f"{blocks}.*.{path}": style
            for blocks in ("noise_refiner", "context_refiner", "siglip_refiner", "layers")
            for path, style in (("attention.to_q", "colwise"), ("attention.to_k", "colwise"),
                                ("attention.to_v", "colwise"), ("attention.to_out.0", "rowwise"),
                                ("feed_forward.w1", "colwise"), ("feed_forward.w3", "colwise"),
                                ("feed_forward.w2", "rowwise"))
        },
        # ZSingleStreamAttnProcessor unflattens by attn.heads: the local head count under tp
        "tp_heads": tuple(f"{b}.*.attention" for b in ("noise_refiner", "context_refiner", "siglip_refiner", "layers")),
        # ar_bridge text-encoder stage: the method it shadows; the user turn in the chat template (thinking on),
        # hidden_states[-2] (the next-to-last layer's output, no final norm), unpadded per prompt.
        "text_encoder_bridge": {
            "style": "z_image", "method": "_encode_prompt", "pipelines": ("ZImagePipeline",), "layer": -2,
            "chat_kwargs": {"enable_thinking": True},
        },
    },
    # kernels=True: the Q/K RMSNorms and the four block RMSNorms (diffusers RMSNorm); the blocks scale inline and
    # the final layer modulates inline (no module to fuse)
    kernels=tuple(
        KernelSites(blocks, ("attention.norm_q", "attention.norm_k", "attention_norm1", "attention_norm2",
                             "ffn_norm1", "ffn_norm2"))
        for blocks in ("noise_refiner", "context_refiner", "siglip_refiner", "layers")
    ),
)
