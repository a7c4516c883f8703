"""int8 W8A8 linears (``quant="int8"``): weights quantized once per output channel, activations per token at run
time, multiplied on int8 tensor cores with int32 accumulation (``torch._int_mm``), dequantized in the epilogue.

Why int8 beside FP8: on the trained built-in model, int8 with a scale per token and per output channel puts the
worst of 16 held-out images at 43.3 dB against the bf16 pipeline (mean 54.3 dB, as close as the float32 model
is), where e4m3 with the same scales gives 29.2 dB (benchmarks/results/linear_formats_study.json). e4m3 keeps 3
mantissa bits on every value; int8 keeps 7 bits on the largest value of each row, and a row of a DiT's
activations or weights has no outliers large enough to lose that. Hopper's int8 and FP8 tensor cores have the same
peak rate.

Activations are scaled per token only: one calibrated scale per layer (what ``quant="fp8"`` allows with
``"activations": "static"``) lowered that worst image to 28.9 dB in int8, because int8 has no exponent to absorb a
token whose values are much smaller than the layer's largest.

Under torch.compile the row quantization below is traced, so Inductor fuses it into the op that produces the
activation; on the cuBLAS path it also fuses the int32 -> scaled 16-bit rescale into the kernel after the GEMM.

The GEMM (``quant_config["int8_gemm"]``): omni_accel's Triton kernel that rescales in its epilogue (``"triton"``,
kernels/int8_gemm_triton.py; an opaque op to Inductor, on the CPU the same arithmetic in PyTorch), or cuBLAS's
``torch._int_mm`` (``"cublas"``), whose int32 sums cross memory before the rescale and whose Hopper kernels ran at
the bf16 rate. ``"auto"`` (the default) takes Triton on a CUDA GPU where Triton is installed: the FLUX forward took
107.8 ms with it against 134.3 ms with cuBLAS on an H200 (benchmarks/results/bench_peers_h200_flux_int8_20261205.json).
"""

from __future__ import annotations

import functools

import torch

from .qlinear import QuantizedLinear, matmul_support, rel_err

INT8_MAX = 127.0
# cuBLASLt's int8 GEMM needs the matrix dimensions that meet in the product to be multiples of 8 ...
INT8_ALIGN = 8
# ... and more than 16 rows: shorter inputs (a short prompt's text tokens) are padded to this many rows.
MIN_GPU_ROWS = 17
_PADDED_ROWS = 32
_MIN_AMAX = 1e-12
# Up to this many rows a weight-only layer is a matrix-vector product (traced as a reduction, or the Triton GEMV),
# above it a GEMM.
GEMV_MAX_ROWS = 16
# Whether a weight-only layer's matrix-vector product on a GPU is omni_accel's Triton kernel (kernels/
# int8_gemm_triton.py's int8_gemv, op omni_accel::int8_gemv) instead of Inductor's reduction, which read the int8
# weight at 117 GB/s on an H200. Off until timed on a GPU; benchmarks' A/B rows set it.
TRITON_GEMV = False
# Whether an int8 linear on the Triton GEMM adds its bias in the GEMM's epilogue (in float32, before the one rounding
# to 16 bits) instead of in the traced graph after it. Why: a fused q / k / v projection's V then leaves the GEMM
# final, a view that the attention (or SageAttention's preparation) reads in place; with the bias added in the graph,
# Inductor writes V once more, bias added (0.73 ms per FLUX step on an H100; on Wan 81 frames the kernels that add the
# biases and lay q / k / v out for the attention took 28.6 ms more per forward). With it,
# FLUX's int8 stack ran 0.5-0.7 % faster per forward (1.0-1.5 % in a loop) and Wan's 1.5-1.9 %, the output error
# unchanged or lower, paired in two rounds (bench_peers_h100_flux_bias_sage_20261206.json,
# bench_peers_h100_wan81_bias_20261206.json). Benchmarks' A/B rows (_graphbias) set it.
BIAS_IN_GEMM = True


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a 2-D tensor to int8 with its own symmetric scale (max |row| / 127, values rounded half to
    even): returns (x_int8, scale (rows, 1) fp32), so that ``x ≈ x_int8.float() * scale``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_AMAX)
    scale = amax / INT8_MAX
    x_int8 = torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x_int8, scale


@functools.lru_cache(maxsize=None)
def _cpu_int_mm_works() -> bool:
    try:
        a = torch.zeros(32, 16, dtype=torch.int8)
        torch._int_mm(a, a.t())
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def int8_matmul_support(device: torch.device) -> tuple[bool, str]:
    """(supported, reason) for int8 GEMMs (int8 x int8 -> int32) on ``device``."""
    cpu_works = device.type == "cpu" and _cpu_int_mm_works()
    return matmul_support(device, "int8", (7, 5), "torch._int_mm", cpu_works, "torch._int_mm")


