"""The floor of a forward's arithmetic: its GEMMs and attention calls alone, back to back in one CUDA graph.

On a GPU at its power cap the time of a forward is set by the energy its kernels draw, not by their count: taking
the memory-bound kernels away lets the clock fall under the GEMMs that remain. How fast the forward's arithmetic can
run at all, with the kernels a stack uses, is therefore a measurement, not a sum of kernel times taken from a
profile of the full forward. ``record`` runs one plain forward under a dispatch mode and keeps the shapes of its
matrix products and attention calls, in order; ``floor_forward`` replays them on buffers of those shapes, with
nothing between them:

- with ``fuse_qkv`` (the default), q / k / v projections that read one input (consecutive products of one tensor
  with equal output widths) become one product, as ``fuse_qkv=True`` and the int8 stack run them; without it they
  stay three, as the default 16-bit stack and diffusers run them;
- products of fewer than ``MIN_ROWS`` rows (one row per sample: the modulation and time embeddings, which a
  pipeline call computes once with the modulation table) are left out;
- one weight per shape and one activation per shape, random (between two calls of one shape the calls in between
  stream far more than the L2 cache holds, so sharing them changes little), the output written to a fresh buffer
  per call as a forward's are;
- ``gemm="bf16"``: ``torch.addmm`` / ``torch.mm`` (cuBLAS, the bias in its epilogue); ``gemm="int8"``: omni_accel's
  int8 GEMM with per-token and per-channel rescale (``omni_accel::int8_mm_rescale``) on int8 operands;
- ``attention="bf16"``: attention through SDPA with the recorded q / k / v shapes and strides, cuDNN's kernel on a
  CUDA GPU; ``attention="fp8"``: cuDNN's FP8 attention (``omni_accel::cudnn_fp8_sdpa``, needs
  ``nvidia-cudnn-frontend`` on a Hopper or newer GPU; emulated on the CPU) on e4m3 operands of those shapes, the
  floor of a stack whose attention is 8-bit with its operands quantized where they are written. Only
  unmasked, non-causal attention is recorded; a forward is refused where an attention call ran masked or causal,
  where fewer of SDPA's fused kernels ran than it called SDPA (its math fallback decomposes into matrix products),
  or where no attention call was seen at all (attention written as matrix products): its floor would leave that
  attention out.

On a CUDA GPU the calls are captured once in a CUDA graph, so no launch gap is left either. The floor's output is
not the model's: the probe's forward returns zeros of the model output's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

MIN_ROWS = 8
_aten = torch.ops.aten
GEMM_OPS = (_aten.addmm.default, _aten.mm.default)
# SDPA's fused kernels as the dispatcher sees them (the math fallback is a composite: it reaches a dispatch mode as
# the matrix products it decomposes into, so it is not among them), with the positions of their mask and is_causal
# arguments
ATTENTION_OPS = {getattr(_aten, name).default: (mask, causal) for name, mask, causal in (
    ("_scaled_dot_product_cudnn_attention", 3, 6), ("_scaled_dot_product_flash_attention", None, 4),
    ("_scaled_dot_product_efficient_attention", 3, 6), ("_scaled_dot_product_flash_attention_for_cpu", None, 4))
    if hasattr(_aten, name)}
GEMMS = ("bf16", "int8")
ATTENTIONS = ("bf16", "fp8")


@dataclass
class Gemm:
    rows: int
    inner: int
    cols: int
    bias: bool
    input_ptr: int  # the input's address: consecutive products of one input are one fused product
    width: int = 0  # one projection's output width (before fusion): what a fused neighbour must match

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.inner * self.cols


@dataclass
class Attention:
    shapes: tuple  # (q, k, v) shapes, (batch, heads, tokens, head dim)
    strides: tuple
    dtype: torch.dtype

    @property
    def flops(self) -> int:
        (b, h, s_q, d), (_, _, s_k, _), _ = self.shapes
        return 4 * b * h * s_q * s_k * d


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Gemm | Attention] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMM_OPS:
            bias, (x, mat2) = (args[0], args[1:3]) if func is _aten.addmm.default else (None, args[:2])
            self.calls.append(Gemm(x.shape[0], x.shape[1], mat2.shape[1], bias is not None, x.data_ptr()))
        elif func in ATTENTION_OPS:
            mask_at, causal_at = ATTENTION_OPS[func]
            mask = args[mask_at] if mask_at is not None and len(args) > mask_at else kwargs.get("attn_mask")
            causal = args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False)
            if mask is not None or causal:
                raise ValueError(f"{func}: masked or causal attention; the floor replays unmasked, non-causal "
                                 "attention only")
            q, k, v = args[:3]
            self.calls.append(Attention((tuple(q.shape), tuple(k.shape), tuple(v.shape)),
                                        (q.stride(), k.stride(), v.stride()), q.dtype))
        return func(*args, **kwargs)


class _SdpaCalls(TorchFunctionMode):
    """Counts the forward's ``scaled_dot_product_attention`` calls, to hold against the fused kernels that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def fuse_projections(calls: list) -> list:
    """Consecutive products of one input with equal output widths (q, k and v) as one product."""
    fused: list = []
    for call in calls:
        last = fused[-1] if fused else None
        if (isinstance(call, Gemm) and isinstance(last, Gemm) and call.input_ptr == last.input_ptr
                and (call.rows, call.inner, call.bias) == (last.rows, last.inner, last.bias)
                and call.cols == last.width):
            last.cols += call.cols
            continue
        if isinstance(call, Gemm):
            call = Gemm(call.rows, call.inner, call.cols, call.bias, call.input_ptr, width=call.cols)
        fused.append(call)
    return fused


