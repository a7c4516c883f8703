"""What a model adapter declares. Adapters describe; passes act.

An adapter is plain data about one family of diffusers pipelines: where its transformer blocks are, which
forward inputs carry the sequence, how it runs classifier-free guidance, which components it has. Passes read
it and hook module boundaries; nothing outside ``omni_accel/pipelines/`` names a model class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

SequenceKind = Literal["image", "text", "rope", "mask"]
CfgStyle = Literal["true_cfg", "batched_cfg", "distilled"]


@dataclass(frozen=True)
class SequenceInput:
    """A tensor argument that carries tokens along ``dim``.

    ``where`` is "transformer" for the transformer's forward kwargs and "block" for the kwargs every block of
    ``block_lists`` receives (rotary embeddings are usually computed inside the transformer and reach blocks only).
    For a rotary embedding that spans text and image tokens, ``order`` says which part comes first.
    """

    name: str
    dim: int
    kind: SequenceKind
    where: Literal["transformer", "block"] = "transformer"
    order: tuple[str, ...] = ()


@dataclass(frozen=True)
class CacheRegion:
    """A block list that step caches skip as a whole, and the format of its blocks' return value.

    ``outputs`` names, in return order, the block *arguments* each returned element replaces (a block maps
    ``hidden_states, encoder_hidden_states -> (encoder_hidden_states, hidden_states)``: outputs =
    ("encoder_hidden_states", "hidden_states")); one name = the block returns a bare tensor. Arguments are
    matched by name through the block's forward signature, so positional calls (Wan, Z-Image) work too."""

    block_list: str
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class PublishedTeaCache:
    """A TeaCache rescale polynomial published for one checkpoint, with the settings it was fitted and used with.

    It applies to a pipeline whose transformer config has every ``config`` (key, value) pair and, with
    ``single_transformer``, holds one transformer (Wan 2.2 A14B's experts share Wan 2.1 14B's config). Checkpoints
    that share one config (Wan 2.1 I2V 480P / 720P) are told apart by ``name_hint``, a substring of the folder or
    repository name the pipeline was loaded from. ``threshold`` is the source's quality ("slow") setting,
    ``warmup_steps`` / ``final_steps`` the steps the source always computes; ``source`` cites where the numbers
    come from."""

    model: str
    coefficients: tuple[float, ...]
    config: tuple[tuple[str, object], ...]
    threshold: float
    warmup_steps: int
    final_steps: int
    source: str
    name_hint: str = ""
    single_transformer: bool = True


@dataclass(frozen=True)
class TeaCacheSpec:
    """How TeaCache reads a family: the module whose output is the first block's modulated input.

    ``modulated_args`` / ``modulated_kwargs`` are the arguments of the first block of the first region that the
    module takes (by the block's argument names): TeaCache calls the module *ahead* of that block with them, so it
    can decide before the block runs. Empty args and kwargs = the module runs before the blocks in the
    transformer's forward (Wan's condition embedder) and its output is captured by a forward hook instead.
    ``modulation`` (optional): an AdaLN modulation module below the transformer fed with the block argument
    ``modulation_arg``; its output split in ``modulation_chunks`` gives shift (chunk 0) and scale (chunk 1), and
    the modulated input is ``out * (1 + scale) + shift`` (Qwen-Image modulates inline). ``output_index``: the
    element taken when the module returns a tuple. ``regions``: what is skipped on a reused step (default: every
    block list of the adapter, with (encoder_hidden_states, hidden_states) outputs). ``published``: polynomials
    published per checkpoint (``PublishedTeaCache``), preferred over ``coefficients`` when one matches."""

    modulated_input: str  # dotted path below the transformer, e.g. "transformer_blocks.0.norm1"
    coefficients: tuple[float, ...] = ()  # published rescale polynomial, highest power first; () = calibrate
    modulated_args: tuple[str, ...] = ("hidden_states",)
    modulated_kwargs: tuple[tuple[str, str], ...] = ()  # (module keyword, block argument)
    output_index: int = 0
    modulation: str = ""
    modulation_arg: str = "temb"
    modulation_chunks: int = 6
    regions: tuple[CacheRegion, ...] = ()
    published: tuple[PublishedTeaCache, ...] = ()  # per-checkpoint polynomials, chosen by the transformer's config