def int8_alignment_problem(linear: torch.nn.Linear) -> str | None:
    """Why ``linear`` cannot become an int8 GEMM, or None when it can."""
    bad = [f"{n}={v}" for n, v in (("in_features", linear.in_features), ("out_features", linear.out_features))
           if v % INT8_ALIGN]
    if bad:
        return f"{', '.join(bad)} not a multiple of {INT8_ALIGN} (int8 GEMM alignment)"
    return None


def rows_to_pad(x2: torch.Tensor) -> int:
    """How many zero rows the GPU's int8 GEMM needs below ``x2`` (it refuses 16 rows or fewer); 0 on the CPU."""
    return _PADDED_ROWS - x2.shape[0] if x2.is_cuda and x2.shape[0] < MIN_GPU_ROWS else 0


INT8_GEMMS = ("auto", "triton", "cublas")


def resolve_int8_gemm(choice: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on a CUDA GPU with Triton installed, else ``"cublas"``; other choices as given."""
    if choice != "auto":
        return choice
    from ..deps import installed

    return "triton" if device.type == "cuda" and installed("triton") else "cublas"


def int8_mm_rescale_reference(x_int8: torch.Tensor, w_int8: torch.Tensor, x_scale: torch.Tensor,
                              w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The cuBLAS path (``torch._int_mm``), and what the Triton kernel computes: int32 sums, fp32 rescale, bias, one
    rounding to ``out_dtype``."""
    rows = x_int8.shape[0]
    if padding := rows_to_pad(x_int8):  # zero rows multiply to zero and are cut off again below
        x_int8 = torch.nn.functional.pad(x_int8, (0, 0, 0, padding))
    # the weight's transposed view, not a contiguous (in, out) copy: cuBLASLt's int8 GEMM wants it column-major;
    # fp32 dequantization: int32 sums of up to 127 * 127 * in_features do not fit a 16-bit mantissa
    y = torch._int_mm(x_int8, w_int8.t())[:rows].float() * x_scale * w_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# Explicit schema: custom_op's annotation inference does not read postponed (string) annotations.
@torch.library.custom_op("omni_accel::int8_mm_rescale", mutates_args=(), schema=(
    "(Tensor x_int8, Tensor w_int8, Tensor x_scale, Tensor w_scale, Tensor? bias, ScalarType out_dtype) -> Tensor"))
def int8_mm_rescale(x_int8, w_int8, x_scale, w_scale, bias, out_dtype):
    if x_int8.is_cuda:
        from . import int8_gemm_triton

        return int8_gemm_triton.int8_mm_rescale(x_int8, w_int8, x_scale, w_scale, bias, out_dtype)
    return int8_mm_rescale_reference(x_int8, w_int8, x_scale, w_scale, bias, out_dtype)


@int8_mm_rescale.register_fake
def _(x_int8, w_int8, x_scale, w_scale, bias, out_dtype):
    return x_int8.new_empty((x_int8.shape[0], w_int8.shape[0]), dtype=out_dtype)


def int8_mm_rescale_residual_reference(x_int8: torch.Tensor, w_int8: torch.Tensor, x_scale: torch.Tensor,
                                       w_scale: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor,
                                       residual: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``residual + gate * product`` with the product as ``int8_mm_rescale_reference`` gives it (rounded to
    ``out_dtype``), ``gate`` N values (one per output column), ``residual`` (M, N); the sum in float32, rounded once.
    That is the unfused graph's arithmetic: its GEMM writes the product in 16 bits and inductor's kernel after it
    computes the gated add in float32 (tests/test_epilogue_fusion.py)."""
    product = int8_mm_rescale_reference(x_int8, w_int8, x_scale, w_scale, bias, out_dtype)
    return (residual.float() + gate.float().reshape(1, -1) * product.float()).to(out_dtype)


@torch.library.custom_op("omni_accel::int8_mm_rescale_residual", mutates_args=(), schema=(
    "(Tensor x_int8, Tensor w_int8, Tensor x_scale, Tensor w_scale, Tensor? bias, Tensor gate, Tensor residual, "
    "ScalarType out_dtype) -> Tensor"))
def int8_mm_rescale_residual(x_int8, w_int8, x_scale, w_scale, bias, gate, residual, out_dtype):
    """A DiT block's gated residual after an int8 linear, ``residual + gate * linear(x)``, in the GEMM's epilogue on a
    GPU (kernels/epilogue_fusion.py's ``GATED_RESIDUAL_INT8`` puts it in): a new tensor, the residual only read."""
    if x_int8.is_cuda:
        from . import int8_gemm_triton

        return int8_gemm_triton.int8_mm_rescale(x_int8, w_int8, x_scale, w_scale, bias, out_dtype, gate=gate,
                                                residual=residual)
    return int8_mm_rescale_residual_reference(x_int8, w_int8, x_scale, w_scale, bias, gate, residual, out_dtype)


@int8_mm_rescale_residual.register_fake
def _(x_int8, w_int8, x_scale, w_scale, bias, gate, residual, out_dtype):
    return x_int8.new_empty((x_int8.shape[0], w_int8.shape[0]), dtype=out_dtype)


def int8_gemv_reference(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x (rows, K) @ (w_int8 * w_scale)^T as a float32 multiply-and-sum, one rounding to x's dtype: what the Triton
    GEMV computes (up to the order of its float32 sums), and what Inductor makes one reduction kernel of."""
    sums = (x.float().unsqueeze(1) * w_int8.unsqueeze(0)).sum(dim=-1)  # (rows, out), fp32
    return (sums * w_scale).to(x.dtype)


@torch.library.custom_op("omni_accel::int8_gemv", mutates_args=(), schema=(
    "(Tensor x, Tensor w_int8, Tensor w_scale) -> Tensor"))
def int8_gemv(x, w_int8, w_scale):
    if x.is_cuda:
        from . import int8_gemm_triton

        return int8_gemm_triton.int8_gemv(x, w_int8, w_scale)
    return int8_gemv_reference(x, w_int8, w_scale)


@int8_gemv.register_fake
def _(x, w_int8, w_scale):
    return x.new_empty((x.shape[0], w_int8.shape[0]))


class _Int8Weight(QuantizedLinear):
    """An int8 weight with one fp32 scale per output channel, what both int8 layers hold."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear)
        weight = linear.weight.detach()
        w_int8, w_scale = quantize_rows_int8(weight)
        self.register_buffer("weight_int8", w_int8, persistent=False)  # (out, in): its .t() is column-major
        self.register_buffer("weight_scale", w_scale.reshape(1, -1).contiguous(), persistent=False)
        self.weight_rel_err = rel_err(w_int8.float() * w_scale, weight.float())


class Int8Linear(_Int8Weight):
    """Drop-in for ``nn.Linear`` holding an int8 weight and one fp32 scale per output channel; activations are
    rounded to int8 per token at run time. ``gemm``: one of INT8_GEMMS (the module docstring)."""

    def __init__(self, linear: torch.nn.Linear, gemm: str = "cublas"):
        if gemm not in ("triton", "cublas"):
            raise ValueError(f"gemm={gemm!r}: use 'triton' or 'cublas' (resolve 'auto' with resolve_int8_gemm)")
        super().__init__(linear)
        self.gemm = gemm

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 W8A8, per-token activations, "
                f"{self.gemm} GEMM")

    def _product(self, x2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x_int8, x_scale = quantize_rows_int8(x2)
        # triton: the rescale inside the GEMM, no int32 round trip through memory (one op, opaque to Inductor);
        # cublas: traced, so Inductor fuses the rescale into the kernel after the GEMM
        multiply = torch.ops.omni_accel.int8_mm_rescale if self.gemm == "triton" else int8_mm_rescale_reference
        return multiply(x_int8, self.weight_int8, x_scale, self.weight_scale, bias, x2.dtype)

    def _biased_product(self, x2: torch.Tensor) -> torch.Tensor:
        if BIAS_IN_GEMM and self.gemm == "triton" and self.bias is not None:
            return self._product(x2, self.bias)
        return super()._biased_product(x2)


class Int8WeightOnlyLinear(_Int8Weight):
    """Drop-in for ``nn.Linear`` with an int8 weight (one fp32 scale per output channel) and 16-bit activations,
    for the per-sample AdaLN modulation linears (``quant_config={"modulation": "int8"}``): one token per sample,
    so each call is a matrix-vector product that reads the whole weight -- FLUX.1-dev's 76 of them read 6.4 GB of
    bf16 per step. Under torch.compile a call with few rows is written as multiply-and-sum, which Inductor turns into
    one reduction kernel that reads the int8 weight itself (half the bytes) and rescales in its epilogue; cuBLAS has
    no int8-weight GEMV. With ``TRITON_GEMV`` a GPU call with few rows takes omni_accel's Triton GEMV instead,
    compiled or not. Eager, or with many rows, it multiplies the dequantized weight."""

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights only"

    def _product(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.shape[0] <= GEMV_MAX_ROWS:
            if TRITON_GEMV and x2.is_cuda and x2.stride(-1) == 1:
                return torch.ops.omni_accel.int8_gemv(x2, self.weight_int8, self.weight_scale)
            if torch.compiler.is_compiling():
                return int8_gemv_reference(x2, self.weight_int8, self.weight_scale)
        weight = (self.weight_int8.to(torch.float32) * self.weight_scale.reshape(-1, 1)).to(x2.dtype)
        return torch.nn.functional.linear(x2, weight)