def record(forward: Callable[[], object], fuse_qkv: bool = True) -> list:
    """The matrix products (``MIN_ROWS`` rows or more; q / k / v as one with ``fuse_qkv``) and attention calls of one
    ``forward``; refused where an attention call would be left out (the module docstring)."""
    recorder, sdpa = _Recorder(), _SdpaCalls()
    with torch.no_grad(), sdpa, recorder:
        forward()
    fused = sum(isinstance(c, Attention) for c in recorder.calls)
    if not fused:
        raise ValueError("no fused attention call in the forward (SDPA's math fallback, or attention written as "
                         "matrix products): the floor would leave the attention out")
    if fused != sdpa.calls:
        raise ValueError(f"{sdpa.calls} scaled_dot_product_attention calls but {fused} ran one of its fused kernels "
                         "(the others took its math fallback): the floor would leave those out")
    calls = fuse_projections(recorder.calls) if fuse_qkv else recorder.calls
    return [c for c in calls if not isinstance(c, Gemm) or c.rows >= MIN_ROWS]


def summary(calls: list) -> dict:
    gemms = [c for c in calls if isinstance(c, Gemm)]
    attention = [c for c in calls if isinstance(c, Attention)]
    return {"gemms": len(gemms), "attention_calls": len(attention),
            "gemm_tflop": round(sum(c.flops for c in gemms) / 1e12, 3),
            "attention_tflop": round(sum(c.flops for c in attention) / 1e12, 3),
            "gemm_shapes": sorted({(c.rows, c.inner, c.cols) for c in gemms})}


