"""FLUX.2 (dev and Klein): Flux2Transformer2DModel, dual-stream blocks then parallel single-stream blocks with
shared (per block kind) AdaLN modulation and 4-axis RoPE over the concatenated [text, image] sequence."""

from .base import (CacheRegion, KernelSites, ModelAdapter, SequenceInput, SequenceRegion, ShardArg,
                   TeaCacheSpec)

ADAPTER = ModelAdapter(
    family="flux2",
    description="FLUX.2 dev / Klein text-to-image and multi-reference editing (Flux2Transformer2DModel)",
    transformer_classes=("Flux2Transformer2DModel",),
    pipeline_classes=(
        "Flux2Pipeline",  # FLUX.2-dev: Mistral3 text encoder, guidance-distilled
        "Flux2KleinPipeline",  # FLUX.2-klein: Qwen3 text encoder, true CFG unless is_distilled
        "Flux2KleinInpaintPipeline",
        "Flux2KleinKVPipeline",  # reference-image K/V cached across steps (kv_cache_mode)
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    sequence_inputs=(
        # transformer forward (Flux2Transformer2DModel._cp_plan: ids are batched (B, S, 4), split on dim 1)
        SequenceInput("hidden_states", dim=1, kind="image"),  # (B, S_img [+ S_ref], C)
        SequenceInput("encoder_hidden_states", dim=1, kind="text"),  # (B, S_txt, 3 * LLM hidden)
        SequenceInput("img_ids", dim=1, kind="rope", order=("image",)),  # (B, S_img, 4) (t, h, w, l)
        SequenceInput("txt_ids", dim=1, kind="rope", order=("text",)),  # (B, S_txt, 4)
        # dual-stream block forward: separate streams; the rotary embedding is (cos, sin), each (S_txt + S_img, D),
        # built as cat(text, image). Single-stream blocks receive hidden_states = cat(text, image) on dim 1 and
        # encoder_hidden_states=None (see extra).
        SequenceInput("hidden_states", dim=1, kind="image", where="block"),
        SequenceInput("encoder_hidden_states", dim=1, kind="text", where="block"),
        SequenceInput("image_rotary_emb", dim=0, kind="rope", where="block", order=("text", "image")),
    ),
    # Flux2Pipeline (FLUX.2-dev) embeds guidance_scale and runs one forward per step. The Klein pipelines differ:
    # see extra["cfg_by_pipeline"].
    cfg="distilled",
    cfg_scale_arg=None,
    negative_prompt_arg=None,  # no pipeline of the family takes a negative prompt string
    text_encoder_names=("text_encoder",),
    # Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor and the KV variants all call dispatch_attention_fn.
    attention_via_dispatcher=True,
    # Every FLUX.2 pipeline takes optional reference images (`image=`), appended as extra image tokens.
    edit_pipelines=("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinKVPipeline"),
    multi_reference_pipelines=("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinKVPipeline"),
    min_reference_side=64,  # Flux2Pipeline.check_inputs: "Both dimensions must be at least 64px"
    # FLUX.2 applies AdaLN inline ((1 + scale) * norm1(x) + shift, the modulation coming from the shared
    # double_stream_modulation_img), so no module outputs the modulated input; norm1 of the first dual-stream
    # block (parameter-free LayerNorm of the image stream) is the nearest hook point. Coefficients: calibrate.
    # TeaCache regions: the dual-stream blocks return (text, image); the single-stream blocks take and return the
    # joint sequence as hidden_states (the concatenation in between is linear, so per-region residuals add up to
    # the whole-transformer residual).
    teacache=TeaCacheSpec(
        modulated_input="transformer_blocks.0.norm1",
        coefficients=(),
        modulated_args=("hidden_states",),
        regions=(
            CacheRegion("transformer_blocks", outputs=("encoder_hidden_states", "hidden_states")),
            CacheRegion("single_transformer_blocks", outputs=("hidden_states",)),
        ),
    ),
    # sp: dual-stream blocks split both streams and the [text, image] rotary table part by part; the transformer
    # then concatenates the gathered streams, and the single-stream blocks split that joint sequence (and the joint
    # rotary table) evenly, returning the joint sequence.
    sequence_parallel=(
        SequenceRegion(
            block_list="transformer_blocks",
            args=(
                ShardArg("hidden_states", dim=1, stream="image"),
                ShardArg("encoder_hidden_states", dim=1, stream="text"),
                ShardArg("image_rotary_emb", dim=0, order=("text", "image"), every_block=True),
            ),
            outputs=("text", "image"),
        ),
        SequenceRegion(
            block_list="single_transformer_blocks",
            args=(
                ShardArg("hidden_states", dim=1, stream="joint"),
                ShardArg("image_rotary_emb", dim=0, stream="joint", every_block=True),
            ),
            outputs=("joint",),
        ),
    ),
    notes=(
        "Single-stream blocks take the joint sequence cat(text, image) as hidden_states (encoder_hidden_states=None, "
        "text_seq_len implicit), so a sequence split there must treat the first S_txt tokens as text. "
        "Reference images (editing) are appended after the target image tokens in hidden_states/img_ids, with "
        "time coordinate 10, 20, ... in img_ids; Flux2KleinKVPipeline removes them after step 0 and injects their "
        "cached K/V between text and image inside attention. Text length = max_sequence_length (the chat template "
        "is padded to it). Flux2Pipeline's modulation is shared by all blocks of a kind "
        "(double_stream_modulation_img/txt, single_stream_modulation)."
    ),
    extra={
        "cfg_by_pipeline": {
            # two separate transformer forwards per step when guidance_scale > 1 and not pipe.config.is_distilled;
            # the negative branch always encodes "" (only negative_prompt_embeds can be passed).
            "Flux2KleinPipeline": {"cfg": "true_cfg", "cfg_scale_arg": "guidance_scale", "cfg_threshold": 1.0,
                                   "disabled_by_config": "is_distilled"},
            "Flux2KleinInpaintPipeline": {"cfg": "true_cfg", "cfg_scale_arg": "guidance_scale",
                                          "cfg_threshold": 1.0, "disabled_by_config": "is_distilled"},
            "Flux2KleinKVPipeline": {"cfg": "distilled"},
        },
        "single_block_sequence": {"arg": "hidden_states", "dim": 1, "order": ("text", "image")},
        "text_seq_arg": "max_sequence_length",
        # ar_bridge text-encoder stage: no engine gives these pipelines their prompt_embeds (text_encoder="vllm" is
        # refused with this reason; "transformers" keeps the pipeline's own encoder in place).
        "text_encoder_bridge": {
            "style": None, "pipelines": (),
            "in_place": dict.fromkeys(
                ("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinInpaintPipeline", "Flux2KleinKVPipeline"),
                "it pads every prompt to max_sequence_length and feeds the DiT the states of the pad tokens too "
                "(three stacked inner layers), which transformers computes with the pad keys masked -- a pad token "
                "attends only to the real tokens, not to itself or the other pads. vLLM's causal attention always "
                "includes a token's own key and takes no key mask, so those rows cannot be reproduced (run as "
                "ordinary tokens they differ by about half their magnitude)."),
        },
    },
    # kernels=True: the blocks modulate inline after plain LayerNorms (no module to fuse), so only the Q/K RMSNorms
    # (torch.nn.RMSNorm) and the AdaLayerNormContinuous output norm
    kernels=(
        KernelSites("transformer_blocks", ("attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k")),
        KernelSites("single_transformer_blocks", ("attn.norm_q", "attn.norm_k")),
        KernelSites("", ("norm_out",)),
    ),
    # its attention processors call the fused to_qkv / to_kv / to_added_* linears once fuse_projections() ran
    fuse_qkv=True,
)
