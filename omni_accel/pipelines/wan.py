"""Wan 2.1 / 2.2 video DiT (WanTransformer3DModel), UMT5 text encoder, causal 3D VAE."""

from .base import (CacheRegion, KernelSites, ModelAdapter, PublishedTeaCache, SequenceInput, SequenceRegion,
                   ShardArg, TeaCacheSpec)

# TeaCache rescale polynomials published for Wan 2.1 (highest power first). They were fitted on e0 =
# time_projection(time_embedding(t)), which is diffusers' condition_embedder.time_proj output (the module this
# adapter measures), in TeaCache4Wan2.1's "use_ret_steps" mode: the first 5 steps always computed, none at the end.
# Sources, identical numbers: ali-vilab/TeaCache, TeaCache4Wan2.1/teacache_generate.py (commit 7c10efc, the
# use_ret_steps branch; thresholds from its README's "slow" column), and modelscope/DiffSynth-Studio,
# diffsynth/pipelines/wan_video.py (class TeaCache, coefficients_dict; commit 019258f). Configs: diffusers'
# scripts/convert_wan_to_diffusers.py. The 480P and 720P I2V checkpoints share one config: the folder name decides.
_WAN21_T2V = (("in_channels", 16), ("image_dim", None), ("attention_head_dim", 128))
_WAN21_I2V = (("in_channels", 36), ("image_dim", 1280), ("attention_head_dim", 128), ("num_attention_heads", 40),
              ("num_layers", 40))
_TEACACHE4WAN = "ali-vilab/TeaCache TeaCache4Wan2.1 (use_ret_steps) = DiffSynth-Studio wan_video TeaCache"
WAN21_TEACACHE = (
    PublishedTeaCache("Wan2.1-T2V-1.3B", (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),
                      _WAN21_T2V + (("num_attention_heads", 12), ("num_layers", 30)),
                      threshold=0.05, warmup_steps=5, final_steps=0, source=_TEACACHE4WAN),
    PublishedTeaCache("Wan2.1-T2V-14B", (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),
                      _WAN21_T2V + (("num_attention_heads", 40), ("num_layers", 40)),
                      threshold=0.10, warmup_steps=5, final_steps=0, source=_TEACACHE4WAN),
    PublishedTeaCache("Wan2.1-I2V-14B-480P", (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01),
                      _WAN21_I2V, threshold=0.20, warmup_steps=5, final_steps=0, source=_TEACACHE4WAN, name_hint="480p"),
    PublishedTeaCache("Wan2.1-I2V-14B-720P", (8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02),
                      _WAN21_I2V, threshold=0.20, warmup_steps=5, final_steps=0, source=_TEACACHE4WAN, name_hint="720p"),
)

