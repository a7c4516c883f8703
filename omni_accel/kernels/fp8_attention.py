"""FP8 attention (``attention="fp8"``, lossy): both attention GEMMs with 8-bit operands.

Why: with FP8 linears the FLUX step's largest bf16 piece is attention (23-25 ms of 107 on an H200, cuDNN at
~640 TFLOP/s), and at Wan's 32k-token video shapes attention is over half of the FLOPs.

Two implementations behind the same routing, chosen per transformer when the pass is applied:
- ``cudnn``: cuDNN's fused FP8 SDPA through NVIDIA's cudnn-frontend package (``cudnn_fp8_attention.py``), on
  Hopper and newer when the package is installed -- the fast one;
- ``triton_tma``: omni_accel's own Triton kernel (below) in its TMA-fed form, on Hopper without the package;
- ``triton``: the same kernel's pointer form, everywhere else Triton runs (and in Triton's interpreter, which is how
  CI tests the routing).

The Triton implementation, and why it is split as it is:
- Quantization is plain torch (``quantize_qkv``), so under ``compile=True`` inductor fuses it into the kernel that
  already writes q / k (RMSNorm + RoPE). By default (``MODES``) Q and K become int8 with a scale per token and V
  e4m3 with a scale per (batch, head). K is "smoothed" first (its mean over the tokens subtracted, as SageAttention
  does): that adds the same q.mean_k to every score of a query row, which softmax ignores, and it removes the
  per-channel offsets of DiT keys that would otherwise spend the 8-bit range.
- The kernel (``fp8_attention_triton.py``) is one custom op, ``omni_accel::fp8_attention_core``, opaque to
  inductor like SDPA is.
- Routing: the attention pass swaps the processors' module-global ``dispatch_attention_fn`` for a wrapper that
  takes the FP8 path only while an FP8-routed transformer runs (other pipelines of the same family in the process
  keep their attention; the same route carries FlashAttention-4 for ``attention="fa4"`` and auto's long sequences,
  ``fa4_attention.py``, and SageAttention for ``attention="sage"``, ``sage_attention.py``) and only for calls it
  can serve (no mask, not causal, no dropout, head dim 64 or 128, same head count for q and k/v); every other call
  goes to the original dispatcher.
- Static scales (cuDNN implementation, with the FP8 linears' static activations): ``attach_attention_scales``
  gives every attention module (a module with a ``processor``) its own ``AttentionScales`` child and a hook that
  names it as the current module while its forward runs (``_SCOPE``); the dispatcher wrapper hands the innermost
  one to the kernel. The dispatcher is called without the module, so the hook is what gives a call its identity.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import torch
from diffusers.hooks import ModelHook

from ..errors import AccelError
from ..hooks import add_hook, swap_module_global
from . import fa4_attention, fused, sage_attention

FP8_MAX = 448.0  # largest finite float8_e4m3fn
HEAD_DIMS = (64, 128)  # what the GPU kernel is tuned for (every supported DiT); 8-bit MMAs need >= 32 anyway
INTERPRETED_HEAD_DIMS = (16, 32, 64, 128)  # Triton's interpreter (CI): the tiny test pipelines have 16
# Read once at import, not per call: the calls are traced by dynamo inside compiled blocks, and fused.interpreted()
# imports triton, which dynamo cannot trace (a graph break per attention call, seen on CPU).
_INTERPRETED = fused.interpreted()
_HEAD_DIMS = INTERPRETED_HEAD_DIMS if _INTERPRETED else HEAD_DIMS


def _triton():
    return importlib.import_module("omni_accel.kernels.fp8_attention_triton")


# The kernel's operand precisions: (Q K^T, P V). "int8_fp8" is SageAttention2's choice: 8-bit integers with a scale
# per token keep the scores ~3x more accurate than e4m3 (measured in tests/test_kernels.py), at the same
# tensor-core rate on Hopper.
MODES = {"fp8": (False, True), "int8_fp8": (True, True), "int8": (True, False), "int8_block_fp8": (True, True)}
DEFAULT_MODE = "int8_fp8"
# Modes whose K has one int8 scale per this many keys (and head) instead of one per key. Why: the kernel multiplies
# each score tile by its keys' scales; per key that is a vector along the tile's columns, which on Hopper makes ptxas
# serialize the tile's warp-group MMAs (its C7515 warning); one scale per tile is a scalar, and it does not
# (tests/test_kernels.py compiles both for sm_90 and reads ptxas's report). On the built-in model a block of keys
# costs 0.7 dB of mean PSNR against a scale per key, far above e4m3's Q K^T (benchmarks/study_fp8_attention_error.py,
# "qk_int8"). The kernel's key tiles must lie inside one block: its tile widths divide the block.
K_BLOCKS = {"int8_block_fp8": 128}


def _per_head_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, H, D) -> e4m3 values and a float32 scale per (B, H) with x ~= values * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    return (xf / scale[:, None, :, None]).to(torch.float8_e4m3fn), scale


def _per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, H, D) -> int8 values as a (B, H, S, D) view and a float32 scale per (B, H, S)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    values = torch.round(xf / scale[..., None]).to(torch.int8)
    return values.transpose(1, 2), scale.transpose(1, 2).contiguous()


def _per_block_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, H, D) -> int8 values as a (B, H, S, D) view and a float32 scale per (B, H, block of ``block`` tokens);
    the last block may be short."""
    xf = x.float()
    batch, seq, heads, dim = xf.shape
    blocks = -(-seq // block)
    padded = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, blocks * block - seq))
    padded = padded.reshape(batch, blocks, block, heads, dim)
    scale = padded.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 127.0  # (B, blocks, H)
    per_token = scale.repeat_interleave(block, dim=1)[:, :seq]  # (B, S, H)
    values = torch.round(xf / per_token[..., None]).to(torch.int8)
    return values.transpose(1, 2), scale.transpose(1, 2).contiguous()


