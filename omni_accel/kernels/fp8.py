"""FP8 e4m3 linears: weights quantized once per output channel, activations per token at run time.

Two modes share one module, ``Fp8Linear``:

- ``w8a8``: both operands in e4m3, multiplied by ``torch._scaled_mm`` with row-wise scales (activation scale per
  token, weight scale per output channel), output in the activation dtype. This is the fast path on GPUs with FP8
  tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell); PyTorch's CPU build also implements it, slowly,
  which is what lets CI test the exact arithmetic.
- ``weight_only``: the e4m3 weight is dequantized on the fly and multiplied in the activation dtype. It halves the
  weight memory of a bf16 model and runs on any device; it is not faster.

Activation scales, two ways (``quant_config={"activations": ...}``):

- ``"dynamic"`` (default): one scale per token, computed at run time. Robust to any activation range; the price is
  a reduction over every row before the cast, which torch.compile fuses into the op that produces the activation
  but which still reads the row twice.
- ``"static"``: one scale per layer, calibrated on real calls (the first pipeline call observes each layer's
  largest |x|, the next one freezes the scales; or loaded from a file). The cast is then a pure elementwise
  epilogue that inductor folds into the producer (LayerNorm + modulate, GELU), which writes one byte per value
  instead of two and no reduction runs. e4m3 is a floating-point format (3 mantissa bits, exponents over ~2^15),
  so one scale per tensor costs precision only to values 2^15 below the calibrated maximum; the calibrated
  maximum is doubled (``STATIC_MARGIN``) so that a later step's slightly larger activations are not clipped.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch
import torch.nn.functional as F

from .qlinear import QuantizedLinear, matmul_support, rel_err

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# cuBLASLt's FP8 GEMM needs both matrix dimensions that meet in the product to be multiples of 16.
FP8_ALIGN = 16
_MIN_AMAX = 1e-12  # an all-zero row would otherwise get scale 0 and divide by it

Fp8Mode = Literal["w8a8", "weight_only"]
ActivationMode = Literal["dynamic", "observing", "static"]
# Static scales map twice the calibrated max |x| to 448: headroom for later steps, free in a floating-point format.
STATIC_MARGIN = 2.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of a 2-D tensor to e4m3 with its own scale: returns (x_fp8, scale (rows, 1) fp32),
    so that ``x ≈ x_fp8.float() * scale``.

    Eager on a GPU this runs as one Triton kernel (PyTorch's op-by-op version launches five kernels and was
    measured at 167 ms of elementwise time per FLUX step on an H200); under torch.compile the PyTorch expression
    is traced instead, so Inductor can fuse it into the producer of ``x``."""
    if x.is_cuda and x.stride(-1) == 1 and not torch.compiler.is_compiling() and _triton_quantizer() is not None:
        return _triton_quantizer()(x, FP8_DTYPE, FP8_MAX, _MIN_AMAX)
    return quantize_rows_torch(x)


