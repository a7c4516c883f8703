"""FP8 attention on cuDNN's fused FP8 SDPA (NVIDIA's ``nvidia-cudnn-frontend`` package), for Hopper and newer.

Why cuDNN: its FP8 flash-attention kernel is NVIDIA's own Hopper implementation (warp-specialised, TMA, FP8 WGMMA)
and was measured 1.4x faster than bf16 cuDNN SDPA at FLUX and Wan shapes on an H200; our Triton kernel is slower
than bf16 cuDNN there. We use the package rather than writing that kernel again.

The arithmetic (``quantize_operands`` is plain torch, so under ``compile=True`` inductor fuses it into the kernels
that produce q / k / v):
- K is smoothed first (its mean over the tokens subtracted, as SageAttention does): every score of a query row
  moves by the same q.mean_k, which softmax ignores, and the per-channel offsets of DiT keys no longer use up range.
- q, k, v get one e4m3 scale per tensor (``amax / 448``): the fused graph takes per-tensor descales. e4m3 is a
  floating-point format, so a tensor-wide scale loses precision only for values ~2^15 below the maximum.
- Softmax probabilities (in [0, 1]) are stored in e4m3 with scale ``P_SCALE`` = 256, a power of two that keeps
  p ~ 1e-4 (uniform attention over ~10^4 keys) in e4m3's normal range.
- On Hopper the kernel writes e4m3 (a 16-bit output is Blackwell-only). Every output row is a convex combination of
  V's rows, so |O| <= max|V| and V's own scale is a safe output scale; the output is dequantized by the caller.

Static scales (``AttentionScales``, one per attention module, used with the FP8 linears' static activations): the
per-tensor amax of q, smoothed k and v and the reduction behind K's smoothing are the only reductions left in the
quantization, and they cost 8-11 ms of a FLUX step because the cast cannot fuse into the producer of q / k / v
until the whole tensor has been read. A calibration call records, per module, max |q|, max |v| and per (head,
channel) the max, min and token mean of K; freezing turns them into fixed descales (``STATIC_MARGIN`` x the
calibrated max / 448, as the linears do) and a fixed smoothing vector (K's calibrated mean: subtracting *any* fixed
vector from K adds the same q.c to every score of a query row, so softmax ignores it exactly). The frozen
quantization is then elementwise -- subtract, scale, clamp, cast -- and fuses into the kernel that writes q / k / v.
Values beyond the calibrated range saturate at +-448 x descale (as TensorRT's and torchao's static FP8 do) instead
of rescaling the tensor; the margin keeps that rare.

The cuDNN call is one custom op, ``omni_accel::cudnn_fp8_sdpa``, opaque to inductor like SDPA. Graphs are built
once per shape and device and cached. A shape cuDNN refuses is computed by SDPA on the dequantized operands inside
the same op (logged once), so a model never fails at run time for one odd attention call. On the CPU the op
emulates cuDNN's arithmetic (e4m3 q, k, v, probabilities and output) so that tests and the quality benchmark on
the built-in model see the same rounding the GPU kernel applies.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import AccelError
from .fp8 import STATIC_MARGIN

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
P_SCALE = 256.0
HEAD_DIMS = (64, 128)  # what cuDNN's FP8 forward takes on Hopper for the DiTs we serve


def unavailable_reason(device: torch.device) -> str | None:
    """Why cuDNN FP8 attention cannot run on ``device``, or None when it can."""
    if device.type != "cuda":
        return f"cuDNN FP8 attention needs a CUDA GPU; the pipeline runs on {device}"
    if importlib.util.find_spec("cudnn") is None:
        return "the 'nvidia-cudnn-frontend' package (import name cudnn) is not installed"
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (9, 0):
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuDNN's FP8 attention needs compute capability 9.0 (Hopper) or newer; this GPU has {major}.{minor}"
    return None


# ---------------------------------------------------------------------------------------------- cuDNN graphs
_UID = dict(q=1, k=2, v=3, o=4, descale_q=5, descale_k=6, descale_v=7, descale_s=8, scale_s=9, scale_o=10,
            amax_s=11, amax_o=12)
_lock = threading.Lock()
_handles: dict[int, Any] = {}
_graphs: dict[tuple, Any] = {}  # key -> (graph, workspace bytes) or the exception cuDNN raised
_constants: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _bshd(b: int, s: int, h: int, d: int) -> tuple[tuple, tuple]:
    """cuDNN dims are (B, H, S, D); diffusers' tensors are (B, S, H, D) in memory: strides say so, no copy."""
    return (b, h, s, d), (s * h * d, d, h * d, 1)


