"""Regional torch.compile: compile each repeated transformer block, not the whole model.

Why regional: the blocks of a DiT are one module repeated 20-60 times, so dynamo traces one graph per block type
and reuses it for every instance -- a cold start of seconds instead of minutes, with nearly the speed of
whole-model compile. ``compile="max"`` adds, on CUDA where the transformer forward is pure (no cache, offload or
parallel pass inside it), a CUDA graph of the whole transformer forward per input signature (``cuda_graphs.py``).
It used to add inductor's GEMM autotuning too (max-autotune): measured on an H200 at FLUX 1024², the autotuned
Triton GEMMs lost to cuBLAS (136.6 vs 133.2 ms/step), so "max" now compiles like ``True`` and adds the graphs only.
``compile=True`` adds the same graph for ``quant="fp8"`` and ``"int8"`` on a GPU, whose forwards are host-bound,
and for 16-bit weights where the family's adapter asks for it (``graphs_by_default``). On GPUs the blocks'
tanh-GELUs are computed in a form inductor codegens cheaply (``sigmoid_gelu``).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from typing import Callable

import torch
from diffusers.hooks import ModelHook

from . import modulation_prefetch, modulation_table
from .cuda_graphs import GraphedForward
from .errors import AccelError
from .hooks import add_hook, swap_module_global
from .pass_base import AccelPass, PassContext

logger = logging.getLogger(__name__)

CUDA_GRAPHS_ENV = "OMNI_ACCEL_CUDA_GRAPHS"  # "0" turns compile="max"'s CUDA graphs off (A/B runs, debugging)


# Inductor options of every compiled block on a GPU (torch.compile(..., options=...)), chosen by measurement
# (benchmarks/bench_peers.py, docs/kernels.md): multi-kernel lets inductor keep a whole row in registers for row
# reductions up to 16k wide (LayerNorm, RMSNorm, FP8 scales; the default stops at 1k and loops over the row) and
# picks per kernel at run time -- 1.6-2.5 % per FLUX step on an H200 (bf16 and FP8), a few seconds more compile.
# Programmatic dependent launch lets each Triton kernel start while the kernel before it drains (Hopper and newer;
# inductor leaves it out on older GPUs): the FP8 stack's ~900 kernels per FLUX forward leave 5-9 ms of gaps even
# inside its CUDA graph, and PDL took 1.8 ms of them (91.1 -> 89.3 ms/step, bf16 131.7 -> 131.0, one H200 run).
# Coordinate-descent tuning was measured too and dropped: over 100 s of compile for FLUX.
CUDA_INDUCTOR_OPTIONS = {"triton.multi_kernel": 1, "triton.enable_pdl": True}
# Benchmarks' A/B rows set this; None = the defaults above.
INDUCTOR_OPTIONS: dict | None = None
# Whether compiled blocks on a GPU compute tanh-GELU through the sigmoid identity (below); benchmarks' A/B rows set it.
SIGMOID_GELU = True

# Whether compiled blocks on a GPU get the epilogue-fusion graph pass (kernels/epilogue_fusion.py: the concatenation +
# GELU, AdaLN norm and q / k norm + rotary epilogues around FP8 linears and attention in hand-written kernels);
# benchmarks' A/B rows set it.
EPILOGUE_FUSION = True
POST_GRAD_PASS = "post_grad_custom_post_pass"  # the inductor option that carries it

# Whether compiled blocks get the joint-views hook of the family's JointStreams (pipelines/base.py): one graph per
# block list instead of two; benchmarks' A/B rows set it.
JOINT_STREAMS = True

# 0.5 * (1 + tanh(z)) == sigmoid(2 z), with z = sqrt(2 / pi) * (x + 0.044715 x^3)
_TWO_SQRT_2_OVER_PI = 2.0 * (2.0 / 3.141592653589793) ** 0.5


def sigmoid_gelu(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximate GELU, ``F.gelu(x, approximate="tanh")``, written as ``x * sigmoid(2 z)``.

    Why: inductor writes tanh as libdevice's ``tanhf``, a few dozen instructions per element, and the kernels that
    apply the DiTs' MLP GELU (fused with the bias, the single blocks' concat and the FP8 cast) then run on
    instructions, not on memory: 137 us for a FLUX single block's 4608 x 15360 epilogue on an H200, over 2x what its
    bytes need. The sigmoid form is one exp and one reciprocal: 112 us (FLUX FP8 step 89.6 -> 86.6 ms, docs/kernels.md).
    Computed in float32 like F.gelu's bf16 kernel."""
    xf = x.float()
    return (xf * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (xf + 0.044715 * xf * xf * xf))).to(x.dtype)