@functools.lru_cache(maxsize=None)
def _triton_quantizer():
    try:
        from .fused_triton import quantize_rows_fp8
    except Exception:  # noqa: BLE001 -- no triton (or no GPU backend): the PyTorch expression is the fallback
        return None
    return quantize_rows_fp8


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch expression of ``quantize_rows`` (the reference, and what torch.compile fuses)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_AMAX)
    scale = amax / FP8_MAX
    x_fp8 = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor with one fixed scale (0-d fp32 tensor): pure elementwise, so inductor fuses it into
    the producer of ``x``. Returns the row-wise scale layout ``_scaled_mm`` takes, (rows, 1), every row equal."""
    x_fp8 = (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


def dequantize_rows(x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x_fp8.to(torch.float32) * scale).to(dtype)


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm_works() -> bool:
    """Whether this torch build multiplies e4m3 matrices with row-wise scales on the CPU."""
    try:
        a = torch.zeros(16, 16, dtype=FP8_DTYPE)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def fp8_matmul_support(device: torch.device) -> tuple[bool, str]:
    """(supported, reason) for W8A8 FP8 GEMMs on ``device``."""
    cpu_works = device.type == "cpu" and _cpu_scaled_mm_works()
    return matmul_support(device, "FP8", (8, 9), "torch._scaled_mm", cpu_works, "torch._scaled_mm for e4m3")


class Fp8Linear(QuantizedLinear):
    """Drop-in for ``nn.Linear`` holding an e4m3 weight and one fp32 scale per output channel."""

    def __init__(self, linear: torch.nn.Linear, mode: Fp8Mode, fast_accum: bool = False):
        super().__init__(linear)
        # Hopper's FP8 tensor cores accumulate in reduced precision unless the GEMM promotes the partial sums to
        # fp32 every few k-steps; ``fast_accum`` skips that promotion (the quant pass's default: see quant.py).
        self.fast_accum = fast_accum
        weight = linear.weight.detach()
        self.mode = mode
        w_fp8, w_scale = quantize_rows(weight)
        self.register_buffer("weight_fp8", w_fp8, persistent=False)
        # (1, out) for _scaled_mm's scale_b; (out, 1) view for dequantization
        self.register_buffer("weight_scale", w_scale.reshape(1, -1).contiguous(), persistent=False)
        self.weight_rel_err = rel_err(dequantize_rows(w_fp8, w_scale, torch.float32), weight.float())
        # activation scales: "dynamic" per token; "observing" = dynamic while recording the largest |x| seen;
        # "static" = one calibrated scale (input_scale)
        self.activations: ActivationMode = "dynamic"
        device = weight.device
        self.register_buffer("observed_amax", torch.zeros((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
                f"activations={self.activations}" + (", fast_accum=True" if self.fast_accum else ""))

    def observe(self) -> None:
        """Start recording the largest |input| (dynamic quantization meanwhile); ``freeze`` turns it into the
        static scale."""
        self.observed_amax.zero_()
        self.activations = "observing"

    def freeze(self) -> float:
        """Static scale from what was observed; returns the observed max |x| (0 if the layer never ran)."""
        amax = float(self.observed_amax)
        if amax > 0:
            self.set_static_scale(amax * STATIC_MARGIN / FP8_MAX)
        else:  # never called while observing (e.g. a branch not taken): keep per-token scales for it
            self.activations = "dynamic"
        return amax

    def set_static_scale(self, scale: float) -> None:
        self.input_scale.fill_(max(float(scale), _MIN_AMAX))
        self.activations = "static"

    def _product(self, x2: torch.Tensor) -> torch.Tensor:
        if self.mode == "w8a8":
            return self._scaled_mm(x2)
        return F.linear(x2, dequantize_rows(self.weight_fp8, self.weight_scale.reshape(-1, 1), x2.dtype))

    def _scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.activations == "static":
            x_fp8, x_scale = quantize_static(x2, self.input_scale)
        else:
            x_fp8, x_scale = quantize_rows(x2)
            if self.activations == "observing":
                # x_scale = row amax / 448, so its max is the tensor's max |x| / 448
                self.observed_amax.copy_(torch.maximum(self.observed_amax, x_scale.amax() * FP8_MAX))
        # cuBLASLt's row-wise-scaled FP8 GEMM writes bf16; fp32 callers (CPU tests) get the result cast back.
        out_dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        y = torch._scaled_mm(
            x_fp8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=out_dtype,
            use_fast_accum=self.fast_accum,
        )
        return y.to(x2.dtype)


def fp8_alignment_problem(linear: torch.nn.Linear) -> str | None:
    """Why ``linear`` cannot become an FP8 GEMM, or None when it can."""
    bad = [f"{n}={v}" for n, v in (("in_features", linear.in_features), ("out_features", linear.out_features))
           if v % FP8_ALIGN]
    if bad:
        return f"{', '.join(bad)} not a multiple of {FP8_ALIGN} (FP8 GEMM alignment)"
    return None
