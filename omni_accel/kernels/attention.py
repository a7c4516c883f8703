"""Attention backend pass: pick the fastest correct attention kernel and route the transformer's attention to it.

Two routes, by what the backend is:
- SDPA's own kernels (cuDNN, FA2, mem-efficient, math) reach every family through a hook that enters
  ``torch.nn.attention.sdpa_kernel`` around the transformer forward. We don't use diffusers' ``_native_cudnn``
  backend for this: it copies q/k/v to contiguous before SDPA, measured 5 % slower per FLUX step on an H200.
- Other kernels (flash-attn, FA3, Sage, flex, xformers) go through diffusers' dispatcher
  (``set_attention_backend``), so only families whose processors use the dispatcher can take them.
- omni_accel's own routes (FP8 attention, FlashAttention-4) wrap the dispatcher and take the calls they can serve
  (``fp8_attention.route_transformer``); the rest go to the dispatcher unchanged.

``attention="auto"`` follows ``AUTO_TABLE`` (device, capability, dtype, compiled or not, head dim, FP8 stack ->
backend), whose rows come from measurements (docs/kernels.md): in eager mode it patches nothing, so the plain
pipeline's own kernel runs; compiled on Hopper in 16-bit it pins cuDNN SDPA (637 vs 331 TFLOP/s for FA2 at FLUX
shapes on an H200) and, where flash-attn-4 is installed, sends calls over ``fa4_attention.AUTO_MIN_TOKENS`` keys
(video) to FlashAttention-4; with ``quant="fp8"`` on Hopper it takes cuDNN's FP8 attention; with ``quant="int8"`` on
Hopper, where sageattention is installed, calls over ``sage_attention.AUTO_MIN_TOKENS`` keys go to SageAttention
(whose int8 Q K^T holds the int8 stack's quality bound), and where only flash-attn-4 is, to FlashAttention-4. Both
long routes also serve forwards a CUDA graph captures: their ops run between the graph's segments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from diffusers.hooks import ModelHook
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..deps import INSTALL, installed, missing_message
from ..errors import AccelError
from ..hooks import add_hook
from ..pass_base import AccelPass, PassContext
from . import fa4_attention, sage_attention

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    name: str  # our name
    dispatcher: str  # diffusers AttentionBackendName value
    sdpa: SDPBackend | None  # the SDPA kernel it is, for families outside the dispatcher; None = not SDPA
    needs_cuda: bool
    package: str | None = None  # import name that must be installed
    note: str = ""


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("sdpa", "native", None, False, note="PyTorch SDPA, its own kernel choice"),
        Backend("cudnn", "_native_cudnn", SDPBackend.CUDNN_ATTENTION, True, note="SDPA cuDNN kernel (Hopper)"),
        Backend("sdpa_flash", "_native_flash", SDPBackend.FLASH_ATTENTION, True, note="SDPA's FlashAttention-2"),
        Backend("efficient", "_native_efficient", SDPBackend.EFFICIENT_ATTENTION, True, note="SDPA mem-efficient"),
        Backend("math", "_native_math", SDPBackend.MATH, False, note="SDPA math reference"),
        Backend("flash_attn", "flash", None, True, "flash_attn", note="flash-attn package (FA2)"),
        Backend("fa3", "_flash_3", None, True, "flash_attn_interface", note="FlashAttention-3 (Hopper)"),
        Backend("sage", "sage", None, True, "sageattention",
                note="SageAttention 2 (int8 Q K^T, FP8 P V on Hopper; lossy), as one op compiled blocks keep whole"),
        Backend("flex", "flex", None, False, note="torch flex_attention"),
        Backend("xformers", "xformers", None, True, "xformers", note="xformers memory-efficient attention"),
        Backend("fa4", "", None, True, "flash_attn.cute",
                note="FlashAttention-4 (flash-attn-4 package, CuTe DSL; Hopper and newer)"),
        Backend("fp8", "", None, True, "triton",
                note="omni_accel's 8-bit flash attention: int8 QK^T, e4m3 PV (Triton; lossy)"),
    )
}
ALIASES = {"native": "sdpa", "flash": "flash_attn", "flash3": "fa3", "flash4": "fa4", "sageattention": "sage"}


def _installed(package: str | None) -> bool:
    return package is None or installed(package)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backend names that can run on ``device`` with what is installed (``auto`` is always accepted too)."""
    device = torch.device(device)

    def runs_here(b: Backend) -> bool:
        if b.name == "fp8":
            return _fp8_refusal(device) is None
        if b.name == "fa4" and device.type == "cuda" and torch.cuda.is_available():
            return _fa4_refusal(device) is None
        return device.type == "cuda" or not b.needs_cuda

    return [b.name for b in BACKENDS.values() if _installed(b.package) and runs_here(b)]