class SigmoidGelu(torch.nn.Module):
    """Stands in for an ``nn.GELU(approximate="tanh")`` in a compiled block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sigmoid_gelu(x)


def use_sigmoid_gelu(module: torch.nn.Module) -> tuple[int, Callable[[], None]]:
    """Route every tanh-GELU inside ``module`` through ``sigmoid_gelu``: torch's ``nn.GELU(approximate="tanh")``
    modules are swapped for ``SigmoidGelu``; diffusers' ``GELU`` projections (FeedForward's "gelu-approximate")
    get an instance ``gelu``. Returns how many and the undo."""
    swapped, patched = [], []
    for parent in module.modules():
        for child_name, child in parent.named_children():
            if type(child) is torch.nn.GELU and child.approximate == "tanh":
                swapped.append((parent, child_name, child))
        if getattr(parent, "approximate", None) == "tanh" and callable(getattr(type(parent), "gelu", None)):
            patched.append(parent)
    for parent, child_name, _ in swapped:
        setattr(parent, child_name, SigmoidGelu())
    for projection in patched:
        projection.gelu = sigmoid_gelu

    def undo() -> None:
        for parent, child_name, child in swapped:
            setattr(parent, child_name, child)
        for projection in patched:
            del projection.gelu

    return len(swapped) + len(patched), undo


# Whether compiled blocks on a GPU apply diffusers' interleaved rotary embedding through a pair swap (below);
# benchmarks' A/B rows set it.
ROTARY_PAIR_SWAP = True
# Whether they also apply the family's complex-table rotary functions (``ModelAdapter.complex_rotary``) in real
# arithmetic (``_pair_swap_complex_rotary``); benchmarks' A/B rows set it.
COMPLEX_ROTARY_PAIR_SWAP = True


def _pair_swap_rotary(original: Callable) -> Callable:
    """diffusers' ``apply_rotary_emb`` for real (cos, sin) tables with interleaved pairs, written as
    ``x * cos + swap(x) * (sin * [-1, +1, ...])`` where ``swap`` exchanges the two values of each pair.

    Why: diffusers builds the rotated tensor with ``unbind`` + ``stack``, which inductor lowers to masked, strided
    loads of each pair's other value (four loads per output value, fused with the RMSNorm before it and the FP8 cast
    after it); FLUX's single blocks spent 120 us per call in that kernel on an H200 for ~40 us of bytes. A swap is
    one load at the neighbouring index: 75 us (static FP8 step 90.2 -> 89.2 ms, docs/kernels.md). Same float32
    products and sums as the original, so the same output.
    Other layouts (complex tables, halves instead of pairs) go to the original."""

    def apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        if not use_real or use_real_unbind_dim != -1 or sequence_dim not in (1, 2) or x.shape[-1] % 2:
            return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        cos, sin = freqs_cis  # (S, D)
        shape = (1, 1, *cos.shape) if sequence_dim == 2 else (1, cos.shape[0], 1, cos.shape[1])
        return _rotate_pairs(x, cos.reshape(shape).to(x.device), sin.reshape(shape).to(x.device))

    apply_rotary_emb._omni_accel_original = original
    return apply_rotary_emb


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by (cos, sin) on its interleaved pairs (tables broadcast over x, one value per channel), as
    ``x * cos + swap(x) * (sin * [-1, +1, ...])`` in float32, rounded to x's dtype."""
    # the rotated pair is (-imag, real): -1 at even, +1 at odd positions (arange, not a tensor from a Python list,
    # whose host-to-device copy a CUDA graph capture would refuse)
    sign = torch.arange(x.shape[-1], device=x.device) % 2 * 2 - 1
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x.float() * cos + swapped.float() * (sin * sign)).to(x.dtype)