ADAPTER = ModelAdapter(
    family="wan",
    description="Wan 2.1 / 2.2 text- and image-to-video (self-attn + cross-attn DiT, UMT5, AutoencoderKLWan)",
    transformer_classes=("WanTransformer3DModel",),
    pipeline_classes=("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"),
    block_lists=("blocks",),
    sequence_inputs=(
        # transformer forward: the 5D latent video [B, C, F, H, W] (tokens are F x H/2 x W/2 after patchify;
        # dim 2 is the frame axis, the outermost token axis), UMT5 states [B, 512, D], and for 2.1 I2V the CLIP
        # image tokens [B, 257, 1280] -- cross-attention context like the text, never split
        SequenceInput("hidden_states", dim=2, kind="image"),
        SequenceInput("encoder_hidden_states", dim=1, kind="text"),
        SequenceInput("encoder_hidden_states_image", dim=1, kind="text"),
        # every block: patchified tokens [B, S, dim], the context [B, (257+)512, D], and
        # rotary_emb = (freqs_cos, freqs_sin), each [1, S, 1, head_dim], video tokens only
        SequenceInput("hidden_states", dim=1, kind="image", where="block"),
        SequenceInput("encoder_hidden_states", dim=1, kind="text", where="block"),
        SequenceInput("rotary_emb", dim=1, kind="rope", where="block", order=("image",)),
    ),
    cfg="true_cfg",
    cfg_scale_arg="guidance_scale",
    negative_prompt_arg="negative_prompt",
    transformer_names=("transformer", "transformer_2"),
    text_encoder_names=("text_encoder",),
    vae_name="vae",
    attention_via_dispatcher=True,  # WanAttnProcessor: both self- and cross-attention via dispatch_attention_fn
    edit_pipelines=(),
    # time_proj runs in the transformer's forward before the blocks: no ahead call, its output is captured.
    teacache=TeaCacheSpec(
        modulated_input="condition_embedder.time_proj",
        coefficients=(),
        modulated_args=(),
        regions=(CacheRegion("blocks", outputs=("hidden_states",)),),
        published=WAN21_TEACACHE,
    ),
    # sp: blocks are called positionally (hidden_states, encoder_hidden_states, temb, rotary_emb); the
    # cross-attention attn2 reads the unsplit text context, so it runs locally on the query shard. temb is
    # per token ([B, S, 6, D]) only for Wan 2.2 TI2V (expand_timesteps).
    sequence_parallel=(
        SequenceRegion(
            block_list="blocks",
            args=(
                ShardArg("hidden_states", dim=1, stream="image", position=0),
                ShardArg("temb", dim=1, stream="image", position=2, every_block=True, ndim=4),
                ShardArg("rotary_emb", dim=1, stream="image", position=3, every_block=True),
            ),
            outputs=("image",),
            local_attention=("attn2",),
        ),
    ),
    notes=(
        "CFG: with guidance_scale > 1 the pipeline calls the transformer twice per step (cond, then uncond, "
        "batch B each). Wan 2.2 A14B holds two experts: transformer for t >= boundary_ratio * num_train_timesteps "
        "(high noise) and transformer_2 below it, each with its own guidance scale (guidance_scale_2); exactly "
        "one runs per step. Wan 2.2 TI2V-5B has only transformer (expand_timesteps=True: a per-token timestep "
        "[B, S]). "
        "TeaCache: Wan modulates inline inside each block (scale_shift_table + timestep_proj), so no submodule "
        "outputs the modulated input; condition_embedder.time_proj outputs timestep_proj, the 6*dim modulation "
        "every block adds to its scale_shift_table (the e0 TeaCache4Wan2.1 measures). The published Wan 2.1 "
        "polynomials (T2V 1.3B / 14B, I2V 480P / 720P) are chosen by the transformer's config; Wan 2.2 and other "
        "checkpoints need a calibrated profile. "
        "The 2.1 I2V attention splits the context at 512 text tokens (hardcoded in WanAttnProcessor): text "
        "sequences must stay padded to 512 there."
    ),
    extra={"cfg_needs_negative": False,  # an absent negative prompt encodes ""
           "fps": 16,  # Wan 2.1 and 2.2 A14B clips (diffusers' examples export at 16; TI2V-5B makes 24)
           "boundary_arg": "boundary_ratio", "rope_module": "rope", "patch_size": (1, 2, 2),
           # tp: diffusers has no _tp_plan for Wan. Self- and cross-attention split by heads (I2V's image K/V
           # projections too), the GELU FFN by hidden units.
           "tp_plan": {
               **{f"blocks.*.{a}.{p}": "colwise" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")},
               **{f"blocks.*.{a}.to_out.0": "rowwise" for a in ("attn1", "attn2")},
               **{f"blocks.*.attn2.{p}": "colwise" for p in ("add_k_proj", "add_v_proj")},
               "blocks.*.ffn.net.0.proj": "colwise",
               "blocks.*.ffn.net.2": "rowwise",
           },
           # WanAttnProcessor unflattens by attn.heads: the local head count under tp
           "tp_heads": ("blocks.*.attn1", "blocks.*.attn2"),
           # qk-norm "rms_norm_across_heads": norm_q / norm_k are RMSNorms over all heads (inner_dim) applied
           # before the head split, so with 1/tp of the heads per rank their sum of squares is all-reduced over
           # the tp group (exact); each rank keeps its slice of the weight
           "tp_norms_across_heads": tuple(f"blocks.*.{a}.{n}" for a in ("attn1", "attn2")
                                          for n in ("norm_q", "norm_k", "norm_added_k")),
           },
    # kernels=True: the blocks modulate inline (FP32LayerNorm + scale_shift_table: no module to fuse), so only the
    # Q/K RMSNorms (torch.nn.RMSNorm across heads, over the whole inner dim)
    kernels=(
        KernelSites("blocks", ("attn1.norm_q", "attn1.norm_k", "attn2.norm_q", "attn2.norm_k", "attn2.norm_added_k")),
    ),
    # its attention processors call the fused to_qkv / to_kv / to_added_* linears once fuse_projections() ran
    fuse_qkv=True,
)