@dataclass(frozen=True)
class AutoRule:
    """One row of ``attention="auto"``'s decision table: the first row that matches a pipeline decides."""

    device: str  # "cuda" or "cpu"
    min_capability: tuple[int, int] | None  # CUDA compute capability this row needs, None = any
    dtypes: tuple[torch.dtype, ...] | None  # None = any
    compiled: bool | None  # whether the blocks are compiled (compile=True/"max"); None = either
    max_head_dim: int | None  # None = any
    fp8_stack: bool | None  # quant="fp8" (lossy stack); None = either
    backend: str
    why: str
    # calls with at least long_min_tokens keys go to long_backend instead (kept only where it can run here)
    long_backend: str | None = None
    long_min_tokens: int = 0
    int8_stack: bool | None = None  # quant="int8"; None = either
    # faster kernels an earlier or this row would take here but cannot, each with why and the fix (the report's
    # "passed_over": a user learns what installing a package would give)
    passed_over: tuple[str, ...] = ()


_HALF = (torch.bfloat16, torch.float16)
# Measured on an H200 (torch 2.11): benchmarks/bench_attention.py rows in docs/kernels.md, "attention='auto'".
AUTO_TABLE: tuple[AutoRule, ...] = (
    AutoRule("cuda", (9, 0), _HALF, True, 128, True, "fp8",
             "FP8 stack on Hopper with cuDNN's FP8 SDPA: e4m3 attention (lossy, like the FP8 linears it joins)"),
    AutoRule("cuda", (9, 0), _HALF, True, 128, False, "cudnn",
             "int8 stack, compiled, Hopper, sageattention installed: cuDNN SDPA below 16k keys (FLUX's 4.6k: 93.4 "
             "against 100.2 ms per step with SageAttention), SageAttention from 16k keys (Wan's 32.8k: 4.04 against "
             "4.72 s per step); its int8 Q K^T holds the int8 stack's quality bound",
             long_backend="sage", long_min_tokens=sage_attention.AUTO_MIN_TOKENS, int8_stack=True),
    AutoRule("cuda", (9, 0), _HALF, True, 128, None, "cudnn",
             "compiled, Hopper+, 16-bit, head dim <= 128: cuDNN SDPA is the fastest measured kernel up to 4.6k "
             "tokens; from 8,192 keys FlashAttention-4 where installed (1.07-1.18x cuDNN from 9.4k keys)",
             long_backend="fa4", long_min_tokens=fa4_attention.AUTO_MIN_TOKENS),
    AutoRule("cuda", None, None, False, None, None, "sdpa",
             "eager: PyTorch's own SDPA choice, exactly the plain pipeline's kernel (never slower than not "
             "calling accelerate)"),
    AutoRule("cuda", None, None, None, None, None, "sdpa", "no measured winner here: PyTorch's own SDPA choice"),
    AutoRule("cpu", None, None, None, None, None, "sdpa", "CPU: PyTorch SDPA (the only CPU kernels)"),
)