_ROTARY_SWAPPED: dict[str, list] = {}  # module name -> [diffusers' function, transformers using the swap]


def use_rotary_pair_swap(transformer: torch.nn.Module) -> tuple[int, Callable[[], None]]:
    """Give the modules that define ``transformer`` and its attention processors the pair-swap
    ``apply_rotary_emb`` where they call diffusers' own (Wan and Qwen-Image call their own rotary code, or none).
    Returns how many modules and the undo; the globals are shared by every pipeline of the family in the process
    (``hooks.swap_module_global`` counts their users)."""
    from diffusers.models import embeddings

    return swap_module_global(transformer, "apply_rotary_emb", _ROTARY_SWAPPED, lambda current: (
        _pair_swap_rotary(current) if current is embeddings.apply_rotary_emb else None))


def _pair_swap_complex_rotary(original: Callable) -> Callable:
    """A family's interleaved rotary embedding over complex tables (``x`` (B, S, H, D), ``freqs_cis`` (S, D / 2)
    complex, ``use_real=False``: Qwen-Image's ``apply_rotary_emb_qwen``), written in real arithmetic as the pair swap
    (``_rotate_pairs``) with the tables' real and imaginary parts as cos and sin.

    Why: inductor does not compile complex numbers, so the complex multiply ran as an ATen elementwise kernel, four
    per Qwen-Image block (240 calls, 5.0 ms per 1024² forward on an H100), beside inductor's q / k norm kernels. In
    real arithmetic the rotation fuses into the norm's kernel. The same products and sums in float32, so the same
    output (tested bit for bit eagerly; compiled, to float32 rounding). Other calls (real tables, other shapes) go to
    the original."""

    def apply_rotary(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        if (use_real or not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex() or x.dim() != 4
                or freqs_cis.shape != (x.shape[1], x.shape[-1] // 2) or x.shape[-1] % 2):
            return original(x, freqs_cis, use_real, use_real_unbind_dim)
        parts = torch.view_as_real(freqs_cis).to(x.device)  # (S, D / 2, 2): each pair's cos and sin
        cos, sin = (parts[..., i].repeat_interleave(2, -1)[None, :, None, :] for i in (0, 1))
        return _rotate_pairs(x, cos, sin)

    apply_rotary._omni_accel_original = original
    return apply_rotary


# attribute name -> swap_module_global's registry for it (module name -> [the family's function, users])
_COMPLEX_ROTARY_SWAPPED: dict[str, dict[str, list]] = {}


def use_complex_rotary_pair_swap(transformer: torch.nn.Module,
                                 names: tuple[str, ...]) -> tuple[int, Callable[[], None]]:
    """Give the modules that define ``transformer`` and its processors the real-arithmetic form of the complex-table
    rotary functions ``names`` (the family adapter's ``complex_rotary``). Returns how many swaps and the undo."""
    total, undos = 0, []
    for name in names:
        count, undo = swap_module_global(transformer, name, _COMPLEX_ROTARY_SWAPPED.setdefault(name, {}),
                                         lambda current: _pair_swap_complex_rotary(current) if callable(current)
                                         else None)
        total += count
        undos.append(undo)

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()

    return total, undo_all


def compile_options(mode: bool | str, device: torch.device) -> dict:
    """torch.compile arguments of a block, the same for True and "max". No inductor CUDA graphs ("reduce-overhead"):
    every instance of a block type replays the *same* regional graph, whose static output buffer the next block's
    replay overwrites while the residual stream still holds it (measured on an H200, 2026-12-03). "max" takes its
    graphs from cuda_graphs.py instead, one over the whole transformer forward."""
    extra = INDUCTOR_OPTIONS if INDUCTOR_OPTIONS is not None else (
        CUDA_INDUCTOR_OPTIONS if device.type == "cuda" else {})
    options = {"dynamic": False}
    extra = {k: v for k, v in (extra or {}).items() if k != "triton.enable_pdl" or inductor_has_pdl()}
    if EPILOGUE_FUSION and device.type == "cuda":
        from .kernels.epilogue_fusion import GRAPH_PASS

        extra[POST_GRAD_PASS] = GRAPH_PASS
    if extra:
        options["options"] = extra
        if extra.get("triton.multi_kernel"):
            repair_multi_kernel_locks()
    return options


@functools.cache
def inductor_has_pdl() -> bool:
    """Whether this torch's inductor knows ``triton.enable_pdl`` (torch.compile refuses options it does not know)."""
    from torch._inductor import config

    return hasattr(config.triton, "enable_pdl")


@functools.cache
def repair_multi_kernel_locks() -> bool:
    """Give back the lock that inductor's pickling strips from a Triton kernel before multi-kernel reads its key.

    Why: inductor drops ``JITFunction._hash_lock`` to pickle a kernel compiled in a worker, and torch 2.11 restores it
    only when it kept the old values; a multi-kernel whose candidates came back that way then fails in
    ``MultiKernelCall.load_cache`` ("'NoneType' object does not support the context manager protocol") -- seen on an
    H200 compiling the built-in model. Newer torch versions restore the lock themselves, which makes this a no-op.
    Returns whether the guard is installed."""
    try:
        from torch._inductor.codegen.multi_kernel import MultiKernelCall
    except ImportError:  # an inductor without multi-kernel: nothing to guard
        return False
    original = MultiKernelCall.load_cache

    @functools.wraps(original)
    def load_cache(self):
        for kernel in self.kernels:
            fn = getattr(kernel, "fn", None)
            if fn is not None and hasattr(fn, "_hash_lock") and fn._hash_lock is None:
                fn._hash_lock = threading.RLock()
        return original(self)

    MultiKernelCall.load_cache = load_cache
    return True


class CompilePass(AccelPass):
    name = "compile"

    def wanted(self, config) -> bool:
        return config.compile is not False

    def check(self, ctx: PassContext) -> None:
        graphs_env = os.environ.get(CUDA_GRAPHS_ENV)
        if graphs_env not in (None, "0", "1"):
            raise AccelError(
                f"{CUDA_GRAPHS_ENV}={graphs_env!r} is not understood; set it to 0 to turn off the CUDA graphs of "
                "compile='max', or to 1 (or unset it) to keep them."
            )
        _check_quack_configs()
        where = modulation_prefetch.MODULATION_PREFETCH
        if where not in modulation_prefetch.WHERE:
            raise AccelError(f"omni_accel.modulation_prefetch.MODULATION_PREFETCH={where!r} is not one of "
                             f"{modulation_prefetch.WHERE}; set it to \"graphs\" (the default), \"always\" or \"off\".")
        if ctx.device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
            raise AccelError(
                "compile=True on CPU needs a C++ compiler for inductor and none was found on PATH; "
                "install g++ (e.g. apt-get install g++) or use compile=False."
            )
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            if not ctx.adapter.blocks_of(transformer):
                raise AccelError(
                    f"compile={ctx.config.compile!r}: the {name} of this pipeline has none of the block lists "
                    f"{ctx.adapter.block_lists} that the {ctx.adapter.family} adapter declares; use compile=False."
                )

    def apply(self, ctx: PassContext) -> None:
        options = compile_options(ctx.config.compile, ctx.device)
        _raise_recompile_limit(ctx)
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            blocks = ctx.adapter.blocks_of(transformer)
            gelus = 0
            undos = []
            rotary = 0
            if SIGMOID_GELU and ctx.device.type == "cuda":
                for _, block in blocks:  # inside the compiled blocks only: eager, F.gelu is the one fused kernel
                    count, undo_gelu = use_sigmoid_gelu(block)
                    gelus += count
                    undos.append(undo_gelu)
            if ROTARY_PAIR_SWAP and ctx.device.type == "cuda":
                rotary, undo_rotary = use_rotary_pair_swap(transformer)
                undos.append(undo_rotary)
            complex_rotary = 0
            if COMPLEX_ROTARY_PAIR_SWAP and ctx.device.type == "cuda" and ctx.adapter.complex_rotary:
                complex_rotary, undo_complex = use_complex_rotary_pair_swap(transformer, ctx.adapter.complex_rotary)
                undos.append(undo_complex)
            joint_specs = ctx.adapter.joint_streams if JOINT_STREAMS else ()
            undos += [undo for spec in joint_specs for undo in _joint_streams(transformer, spec)]
            prefetched = tabulated = 0
            if _tabulates_modulation(ctx, transformer):  # before compiling: the blocks trace the prefetched linears
                tabulated, undo_table = modulation_table.use_modulation_table(
                    ctx.pipe, transformer, ctx.adapter.modulation_prefetch, ctx.state, fill_own_rows=_graphed(ctx))
                undos.append(undo_table)
            elif _prefetches_modulation(ctx):
                prefetched, undo_prefetch = modulation_prefetch.use_modulation_prefetch(
                    transformer, ctx.adapter.modulation_prefetch)
                undos.append(undo_prefetch)
            undos += [_compile_block(block, options) for _, block in blocks]

            def undo(undos=undos) -> None:
                for u in reversed(undos):
                    u()

            if EPILOGUE_FUSION and ctx.device.type == "cuda":
                from .kernels import gemm_tuning

                # which cuBLASLt algorithm each 16-bit GEMM shape runs on (filled in by the first forward)
                ctx.state.report_sections["tuned_gemms"] = gemm_tuning.choices
                undos.append(lambda: ctx.state.report_sections.pop("tuned_gemms", None))
            ctx.state.record("compile", undo, component=name, blocks=len(blocks), sigmoid_gelu=gelus,
                             rotary_pair_swap=rotary, complex_rotary_pair_swap=complex_rotary,
                             modulation_prefetch=prefetched, modulation_table=tabulated,
                             joint_streams=[spec.block_list for spec in joint_specs], **_printable(options))
        if ctx.config.compile == "max" or graphs_by_default(ctx):
            _apply_cuda_graphs(ctx)
        logger.info("omni_accel: regional compile of %s", [n for n, _ in ctx.adapter.transformers_of(ctx.pipe)])


def _check_quack_configs() -> None:
    """Refuse a ``gemm_tuning.QUACK_CONFIGS`` that is not a tuple of config names, before anything is patched."""
    from .kernels import gemm_tuning, quack_gemm

    names = gemm_tuning.QUACK_CONFIGS
    if not isinstance(names, tuple) or not all(isinstance(name, str) for name in names):
        raise AccelError(f"gemm_tuning.QUACK_CONFIGS={names!r} is not a tuple of config names: set it to () (off, "
                         "the default) or to names such as ('256x192_coop_c2x1',).")
    for name in names:
        quack_gemm.check_name(name)


def _tabulates_modulation(ctx: PassContext, transformer: torch.nn.Module) -> bool:
    """Whether the family's modulation linears come from a table computed once per pipeline call
    (modulation_table.py, ``MODULATION_TABLE``): where the family declares the table for this transformer's
    configuration, on any device (only under the whole-forward CUDA graph where the family says so), but not with
    offload (the linears' weights may be off the GPU when the table is filled) or tensor parallelism (sharded)."""
    spec = ctx.adapter.modulation_prefetch
    if not (modulation_table.MODULATION_TABLE and modulation_table.tabulates(spec, transformer)):
        return False
    return (not spec.table.graphed_only or _graphed(ctx)) and ctx.config.offload is None and ctx.config.tp == 1


def _prefetches_modulation(ctx: PassContext) -> bool:
    """Whether the family's modulation linears are computed ahead on a second stream (modulation_prefetch.py): inside
    the whole-forward CUDA graph only. Measured on an H100 at FLUX 1024² (docs/kernels.md): in the graph of the int8
    stack 0.3-0.8 ms per forward faster (0.7-0.8 in loops); in the bf16 forward without a graph no faster, the host's extra launches and
    events in front of the blocks for nothing. ``MODULATION_PREFETCH = "always"`` takes any GPU forward but one whose
    offload moves the weights during it or whose tensor parallelism shards them (the graph rules both out).)"""
    where = modulation_prefetch.MODULATION_PREFETCH
    if ctx.adapter.modulation_prefetch is None or ctx.device.type != "cuda" or where == "off":
        return False
    return _graphed(ctx) or (where == "always" and ctx.config.offload is None and ctx.config.tp == 1)


def _graphed(ctx: PassContext) -> bool:
    """Whether the compile pass captures the whole forward in CUDA graphs (``_apply_cuda_graphs``)."""
    return (ctx.config.compile == "max" or graphs_by_default(ctx)) and cuda_graphs_blocker(ctx) is None


def _printable(options: dict) -> dict:
    """compile_options for the report: the graph pass object by its class name."""
    extra = options.get("options")
    if not extra or POST_GRAD_PASS not in extra:
        return options
    return {**options, "options": {**extra, POST_GRAD_PASS: type(extra[POST_GRAD_PASS]).__name__}}


# Every accelerate(compile=True) on the same block class adds guard entries to the same forward code object (other
# hooks, FP8 modules, shapes); past dynamo's default limit of 8 it silently runs that code eager. Seen on the H200:
# the fifth compiled config of one benchmark process had a 0.2 s "cold start" and eager speed. A process that
# re-accelerates a pipeline a few times must keep compiling, so the limit is raised while a compile pass is applied.
RECOMPILE_LIMIT = 64


def _raise_recompile_limit(ctx: PassContext) -> None:
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo_config, name)
    if before >= RECOMPILE_LIMIT:
        return
    setattr(dynamo_config, name, RECOMPILE_LIMIT)
    ctx.state.record("compile", lambda: setattr(dynamo_config, name, before), hidden=True)


def graphs_by_default(ctx: PassContext) -> bool:
    """Whether ``compile=True`` adds the whole-forward CUDA graph of ``"max"`` by itself: for the 8-bit linears
    (``quant="fp8"`` or ``"int8"``) on a GPU. Why: those forwards are host-bound. The FP8 stack's compiled blocks
    spend 24-58 us of CPU per ``torch._scaled_mm`` call (measured) and launch ~1,500 kernels; on an H200 the host took
    54-120 ms to queue one FLUX 1024² forward whose kernels run for 81 ms, and a Qwen-Image forward took 164 ms for 85
    ms of kernels (with the graph 113 ms; FLUX, where the host kept up, pays 1-2 %). The int8 stack with
    SageAttention, whose Python runs around every attention call, took 119.7 ms per FLUX forward without the graph
    and 82.4 with it (benchmarks/results/bench_peers_h200_flux_int8_sage_levers_20261205.json). A replay costs the host
    2 ms. 16-bit forwards take the graph where the family's adapter says so (``graphs_16bit``: Qwen-Image, 3.6 %
    per step of a 28-step run, the graph letting its modulation table in); FLUX's is GPU-bound and tied with and
    without (1.001x), so it keeps compile=True as it was."""
    if ctx.config.compile is not True or ctx.device.type != "cuda":
        return False
    return ctx.config.quant in ("fp8", "int8") or (ctx.config.quant is None and ctx.adapter.graphs_16bit)


def cuda_graphs_blocker(ctx: PassContext) -> str | None:
    """Why ``compile="max"`` cannot graph this transformer forward, or None when it can.

    A replay re-runs the recorded kernels and none of the Python in between, so every pass that decides or
    communicates inside the forward at run time rules graphs out."""
    cfg = ctx.config
    if os.environ.get(CUDA_GRAPHS_ENV, "1") == "0":
        return f"{CUDA_GRAPHS_ENV}=0 is set"
    if ctx.device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the pipeline runs on {ctx.device}"
    if cfg.cache is not None:
        return f"cache={cfg.cache!r} decides per step inside the forward whether blocks run"
    if cfg.offload is not None:
        return f"offload={cfg.offload!r} moves weights in hooks during the forward"
    if cfg.world_size > 1:
        return f"parallel degree {cfg.world_size}: the forward exchanges tensors with other ranks"
    return None


def _apply_cuda_graphs(ctx: PassContext) -> None:
    reason = cuda_graphs_blocker(ctx)
    if reason is not None:
        logger.info("omni_accel: compile=%r without CUDA graphs: %s", ctx.config.compile, reason)
        ctx.state.record("compile", lambda: None, cuda_graphs=False, cuda_graphs_off_because=reason)
        return
    for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
        get_forward, set_forward = _innermost_forward(transformer)
        eager = get_forward()
        graphed = GraphedForward(eager, transformer, ctx.device)
        set_forward(graphed)

        def undo(set_forward=set_forward, eager=eager, graphed=graphed) -> None:
            set_forward(eager)
            graphed.reset()  # frees the graphs' memory pools

        ctx.state.record("compile", undo, component=name, cuda_graphs=True, graph_stats=graphed.stats)


def _innermost_forward(module: torch.nn.Module):
    """Getter and setter of the forward that diffusers' hook chain on ``module`` finally calls (the hooks stay
    outside); without hooks, the module's own ``forward`` attribute."""
    registry = getattr(module, "_diffusers_hook", None)
    refs = getattr(registry, "_fn_refs", None)
    if not refs:
        own = vars(module).get("forward")
        original = module.forward

        def set_plain(fn) -> None:
            if fn == original and own is None:
                vars(module).pop("forward", None)  # the undo: back to the class's forward
            else:
                module.forward = fn

        return (lambda: module.forward), set_plain
    ref = refs[0]
    attr = "original_forward" if ref.original_forward is not None else "forward"
    return (lambda: getattr(ref, attr)), (lambda fn: setattr(ref, attr, fn))


def _adjacent_views(text: torch.Tensor, image: torch.Tensor) -> bool:
    """Whether ``text`` and ``image`` (B, S, C) already are the two halves of one contiguous [text, image] tensor."""
    if text.dim() != 3 or image.dim() != 3 or text.stride() != image.stride() or text.stride(2) != 1:
        return False
    row = text.stride(1)
    return (row == text.shape[2] == image.shape[2] and text.stride(0) == (text.shape[1] + image.shape[1]) * row
            and text.untyped_storage().data_ptr() == image.untyped_storage().data_ptr()
            and image.storage_offset() == text.storage_offset() + text.shape[1] * row)


class _JointStreamsHook(ModelHook):
    """Hands a block its text and image streams as views of one [text, image] tensor (pipelines' JointStreams):
    the first block of the list gets them from one concatenation, the others already receive such views."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec

    def pre_forward(self, module, *args, **kwargs):
        args = list(args)
        # where each stream was passed: its keyword, else its position (None: not passed at all)
        text_at, image_at = (name if name in kwargs else position if position < len(args) else None
                             for name, position in ((self.spec.text, self.spec.text_position),
                                                    (self.spec.image, self.spec.image_position)))
        if text_at is None or image_at is None:
            return tuple(args), kwargs
        place = {str: kwargs, int: args}
        text, image = place[type(text_at)][text_at], place[type(image_at)][image_at]
        if isinstance(text, torch.Tensor) and isinstance(image, torch.Tensor) and not _adjacent_views(text, image):
            joint = torch.cat([text, image], dim=1)
            place[type(text_at)][text_at] = joint[:, :text.shape[1]]
            place[type(image_at)][image_at] = joint[:, text.shape[1]:]
        return tuple(args), kwargs


def _joint_streams(transformer: torch.nn.Module, spec) -> list[Callable[[], None]]:
    """Give every block of ``spec.block_list`` the joint-views hook; return their undos. Every block, not only the
    first: blocks with diffusers hooks are compiled under them (``_compile_block``), so all blocks of the list keep
    one way of being compiled, and one graph."""
    return [add_hook(block, "joint_streams", _JointStreamsHook(spec))
            for block in getattr(transformer, spec.block_list, None) or ()]


def _compile_block(block: torch.nn.Module, options: dict):
    """Compile ``block``'s own forward, *under* every diffusers hook on it; return the undo.

    Why under the hooks: the passes' hooks make per-step Python decisions (TeaCache computes or replays the block,
    sp splits and gathers, cfg_parallel exchanges). Compiled into the graph they would guard on that state (a
    recompile whenever a step switches between computed and reused) or break it; outside it the compiled region is
    the same pure block forward every step. The innermost link of diffusers' hook chain (``_fn_refs[0]``, the first
    hook registered) holds the block's forward: it is swapped for the compiled one. Without hooks:
    ``nn.Module.compile`` as before.
    """
    registry = getattr(block, "_diffusers_hook", None)
    if not getattr(registry, "_fn_refs", None):
        block.compile(**options)

        def undo_plain() -> None:
            block._compiled_call_impl = None  # what nn.Module.compile() set; None = eager again

        return undo_plain
    get_forward, set_forward = _innermost_forward(block)
    eager = get_forward()
    set_forward(torch.compile(eager, **options))
    return lambda: set_forward(eager)


# ------------------------------------------------------------------------------------------ compile cache file
def save_compile_cache(path: str | os.PathLike) -> int:
    """Write what this process has compiled -- inductor's graphs and Triton kernels, AOTAutograd's graphs, autotuning
    results (``torch.compiler.save_cache_artifacts``) -- to ``path``; return the bytes written.

    Why: a cold first call spends most of its time compiling (15-18 s of a FLUX FP8 first call on an H200, more on a
    slow host). A machine that loads this file before its first call (``load_compile_cache``) finds those compiles
    in its caches, as a machine with warm caches does. Run one call of every shape you serve first, then save."""
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        raise AccelError(f"save_compile_cache({os.fspath(path)!r}): this process has compiled nothing yet. Call the "
                         "pipeline once after accelerate(..., compile=True) (once per shape you serve), then save.")
    data, _ = artifacts
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    partial = f"{os.fspath(path)}.partial"
    with open(partial, "wb") as fh:  # a reader never sees half a file
        fh.write(data)
    os.replace(partial, path)
    return len(data)


def load_compile_cache(path: str | os.PathLike) -> dict[str, int]:
    """Put the compiles that ``save_compile_cache`` wrote into this process's caches, before the first compiled
    call; return how many artifacts of each kind were loaded. They are hits only for the same torch / Triton
    versions, GPU, shapes and options; anything else compiles as usual."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise AccelError(f"load_compile_cache({os.fspath(path)!r}): cannot read it ({exc.strerror}). Give the file "
                         "that omni_accel.save_compile_cache() wrote.") from None
    try:
        info = torch.compiler.load_cache_artifacts(data)  # None (and a logged warning) for a damaged file
    except Exception as exc:  # noqa: BLE001 -- and assorted errors for a foreign one
        info, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = "its checksum or format does not match"
    if info is None:
        raise AccelError(f"load_compile_cache({os.fspath(path)!r}): not a compile cache torch {torch.__version__} "
                         f"can read ({why}). Save it again with omni_accel.save_compile_cache() on this torch "
                         "version.")
    return {kind: len(info.artifacts[kind]) for kind in sorted(info.artifacts)}
