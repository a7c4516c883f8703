"""FLUX.1 (dev / schnell / Kontext / Fill / Control): FluxTransformer2DModel, an MMDiT of dual-stream blocks followed
by single-stream blocks, with FLUX-style 3-axis RoPE over the concatenated [text, image] sequence."""

from .base import (CacheRegion, JointStreams, KernelSites, ModelAdapter, ModulationPrefetch, ModulationTable,
                   SequenceInput, SequenceRegion, ShardArg, TeaCacheSpec, timestep_per_mille)


def _embedding_args(arguments: dict, timestep) -> tuple:
    """``time_text_embed``'s arguments for rows of the timestep argument, as FluxTransformer2DModel.forward makes
    them: timestep and guidance to the hidden states' dtype times 1000; guidance and pooled text repeated per step."""
    dtype = arguments["hidden_states"].dtype
    steps = timestep.shape[0] // arguments["hidden_states"].shape[0]
    pooled = arguments["pooled_projections"].repeat(steps, 1)
    guidance = arguments.get("guidance")
    if guidance is None:
        return timestep.to(dtype) * 1000, pooled
    return timestep.to(dtype) * 1000, guidance.to(dtype).repeat(steps) * 1000, pooled


ADAPTER = ModelAdapter(
    family="flux",
    description="FLUX.1 text-to-image and editing (FluxTransformer2DModel: dual-stream then single-stream blocks)",
    transformer_classes=("FluxTransformer2DModel",),
    pipeline_classes=(
        "FluxPipeline",
        "FluxImg2ImgPipeline",
        "FluxInpaintPipeline",
        "FluxKontextPipeline",
        "FluxKontextInpaintPipeline",
        "FluxFillPipeline",
        "FluxControlPipeline",
        "FluxControlImg2ImgPipeline",
        "FluxControlInpaintPipeline",
        "FluxControlNetPipeline",
        "FluxControlNetImg2ImgPipeline",
        "FluxControlNetInpaintPipeline",
    ),
    # FluxTransformer2DModel.forward runs every dual-stream block, then every single-stream block.
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    sequence_inputs=(
        # transformer forward (FluxTransformer2DModel._cp_plan splits the same four)
        SequenceInput("hidden_states", dim=1, kind="image"),  # (B, S_img, C) packed 2x2 latents
        SequenceInput("encoder_hidden_states", dim=1, kind="text"),  # (B, S_txt, joint_attention_dim), T5
        SequenceInput("img_ids", dim=0, kind="rope", order=("image",)),  # (S_img, 3) positions of image tokens
        SequenceInput("txt_ids", dim=0, kind="rope", order=("text",)),  # (S_txt, 3) positions of text tokens
        # block forward: both block kinds take the two streams separately (the single-stream block concatenates
        # [text, image] inside and splits again on return); the rotary embedding is computed once in the
        # transformer from cat(txt_ids, img_ids), so it covers text first, then image.
        SequenceInput("hidden_states", dim=1, kind="image", where="block"),
        SequenceInput("encoder_hidden_states", dim=1, kind="text", where="block"),
        SequenceInput("image_rotary_emb", dim=0, kind="rope", where="block", order=("text", "image")),  # (cos, sin)
    ),
    # FLUX.1-dev / Kontext are guidance-distilled (guidance_scale is embedded, one forward per step); FluxPipeline
    # and the img2img/inpaint/Kontext/ControlNet variants also run true CFG (a second, separate forward on the
    # negative prompt) when true_cfg_scale > 1 and a negative prompt is given.
    cfg="distilled",
    cfg_scale_arg="true_cfg_scale",
    negative_prompt_arg="negative_prompt",
    text_encoder_names=("text_encoder", "text_encoder_2"),  # CLIP (pooled) + T5 (sequence)
    # FluxAttnProcessor and FluxIPAdapterAttnProcessor both call dispatch_attention_fn.
    attention_via_dispatcher=True,
    edit_pipelines=("FluxKontextPipeline", "FluxKontextInpaintPipeline"),
    # AdaLayerNormZero of the first dual-stream block: its output[0] is the timestep-modulated image input
    # (the quantity TeaCache measures); coefficients are the published FLUX.1 rescale polynomial.
    teacache=TeaCacheSpec(
        modulated_input="transformer_blocks.0.norm1",
        coefficients=(498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861),
        modulated_args=("hidden_states",),
        modulated_kwargs=(("emb", "temb"),),  # AdaLayerNormZero(x, emb=temb) -> (modulated x, gates...)
        regions=(
            CacheRegion("transformer_blocks", outputs=("encoder_hidden_states", "hidden_states")),
            CacheRegion("single_transformer_blocks", outputs=("encoder_hidden_states", "hidden_states")),
        ),
    ),
    # sp: both block lists take the two streams separately and return (text, image); the rotary table is
    # computed once from cat(txt_ids, img_ids) and passed to every block.
    sequence_parallel=tuple(
        SequenceRegion(
            block_list=blocks,
            args=(
                ShardArg("hidden_states", dim=1, stream="image"),
                ShardArg("encoder_hidden_states", dim=1, stream="text"),
                ShardArg("image_rotary_emb", dim=0, order=("text", "image"), every_block=True),
            ),
            outputs=("text", "image"),
        )
        for blocks in ("transformer_blocks", "single_transformer_blocks")
    ),
    # AdaLN modulation linears (one token per sample) stay bf16 under quant
    quant_skip=("*.norm1.linear", "*.norm1_context.linear", "single_transformer_blocks.*.norm.linear"),
    notes=(
        "Kontext appends the reference-image tokens after the generated image tokens in hidden_states/img_ids "
        "(img_ids of the reference carry first coordinate 1), so the image part of the sequence is "
        "[target, reference] there. Fill and Control use in_channels 384/128 (the condition is concatenated on the "
        "channel dim, not the sequence). True CFG runs only when true_cfg_scale > 1 AND a negative prompt "
        "(or negative_prompt_embeds + negative_pooled_prompt_embeds) is given. The text length is "
        "max_sequence_length (T5 pads to it)."
    ),
    # cache-dit: both block lists take (hidden_states, encoder_hidden_states, temb, ...) and return (text, image),
    # so cache-dit caches them as one list (Fn/Bn count over all blocks) -- see omni_accel/cache/cache_dit_backend.py
    extra={"cfg_threshold": 1.0, "cfg_needs_negative": True, "text_seq_arg": "max_sequence_length",
           "cache_dit_unify": ("transformer_blocks", "single_transformer_blocks")},
    # kernels=True: the AdaLN norms of both block kinds and the output norm, and every Q/K RMSNorm (torch.nn.RMSNorm)
    kernels=(
        KernelSites("transformer_blocks", ("norm1", "norm1_context", "attn.norm_q", "attn.norm_k",
                                           "attn.norm_added_q", "attn.norm_added_k")),
        KernelSites("single_transformer_blocks", ("norm", "attn.norm_q", "attn.norm_k")),
        KernelSites("", ("norm_out",)),
    ),
    # its attention processors call the fused to_qkv / to_kv / to_added_* linears once fuse_projections() ran
    fuse_qkv=True,
    # single-stream blocks return (text, image) as views of their joint output; the first one gets two tensors
    joint_streams=(JointStreams("single_transformer_blocks"),),
    # every block's AdaLayerNormZero(-Single) and norm_out (AdaLayerNormContinuous) run linear(silu(temb)) on the
    # temb that time_text_embed returns
    modulation_prefetch=ModulationPrefetch("time_text_embed", (
        "transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
        "single_transformer_blocks.*.norm.linear", "norm_out.linear"),
        table=ModulationTable(timestep_per_mille, _embedding_args, conditioning=("pooled_projections", "guidance"))),
)