def choose_auto(device: torch.device, dtype: torch.dtype, compiled: bool, head_dim: int | None = None,
                fp8_stack: bool = False, capability: tuple[int, int] | None = None,
                int8_stack: bool = False) -> AutoRule:
    """The rule ``attention="auto"`` follows here. ``capability`` defaults to the device's (tests fake it)."""
    if device.type == "cuda" and capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    passed_over: list[str] = []
    for rule in AUTO_TABLE:
        if rule.device != device.type:
            continue
        if rule.min_capability is not None and (capability is None or capability < rule.min_capability):
            continue
        if rule.dtypes is not None and dtype not in rule.dtypes:
            continue
        if rule.compiled is not None and rule.compiled != compiled:
            continue
        if rule.max_head_dim is not None and (head_dim is None or head_dim > rule.max_head_dim):
            continue
        if rule.fp8_stack is not None and rule.fp8_stack != fp8_stack:
            continue
        if rule.int8_stack is not None and rule.int8_stack != int8_stack:
            continue
        if rule.long_backend == "sage" and (refusal := sage_attention.auto_refusal(capability)) is not None:
            if capability is not None and capability[0] == 9:  # a package or its kernel missing: installing helps
                passed_over.append(f"sage from {rule.long_min_tokens} keys: {refusal}")
            continue
        if rule.backend == "fp8" and _fp8_stack_attention_refusal(device) is not None:
            continue
        if rule.long_backend == "fa4" and (refusal := _fa4_refusal(device, capability)) is not None:
            if not _installed(fa4_attention.PACKAGE):  # the refusal's own text is written for attention="fa4"
                refusal = f"flash-attn-4 is not installed; {INSTALL[fa4_attention.PACKAGE]}"
            passed_over.append(f"fa4 from {rule.long_min_tokens} keys: {refusal}")
            rule = replace(rule, long_backend=None, long_min_tokens=0)
        return replace(rule, passed_over=tuple(passed_over)) if passed_over else rule
    return AutoRule(device.type, None, None, None, None, None, "sdpa", "no rule for this device type")


def _fa4_refusal(device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    return fa4_attention.unavailable_reason(device, capability)


def _fp8_stack_attention_refusal(device: torch.device) -> str | None:
    """auto picks FP8 attention for the FP8 stack only on cuDNN's FP8 SDPA (the Triton kernel measured slower)."""
    from .cudnn_fp8_attention import unavailable_reason

    return unavailable_reason(device)


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, compiled: bool = False,
                    head_dim: int | None = None, fp8_stack: bool = False, int8_stack: bool = False) -> Backend:
    """Turn a user's name (or ``auto``) into a backend that runs here; raise AccelError with the choices."""
    if name == "auto":
        return BACKENDS[choose_auto(device, dtype, compiled, head_dim, fp8_stack, int8_stack=int8_stack).backend]
    key = ALIASES.get(name, name)
    if key not in BACKENDS:
        raise AccelError(
            f"attention={name!r} is not a known backend. Available here: auto, "
            f"{', '.join(available_backends(device))} (all known: {', '.join(BACKENDS)})."
        )
    backend = BACKENDS[key]
    if backend.name == "fp8":
        return _check_fp8(device)
    if backend.name == "fa4":
        refusal = _fa4_refusal(device)
        if refusal is not None:
            raise AccelError(refusal)
        return backend
    if backend.needs_cuda and device.type != "cuda":
        raise AccelError(
            f"attention={name!r} needs a CUDA GPU but the pipeline runs on {device}; use attention='auto' or 'sdpa'."
        )
    if not _installed(backend.package):
        raise AccelError(missing_message(backend.package, f"attention={name!r}", "use attention='auto'"))
    return backend


def _fp8_refusal(device: torch.device) -> str | None:
    """Why attention='fp8' cannot run on ``device``, or None. The capability is read only where torch sees CUDA:
    ``available_backends("cuda")`` also lists what a GPU would take on machines without one."""
    from . import fused

    if not _installed("triton"):
        return missing_message("triton", "attention='fp8'", "use attention='auto'")
    if device.type != "cuda" and not fused.interpreted():  # the interpreter runs it on CPU tensors (CI)
        return (f"attention='fp8' needs a CUDA GPU with FP8 tensor cores but the pipeline runs on {device}; "
                "use attention='auto'.")
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"attention='fp8' needs FP8 tensor cores (compute capability 8.9 or newer); this GPU has "
                f"{major}.{minor}. Use attention='auto'.")
    return None