def _tokens_contiguous(v8: torch.Tensor, aligned: bool) -> torch.Tensor:
    """(B, S, H, D) -> a (B, H, S, D) view whose tokens are contiguous; with ``aligned`` each (batch, head, dim) row
    padded to 16 bytes: TMA (the Hopper form's loads) needs 16-byte aligned row strides, and Wan's 32,760 tokens are
    not."""
    seq = v8.shape[1]
    rows = v8.permute(0, 2, 3, 1)
    if seq % 16 == 0 or not aligned:
        return rows.contiguous().transpose(2, 3)
    # padded in float32, which holds every e4m3 value exactly (inductor cannot pad a float8 tensor)
    padded = torch.nn.functional.pad(rows.float(), (0, -seq % 16)).to(v8.dtype)
    return padded[..., :seq].transpose(2, 3)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str = DEFAULT_MODE,
                 tma_aligned: bool = False):
    """The kernel's operands from diffusers' (B, S, H, D) q / k / v, as (B, H, S, D) views, and their scales.
    An e4m3 V is stored transposed (tokens contiguous): Hopper's FP8 MMA wants the reduced dim contiguous; with
    ``tma_aligned`` its token rows are padded to 16 bytes in storage (the TMA-fed kernel's loads need it)."""
    qk_int8, pv_fp8 = MODES[mode]
    k = k.float()
    k = k - k.mean(dim=1, keepdim=True)  # softmax-invariant shift; see the module docstring
    if qk_int8:
        q_op, q_scale = _per_token_int8(q)
        k_op, k_scale = _per_block_int8(k, K_BLOCKS[mode]) if mode in K_BLOCKS else _per_token_int8(k)
    else:
        q_op, q_scale = _per_head_fp8(q)
        k_op, k_scale = _per_head_fp8(k)
        q_op, k_op = q_op.transpose(1, 2), k_op.transpose(1, 2)
    if pv_fp8:
        v8, v_scale = _per_head_fp8(v)
        v_op = _tokens_contiguous(v8, tma_aligned)
    else:
        v_op, v_scale = v.transpose(1, 2), torch.ones(1, device=v.device)
    return q_op, k_op, v_op, q_scale, k_scale, v_scale


@torch.library.custom_op("omni_accel::fp8_attention_core", mutates_args=())
def fp8_attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                       k_scale: torch.Tensor, v_scale: torch.Tensor, sm_scale: float, out_dtype: torch.dtype,
                       qk_int8: bool, pv_fp8: bool, k_block: int = 0, design: str = "pointer") -> torch.Tensor:
    batch, heads, seq_q, head_dim = q.shape
    out = torch.empty(batch, seq_q, heads, head_dim, dtype=out_dtype, device=q.device)
    return _triton().launch(q, k, v, q_scale, k_scale, v_scale, sm_scale, out, qk_int8, pv_fp8,
                            interpreted=not q.is_cuda, k_block=k_block, design=design)


@fp8_attention_core.register_fake
def _(q, k, v, q_scale, k_scale, v_scale, sm_scale, out_dtype, qk_int8, pv_fp8, k_block=0, design="pointer"):
    batch, heads, seq_q, head_dim = q.shape
    return q.new_empty((batch, seq_q, heads, head_dim), dtype=out_dtype)


def fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
                  mode: str = DEFAULT_MODE, design: str = "pointer") -> torch.Tensor:
    """Non-causal, unmasked attention of (B, S, H, D) tensors (diffusers' dispatcher layout), output like query;
    ``design`` is the kernel's form (fp8_attention_triton.DESIGNS; "tma" takes mode "int8_block_fp8" only)."""
    if not (query.is_cuda or _INTERPRETED):
        raise AccelError("attention='fp8' runs a Triton kernel on CUDA tensors (or in Triton's interpreter with "
                         "TRITON_INTERPRET=1); use attention='auto' on this device.")
    if mode not in MODES:
        raise AccelError(f"fp8 attention mode={mode!r} is not known; use one of {', '.join(MODES)}.")
    sm_scale = scale if scale is not None else query.shape[-1] ** -0.5
    operands = quantize_qkv(query, key, value, mode, tma_aligned=design != "pointer")
    return fp8_attention_core(*operands, float(sm_scale), query.dtype, *MODES[mode], K_BLOCKS.get(mode, 0), design)


def fp8_eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: float,
                 is_causal: bool) -> bool:
    """Whether the FP8 kernel serves this call; everything else goes to the original dispatcher."""
    return (attn_mask is None and not is_causal and not dropout_p and query.ndim == 4
            and query.shape[-1] in _HEAD_DIMS and key.shape[2] == query.shape[2] == value.shape[2]
            and query.dtype.is_floating_point)


IMPLEMENTATIONS = ("cudnn", "triton_tma", "triton")  # FP8 ones; the route also carries "fa4" (fa4_attention.py),
# "sage" and "sage_package" (sage_attention.route_implementation)
# "triton_tma" (Hopper): the Triton kernel's TMA-fed form, which takes K's scales per block of keys only (a scale per
# key serializes its MMAs, see K_BLOCKS; the block costs 0.7 dB of mean PSNR on the built-in model). Kernel alone on
# an H100, it ran 2.08x the pointer kernel in the same block mode at Wan's 81-frame shape (34.0 vs 70.7 ms per call,
# 1.11x bf16 cuDNN's 37.7) and 1.14x at FLUX's, with the same error per call
# (benchmarks/results/bench_attention_h100_tma_tiles_20261207.json).
TMA_MODE = "int8_block_fp8"


def _tma_kernel_runs_on(device: torch.device) -> bool:
    """Hopper (the GPUs it was measured on) with a Triton that builds TMA descriptors in kernels and whose loops take
    ``warp_specialize`` (3.4+; the kernel names it either way)."""
    if device.type != "cuda" or _INTERPRETED or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    try:
        import triton.language as tl
    except ImportError:
        return False
    return hasattr(tl, "make_tensor_descriptor") and \
        "warp_specialize" in inspect.signature(tl.range.__init__).parameters


def implementation_for(device: torch.device) -> str:
    """cuDNN's FP8 SDPA where it runs (Hopper+, package installed), else the Triton kernel: its TMA-fed form on
    Hopper, the pointer form elsewhere."""
    from .cudnn_fp8_attention import unavailable_reason

    if unavailable_reason(device) is None and not _INTERPRETED:
        return "cudnn"
    return "triton_tma" if _tma_kernel_runs_on(device) else "triton"


class _Route:
    """How many routed transformer forwards are running (nesting-safe), and the implementation and minimum key
    count of the innermost one. No per-call counters here: compiled blocks read this class, and dynamo would guard
    on (and recompile for) every counter value."""

    depth = 0
    implementation = "triton"
    min_tokens = 0
    timed_below = 0  # FA4 route: calls with fewer keys are served by the kernel timed faster (fa4_attention.py)


class _RouteHook(ModelHook):
    def __init__(self, implementation: str, min_tokens: int = 0, timed_below: int = 0):
        super().__init__()
        self.implementation = implementation
        self.min_tokens = min_tokens
        self.timed_below = timed_below

    def new_forward(self, module, *args, **kwargs):
        _Route.depth += 1
        outer = _Route.implementation, _Route.min_tokens, _Route.timed_below
        _Route.implementation, _Route.min_tokens, _Route.timed_below = (self.implementation, self.min_tokens,
                                                                        self.timed_below)
        scope_depth = len(_SCOPE)
        try:
            return self.fn_ref.original_forward(*args, **kwargs)
        finally:
            _Route.depth -= 1
            _Route.implementation, _Route.min_tokens, _Route.timed_below = outer
            del _SCOPE[scope_depth:]  # an attention forward that raised skipped its scope's exit hook


# The AttentionScales of the attention modules whose forwards are running, innermost last. A list, so compiled
# blocks trace the hooks' append / pop as side effects; the scales are buffers of the block's own modules, so one
# graph still serves every block of a type (CPU-tested: no recompile per block).
_SCOPE: list = []
SCALES_ATTR = "omni_accel_fp8_scales"


def _enter_scope(module, args, kwargs):
    _SCOPE.append(getattr(module, SCALES_ATTR))


def _leave_scope(module, args, kwargs, output):
    _SCOPE.pop()