def _build(b: int, h: int, s_q: int, s_kv: int, d: int, sm_scale: float):
    import cudnn

    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32)
    dims_q, strides_q = _bshd(b, s_q, h, d)
    dims_kv, strides_kv = _bshd(b, s_kv, h, d)
    q = graph.tensor(uid=_UID["q"], dim=dims_q, stride=strides_q, data_type=fp8)
    k = graph.tensor(uid=_UID["k"], dim=dims_kv, stride=strides_kv, data_type=fp8)
    v = graph.tensor(uid=_UID["v"], dim=dims_kv, stride=strides_kv, data_type=fp8)
    scalars = {name: graph.tensor(uid=_UID[name], dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
               for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
    o, _stats, amax_s, amax_o = graph.sdpa_fp8(
        q=q, k=k, v=v, **scalars, generate_stats=False, attn_scale=sm_scale, use_causal_mask=False)
    o.set_uid(_UID["o"]).set_output(True).set_dim(dims_q).set_stride(strides_q).set_data_type(fp8)
    for name, t in (("amax_s", amax_s), ("amax_o", amax_o)):
        t.set_uid(_UID[name]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, int(graph.get_workspace_size())


def _graph_for(key: tuple):
    with _lock:
        if key not in _graphs:
            try:
                _graphs[key] = _build(*key[1:])
            except Exception as exc:  # noqa: BLE001 -- cuDNN refuses some shapes; SDPA serves those
                logger.warning("omni_accel: cuDNN FP8 attention refused (B, H, Sq, Skv, D)=%s: %s; that shape runs "
                               "in bf16 SDPA", key[1:6], exc)
                _graphs[key] = exc
        return _graphs[key]


def refused_shapes() -> dict[str, str]:
    """Shapes cuDNN refused in this process (they ran in bf16 SDPA inside the op): "(B, H, Sq, Skv, D)" -> why."""
    with _lock:
        return {str(key[1:6]): repr(v)[:300] for key, v in _graphs.items() if isinstance(v, Exception)}


def _handle(device: torch.device):
    import cudnn

    with _lock:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _handles:
            with torch.cuda.device(index):
                _handles[index] = cudnn.create_handle()
        return _handles[index]


def _softmax_scales(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _constants:
        _constants[index] = (torch.full((1, 1, 1, 1), P_SCALE, dtype=torch.float32, device=device),
                             torch.full((1, 1, 1, 1), 1.0 / P_SCALE, dtype=torch.float32, device=device))
    return _constants[index]


def _dequantized_sdpa(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, sm_scale: float) -> torch.Tensor:
    """The same function without cuDNN: SDPA on the dequantized operands, output quantized like cuDNN's."""
    def deq(x, s):
        return (x.float() * s.reshape(())).to(torch.bfloat16).transpose(1, 2)

    out = F.scaled_dot_product_attention(deq(q8, descale_q), deq(k8, descale_k), deq(v8, descale_v), scale=sm_scale)
    return (out.transpose(1, 2).float() * scale_o.reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _emulated_fp8_sdpa(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, sm_scale: float) -> torch.Tensor:
    """cuDNN's FP8 arithmetic in float32 on the CPU: e4m3 operands, softmax probabilities rounded to e4m3 (scaled
    by P_SCALE) before P V, the output rounded to e4m3. Materialises the scores: for tests and small models."""
    q = q8.float() * descale_q.reshape(())
    k = k8.float() * descale_k.reshape(())
    v = v8.float() * descale_v.reshape(())
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * sm_scale
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    denominator = p.sum(dim=-1, keepdim=True)
    p8 = (p * P_SCALE).clamp(max=FP8_MAX).to(FP8_DTYPE).float() / P_SCALE
    out = torch.einsum("bhqk,bkhd->bqhd", p8 / denominator, v)
    return (out * scale_o.reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@torch.library.custom_op("omni_accel::cudnn_fp8_sdpa", mutates_args=())
def cudnn_fp8_sdpa(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                   descale_k: torch.Tensor, descale_v: torch.Tensor, scale_o: torch.Tensor,
                   sm_scale: float) -> torch.Tensor:
    """e4m3 (B, S, H, D) q / k / v and (1, 1, 1, 1) fp32 scales -> e4m3 (B, Sq, H, D) output (scaled by scale_o),
    contiguous on every path (compiled callers check the strides the fake implementation promises)."""
    if not q8.is_cuda:
        return _emulated_fp8_sdpa(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, sm_scale).contiguous()
    q8, k8, v8 = (x if x.is_contiguous() else x.contiguous() for x in (q8, k8, v8))
    b, s_q, h, d = q8.shape
    key = (q8.device.index, b, h, s_q, k8.shape[1], d, float(sm_scale))
    built = _graph_for(key)
    if isinstance(built, Exception):
        return _dequantized_sdpa(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, sm_scale).contiguous()
    graph, workspace_bytes = built
    import cudnn

    handle = _handle(q8.device)
    cudnn.set_stream(handle, torch.cuda.current_stream(q8.device).cuda_stream)
    out = torch.empty_like(q8)
    scale_s, descale_s = _softmax_scales(q8.device)
    amax = torch.empty(2, 1, 1, 1, dtype=torch.float32, device=q8.device)
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=q8.device)
    pack = {_UID["q"]: q8, _UID["k"]: k8, _UID["v"]: v8, _UID["o"]: out,
            _UID["descale_q"]: descale_q.contiguous(), _UID["descale_k"]: descale_k.contiguous(),
            _UID["descale_v"]: descale_v.contiguous(), _UID["descale_s"]: descale_s, _UID["scale_s"]: scale_s,
            _UID["scale_o"]: scale_o.contiguous(), _UID["amax_s"]: amax[0:1], _UID["amax_o"]: amax[1:2]}
    graph.execute(pack, workspace, handle=handle)
    return out


@cudnn_fp8_sdpa.register_fake
def _(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, sm_scale):
    return q8.new_empty(q8.shape)  # contiguous, whatever q8's strides


# ------------------------------------------------------------------------------------------- the torch side
def _per_tensor_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, S, H, D) -> (e4m3 values, (1, 1, 1, 1) fp32 descale) with x ~= values * descale.

    The max is taken per (token, head) row first and then over the rows: inductor fuses a reduction over D into the
    RMSNorm + RoPE kernel that writes q / k (it reduces over D already), and the rest is a small reduction. A single
    reduction over the whole tensor compiled into a split reduction that took 11 ms of a 101 ms FLUX step (H200)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).amax().clamp(min=1e-6)
    values = (xf * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, (amax / FP8_MAX).reshape(1, 1, 1, 1)


def _static_e4m3(x: torch.Tensor, inverse_descale: torch.Tensor) -> torch.Tensor:
    """Elementwise only: scale, saturate at e4m3's largest value, cast."""
    return (x.float() * inverse_descale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


class AttentionScales(torch.nn.Module):
    """Calibrated q / k / v descales and K smoothing vector of one attention module (see the module docstring).

    ``activations`` follows ``Fp8Linear``'s states: "dynamic" (not calibrated: per-call scales), "observing"
    (per-call scales while recording the statistics), "static" (the frozen, elementwise quantization)."""

    def __init__(self, name: str, device: torch.device):
        super().__init__()
        self.name = name  # the module's name in the pipeline, e.g. "transformer.transformer_blocks.0.attn"
        self.activations = "dynamic"
        zero = dict(dtype=torch.float32, device=device)
        for buffer in ("q_amax", "v_amax"):  # statistics of the calibration call
            self.register_buffer(buffer, torch.zeros((), **zero), persistent=False)
        for buffer in ("k_max", "k_min", "k_mean_sum"):  # (H, D) once a call has been observed
            self.register_buffer(buffer, None, persistent=False)
        self.k_rows = 0  # how many (batch element, call) token means k_mean_sum adds up
        # frozen: descales for cuDNN (x ~= x8 * descale), their inverses for the cast, K's mean (1, 1, H, D)
        for buffer in ("descale_q", "descale_k", "descale_v", "inverse_q", "inverse_k", "inverse_v"):
            self.register_buffer(buffer, torch.ones(1, 1, 1, 1, **zero), persistent=False)
        self.register_buffer("k_mean", None, persistent=False)

    def extra_repr(self) -> str:
        return f"{self.name}, activations={self.activations}"

    def observe(self) -> None:
        self.q_amax.zero_()
        self.v_amax.zero_()
        self.k_max = self.k_min = self.k_mean_sum = None
        self.k_rows = 0
        self.activations = "observing"

    @torch.no_grad()
    def record(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """One call's statistics (eager: calibration runs its blocks uncompiled)."""
        k = key.float()
        if self.k_max is not None and self.k_max.shape != k.shape[2:]:
            raise AccelError(f"static FP8 attention scales of {self.name}: calibration saw keys of (heads, head dim) "
                             f"{tuple(self.k_max.shape)} and then {tuple(k.shape[2:])}; one module must call attention "
                             "with one key shape. Use quant_config={'attention_scales': 'dynamic'}.")
        self.q_amax.copy_(torch.maximum(self.q_amax, query.abs().amax().float()))
        self.v_amax.copy_(torch.maximum(self.v_amax, value.abs().amax().float()))
        k_max, k_min, k_mean_sum = k.amax(dim=(0, 1)), k.amin(dim=(0, 1)), k.mean(dim=1).sum(dim=0)
        if self.k_max is None:
            self.k_max, self.k_min, self.k_mean_sum = k_max, k_min, k_mean_sum
        else:
            self.k_max = torch.maximum(self.k_max, k_max)
            self.k_min = torch.minimum(self.k_min, k_min)
            self.k_mean_sum = self.k_mean_sum + k_mean_sum
        self.k_rows += k.shape[0]

    def freeze(self) -> bool:
        """Static scales from what was observed; False (and per-call scales kept) if the module never ran."""
        if self.k_max is None:
            self.activations = "dynamic"
            return False
        mean = self.k_mean_sum / self.k_rows
        # exact max |k - mean| over every key observed, from the per-channel extremes
        k_amax = torch.maximum(self.k_max - mean, mean - self.k_min).amax()
        self.set_static(*(float(a.clamp(min=1e-6)) * STATIC_MARGIN / FP8_MAX
                          for a in (self.q_amax, k_amax, self.v_amax)), mean)
        return True

    def set_static(self, descale_q: float, descale_k: float, descale_v: float, k_mean: torch.Tensor) -> None:
        for which, descale in zip("qkv", (descale_q, descale_k, descale_v)):
            getattr(self, f"descale_{which}").fill_(descale)
            getattr(self, f"inverse_{which}").fill_(1.0 / descale)
        self.k_mean = k_mean.to(device=self.descale_q.device, dtype=torch.float32).reshape(1, 1, *k_mean.shape[-2:])
        self.activations = "static"

    def state(self) -> dict:
        """What ``set_static`` takes back (the scales file's entry): descales and K's mean as (heads x dim) lists."""
        return {"q": float(self.descale_q), "k": float(self.descale_k), "v": float(self.descale_v),
                "k_mean": self.k_mean[0, 0].tolist()}

    def quantize(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """The frozen quantization: elementwise, no reduction."""
        if key.shape[2:] != self.k_mean.shape[2:]:
            raise AccelError(f"static FP8 attention scales of {self.name} hold K's mean for (heads, head dim) "
                             f"{tuple(self.k_mean.shape[2:])}, but the module's keys are {tuple(key.shape[2:])}: the "
                             "scales come from another model. Calibrate again, or drop quant_config['scales'].")
        q8 = _static_e4m3(query, self.inverse_q)
        k8 = _static_e4m3(key.float() - self.k_mean, self.inverse_k)
        v8 = _static_e4m3(value, self.inverse_v)
        return q8, k8, v8, self.descale_q, self.descale_k, self.descale_v


def quantize_operands(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scales: AttentionScales | None = None):
    """(B, S, H, D) q / k / v -> e4m3 q / smoothed k / v and their descales: per call, or with ``scales``' frozen
    values once they are static."""
    if scales is not None:
        if scales.activations == "static":
            return scales.quantize(query, key, value)
        if scales.activations == "observing":
            scales.record(query, key, value)
    key = key.float()
    key = key - key.mean(dim=1, keepdim=True)  # softmax-invariant shift; see the module docstring
    q8, dq = _per_tensor_e4m3(query)
    k8, dk = _per_tensor_e4m3(key)
    v8, dv = _per_tensor_e4m3(value)
    return q8, k8, v8, dq, dk, dv


def cudnn_fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
                        scales: AttentionScales | None = None) -> torch.Tensor:
    """Non-causal, unmasked attention of (B, S, H, D) tensors (diffusers' dispatcher layout), output like query.
    ``scales``: the calling module's calibrated scales (observed, or used once frozen); None = per-call scales."""
    sm_scale = scale if scale is not None else query.shape[-1] ** -0.5
    q8, k8, v8, dq, dk, dv = quantize_operands(query, key, value, scales)
    out8 = cudnn_fp8_sdpa(q8, k8, v8, dq, dk, dv, 1.0 / dv, float(sm_scale))
    return (out8.float() * dv).to(query.dtype)