def _check_fp8(device: torch.device) -> Backend:
    refusal = _fp8_refusal(device)
    if refusal is not None:
        raise AccelError(refusal)
    return BACKENDS["fp8"]


# Kernels SDPA may fall back to when the chosen one rejects a shape or dtype (e.g. cuDNN and a float mask).
_FALLBACKS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class _SdpaKernelHook(ModelHook):
    """Runs the module's forward inside ``sdpa_kernel`` with ``backend`` first in SDPA's priority order."""

    def __init__(self, backend: SDPBackend):
        super().__init__()
        self.order = [backend] + [b for b in _FALLBACKS if b != backend]

    def new_forward(self, module, *args, **kwargs):
        with sdpa_kernel(self.order, set_priority=True):
            return self.fn_ref.original_forward(*args, **kwargs)


def _fp8_stack(ctx: PassContext) -> bool:
    """Whether auto may take FP8 attention: the lossy FP8 stack, on a family whose attention goes through
    diffusers' dispatcher (where the FP8 route hooks in), without sequence parallelism (its own attention path)."""
    return (ctx.config.quant == "fp8" and ctx.adapter.attention_via_dispatcher
            and ctx.config.sequence_degree == 1)


def _int8_stack(ctx: PassContext) -> bool:
    return ctx.config.quant == "int8"


def _head_dim(transformer) -> int | None:
    """The attention head size from the transformer's config (diffusers' DiTs name it attention_head_dim, or
    give dim and n_heads)."""
    config = getattr(transformer, "config", {}) or {}
    if config.get("attention_head_dim"):
        return int(config["attention_head_dim"])
    dim, heads = config.get("dim"), config.get("n_heads") or config.get("num_attention_heads")
    return int(dim) // int(heads) if dim and heads else None


def _attention_processors(transformer) -> list:
    return [m.processor for m in transformer.modules() if hasattr(m, "processor") and m.processor is not None]