@dataclass(frozen=True)
class ShardArg:
    """A block argument that sequence parallelism splits: by keyword ``name`` or, when the block is called
    positionally, by ``position``. ``stream`` is the token stream it carries ("image", "text" or "joint" -- one
    sequence the model already concatenated); a tensor that covers several streams concatenated (a rotary table
    over [text, image]) names them in ``order``. ``item`` picks one element of a tuple argument (otherwise every
    tensor of a tuple is split). ``every_block``: the value is computed once in the transformer and passed to every
    block (rotary tables, masks), so it is split at every block, not only at the first."""

    name: str
    dim: int = 1
    stream: str = "image"
    order: tuple[str, ...] = ()
    item: int | None = None
    every_block: bool = False
    position: int | None = None
    ndim: int | None = None  # split only tensors of this rank (Wan's temb is per token only when 4-D)


@dataclass(frozen=True)
class SequenceRegion:
    """One block list run on sequence shards: ``args`` split at its blocks, the block outputs gathered after its
    last block (``outputs``: the stream of each element of the block's return value; None = not a sequence).
    ``local_attention``: attention submodules of a block (relative names) whose keys are not split, i.e.
    cross-attention to an unsplit context -- they run locally on the query shard."""

    block_list: str
    args: tuple[ShardArg, ...]
    outputs: tuple[str | None, ...]
    local_attention: tuple[str, ...] = ()


@dataclass(frozen=True)
class JointStreams:
    """A block list whose blocks take the text and image streams as two arguments and return them as two views of
    one joint [text, image] tensor (FLUX.1's single-stream blocks: ``cat`` inside, split on return). Every block but
    the first therefore receives strided views, and the first receives two separate tensors: dynamo guards on
    strides, so regional compile would build a second graph for the rest of the list. The compile pass hands every
    block its streams as views of one tensor (one concatenation before the first block; the others already have
    it), and one graph serves the whole list. By keyword ``text`` / ``image``, or by ``*_position`` when positional.
    """

    block_list: str
    text: str = "encoder_hidden_states"
    image: str = "hidden_states"
    text_position: int = 1
    image_position: int = 0


@dataclass(frozen=True)
class KernelSites:
    """Norm modules the kernels pass computes with fused kernels (kernels/fused_pass.py): dotted ``paths`` relative
    to every block of the block list ``blocks`` ("" = relative to the transformer itself). The pass recognises each
    module by its layer type (diffusers' AdaLayerNormZero / -Single / -Continuous, torch's or diffusers' RMSNorm); a
    path that is absent (e.g. no added-KV norms in single-stream blocks) or of another type is left alone and
    reported."""

    blocks: str
    paths: tuple[str, ...]


@dataclass(frozen=True)
class ModulationTable:
    """How the modulation table (modulation_table.py) fills a pipeline call's rows: ``schedule_timestep(timesteps
    (steps,), samples, dtype)`` gives the transformer's timestep argument at every step of the scheduler's schedule
    as the family's pipeline passes it ((steps x samples,), step-major); ``embedding_args(arguments, timestep
    (rows,))`` gives the embedding module's arguments for such rows from the forward's bound arguments, as the
    transformer's forward computes them, its other inputs repeated per step; ``conditioning``, the transformer
    arguments that, besides the timestep, decide ``temb``; ``timestep_arg`` / ``batch_arg``, the timestep argument
    and an argument whose first dimension is the samples and whose dtype the pipeline casts the timestep to."""

    schedule_timestep: Callable
    embedding_args: Callable
    conditioning: tuple[str, ...] = ()
    timestep_arg: str = "timestep"
    batch_arg: str = "hidden_states"
    # Whether a transformer's temb follows this mapping (a config switch may change what the forward embeds); None:
    # every one. Where it does not, the compile pass serves the linears as it would without a table.
    applies: Callable | None = None
    # Only inside the whole-forward CUDA graph: where the table measured no gain in a family's forward without the
    # graph (pipelines/<family>.py says what was measured).
    graphed_only: bool = False


def timestep_per_mille(timesteps, samples: int, dtype):
    """The timestep argument that FluxPipeline and QwenImagePipeline pass at each step t,
    ``t.expand(samples).to(latents dtype) / 1000``, for every step of ``timesteps`` ((steps x samples,), step-major)."""
    return (timesteps[:, None].expand(-1, samples).to(dtype) / 1000).reshape(-1)