def attention_modules(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose attention calls the route sees: diffusers' attention modules carry a ``processor``."""
    return [(name, m) for name, m in transformer.named_modules() if getattr(m, "processor", None) is not None]


def attach_attention_scales(transformer: torch.nn.Module, prefix: str) -> tuple[dict, Callable[[], None]]:
    """Give each attention module of ``transformer`` its own (uncalibrated) ``AttentionScales``, named
    ``<prefix>.<module name>``; return {name: scales} and the undo."""
    from .cudnn_fp8_attention import AttentionScales

    fallback = next(transformer.parameters()).device
    scales, undos = {}, []
    for name, module in attention_modules(transformer):
        device = next(module.parameters(), torch.empty(0, device=fallback)).device
        scales[f"{prefix}.{name}"] = module_scales = AttentionScales(f"{prefix}.{name}", device)
        module.add_module(SCALES_ATTR, module_scales)
        # torch's own module hooks, the same two functions on every module: a diffusers hook would make each
        # module's forward its own functools.partial, which compiled blocks guard on by identity, and
        # always_call=True makes them guard on each module's hook ids: a recompile per block either way (seen on
        # CPU). A forward that raises leaves its scope entry behind; the transformer's route hook drops it.
        handles = (module.register_forward_pre_hook(_enter_scope, with_kwargs=True),
                   module.register_forward_hook(_leave_scope, with_kwargs=True))
        undos.append((module, handles))

    def undo() -> None:
        for module, handles in reversed(undos):
            for handle in handles:
                handle.remove()
            delattr(module, SCALES_ATTR)

    return scales, undo


def _served(query, key, value, attn_mask, dropout_p, is_causal) -> bool:
    if _Route.implementation in ("sage", "sage_package"):
        return sage_attention.eligible(query, key, value, attn_mask, dropout_p, is_causal, _Route.min_tokens)
    if _Route.implementation == "fa4":
        return fa4_attention.eligible(query, key, value, attn_mask, dropout_p, is_causal, _Route.min_tokens)
    return fp8_eligible(query, key, value, attn_mask, dropout_p, is_causal)


def _routed_attention(query, key, value, scale):
    if _Route.implementation in ("sage", "sage_package"):
        # "sage_package": a GPU without the package's Hopper kernel, where sageattn picks its own kernels
        if sage_attention.PREP_IN_GRAPH and _Route.implementation == "sage":  # traced: inductor fuses the quantization
            return sage_attention.prepared_attention(query, key, value, scale)
        if sage_attention.SMOOTH_KEYS_IN_GRAPH:  # traced: inductor fuses the mean and subtraction into K's kernels
            return sage_attention.sage_attention(query, sage_attention.smoothed_keys(key), value, scale, True)
        return sage_attention.sage_attention(query, key, value, scale)
    if _Route.implementation == "fa4":
        return fa4_attention.fa4_attention(query, key, value, scale, key.shape[1] < _Route.timed_below)
    if _Route.implementation == "cudnn":
        from .cudnn_fp8_attention import cudnn_fp8_attention

        return cudnn_fp8_attention(query, key, value, scale, _SCOPE[-1] if _SCOPE else None)
    if _Route.implementation == "triton_tma":
        return fp8_attention(query, key, value, scale, mode=TMA_MODE, design="tma")
    return fp8_attention(query, key, value, scale)


def _make_dispatch(original: Callable) -> Callable:
    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if _Route.depth and _served(query, key, value, attn_mask, dropout_p, is_causal):
            return _routed_attention(query, key, value, scale)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=backend,
                        parallel_config=parallel_config)

    dispatch_attention_fn._omni_accel_fp8_original = original
    return dispatch_attention_fn


_ROUTED: dict[str, list] = {}  # module name -> [original dispatch_attention_fn, transformers routed through it]


def route_transformer(transformer: torch.nn.Module, implementation: str = "triton",
                      min_tokens: int = 0, timed_below: int = 0) -> Callable[[], None]:
    """Send ``transformer``'s eligible attention calls to ``implementation`` (an FP8 one, or "fa4" / "sage" for calls
    with at least ``min_tokens`` keys; "fa4" times itself against SDPA per shape for calls with fewer than
    ``timed_below`` keys); return the undo. The modules' ``dispatch_attention_fn`` globals are shared by
    every pipeline of the family in the process, so they are swapped once and put back with the last routed
    transformer's undo (``hooks.swap_module_global``)."""
    undo_hook = add_hook(transformer, f"attention_route.{implementation}",
                         _RouteHook(implementation, min_tokens, timed_below))
    # a module without dispatch_attention_fn does not dispatch attention
    _, undo_globals = swap_module_global(transformer, "dispatch_attention_fn", _ROUTED,
                                         lambda current: None if current is None else _make_dispatch(current))

    def undo_all() -> None:
        undo_globals()
        undo_hook()

    return undo_all