class AttentionPass(AccelPass):
    name = "attention"

    def wanted(self, config) -> bool:
        return True

    @staticmethod
    def _decision(ctx: PassContext) -> dict:
        """What auto's table reads of this pipeline (``choose_auto``'s arguments besides the device)."""
        transformer = ctx.adapter.transformers_of(ctx.pipe)[0][1]  # Wan 2.2 may hold only transformer_2
        return dict(dtype=transformer.dtype, compiled=bool(ctx.config.compile), head_dim=_head_dim(transformer),
                    fp8_stack=_fp8_stack(ctx), int8_stack=_int8_stack(ctx))

    def _plan(self, ctx: PassContext) -> tuple[Backend, tuple[str, int] | None]:
        """The backend, and auto's long-sequence route: (kernel, the key count from which calls take it), or None."""
        decision = self._decision(ctx)
        backend = resolve_backend(ctx.config.attention, ctx.device, **decision)
        if not ctx.adapter.attention_via_dispatcher and backend.sdpa is None and backend.name != "sdpa":
            # only SDPA kernels reach processors that call F.scaled_dot_product_attention themselves
            usable = [b.name for b in BACKENDS.values() if b.sdpa is not None or b.name == "sdpa"]
            raise AccelError(
                f"attention={ctx.config.attention!r} cannot reach {ctx.adapter.family}: its attention calls PyTorch "
                f"SDPA directly, so only SDPA kernels apply. Use one of: auto, {', '.join(usable)}."
            )
        if backend.name == "fa4":
            return backend, None
        if self._long_routes_apply(ctx):
            rule = choose_auto(ctx.device, **decision)
            # under a whole-forward CUDA graph both long routes run between the graph's segments
            # (cuda_graphs.run_outside_graph: sage_attention.py, fa4_attention.py)
            if rule.long_backend is not None:
                return backend, (rule.long_backend, rule.long_min_tokens)
        return backend, None

    def check(self, ctx: PassContext) -> None:
        backend, long_route = self._plan(ctx)
        if long_route:
            _long_route_bounds(*long_route)  # refuses a bad timing switch before anything is patched
        if backend.name in ("fp8", "fa4") and ctx.config.sequence_degree > 1:
            raise AccelError(
                f"attention={backend.name!r} cannot be combined with sequence parallelism (sp={ctx.config.sp}): the "
                "ring and Ulysses paths need the dispatcher's own kernels. Use attention='auto' with sp, or sp=1."
            )
        if ctx.config.quant == "fp8":
            from .fp8_attention import implementation_for
            from .quant import check_static_attention

            check_static_attention(ctx, backend.name == "fp8" and implementation_for(ctx.device) == "cudnn")

    def apply(self, ctx: PassContext) -> None:
        from .fp8_attention import route_transformer

        backend, long_route = self._plan(ctx)
        long_route = _long_route_bounds(*long_route) if long_route else None  # (kernel, from keys, timed below)
        passed_over = self._passed_over(ctx)
        routed = {backend.name} | ({long_route[0]} if long_route else set())
        if ctx.config.sequence_degree == 1:
            _report_fallbacks(ctx.state, routed, timed=bool(long_route) and long_route[2] > 0)
        for name, transformer in ctx.adapter.transformers_of(ctx.pipe):
            details = {"passed_over": list(passed_over)} if passed_over else {}
            if backend.name == "sdpa":
                undo = lambda: None  # noqa: E731 -- default path: nothing to patch
            elif backend.name == "fp8":
                from .fp8_attention import implementation_for

                implementation = implementation_for(ctx.device)
                undo = route_transformer(transformer, implementation)
                ctx.state.record("attention", undo, component=name, backend="fp8", implementation=implementation,
                                 requested=ctx.config.attention)
                if implementation == "cudnn" and ctx.config.quant == "fp8":  # per-tensor scales: static ones apply
                    from .quant import start_static_attention

                    start_static_attention(ctx, name, transformer)
                continue
            elif backend.name == "fa4":
                undo = route_transformer(transformer, "fa4")
            elif backend.name == "sage" and ctx.config.sequence_degree == 1:
                # our op, not diffusers' sage backend: its Python breaks compiled blocks (sage_attention.py)
                # per transformer, from the GPU its weights are on (a pipeline's device may carry no index)
                implementation = sage_attention.route_implementation(_weights_device(transformer, ctx.device))
                undo = route_transformer(transformer, implementation)
                details.update(route="omni_accel::sage_attention", implementation=implementation)
            elif backend.sdpa is not None:
                undo = add_hook(transformer, f"sdpa_kernel.{name}", _SdpaKernelHook(backend.sdpa))
                if long_route:  # auto: long sequences to FlashAttention-4 / SageAttention, the rest to the SDPA kernel
                    kernel, min_tokens, timed_below = long_route
                    undo = _both(route_transformer(transformer, kernel, min_tokens, timed_below), undo)
                    details["long_sequences"] = f"{kernel} from {min_tokens} keys" + (
                        f" (below {timed_below}: the faster of it and {backend.name}, timed per shape)"
                        if timed_below > min_tokens else "")
            else:
                undo = _set_dispatcher_backend(transformer, backend.dispatcher)
            ctx.state.record("attention", undo, component=name, backend=backend.name, requested=ctx.config.attention,
                             **details)
        logger.info("omni_accel: attention backend %s (%s)", backend.name, backend.note)
        for line in passed_over:
            logger.info("omni_accel: attention='auto' passed over %s", line)

    @staticmethod
    def _long_routes_apply(ctx: PassContext) -> bool:
        """Whether auto's long-sequence routes (FA4, SageAttention) can serve this pipeline: its attention goes
        through diffusers' dispatcher and no sequence parallelism (the ring / Ulysses paths need the dispatcher's
        kernels)."""
        return (ctx.config.attention == "auto" and ctx.adapter.attention_via_dispatcher
                and ctx.config.sequence_degree == 1)

    def _passed_over(self, ctx: PassContext) -> tuple[str, ...]:
        """The faster kernels auto's table would take for this pipeline but cannot here, with why: only where a
        long-sequence route could run at all (``_long_routes_apply``), so that installing the package named would
        route calls."""
        if not self._long_routes_apply(ctx):
            return ()
        return choose_auto(ctx.device, **self._decision(ctx)).passed_over