@dataclass(frozen=True)
class ModulationPrefetch:
    """The AdaLN modulation linears that compile=True computes ahead on a second stream (modulation_prefetch.py):
    ``embedding``, the module (dotted path below the transformer) whose output is ``temb``; ``linears``, fnmatch
    patterns of the linears whose input is ``silu(temb)``, every one of them (in the forward's order); ``table``,
    how to compute them once per pipeline call instead (modulation_table.py), where the family knows it."""

    embedding: str
    linears: tuple[str, ...]
    table: ModulationTable | None = None


@dataclass(frozen=True)
class ModelAdapter:
    family: str
    description: str
    transformer_classes: tuple[str, ...]
    pipeline_classes: tuple[str, ...]
    block_lists: tuple[str, ...]
    sequence_inputs: tuple[SequenceInput, ...]
    cfg: CfgStyle
    # Call kwargs that switch true CFG on: the scale and its threshold ("> 1" runs the negative branch).
    cfg_scale_arg: str | None = None
    negative_prompt_arg: str | None = "negative_prompt"
    transformer_names: tuple[str, ...] = ("transformer",)
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    vae_name: str = "vae"
    # True when every attention of the transformer goes through diffusers' attention dispatcher, so
    # ``set_attention_backend`` reaches it; False means the pass wraps forward in ``sdpa_kernel`` instead.
    attention_via_dispatcher: bool = True
    edit_pipelines: tuple[str, ...] = ()
    # editing: the edit pipelines that take several reference images (the others take exactly one), and the
    # smallest side in pixels a reference image may have (0: the pipeline's size multiple, vae_scale_factor * 2)
    multi_reference_pipelines: tuple[str, ...] = ()
    min_reference_side: int = 0
    teacache: TeaCacheSpec | None = None
    # sequence parallelism: the block lists that run on sequence shards (empty = sp not supported)
    sequence_parallel: tuple[SequenceRegion, ...] = ()
    # quant: fnmatch patterns (names relative to the transformer, e.g. "transformer_blocks.0.norm1.linear") of
    # block linears kept in bf16 -- the per-sample AdaLN modulation linears by default (one token each: nothing to
    # gain from FP8, and their error feeds every token's shift/scale/gate).
    quant_skip: tuple[str, ...] = ()
    notes: str = ""
    extra: dict = field(default_factory=dict)
    # kernels=True: where the fused norm kernels go (empty = the family has no matching norm modules)
    kernels: tuple[KernelSites, ...] = ()
    # fuse_qkv=True: the family's attention processors read diffusers' ``fused_projections`` flag, so
    # ``AttentionModuleMixin.fuse_projections()`` takes effect (one q/k/v GEMM per stream)
    fuse_qkv: bool = False
    # compile: block lists that return their streams as views of one joint tensor (see JointStreams)
    joint_streams: tuple[JointStreams, ...] = ()
    # compile on GPUs: module-global rotary functions the family's processors call with complex tables
    # (``fn(x (B, S, H, D), freqs (S, D / 2) complex, use_real=False)``), applied in real arithmetic instead
    complex_rotary: tuple[str, ...] = ()
    # compile on GPUs: the modulation linears computed ahead on a second stream (see ModulationPrefetch)
    modulation_prefetch: ModulationPrefetch | None = None
    # compile=True on GPUs: capture the whole forward in CUDA graphs with 16-bit weights too, as it does for the
    # 8-bit linears of every family: set where the family's 16-bit denoising loop was measured faster with them
    graphs_16bit: bool = False

    def transformers_of(self, pipe) -> list[tuple[str, object]]:
        """The (name, module) transformers the pipeline actually holds (Wan 2.2 may have two, or one)."""
        found = []
        for name in self.transformer_names:
            module = getattr(pipe, name, None)
            if module is not None:
                found.append((name, module))
        return found

    def blocks_of(self, transformer) -> list[tuple[str, object]]:
        """Every repeated block, as (dotted name, module), in execution order."""
        blocks = []
        for list_name in self.block_lists:
            for index, block in enumerate(getattr(transformer, list_name, None) or ()):
                blocks.append((f"{list_name}.{index}", block))
        return blocks

    def size_multiple(self, pipe) -> int:
        """Image sides are multiples of this: the VAE's down-sampling times the transformer's 2x2 patches (every
        family packs or patchifies 2x2 latents); smaller sides round down to zero latent pixels."""
        scale = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 8
        return int(scale) * 2

    def is_edit_pipeline(self, pipe) -> bool:
        return type(pipe).__name__ in self.edit_pipelines

    def takes_several_references(self, pipe) -> bool:
        return type(pipe).__name__ in self.multi_reference_pipelines