class _Buffers:
    """One random tensor per (shape, dtype): the floor's operands."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device, self.tensors = device, {}
        self.generator = torch.Generator(device).manual_seed(seed)

    def get(self, shape: tuple, dtype: torch.dtype, scale: float = 1.0, strides: tuple | None = None) -> torch.Tensor:
        key = (shape, dtype, strides, scale)
        if key not in self.tensors:
            if dtype == torch.int8:
                t = torch.randint(-127, 128, shape, generator=self.generator, device=self.device, dtype=dtype)
            elif dtype == torch.float32 and scale != 1.0:  # rescale factors: positive
                t = torch.rand(shape, generator=self.generator, device=self.device) * scale + scale
            else:
                t = (torch.randn(shape, generator=self.generator, device=self.device) * scale).to(dtype)
            if strides is not None:
                t = torch.empty_strided(shape, strides, dtype=dtype, device=self.device).copy_(t)
            self.tensors[key] = t
        return self.tensors[key]


def _gemm_call(call: Gemm, gemm: str, dtype: torch.dtype, buffers: _Buffers) -> Callable[[], torch.Tensor]:
    m, k, n = call.rows, call.inner, call.cols
    if gemm == "int8":
        from omni_accel.kernels.int8 import int8_mm_rescale

        x, w = buffers.get((m, k), torch.int8), buffers.get((n, k), torch.int8)
        x_scale, w_scale = buffers.get((m, 1), torch.float32, 1e-3), buffers.get((1, n), torch.float32, 1e-3)
        bias = buffers.get((n,), dtype, 0.1) if call.bias else None
        return lambda: int8_mm_rescale(x, w, x_scale, w_scale, bias, dtype)
    x, w_t = buffers.get((m, k), dtype), buffers.get((n, k), dtype, k ** -0.5).t()
    if call.bias:
        bias = buffers.get((n,), dtype, 0.1)
        return lambda: torch.addmm(bias, x, w_t)
    return lambda: torch.mm(x, w_t)


def _fp8_attention_call(call: Attention, buffers: _Buffers) -> Callable[[], torch.Tensor]:
    from omni_accel.kernels import cudnn_fp8_attention as fp8

    if buffers.device.type == "cuda" and (reason := fp8.unavailable_reason(buffers.device)):
        raise RuntimeError(f"the FP8 attention floor needs cuDNN's FP8 attention: {reason}")
    # cuDNN's FP8 kernel reads (batch, tokens, heads, head dim) e4m3 operands, scaled by one factor each
    q8, k8, v8 = (buffers.get((b, s, h, d), fp8.FP8_DTYPE) for b, h, s, d in call.shapes)
    one = buffers.get((1, 1, 1, 1), torch.float32, 0.5)  # rand * 0.5 + 0.5: a positive scale
    head_dim = call.shapes[0][3]
    return lambda: fp8.cudnn_fp8_sdpa(q8, k8, v8, one, one, one, one, head_dim ** -0.5)


def _attention_call(call: Attention, buffers: _Buffers) -> Callable[[], torch.Tensor]:
    q, k, v = (buffers.get(shape, call.dtype, strides=strides) for shape, strides in zip(call.shapes, call.strides))
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn_attention() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return cudnn_attention
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)


def floor_forward(calls: list, gemm: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                  attention: str = "bf16") -> Callable[[], None]:
    """``calls`` replayed back to back (one CUDA graph on a CUDA GPU, captured at the first call)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm={gemm!r}: use one of {GEMMS}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTIONS}")
    buffers = _Buffers(device)
    attention_call = _fp8_attention_call if attention == "fp8" else _attention_call
    steps = [_gemm_call(c, gemm, dtype, buffers) if isinstance(c, Gemm) else attention_call(c, buffers)
             for c in calls]

    def run_all() -> None:
        for step in steps:
            step()

    if device.type != "cuda":
        return run_all
    graph: list[torch.cuda.CUDAGraph] = []

    def replay() -> None:
        if not graph:
            from benchmarks.timing import capture_graph

            graph.append(capture_graph(run_all))
        graph[0].replay()

    return replay


def floor_setup(gemm: str, fuse_qkv: bool = True, attention: str = "bf16"):
    """A bench_peers row's setup: (forward that replays the floor and returns zeros of the output's shape, undo)."""
    def setup(pipe, transformer, inputs, model):
        from benchmarks.bench_transformer import first_tensor, log

        outputs = []
        calls = record(lambda: outputs.append(first_tensor(transformer(**inputs))), fuse_qkv)
        zeros = torch.zeros_like(outputs[0])
        log(f"{model}: floor of {summary(calls)} ({gemm} GEMMs, q / k / v {'fused' if fuse_qkv else 'apart'}, "
            f"{attention} attention)")
        replay = floor_forward(calls, gemm, zeros.device, zeros.dtype, attention)

        def forward() -> torch.Tensor:
            replay()
            return zeros
        return forward, lambda: None  # nothing patched: nothing to undo
    return setup
