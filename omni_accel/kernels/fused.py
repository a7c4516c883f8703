"""Fused norm kernels for DiT blocks: Triton on CUDA, the eager PyTorch reference elsewhere.

    layernorm_modulate(x, scale, shift, eps)  LN(x) * (1 + scale[:, None]) + shift[:, None]   (adaLN, no affine)
    rms_norm(x, weight, eps, out_dtype)       x * rsqrt(mean(x^2) + eps) * weight over the last dim (Q/K norms)
    rms_norm_rope(x, weight, eps, cos, sin)   rms_norm, then interleaved-pair rotary embedding (FLUX layout)
    gated_residual(x, gate, y)                x + gate[:, None] * y

Each op is a torch custom op (``torch.ops.omni_accel.*``) with a fake (meta) implementation, so a module that calls
it compiles with ``torch.compile`` without a graph break; outside compilation the implementation is called directly
(the custom-op dispatcher costs tens of microseconds per call, which eager DiT blocks would pay hundreds of times
per step). Which path runs is decided per call, by the tensor's device and the backend switch:

    backend "auto"    Triton for CUDA tensors when triton imports, the eager reference otherwise   <- default
    backend "triton"  Triton for every tensor, or an AccelError: CPU tensors need Triton's interpreter
    backend "eager"   the eager PyTorch reference everywhere

With ``TRITON_INTERPRET=1`` set before torch / triton are imported, triton's interpreter runs the kernels on CPU
tensors and "auto" takes the Triton path there too -- how CI tests the kernels (tests/kernels_worker.py).

Set it with ``set_backend(name)`` / ``with use_backend(name):`` or the environment variable
``OMNI_ACCEL_KERNELS=auto|triton|eager`` (read at import). Triton kernels compute in fp32 and round once; the
eager references are the op sequences diffusers' layers run, in the input dtype (so they are what the kernels
replace, and what the speedups in benchmarks/bench_kernels.py are measured against).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from typing import Iterator

import torch
import torch.nn.functional as F

from ..errors import AccelError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "eager")
ENV_VAR = "OMNI_ACCEL_KERNELS"


def _backend_from_env() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise AccelError(f"{ENV_VAR}={value!r} is not a kernel backend; use one of {', '.join(BACKENDS)}.")
    return value


_backend = _backend_from_env()


@functools.lru_cache(maxsize=1)
def _triton_module():
    """omni_accel.kernels.fused_triton, or None when triton does not import here."""
    try:
        return importlib.import_module(f"{__package__}.fused_triton")
    except Exception as exc:  # ImportError, or a triton build that fails to initialise
        logger.info("omni_accel: Triton kernels unavailable (%s); the eager PyTorch references run", exc)
        return None


def triton_available() -> bool:
    return _triton_module() is not None


def get_backend() -> str:
    return _backend


def set_backend(name: str) -> str:
    """Choose "auto", "triton" or "eager" for every later call; returns the previous backend."""
    global _backend
    if name not in BACKENDS:
        raise AccelError(f"kernel backend {name!r} is not known; use one of {', '.join(BACKENDS)}.")
    if name == "triton" and not triton_available():
        raise AccelError("kernel backend 'triton' was asked for but triton does not import here; pip install triton "
                         "or use 'auto'.")
    previous, _backend = _backend, name
    return previous


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def interpreted() -> bool:
    """Whether triton was imported with TRITON_INTERPRET=1, i.e. its kernels run on CPU tensors."""
    module = _triton_module()
    return module is not None and module.INTERPRETED


def uses_triton(device: torch.device | str) -> bool:
    """Whether a call on a tensor of ``device`` takes the Triton path under the current backend."""
    if _backend == "eager":
        return False
    on_cuda = torch.device(device).type == "cuda"
    if _backend == "auto":  # CPU tensors take Triton only when its interpreter was asked for: no import otherwise
        return (on_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")) and \
            triton_available() and (on_cuda or interpreted())
    if not triton_available():
        raise AccelError("kernel backend 'triton' was asked for but triton does not import here; pip install triton "
                         "or use 'auto'.")
    if not (on_cuda or interpreted()):
        raise AccelError(f"kernel backend 'triton' got a tensor on {device}: Triton runs CPU tensors only in its "
                         "interpreter; set TRITON_INTERPRET=1 before importing torch/triton, or use backend 'auto'.")
    return True


def _check_last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------- eager references
def layernorm_modulate_ref(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """What AdaLayerNormZero / -Single / -Continuous compute after their linear (LayerNorm without affine)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """RMS norm over the last dim in fp32, rounded once to ``out_dtype`` (F.rms_norm's numerics)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(out_dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved (real, imag) pairs of x (B, S, H, D) with cos / sin (S, D), in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    c, s = cos[None, :, None, :].float(), sin[None, :, None, :].float()
    return (x.float() * c + rotated * s).to(x.dtype)


def rms_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """The Q/K norm module then the processor's rotary embedding, as FLUX-style attention runs them."""
    return rope_ref(rms_norm_ref(x, weight, eps, x.dtype), cos, sin)


def gated_residual_ref(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + gate[:, None] * y


# --------------------------------------------------------------------------------------------- implementations
def _layernorm_modulate_impl(x, scale, shift, eps):
    if not uses_triton(x.device):
        return layernorm_modulate_ref(x, scale, shift, eps)
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, scale.dtype), shift.dtype)
    batch = x.shape[0]
    scale = _check_last_dim_contiguous(scale.expand(batch, -1))
    shift = _check_last_dim_contiguous(shift.expand(batch, -1))
    return _triton_module().layernorm_modulate(_check_last_dim_contiguous(x), scale, shift, eps, out_dtype)