# The packaged kernels omni_accel's routes call, by backend name: (the name a report shows, its refused_shapes()). A
# package that is found but fails at a call (a missing runtime library, a shape its kernels reject) costs that shape
# the kernel: another kernel computes it inside the op from then on (SDPA; for SageAttention's prepared route without
# its Hopper kernel, PyTorch on the dequantized operands, listed under one marker).
_PACKAGED_KERNELS = {"fa4": (fa4_attention.KERNEL_NAME, fa4_attention.refused_shapes),
                     "sage": (sage_attention.KERNEL_NAME, sage_attention.refused_shapes)}


def _report_fallbacks(state, routed: set[str], timed: bool = False) -> None:
    """``report()["attention_fallbacks"]``: for each packaged kernel this pipeline routes calls to, what it failed on
    in this process (process-wide lists; {} means no failure yet), and ``report()["attention_served"]``: how many
    calls it computed (process-wide counts; 0 with no failure means no call reached it). Without them a broken
    install would look, in the report, like the fast kernel at work; the log says it once per shape. With auto's
    FA4 route, ``report()["attention_timed"]``: the shapes it timed against SDPA (process-wide), times and winner."""
    kernels = [_PACKAGED_KERNELS[name] for name in sorted(routed) if name in _PACKAGED_KERNELS]
    if kernels:
        state.report_sections["attention_fallbacks"] = lambda: {label: shapes() for label, shapes in kernels}
        state.report_sections["attention_served"] = lambda: {label: fa4_attention.served_calls(label)
                                                             for label, _ in kernels}
    if timed:  # auto's FA4 route: the shapes it timed against SDPA, each with both kernels' times and the winner
        state.report_sections["attention_timed"] = fa4_attention.timed_choices


def _long_route_bounds(kernel: str, min_tokens: int) -> tuple[str, int, int]:
    """auto's long route as (kernel, first key count routed, key count below which the op times FA4 against SDPA per
    shape: 0 for none). The timing is FA4's switch ``fa4_attention.TIMED_MIN_TOKENS`` (off by default)."""
    timed_from = fa4_attention.TIMED_MIN_TOKENS
    if timed_from is not None and (isinstance(timed_from, bool) or not isinstance(timed_from, int) or timed_from < 1):
        raise AccelError(f"fa4_attention.TIMED_MIN_TOKENS={timed_from!r} is not a key count: set it to None (off, the "
                         "default) or to a positive int such as 4096.")
    if kernel == "fa4" and timed_from is not None and timed_from < min_tokens:
        return kernel, timed_from, min_tokens
    return kernel, min_tokens, 0


def _weights_device(module: torch.nn.Module, default: torch.device) -> torch.device:
    """The device of ``module``'s first parameter (``default`` for a module without any)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else default


def _both(first, second):
    """One undo that runs ``first`` then ``second``."""
    def undo() -> None:
        first()
        second()

    return undo


def _set_dispatcher_backend(transformer, dispatcher_name: str):
    """Set every processor's backend; the undo restores each processor's and the registry's previous value.

    diffusers' ``reset_attention_backend`` clears processors to None but leaves the registry's global active
    backend changed, which would leak into other models; so we record and restore both ourselves.
    """
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    processors = [p for p in _attention_processors(transformer) if hasattr(p, "_attention_backend")]
    previous = [p._attention_backend for p in processors]
    previous_active = _AttentionBackendRegistry._active_backend
    transformer.set_attention_backend(dispatcher_name)

    def undo() -> None:
        for processor, value in zip(processors, previous):
            processor._attention_backend = value
        _AttentionBackendRegistry._active_backend = previous_active

    return undo