def _rms_norm_impl(x, weight, eps, out_dtype):
    if not uses_triton(x.device):
        return rms_norm_ref(x, weight, eps, out_dtype)
    shape = x.shape
    if x.dim() > 4:  # the kernel addresses up to three leading dims
        x = x.reshape(-1, shape[-1])
    out = _triton_module().rms_norm(_check_last_dim_contiguous(x), weight, eps, out_dtype)
    return out.reshape(shape)


def _rms_norm_rope_impl(x, weight, eps, cos, sin):
    if not uses_triton(x.device):
        return rms_norm_rope_ref(x, weight, eps, cos, sin)
    return _triton_module().rms_norm_rope(_check_last_dim_contiguous(x), weight, eps, _check_last_dim_contiguous(cos),
                                          _check_last_dim_contiguous(sin), x.dtype)


def _gated_residual_impl(x, gate, y):
    if not uses_triton(x.device):
        return gated_residual_ref(x, gate, y)
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype)
    gate = _check_last_dim_contiguous(gate.expand(x.shape[0], -1))
    return _triton_module().gated_residual(_check_last_dim_contiguous(x), gate, _check_last_dim_contiguous(y),
                                           out_dtype)


# ------------------------------------------------------------------------------------------------- custom ops
# Explicit schemas: custom_op's annotation inference does not read postponed (string) annotations.
_LIB = "omni_accel"


@torch.library.custom_op(f"{_LIB}::layernorm_modulate", mutates_args=(),
                         schema="(Tensor x, Tensor scale, Tensor shift, float eps) -> Tensor")
def _layernorm_modulate_op(x, scale, shift, eps):
    return _layernorm_modulate_impl(x, scale, shift, eps)


@_layernorm_modulate_op.register_fake
def _(x, scale, shift, eps):
    dtype = torch.promote_types(torch.promote_types(x.dtype, scale.dtype), shift.dtype)
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op(f"{_LIB}::rms_norm", mutates_args=(),
                         schema="(Tensor x, Tensor? weight, float eps, ScalarType out_dtype) -> Tensor")
def _rms_norm_op(x, weight, eps, out_dtype):
    return _rms_norm_impl(x, weight, eps, out_dtype)


@_rms_norm_op.register_fake
def _(x, weight, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::rms_norm_rope", mutates_args=(),
                         schema="(Tensor x, Tensor? weight, float eps, Tensor cos, Tensor sin) -> Tensor")
def _rms_norm_rope_op(x, weight, eps, cos, sin):
    return _rms_norm_rope_impl(x, weight, eps, cos, sin)


@_rms_norm_rope_op.register_fake
def _(x, weight, eps, cos, sin):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_LIB}::gated_residual", mutates_args=(),
                         schema="(Tensor x, Tensor gate, Tensor y) -> Tensor")
def _gated_residual_op(x, gate, y):
    return _gated_residual_impl(x, gate, y)


@_gated_residual_op.register_fake
def _(x, gate, y):
    dtype = torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype)
    return x.new_empty(x.shape, dtype=dtype)


# ---------------------------------------------------------------------------------------------- public entry
def _check_modulation(name: str, x: torch.Tensor, param: torch.Tensor, what: str) -> None:
    if x.dim() != 3:
        raise AccelError(f"{name}: x must be (batch, tokens, channels), got shape {tuple(x.shape)}.")
    if param.dim() != 2 or param.shape[-1] != x.shape[-1] or param.shape[0] not in (1, x.shape[0]):
        raise AccelError(f"{name}: {what} must be ({x.shape[0]}, {x.shape[-1]}) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(param.shape)}.")


def layernorm_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``LayerNorm(x) * (1 + scale[:, None]) + shift[:, None]`` for x (B, S, C), scale / shift (B, C)."""
    _check_modulation("layernorm_modulate", x, scale, "scale")
    _check_modulation("layernorm_modulate", x, shift, "shift")
    if torch.compiler.is_compiling():
        return _layernorm_modulate_op(x, scale, shift, float(eps))
    return _layernorm_modulate_impl(x, scale, shift, float(eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """RMS norm over the last dim of x with an optional weight of that size; fp32 math, output ``out_dtype``
    (default: x's dtype)."""
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1]):
        raise AccelError(f"rms_norm: weight must be ({x.shape[-1]},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}.")
    out_dtype = out_dtype or x.dtype
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, float(eps), out_dtype)
    return _rms_norm_impl(x, weight, float(eps), out_dtype)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
                  ) -> torch.Tensor:
    """RMS norm over head_dim of x (B, S, H, D), then the rotary embedding with cos / sin (S, D) on interleaved
    pairs -- one pass over q or k instead of a norm and a six-op rotary."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise AccelError(f"rms_norm_rope: x must be (batch, tokens, heads, even head_dim), got {tuple(x.shape)}.")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (x.shape[1], x.shape[-1]):
            raise AccelError(f"rms_norm_rope: {name} must be ({x.shape[1]}, {x.shape[-1]}) for x of shape "
                             f"{tuple(x.shape)}, got {tuple(table.shape)}.")
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise AccelError(f"rms_norm_rope: weight must be ({x.shape[-1]},), got {tuple(weight.shape)}.")
    if torch.compiler.is_compiling():
        return _rms_norm_rope_op(x, weight, float(eps), cos, sin)
    return _rms_norm_rope_impl(x, weight, float(eps), cos, sin)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate[:, None] * y`` for x, y (B, S, C) and gate (B, C)."""
    _check_modulation("gated_residual", x, gate, "gate")
    if tuple(y.shape) != tuple(x.shape):
        raise AccelError(f"gated_residual: y must have x's shape {tuple(x.shape)}, got {tuple(y.shape)}.")
    if torch.compiler.is_compiling():
        return _gated_residual_op(x, gate, y)
    return _gated_residual_impl(x, gate, y)
