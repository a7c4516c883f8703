"""A graph pass for ``compile=True``: the memory-bound epilogues around FP8 linears and attention, each in one
hand-written kernel (epilogue_triton.py) instead of inductor's generated one.

What it finds, in the ATen graph inductor is about to lower (a post-grad custom pass, so it sees every block's graph
whatever model code produced it), and what each becomes:

    cat([a, gelu(h [+ bias])], dim=-1) [-> static_fp8_cast]    omni_accel::concat_gelu          (a linear's input)
    cat([a, gelu(h [+ bias])], dim=-1) -> int8 rows + scales   omni_accel::concat_gelu_int8     (an int8 linear)
    gelu(h [+ bias]) -> static_fp8_cast                         omni_accel::concat_gelu, no a    (an FP8 down projection)
    layer_norm(x) * (1 + scale) + shift -> 1-3 static casts     omni_accel::layernorm_modulate_fp8   (AdaLN's norm)
    layer_norm(x) * (1 + scale) + shift -> int8 rows + scales   omni_accel::layernorm_modulate_int8  (int8 linears)
    rotary(rms_norm(q or k of a fused projection)) [- mean] -> static cast   omni_accel::qk_norm_rope_fp8 (FP8 attention)
    rotary(rms_norm(q or k of a fused projection)), 16 bits   omni_accel::qk_norm_rope (16-bit attention; a switch)
    either, rotary(cat([rms_norm(text q / k), rms_norm(image q / k)]))   the same, both streams read (a switch)
    gelu(x @ w.T + bias), 16 bits, read by linears only       omni_accel::linear_gelu (cuBLASLt's GELU epilogue)
    cat([a, gelu(x @ w.T + bias)]) read by one 16-bit linear  omni_accel::linear_gelu + omni_accel::concat_linear
    any other 16-bit x @ w.T [+ bias] of >= 20 GFLOP            omni_accel::linear_tuned (a tuned cuBLASLt algorithm)
    residual + gate * int8_mm_rescale(...), one gate row        omni_accel::int8_mm_rescale_residual (in the GEMM)

``a`` may be an FP8 attention output dequantized by its scale (``a8.float() * scale``, then bf16); ``gelu`` is the
sigmoid form of the tanh GELU that ``compile=True`` installs (``compiler.sigmoid_gelu``); ``static_fp8_cast`` is what
an FP8 linear (or FP8 attention) with calibrated scales does to its input; ``rotary`` is the pair-swap form
``compile=True`` installs; ``x`` may be the concatenation of a joint block's two streams. FLUX's single-stream blocks
have all four (``proj_out(cat([attention, act_mlp(proj_mlp(x))]))``), its dual-stream blocks the feed-forward's GELU
and the norms, Qwen-Image's blocks the GELU and the norms. The two GEMM forms are for 16-bit linears (the bf16
stack, and any model's MLP between two 16-bit linears: Wan's, Qwen-Image's); the last is a DiT block's gated residual
after an int8 linear on the Triton GEMM (the attention output and feed-forward projections of FLUX's, Qwen-Image's and
Wan's blocks), moved into that GEMM's epilogue; the rest rewrites only the epilogues.

Why: inductor's kernels for these ran on instructions, not memory. Its concatenation is a per-element choice between
the two inputs (both evaluated under masks, a division and a modulo per element's column): 104 us per call at FLUX's
4608 x 15360 where the bytes need ~50, 54 us in the 2-D-tiled kernel. The interleaved rotary's pair swap became a
gather per element (78 us for FLUX's q and k, 2 x 23 us with the swap in registers); the norm read a concatenation
the same way (25-39 us, 16 us). Measured on an H200: docs/kernels.md and ``benchmarks/bench_fp8_epilogues.py``. The
values are the same float32 expressions inductor's kernels compute (the GELU's reciprocal is the hardware's
approximate one, ~1 ulp of float32); the AdaLN kernel keeps float32 where inductor's rounded to bf16 in between.
The two GEMM forms round differently from inductor's graph: cuBLASLt applies the GELU to the float32 sums (inductor
rounds the GEMM's output to 16 bits first), and concat_linear rounds its first part's sums to 16 bits once before the
second GEMM adds to them; on FLUX's blocks the outputs stay within a few bf16 steps of inductor's
(tests/test_epilogue_fusion.py).

Nothing else is changed: a graph without the patterns, or one whose tensors the kernels do not take (widths no
power-of-two tile divides, rows that are not evenly strided, a batch above 1 for the norm, another rotary layout),
compiles as before, and an unexpected graph is left to inductor rather than failing the compile. The pass counts what
it replaced in ``REWRITES``; ``QK_NORM_ROPE``, ``LAYERNORM``, ``GELU_GEMM``, ``GATED_RESIDUAL_INT8`` and
``gemm_tuning.TUNED_GEMMS`` switch parts of it (A/B runs).

Where inductor launches its own kernels with programmatic dependent launch (``triton.enable_pdl``, on by default on
Hopper and newer), the kernels put in do too (``_pdl``; ``PDL`` switches that off): without it the GPU starts each
of them only once the kernel before it has finished.
"""

from __future__ import annotations

import collections
import logging
import math
import operator
import os

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort

from . import gemm_tuning

logger = logging.getLogger(__name__)

aten = torch.ops.aten
prims = torch.ops.prims
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_GELU_K = 2.0 * (2.0 / math.pi) ** 0.5  # compiler.sigmoid_gelu's 2 sqrt(2 / pi)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_CONVERT = prims.convert_element_type.default
_FUSED_RMS_NORM = getattr(aten, "_fused_rms_norm", None)
_FUSED_RMS_NORM = _FUSED_RMS_NORM.default if _FUSED_RMS_NORM is not None else None

# "concat_gelu_fp8" / "concat_gelu" / "concat_gelu_int8" / "gelu_fp8" / "gelu_int8" / "layernorm_modulate_fp8" /
# "layernorm_modulate_int8" / "qk_norm_rope_fp8" / "qk_norm_rope" / "sage_quantize_normed" / "gelu_gemm" /
# "concat_gelu_gemm" / "tuned_gemm" / "gated_residual_int8" -> how many this process replaced (graphs
# compiled here: one loaded from inductor's cache ran its passes when it was first compiled)
REWRITES: collections.Counter = collections.Counter()


def rewrites_since(before: dict) -> dict:
    """The ``REWRITES`` counts added since the snapshot ``before`` (``dict(REWRITES)`` taken earlier), by kind."""
    return {kind: count - before.get(kind, 0) for kind, count in REWRITES.items() if count != before.get(kind, 0)}


# Whether the pass also replaces FP8 attention's q / k RMSNorm + rotary + cast; benchmarks' A/B rows set it.
QK_NORM_ROPE = True
# Whether it also replaces the 16-bit q / k RMSNorm + rotary in front of a 16-bit attention (the bf16 and int8
# stacks' cuDNN attention, SageAttention's quantization): the same kernel without the cast. FLUX on an H100: bf16
# 128.8 -> 127.5 ms per step with QK_NORM_ROPE_JOINT
# (benchmarks/results/bench_peers_h100_flux_newkernels_ab2_20261205.json).
QK_NORM_ROPE_16 = True
# Whether the q / k forms also take a q or k concatenated from two normalized streams before the rotary (FLUX's
# dual-stream blocks), reading both projections in place; else those stay with inductor. FLUX's static FP8 stack on an
# H100: 80.7 -> 80.1 ms per step (same file). Benchmarks' A/B rows set both.
QK_NORM_ROPE_JOINT = True
# Whether the 16-bit q / k form also takes diffusers' own RMSNorm class, which rounds the normalized value to 16 bits
# before the weight (Qwen-Image's q / k norms; FLUX's are torch's RMSNorm), and rotary tables the graph builds in
# (1, S, 1, D) views (Qwen-Image's per-stream tables from its complex rotary), which the operation reads
# materialized as (S, D). The kernel computes the norm in float32 as inductor's fused kernel does (it keeps the
# intermediate rounding out, torch's default; not where inductor emulates precision casts). The 16-bit operation only
# (the bf16 and int8 stacks' attention), not the FP8 form. Qwen-Image 1024² on an H100, two rounds each: the int8
# stack 204.2 -> 198.4 ms per step, bf16 265.0 -> 262.3 (bench_peers_h100_qwen_image_qwenqk[_bf16]_20261207.json);
# the benchmarks' `_noqwenqk` rows run without it.
QK_NORM_ROPE_DIFFUSERS_RMS = True
# Whether it also replaces LayerNorm + modulate + static cast(s) (the AdaLN norms in front of FP8 linears).
LAYERNORM = True
# Whether a concatenation + GELU feeding an int8 linear's row quantization becomes one operation that writes the
# int8 rows and their scales (else the 16-bit concatenation is written and quantized by inductor's kernel;
# benchmarks' A/B rows set it). At FLUX's 4608 x 15360 on an H200: 130 us against 159 for the two kernels
# (benchmarks/results/bench_fp8_epilogues_h200_int8_20261205.json).
INT8 = True
# Whether, with INT8, a lone GELU feeding an int8 linear (the dual-stream blocks' feed-forward) becomes that operation
# too (else inductor's GELU + quantization kernel, a split reduction); benchmarks' A/B rows set it.
GELU_INT8 = True
# Whether the int8 concatenation + GELU kernel holds a row of up to 16,384 values in registers and reads its inputs
# once (else it reads them twice: epilogue_triton.concat_gelu_int8). On an H100: 98 us per call at 4608 x 15360
# against 134-142 for the two-pass kernel; the int8 FLUX step 93.2 -> 91.0 ms
# (benchmarks/results/bench_peers_h100_flux_newkernels_ab1_20261205.json). Benchmarks' A/B rows set it.
INT8_ONE_PASS = True
# Whether the int8 concatenation + GELU kernels take the GELU's tanh from the hardware's approximate tanh (one
# special-function instruction per value where the sigmoid form takes two; its error, up to 0.5 |h| 2^-11, is under
# half an int8 step unless a row's negative inputs exceed about 16x its largest output: epilogue_triton._gelu),
# and whether the int8 kernels multiply each value by its row's reciprocal scale instead of dividing by the scale
# (the GPU's division is another special-function instruction per value). Off: on an H200 both cut the kernel of
# FLUX's single blocks, alone, from 96.7 to 81.5 us but made the FLUX step no faster (90.6 against 89.8 ms;
# benchmarks/results/bench_fp8_epilogues_h200_int8_diet_20261206.json, bench_peers_h200_flux_int8_ab_20261206.json).
# Benchmarks' A/B rows set them.
INT8_GELU_TANH = False
INT8_RECIPROCAL = False
# Whether, with INT8, AdaLN's LayerNorm + modulate feeding int8 linears becomes one operation that writes the int8
# rows and their scales (else inductor's norm + quantization kernels). The int8 FLUX step on an H100: 93.2 -> 92.7
# ms, output error 0.0146 -> 0.0104 (same file). Benchmarks' A/B rows set it.
LAYERNORM_INT8 = True
# Whether the kernels it puts in take part in programmatic dependent launch where inductor's own kernels do
# (``_pdl``); benchmarks' A/B rows set it.
PDL = True
# Whether SageAttention's operand preparation (omni_accel::sage_quantize, sage_attention.PREP_KERNELS) whose q and k
# are the 16-bit q / k kernel's outputs takes that kernel's inputs instead (omni_accel::sage_quantize_normed): Q is
# then quantized where it is normalized and rotated, never written in 16 bits, and K's column sums (its mean) are
# taken where K is written, not read back for them. At FLUX's shape that is 28 MB of Q written and read, and 28 MB
# of K read, less per attention call. The same operands (tests/test_kernels.py). Off: measured on FLUX with
# attention="sage" on an H100, the fused kernels took as long as the ones they replace (Q 2.2 ms per step against
# 1.4 + 1.0, K 2.4 + 1.2 against 1.4 + 2.0: these kernels are bound by their instructions, not their bytes), and the
# step was no faster: as a fraction of the cuDNN row's speed in the same rounds, 0.997 with the switch (one head per
# program; 0.990 with eight), 0.994 and 0.991 without (bench_peers_h100_flux_bias_sage_20261206.json,
# bench_peers_h100_flux_fromnorms_20261206.json). Benchmarks' A/B rows (_fromnorms) set it.
SAGE_FROM_NORMS = False
# Whether a 16-bit GELU between two linears (the MLP, where no 8-bit linear quantizes its output) moves into the first
# linear's GEMM: cuBLASLt applies it to the float32 sums before the one rounding to 16 bits (its GELU + bias epilogue,
# omni_accel::linear_gelu), and the concatenation in front of FLUX's single blocks' proj_out is not written at all
# (omni_accel::concat_linear: two GEMMs over its two parts, the second adding into the first's output). At FLUX's
# shapes on an H100, 40 calls replayed from one CUDA graph: the image stream's up projection alone 467.4 us, with the
# GELU in its epilogue 476.7, with inductor's GELU kernel after it 522.7; the single block's MLP + proj_out 1,174.2 us
# against 1,248.4 with the concatenation kernel and 1,144.6 for its two GEMMs alone
# (benchmarks/results/bench_gemm_gelu_h100_20261206.json). The bf16 FLUX step: 125.5 against 129.3 ms
# (bench_peers_h100_flux_gelu_gemm_20261206.json). Benchmarks' A/B rows set it.
GELU_GEMM = True
# Whether, with INT8, a DiT block's gated residual after an int8 linear on the Triton GEMM, ``residual + gate *
# linear(x)`` with one gate row for every token (FLUX's, Qwen-Image's and Wan's attention output and feed-forward
# projections, FLUX's single blocks' proj_out), moves into that GEMM's epilogue (omni_accel::int8_mm_rescale_residual,
# kernels/int8_gemm_triton.py): the linear's 16-bit output is then neither written by the GEMM nor read back by
# inductor's add kernel, 25-28 MB each way per call at FLUX's 4096-4608 x 3072 (76 such calls per forward, beside the
# text stream's 38 of 512 rows; inductor's add kernels took about 1.8 ms of an 88 ms int8 step on an H100). The values
# are the unfused graph's: the product is rounded to 16 bits in registers before the gated add. On a GPU only where
# the GEMM's kernel takes the residual (int8_gemm_triton.residual_in_gemm: on Hopper, up to 1,024 rows while the
# warp-specialized kernel's twin is off). Off until a whole forward is timed with it (the per-call timings are in
# docs/kernels.md); benchmarks' A/B rows set it.
GATED_RESIDUAL_INT8 = False


# ---------------------------------------------------------------------------------------------- the operation
def concat_gelu_reference(a: torch.Tensor | None, a_scale: torch.Tensor | None, h: torch.Tensor,
                          bias: torch.Tensor | None, inverse: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """a (rows, heads, head dim) or None, h (rows, H) -> cast(cat([a [* a_scale], gelu(h [+ bias])], -1)), in
    float32."""
    hf = h.float() + (bias.float() if bias is not None else 0.0)
    y = hf * torch.sigmoid(_GELU_K * (hf + 0.044715 * hf * hf * hf))
    if a is not None:
        af = a.reshape(a.shape[0], -1).float()
        if a_scale is not None:
            af = af * a_scale.float().reshape(())
        y = torch.cat([af, y], dim=-1)
    if inverse is not None:
        y = (y * inverse.float().reshape(())).clamp(-FP8_MAX, FP8_MAX)
    return y.to(out_dtype)


def _pdl(device: torch.device) -> bool:
    """Whether a kernel the pass puts in uses programmatic dependent launch: when inductor compiles the graph with
    ``triton.enable_pdl`` (compiler.py's default on GPUs) for a Hopper or newer GPU, as its own kernels then do
    (its code generation makes the same check). Read while the pass runs, inside the compile that set the option."""
    from torch._inductor import config

    return (PDL and bool(getattr(config.triton, "enable_pdl", False)) and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _use_triton(device: torch.device) -> bool:
    from . import fused

    return fused.uses_triton(device)


@torch.library.custom_op("omni_accel::concat_gelu", mutates_args=(), schema=(
    "(Tensor? a, Tensor? a_scale, Tensor h, Tensor? bias, Tensor? inverse, ScalarType out_dtype, bool pdl=False) "
    "-> Tensor"))
def concat_gelu(a, a_scale, h, bias, inverse, out_dtype, pdl=False):
    if _use_triton(h.device):
        from . import epilogue_triton

        a_cols, a_head = (a.shape[1] * a.shape[2], a.shape[2]) if a is not None else (0, 0)
        if epilogue_triton.supported(a_cols, a_head, h.shape[1]):
            return epilogue_triton.concat_gelu(a, a_scale, h, bias, inverse, out_dtype, pdl=pdl)
    return concat_gelu_reference(a, a_scale, h, bias, inverse, out_dtype)


@concat_gelu.register_fake
def _(a, a_scale, h, bias, inverse, out_dtype, pdl=False):
    a_cols = a.shape[1] * a.shape[2] if a is not None else 0
    return h.new_empty((h.shape[0], a_cols + h.shape[1]), dtype=out_dtype)


def linear_gelu_reference(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(x @ w_t + bias) in float32, rounded once to x's dtype (what cuBLASLt's GELU epilogue computes)."""
    y = x.float() @ w_t.float() + bias.float()
    return torch.nn.functional.gelu(y, approximate="tanh").to(x.dtype)


@torch.library.custom_op("omni_accel::linear_gelu", mutates_args=(),
                         schema="(Tensor x, Tensor w_t, Tensor bias) -> Tensor")
def linear_gelu(x, w_t, bias):
    """A linear (x (rows, K), w_t (K, N), bias (N,)) and the tanh GELU after it in one GEMM on a GPU."""
    if x.is_cuda:
        # cuBLASLt's GELU_BIAS epilogue (the tanh form; torch computes the same product and GELU in two kernels
        # where cuBLASLt does not take the operands), on the algorithm gemm_tuning picked for the shape
        return gemm_tuning.linear(x, w_t, bias, "gelu_bias")
    return linear_gelu_reference(x, w_t, bias)


@linear_gelu.register_fake
def _(x, w_t, bias):
    return x.new_empty((x.shape[0], w_t.shape[1]))


@torch.library.custom_op("omni_accel::concat_linear", mutates_args=(),
                         schema="(Tensor a, Tensor b, Tensor w_t, Tensor? bias) -> Tensor")
def concat_linear(a, b, w_t, bias):
    """cat([a, b], -1) @ w_t (+ bias) without the concatenation: a's rows times w_t's first rows (+ bias), then b's
    times the rest added into that output in place (a GEMM with beta = 1; the first part's sums are rounded to 16
    bits once on the way)."""
    cols = a.shape[1]
    out = gemm_tuning.linear(a, w_t[:cols], bias, "bias" if bias is not None else "none")
    return gemm_tuning.linear(b, w_t[cols:], None, "accumulate", out=out)


@concat_linear.register_fake
def _(a, b, w_t, bias):
    return a.new_empty((a.shape[0], w_t.shape[1]))


@torch.library.custom_op("omni_accel::linear_tuned", mutates_args=(),
                         schema="(Tensor x, Tensor w_t, Tensor? bias) -> Tensor")
def linear_tuned(x, w_t, bias):
    """x (rows, K) @ w_t (K, N) (+ bias) on the cuBLASLt algorithm gemm_tuning picked for the shape (torch's call
    where none beat it, and off a GPU)."""
    return gemm_tuning.linear(x, w_t, bias, "bias" if bias is not None else "none")


@linear_tuned.register_fake
def _(x, w_t, bias):
    return x.new_empty((x.shape[0], w_t.shape[1]))


def concat_gelu_int8_reference(a: torch.Tensor | None, a_scale: torch.Tensor | None, h: torch.Tensor,
                               bias: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``concat_gelu_reference`` in ``dtype``, then each row to int8 (kernels/int8.py's ``quantize_rows_int8``):
    (int8 (rows, A + H), scale (rows, 1) float32)."""
    from .int8 import quantize_rows_int8

    return quantize_rows_int8(concat_gelu_reference(a, a_scale, h, bias, None, dtype))


@torch.library.custom_op("omni_accel::concat_gelu_int8", mutates_args=(), schema=(
    "(Tensor? a, Tensor? a_scale, Tensor h, Tensor? bias, ScalarType dtype, bool pdl=False) -> (Tensor, Tensor)"))
def concat_gelu_int8(a, a_scale, h, bias, dtype, pdl=False):
    if _use_triton(h.device):
        from . import epilogue_triton

        a_cols, a_head = (a.shape[1] * a.shape[2], a.shape[2]) if a is not None else (0, 0)
        if epilogue_triton.int8_supported(a_cols, a_head, h.shape[1]):
            return epilogue_triton.concat_gelu_int8(a, a_scale, h, bias, dtype, pdl=pdl, one_pass=INT8_ONE_PASS,
                                                    gelu_tanh=INT8_GELU_TANH, reciprocal=INT8_RECIPROCAL)
    return concat_gelu_int8_reference(a, a_scale, h, bias, dtype)


@concat_gelu_int8.register_fake
def _(a, a_scale, h, bias, dtype, pdl=False):
    cols = (a.shape[1] * a.shape[2] if a is not None else 0) + h.shape[1]
    return (h.new_empty((h.shape[0], cols), dtype=torch.int8), h.new_empty((h.shape[0], 1), dtype=torch.float32))


def _rms_normalized(src: torch.Tensor, bias: torch.Tensor | None, first_col: int, heads: int,
                    weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Columns [first_col, first_col + heads * D) of src (+ bias) as (rows, heads, D), RMS-normalized per head, in
    float32."""
    d = weight.numel()
    x = src[:, first_col:first_col + heads * d].float()
    if bias is not None:
        x = x + bias[first_col:first_col + heads * d].float()
    x = x.reshape(src.shape[0], heads, d)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def qk_norm_rope_reference(src: torch.Tensor, bias: torch.Tensor | None, first_col: int, heads: int,
                           weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                           k_mean: torch.Tensor | None, inverse: torch.Tensor | None,
                           out_dtype: torch.dtype = FP8_DTYPE, second: tuple | None = None) -> torch.Tensor:
    """The q or k part of a fused projection's output -> (rows, heads, D), in float32 (see epilogue_triton), cast to
    e4m3 with ``inverse`` or rounded to ``out_dtype`` without. ``second``: (src2, bias2, first_col2, weight2,
    tokens_a), a second stream whose rows follow each sample's first tokens_a rows of src."""
    d = weight.numel()
    y = _rms_normalized(src, bias, first_col, heads, weight, eps)
    if second is not None:
        src2, bias2, first_col2, weight2, tokens_a = second
        samples = src.shape[0] // tokens_a
        y2 = _rms_normalized(src2, bias2, first_col2, heads, weight2, eps)
        y = torch.cat([y.reshape(samples, tokens_a, heads, d), y2.reshape(samples, -1, heads, d)], dim=1)
        y = y.reshape(-1, heads, d)
    positions = torch.arange(y.shape[0], device=src.device) % cos.shape[0]
    c, s = cos.float()[positions][:, None, :], sin.float()[positions][:, None, :]
    sign = torch.arange(d, device=src.device) % 2 * 2 - 1
    out = y * c + y.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * (s * sign)
    if k_mean is not None:
        out = out - k_mean.float().reshape(heads, d)
    if inverse is None:
        return out.to(out_dtype)
    return (out * inverse.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _second_stream(src2, bias2, first_col2, weight2, tokens_a) -> tuple | None:
    """The ops' optional second-stream arguments as ``qk_norm_rope``'s ``second``, or None."""
    return (src2, bias2, first_col2, weight2, tokens_a) if src2 is not None else None


def _qk_rows(src, src2) -> int:
    return src.shape[0] + (src2.shape[0] if src2 is not None else 0)


_SECOND_STREAM_SCHEMA = "Tensor? src2=None, Tensor? bias2=None, int first_col2=0, Tensor? weight2=None, int tokens_a=0"


@torch.library.custom_op("omni_accel::qk_norm_rope_fp8", mutates_args=(), schema=(
    "(Tensor src, Tensor? bias, int first_col, int heads, Tensor weight, float eps, Tensor cos, Tensor sin, "
    f"Tensor? k_mean, Tensor inverse, bool pdl=False, {_SECOND_STREAM_SCHEMA}) -> Tensor"))
def qk_norm_rope_fp8(src, bias, first_col, heads, weight, eps, cos, sin, k_mean, inverse, pdl=False, src2=None,
                     bias2=None, first_col2=0, weight2=None, tokens_a=0):
    second = _second_stream(src2, bias2, first_col2, weight2, tokens_a)
    if _use_triton(src.device):
        from . import epilogue_triton

        if epilogue_triton.qk_norm_rope_supported(weight.numel()):
            return epilogue_triton.qk_norm_rope(src, bias, first_col, heads, weight, eps, cos, sin, k_mean, inverse,
                                                pdl=pdl, second=second)
    return qk_norm_rope_reference(src, bias, first_col, heads, weight, eps, cos, sin, k_mean, inverse, second=second)


@qk_norm_rope_fp8.register_fake
def _(src, bias, first_col, heads, weight, eps, cos, sin, k_mean, inverse, pdl=False, src2=None, bias2=None,
      first_col2=0, weight2=None, tokens_a=0):
    return src.new_empty((_qk_rows(src, src2), heads, weight.numel()), dtype=FP8_DTYPE)


@torch.library.custom_op("omni_accel::qk_norm_rope", mutates_args=(), schema=(
    "(Tensor src, Tensor? bias, int first_col, int heads, Tensor weight, float eps, Tensor cos, Tensor sin, "
    f"ScalarType out_dtype, bool pdl=False, {_SECOND_STREAM_SCHEMA}) -> Tensor"))
def qk_norm_rope(src, bias, first_col, heads, weight, eps, cos, sin, out_dtype, pdl=False, src2=None, bias2=None,
                 first_col2=0, weight2=None, tokens_a=0):
    second = _second_stream(src2, bias2, first_col2, weight2, tokens_a)
    if _use_triton(src.device):
        from . import epilogue_triton

        if epilogue_triton.qk_norm_rope_supported(weight.numel()):
            return epilogue_triton.qk_norm_rope(src, bias, first_col, heads, weight, eps, cos, sin, None, None,
                                                pdl=pdl, out_dtype=out_dtype, second=second)
    return qk_norm_rope_reference(src, bias, first_col, heads, weight, eps, cos, sin, None, None, out_dtype,
                                  second=second)


@qk_norm_rope.register_fake
def _(src, bias, first_col, heads, weight, eps, cos, sin, out_dtype, pdl=False, src2=None, bias2=None, first_col2=0,
      weight2=None, tokens_a=0):
    return src.new_empty((_qk_rows(src, src2), heads, weight.numel()), dtype=out_dtype)


def layernorm_modulate_reference(a: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor, shift: torch.Tensor,
                                 eps: float, inverses: list[torch.Tensor]) -> torch.Tensor:
    """Rows of a then b -> e4m3 (len(inverses), rows, C) of LayerNorm(x) * (1 + scale) + shift, in float32."""
    x = torch.cat([a, b]) if b is not None else a
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    y = y * (1 + scale.float().reshape(-1)) + shift.float().reshape(-1)
    return torch.stack([(y * inverse.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                        for inverse in inverses])


@torch.library.custom_op("omni_accel::layernorm_modulate_fp8", mutates_args=(), schema=(
    "(Tensor a, Tensor? b, Tensor scale, Tensor shift, float eps, Tensor inverse, Tensor? second_inverse, "
    "Tensor? third_inverse, bool pdl=False) -> Tensor"))
def layernorm_modulate_fp8(a, b, scale, shift, eps, inverse, second_inverse, third_inverse, pdl=False):
    inverses = [x for x in (inverse, second_inverse, third_inverse) if x is not None]
    if _use_triton(a.device):
        from . import epilogue_triton

        if b is None or epilogue_triton.layernorm_modulate_rows(a.shape[0]) is not None:
            return epilogue_triton.layernorm_modulate_cast(a, b, scale, shift, eps, inverses, pdl=pdl)
    return layernorm_modulate_reference(a, b, scale, shift, eps, inverses)


@layernorm_modulate_fp8.register_fake
def _(a, b, scale, shift, eps, inverse, second_inverse, third_inverse, pdl=False):
    rows = a.shape[0] + (b.shape[0] if b is not None else 0)
    count = 1 + (second_inverse is not None) + (third_inverse is not None)
    return a.new_empty((count, rows, a.shape[-1]), dtype=FP8_DTYPE)


def layernorm_modulate_int8_reference(a: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor,
                                      shift: torch.Tensor, eps: float,
                                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a then b: LayerNorm(x) * (1 + scale) + shift in float32, rounded to ``dtype``, then each row to int8
    (kernels/int8.py's ``quantize_rows_int8``): (int8 (rows, C), scale (rows, 1) float32)."""
    from .int8 import quantize_rows_int8

    x = torch.cat([a, b]) if b is not None else a
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return quantize_rows_int8((y * (1 + scale.float().reshape(-1)) + shift.float().reshape(-1)).to(dtype))


@torch.library.custom_op("omni_accel::layernorm_modulate_int8", mutates_args=(), schema=(
    "(Tensor a, Tensor? b, Tensor scale, Tensor shift, float eps, ScalarType dtype, bool pdl=False) "
    "-> (Tensor, Tensor)"))
def layernorm_modulate_int8(a, b, scale, shift, eps, dtype, pdl=False):
    if _use_triton(a.device):
        from . import epilogue_triton

        if b is None or epilogue_triton.layernorm_modulate_rows(a.shape[0]) is not None:
            return epilogue_triton.layernorm_modulate_int8(a, b, scale, shift, eps, dtype, pdl=pdl,
                                                           reciprocal=INT8_RECIPROCAL)
    return layernorm_modulate_int8_reference(a, b, scale, shift, eps, dtype)


@layernorm_modulate_int8.register_fake
def _(a, b, scale, shift, eps, dtype, pdl=False):
    rows = a.shape[0] + (b.shape[0] if b is not None else 0)
    return a.new_empty((rows, a.shape[-1]), dtype=torch.int8), a.new_empty((rows, 1), dtype=torch.float32)


# ------------------------------------------------------------------------------------------- graph matching
def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _only_user(node: fx.Node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_number(x, value: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isclose(x, value, rel_tol=1e-6)


def _is_scalar_tensor(node) -> bool:
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.numel() == 1 and val.dtype == torch.float32


def _up_views(node, shared: bool = False):
    """The node behind a chain of views of ``node``; with ``shared``, also through views that other nodes read."""
    while _call(node, *_VIEWS) and (shared or len(node.users) == 1):
        node = node.args[0]
    return node


def _static_fp8_cast(node: fx.Node):
    """The chain after ``node`` that casts it with a fixed scale: [views] -> float32 -> * inverse -> clamp(+-448) ->
    e4m3 (kernels/fp8.py's ``quantize_static``). Returns (the e4m3 node, the inverse scale node) or None."""
    n = node
    while (user := _only_user(n)) is not None and _call(user, *_VIEWS):
        n = user
    return _cast_from_float32(_only_user(n))


def _cast_from_float32(n):
    """``_static_fp8_cast`` from its float32 conversion on."""
    if not (_call(n, _CONVERT) and n.args[1] == torch.float32):
        return None
    mul = _only_user(n)
    return _cast_after_mul(mul, n) if _call(mul, aten.mul.Tensor) and n in mul.args else None


def _cast_after_mul(mul: fx.Node, operand):
    """``mul`` = operand * inverse (a one-value float32 tensor), then clamp(+-448) and the e4m3 cast: (the e4m3 node,
    the inverse scale node) or None."""
    inverse = mul.args[1] if mul.args[0] is operand else mul.args[0]
    if not _is_scalar_tensor(inverse):
        return None
    clamped = _symmetric_clamp(_only_user(mul), FP8_MAX)
    cast = _only_user(clamped) if clamped is not None else None
    if not (_call(cast, _CONVERT) and cast.args[1] == FP8_DTYPE and cast.users):
        return None
    return cast, inverse


def _symmetric_clamp(n, bound: float):
    """``n`` = clamp(t, -bound, bound), or clamp_min(t, -bound) used once by clamp_max(., bound): the node whose
    value is the clamped one, else None."""
    if _call(n, aten.clamp.default) and _is_number(n.args[1], -bound) and _is_number(n.args[2], bound):
        return n
    if (_call(n, aten.clamp_min.default) and _is_number(n.args[1], -bound)
            and _call(hi := _only_user(n), aten.clamp_max.default) and _is_number(hi.args[1], bound)):
        return hi
    return None


def _int8_row_quantization(node: fx.Node):
    """The chain after ``node`` (a 16-bit tensor) that quantizes its rows to int8 for an int8 linear
    (kernels/int8.py's ``quantize_rows_int8``): [views] -> both abs -> amax(last dim, keepdim) -> float32 ->
    clamp_min(1e-12) -> / 127 (the scale), and float32 -> / scale -> round -> clamp(+-127) -> int8.
    Returns (the int8 node, the scale node) or None."""
    from .int8 import INT8_MAX, _MIN_AMAX

    n = node
    while (user := _only_user(n)) is not None and _call(user, *_VIEWS):
        n = user
    if _val(n).shape[-1] != _val(node).shape[-1]:  # a view to other rows: not the rows the kernels quantize
        return None
    users = list(n.users)
    absolute = next((u for u in users if _call(u, aten.abs.default)), None)
    to_float = next((u for u in users if _call(u, _CONVERT) and u.args[1] == torch.float32), None)
    if len(users) != 2 or absolute is None or to_float is None:
        return None
    amax = _only_user(absolute)
    last = _val(n).dim() - 1
    if not (_call(amax, aten.amax.default) and list(amax.args[1]) in ([-1], [last])
            and (amax.args[2] if len(amax.args) > 2 else amax.kwargs.get("keepdim", False))):
        return None
    widened = _only_user(amax)
    floor = _only_user(widened) if _call(widened, _CONVERT) and widened.args[1] == torch.float32 else None
    if not (_call(floor, aten.clamp_min.default) and _is_number(floor.args[1], _MIN_AMAX)):
        return None
    scale = _only_user(floor)
    if not (_call(scale, aten.div.Tensor) and scale.args[0] is floor and _is_number(scale.args[1], INT8_MAX)):
        return None
    divided = _only_user(to_float)
    if not (_call(divided, aten.div.Tensor) and divided.args[:2] == (to_float, scale)):
        return None
    rounded = _only_user(divided)
    clamped = _symmetric_clamp(_only_user(rounded), INT8_MAX) if _call(rounded, aten.round.default) else None
    cast = _only_user(clamped) if clamped is not None else None
    if not (_call(cast, _CONVERT) and cast.args[1] == torch.int8 and cast.users):
        return None
    return cast, scale


def _int8_row_quantizations(node: fx.Node):
    """Every use of ``node`` is the int8 linears' row quantization (``_int8_row_quantization``), each through its own
    view of the same rows (one per int8 linear reading them: the graph does not merge them): [(int8 node, scale
    node)], or None."""
    if (found := _int8_row_quantization(node)) is not None:
        return [found]
    cols = _val(node).shape[-1]
    chains = []
    for user in node.users:
        if not (_call(user, *_VIEWS) and _val(user).shape[-1] == cols):
            return None
        if (found := _int8_row_quantization(user)) is None:
            return None
        chains.append(found)
    return chains or None


def _mul_factors(node, depth: int = 3) -> list:
    """The factors of a tree of tensor multiplications (each inner product used once): nodes and numbers."""
    if depth and _call(node, aten.mul.Tensor) and len(node.users) == 1:
        return _mul_factors(node.args[0], depth - 1) + _mul_factors(node.args[1], depth - 1)
    return [node]


def _split_bias(node):
    """``node`` = t + bias, used once, with a bias of t's last-dim size (t of two dims or more): (t up through its
    views, bias), else (node, None)."""
    if _call(node, aten.add.Tensor) and len(node.users) == 1:
        t, bias = node.args[:2]
        bias_val, t_val = _val(bias), _val(t)
        if (isinstance(bias_val, torch.Tensor) and isinstance(t_val, torch.Tensor) and bias_val.dim() == 1
                and t_val.dim() >= 2 and bias_val.shape[0] == t_val.shape[-1]):
            return _up_views(t), bias
    return node, None


def _kernel_takes(out: torch.Tensor, supported) -> bool:
    """Whether the Triton kernel takes this call (``supported(epilogue_triton)``); off the GPU the operation runs its
    torch reference, which takes any shape."""
    if not out.is_cuda:
        return True
    from . import epilogue_triton

    return supported(epilogue_triton)


def _sigmoid_gelu_source(node: fx.Node):
    """``node`` = [to 16-bit] of x * sigmoid(K * (x + 0.044715 * x * x * x)) with x = float32 of a source: returns
    (source, bias or None) where the source may be ``t + bias`` (a bias of the last dim's size), else None."""
    if _call(node, _CONVERT) and node.args[1] in (torch.bfloat16, torch.float16):
        node = node.args[0]
    if not (_call(node, aten.mul.Tensor) and len(node.users) == 1):
        return None
    sig = next((arg for arg in node.args[:2] if _call(arg, aten.sigmoid.default)), None)
    if sig is None:
        return None
    x = node.args[1] if node.args[0] is sig else node.args[0]
    inner = sig.args[0]
    if not (_call(inner, aten.mul.Tensor) and any(_is_number(arg, _GELU_K) for arg in inner.args[:2])):
        return None
    total = next(arg for arg in inner.args[:2] if isinstance(arg, fx.Node))
    if not (_call(total, aten.add.Tensor) and x in total.args[:2]):
        return None
    cube = total.args[1] if total.args[0] is x else total.args[0]
    factors = _mul_factors(cube, depth=4)
    rest = [f for f in factors if f is not x]
    if len(factors) - len(rest) != 3 or len(rest) != 1 or not _is_number(rest[0], 0.044715):
        return None
    source = x.args[0] if _call(x, _CONVERT) and x.args[1] == torch.float32 else x
    return _split_bias(_up_views(source))


def _dequantized_source(node: fx.Node):
    """``node`` (up through views) = 16-bit of (float32 of an e4m3 tensor) * scale: (the e4m3 node, scale node);
    else (the node itself, None)."""
    n = _up_views(node)
    if _call(n, _CONVERT) and n.args[1] in (torch.bfloat16, torch.float16) and len(n.users) == 1:
        mul = n.args[0]
        if _call(mul, aten.mul.Tensor) and len(mul.users) == 1:
            for i in (0, 1):
                src, scale = mul.args[i], mul.args[1 - i]
                if (_call(src, _CONVERT) and src.args[1] == torch.float32 and _is_scalar_tensor(scale)
                        and getattr(_val(src.args[0]), "dtype", None) == FP8_DTYPE):
                    return src.args[0], scale
    return n, None


def _rows_heads(val: torch.Tensor, cols: int):
    """How to see ``val`` (``cols`` values per row once its trailing dims are merged) as (rows, heads, head dim)
    with stride(-1) == 1: ("reshape", shape) for a contiguous tensor, ("select0", None) for a (1, S, H, D) tensor with
    any token / head strides (an attention output), else None."""
    if val.is_contiguous():
        return "reshape", [val.numel() // cols, 1, cols]
    if val.dim() == 4 and val.shape[0] == 1 and val.stride(-1) == 1 and val.shape[-2] * val.shape[-1] == cols:
        return "select0", None
    return None


class _Candidate:
    def __init__(self, cat, a, a_scale, a_layout, h, bias, final, inverse, int8_scale=None):
        self.cat, self.a, self.a_scale, self.a_layout, self.h, self.bias = cat, a, a_scale, a_layout, h, bias
        # final: the node whose value the fused operation replaces (the concatenation, its e4m3 cast or its int8
        # quantization); int8_scale: the quantization's scale node, replaced too
        self.final, self.inverse, self.int8_scale = final, inverse, int8_scale


def _candidate(cat: fx.Node):
    tensors, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    out = _val(cat)
    if not isinstance(out, torch.Tensor) or len(tensors) != 2 or dim not in (-1, out.dim() - 1):
        return None
    if out.dtype not in (torch.bfloat16, torch.float16) or out.dim() < 2:
        return None
    gelu = _sigmoid_gelu_source(tensors[1])
    if gelu is None or len(tensors[1].users) != 1:
        return None
    h, bias = gelu
    h_val = _val(h)
    a_cols = _val(tensors[0]).shape[-1]
    h_cols = out.shape[-1] - a_cols
    rows = out.numel() // out.shape[-1]
    # the same rows on both sides: a GELU input broadcast by its bias (fewer rows than the output) is not taken
    if not (isinstance(h_val, torch.Tensor) and h_val.is_contiguous() and h_val.shape[-1] == h_cols
            and h_val.numel() == rows * h_cols):
        return None
    a, a_scale = _dequantized_source(tensors[0])
    a_val = _val(a)
    layout = _rows_heads(a_val, a_cols) if isinstance(a_val, torch.Tensor) and a_val.numel() == rows * a_cols else None
    if layout is None:
        return None
    a_head = a_val.shape[-1] if layout[0] == "select0" else a_cols
    if INT8 and (quantized := _int8_row_quantization(cat)) is not None:
        if not _kernel_takes(out, lambda kernels: kernels.int8_supported(a_cols, a_head, h_cols)):
            return None
        return _Candidate(cat, a, a_scale, layout, h, bias, quantized[0], None, int8_scale=quantized[1])
    if (gemm := _concat_gemm_candidate(cat, a, a_scale, layout, h, bias)) is not None:
        return gemm
    if not _kernel_takes(out, lambda kernels: kernels.supported(a_cols, a_head, h_cols)):
        return None
    cast = _static_fp8_cast(cat)
    final, inverse = cast if cast is not None else (cat, None)
    return _Candidate(cat, a, a_scale, layout, h, bias, final, inverse)


def _fake(fn, *args):
    from torch._guards import detect_fake_mode

    vals = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode:
        return fn(*vals)


def _node(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = _fake(target, *args)
    return node


def _lone_gelu_candidate(node: fx.Node):
    """``node`` = a sigmoid-GELU's 16-bit output whose only use is a static FP8 cast, or an int8 linear's per-row
    quantization (the dual-stream blocks' feed-forward between its two linears): the same kernels, no first input."""
    if not (_call(node, _CONVERT) and node.args[1] in (torch.bfloat16, torch.float16)):
        return None
    quantized = _int8_row_quantization(node) if INT8 and GELU_INT8 else None
    cast = _static_fp8_cast(node) if quantized is None else None
    gelu = _sigmoid_gelu_source(node) if quantized is not None or cast is not None else None
    if gelu is None:
        return None
    h, bias = gelu
    h_val, out = _val(h), _val(node)
    if not (isinstance(h_val, torch.Tensor) and h_val.is_contiguous() and h_val.shape[-1] == out.shape[-1]
            and h_val.numel() == out.numel()):
        return None
    if quantized is not None:
        if not _kernel_takes(out, lambda kernels: kernels.int8_supported(0, 0, out.shape[-1])):
            return None
        return _Candidate(node, None, None, None, h, bias, quantized[0], None, int8_scale=quantized[1])
    if not _kernel_takes(out, lambda kernels: kernels.supported(0, 0, out.shape[-1])):
        return None
    return _Candidate(node, None, None, None, h, bias, *cast)


def _rewrite(graph: fx.Graph, c: _Candidate) -> None:
    lone = c.a is None
    a_cols = 0 if lone else _val(c.cat.args[0][0]).shape[-1]
    h_cols = _val(c.cat).shape[-1] - a_cols
    final_val = _val(c.final)
    with graph.inserting_before(c.final):
        if lone:
            a3 = None
        else:
            how, shape = c.a_layout
            a3 = (_node(graph, aten.reshape.default, c.a, shape) if how == "reshape"
                  else _node(graph, aten.select.int, c.a, 0, 0))
        h2 = _node(graph, aten.reshape.default, c.h, [-1, h_cols])
        if c.int8_scale is not None:
            _rewrite_int8(graph, c, a3, h2)
            return
        fused = _node(graph, torch.ops.omni_accel.concat_gelu.default, a3, c.a_scale, h2, c.bias, c.inverse,
                      final_val.dtype, _pdl(final_val.device))
        out = _node(graph, aten.reshape.default, fused, list(final_val.shape))
    c.final.replace_all_uses_with(out)


def _rewrite_int8(graph: fx.Graph, c: _Candidate, a3, h2) -> None:
    """The int8 form of ``_rewrite`` (inside its insertion point): one operation gives the int8 rows and their
    scales, which replace the quantization's int8 node and its scale node."""
    fused = _node(graph, torch.ops.omni_accel.concat_gelu_int8.default, a3, c.a_scale, h2, c.bias,
                  _val(c.cat).dtype, _pdl(_val(c.cat).device))
    _replace_int8_rows(graph, fused, [(c.final, c.int8_scale)])


def _replace_int8_rows(graph: fx.Graph, fused: fx.Node, chains) -> None:
    """``fused``'s (int8 rows, scales) replace each quantization's (int8 node, scale node) in ``chains``, each reshaped
    to that node's shape (inside the caller's insertion point)."""
    parts = []
    for index in (0, 1):
        parts.append(graph.call_function(operator.getitem, (fused, index)))
        parts[-1].meta["val"] = _val(fused)[index]
    for chain in chains:
        for part, old in zip(parts, chain):
            old.replace_all_uses_with(_node(graph, aten.reshape.default, part, list(_val(old).shape)))


# ----------------------------------------------------------------- 16-bit GELU into the GEMM (GELU_GEMM)
class _GemmCandidate:
    def __init__(self, final, linear, a=None, out_linear=None):
        # final: the node whose value is replaced (the GELU's 16-bit output, or the linear reading the concatenation);
        # linear: the GELU's linear as (x, w_t, bias); a: the concatenation's first part (rows, a_cols), then
        # out_linear: (w_t, bias or None) of the linear reading the concatenation
        self.final, self.linear, self.a, self.out_linear = final, linear, a, out_linear
        self.kind = "gelu_gemm" if a is None else "concat_gelu_gemm"


def _linear_operands(node):
    """``node`` = mm(x, w_t) or addmm(bias, x, w_t) with a 1-D bias and no scaling: (x, w_t, bias or None)."""
    if _call(node, aten.mm.default):
        return node.args[0], node.args[1], None
    if (_call(node, aten.addmm.default) and len(node.args) == 3
            and all(_is_number(v, 1.0) for v in node.kwargs.values())
            and getattr(_val(node.args[0]), "dim", lambda: 0)() == 1):
        return node.args[1], node.args[2], node.args[0]
    return None


def _linear_readers(node: fx.Node):
    """The linears that read ``node``'s rows as their input, through views that keep its last dim: [mm / addmm],
    or None where any use is something else."""
    readers = []
    for user in node.users:
        if _call(user, *_VIEWS) and _val(user).shape[-1] == _val(node).shape[-1]:
            further = _linear_readers(user)
            if further is None:
                return None
            readers += further
        elif (operands := _linear_operands(user)) is not None and operands[0] is node:
            readers.append(user)
        else:
            return None
    return readers


def _gelu_linear(h, bias, dtype: torch.dtype):
    """The linear that gives the GELU its input: (x, w_t, bias) where ``h`` (used by the GELU alone) is mm with the
    GELU's bias, or addmm; all in ``dtype`` (the GELU's output dtype: the op writes the GELU in its inputs' dtype).
    Else None."""
    operands = _linear_operands(h)
    if operands is None or len(h.users) != 1:
        return None
    x, w_t, inner_bias = operands
    if (inner_bias is None) == (bias is None):  # cuBLASLt's epilogue adds one bias
        return None
    linear = (x, w_t, bias if bias is not None else inner_bias)
    dtypes = {getattr(_val(n), "dtype", None) for n in linear}
    return linear if dtypes == {dtype} and dtype in (torch.bfloat16, torch.float16) else None


def _lone_gelu_gemm_candidate(node: fx.Node):
    """``node`` = a sigmoid-GELU's 16-bit output read only by linears (a feed-forward between its two linears, no
    8-bit quantization after it), of a linear's output + bias."""
    if not (GELU_GEMM and _call(node, _CONVERT) and node.args[1] in (torch.bfloat16, torch.float16)):
        return None
    if not _linear_readers(node) or (gelu := _sigmoid_gelu_source(node)) is None:
        return None
    h_val, out = _val(gelu[0]), _val(node)
    if not (isinstance(h_val, torch.Tensor) and h_val.shape[-1] == out.shape[-1] and h_val.numel() == out.numel()):
        return None
    linear = _gelu_linear(*gelu, out.dtype)
    return _GemmCandidate(node, linear) if linear is not None else None


def _concat_gemm_candidate(cat: fx.Node, a, a_scale, a_layout, h, bias):
    """``cat`` = cat([a, gelu(linear)]) read by one linear alone, ``a`` a contiguous 16-bit tensor (FLUX's single
    blocks' ``proj_out`` input): that linear becomes omni_accel::concat_linear over ``a`` and the GELU's linear."""
    if not GELU_GEMM or a_scale is not None or a_layout[0] != "reshape":
        return None
    readers = _linear_readers(cat)
    linear = _gelu_linear(h, bias, _val(cat).dtype)
    if linear is None or readers is None or len(readers) != 1:
        return None
    reader = readers[0]
    _, w_t, out_bias = _linear_operands(reader)
    dtype = _val(cat).dtype
    if any(getattr(_val(n), "dtype", dtype) != dtype for n in (w_t, out_bias, a) if n is not None):
        return None
    return _GemmCandidate(reader, linear, a=a, out_linear=(w_t, out_bias))


def _rewrite_gemm(graph: fx.Graph, c: _GemmCandidate) -> None:
    with graph.inserting_before(c.final):
        gelu = _node(graph, torch.ops.omni_accel.linear_gelu.default, *c.linear)
        if c.a is None:
            out = _node(graph, aten.reshape.default, gelu, list(_val(c.final).shape))
        else:
            a2 = _node(graph, aten.reshape.default, c.a, [_val(gelu).shape[0], -1])
            out = _node(graph, torch.ops.omni_accel.concat_linear.default, a2, gelu, *c.out_linear)
    c.final.replace_all_uses_with(out)


# ------------------------------------------------ 16-bit linears on a tuned algorithm (gemm_tuning.TUNED_GEMMS)
def _tuned_gemm_candidate(node: fx.Node):
    """``node`` = a 16-bit mm / addmm (a linear) large enough for gemm_tuning to time: its (x, w_t, bias or None)."""
    operands = _linear_operands(node)
    if operands is None:
        return None
    vals = [_val(n) for n in operands if n is not None]
    if not all(isinstance(v, torch.Tensor) for v in vals) or len({v.dtype for v in vals}) != 1:
        return None
    (m, k), n = vals[0].shape, vals[1].shape[1]
    if vals[0].dtype not in (torch.bfloat16, torch.float16) or 2 * m * k * n < gemm_tuning.MIN_GFLOP * 1e9:
        return None
    if operands[2] is not None and (vals[2].shape != (n,) or vals[2].stride() != (1,)):  # a broadcast bias: torch's
        return None
    return operands


def _rewrite_tuned_gemm(graph: fx.Graph, node: fx.Node, operands) -> None:
    with graph.inserting_before(node):
        tuned = _node(graph, torch.ops.omni_accel.linear_tuned.default, *operands)
    node.replace_all_uses_with(tuned)


# --------------------------------------------------------------------- q / k: RMSNorm + rotary + static cast
def _static_cast_source(cast):
    """``cast`` = e4m3 of clamp(z * inverse, +-448): (z, inverse) or None (``_cast_after_mul`` found from its end)."""
    if not (_call(cast, _CONVERT) and cast.args[1] == FP8_DTYPE):
        return None
    m = cast.args[0]
    while _call(m, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        m = m.args[0]
    if not _call(m, aten.mul.Tensor):
        return None
    for z in m.args[:2]:
        if isinstance(z, fx.Node) and not _is_scalar_tensor(z):
            found = _cast_after_mul(m, z)
            if found is not None and found[0] is cast:
                return z, found[1]
    return None


def _skip_round_trip(node):
    """float32 of a 16-bit rounding of x -> x: the rotary's ``.to(x.dtype)`` before the cast's ``.float()``. Inductor's
    own kernel keeps float32 there on GPUs (it drops such pairs), and so does the replacement."""
    if (_call(node, _CONVERT) and node.args[1] == torch.float32 and _call(node.args[0], _CONVERT)
            and node.args[0].args[1] in (torch.bfloat16, torch.float16) and len(node.args[0].users) == 1
            and getattr(_val(node.args[0].args[0]), "dtype", None) == torch.float32):
        return node.args[0].args[0]
    return node


def _rms_norm_source(y16, diffusers_rms: bool = False):
    """``y16`` = 16-bit of x * rsqrt(mean(x^2, -1) + eps) * w with x = float32 of a source (torch's rms_norm as it
    decomposes), or the first output of ``_fused_rms_norm``, or (``diffusers_rms``) diffusers' RMSNorm: 16-bit(x *
    rsqrt(...)) * w in 16 bits. Returns (source, weight, eps) or None."""
    if diffusers_rms and (found := _diffusers_rms_norm_source(y16)) is not None:
        return found
    if _call(y16, operator.getitem) and y16.args[1] == 0 and _call(y16.args[0], _FUSED_RMS_NORM):
        x, _, weight, eps = (list(y16.args[0].args) + [None, None])[:4]
        return (x, weight, eps) if weight is not None and isinstance(eps, float) else None
    if not (_call(y16, _CONVERT) and y16.args[1] in (torch.bfloat16, torch.float16)):
        return None
    factors = _mul_factors(y16.args[0])
    rsqrt = [f for f in factors if _call(f, aten.rsqrt.default)]
    if len(factors) != 3 or len(rsqrt) != 1 or (found := _mean_square(rsqrt[0])) is None:
        return None
    xf, eps = found
    rest = [f for f in factors if f is not rsqrt[0]]
    if xf not in rest:
        return None
    weight = rest[1] if rest[0] is xf else rest[0]
    if not (isinstance(_val(weight), torch.Tensor) and _val(weight).dim() == 1):
        return None
    return _float32_source(xf), weight, eps


def _mean_square(rsqrt):
    """``rsqrt`` = rsqrt(mean(xf^2, -1) + eps): (xf, eps) or None."""
    total = rsqrt.args[0]
    if not (_call(total, aten.add.Scalar, aten.add.Tensor) and isinstance(total.args[1], float)):
        return None
    mean = total.args[0]
    if not (_call(mean, aten.mean.dim) and list(mean.args[1]) in ([-1], [_val(mean).dim() - 1])
            and _val(mean).shape[-1] == 1):  # keepdim: one mean per row, broadcast over it
        return None
    square = mean.args[0]
    if not (_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2):
        return None
    return square.args[0], total.args[1]


def _float32_source(xf):
    """What ``xf`` converts to float32 (``xf`` itself where it is no such conversion)."""
    return xf.args[0] if _call(xf, _CONVERT) and xf.args[1] == torch.float32 else xf


def _normalized_source(z):
    """``z`` = x * rsqrt(mean(xf^2, -1) + eps) with xf = float32 of the source x, and x the source itself or xf
    (diffusers' RMSNorm multiplies its 16-bit input, which promotes to float32): (source, eps) or None."""
    factors = _mul_factors(z)
    rsqrt = [f for f in factors if _call(f, aten.rsqrt.default)]
    if len(factors) != 2 or len(rsqrt) != 1 or (found := _mean_square(rsqrt[0])) is None:
        return None
    (xf, eps), x = found, [f for f in factors if f is not rsqrt[0]][0]
    source = _float32_source(xf)
    return (source, eps) if x is xf or x is source else None


def _diffusers_rms_norm_source(y16):
    """``y16`` = 16-bit(x * rsqrt(mean(x^2, -1) + eps)) * w, both 16-bit (diffusers' RMSNorm with a 16-bit weight):
    (source, weight, eps) or None. Not where inductor emulates precision casts: its kernel would round before the
    weight, the operation does not (it matches inductor's default, which keeps the product in float32)."""
    from torch._inductor import config as inductor_config

    if inductor_config.emulate_precision_casts:
        return None
    out = _val(y16)
    if not (_call(y16, aten.mul.Tensor) and isinstance(out, torch.Tensor)
            and out.dtype in (torch.bfloat16, torch.float16)):
        return None
    for rounded, weight in ((y16.args[0], y16.args[1]), (y16.args[1], y16.args[0])):
        w = _val(weight) if isinstance(weight, fx.Node) else None
        if not (isinstance(w, torch.Tensor) and w.dim() == 1 and w.dtype == out.dtype):
            continue
        if not (_call(rounded, _CONVERT) and rounded.args[1] == out.dtype):
            continue
        found = _normalized_source(rounded.args[0])
        if found is not None:
            return found[0], weight, found[1]
    return None


def _is_pair_sign(node) -> bool:
    """``arange(D) % 2 * 2 - 1`` (the pair-swap rotary's signs, compiler._pair_swap_rotary) as the graph has it."""
    if not (_call(node, aten.sub.Tensor) and node.args[1] == 1 and _call(node.args[0], aten.mul.Tensor)):
        return False
    rem = node.args[0].args[0]
    return (node.args[0].args[1] == 2 and _call(rem, aten.remainder.Scalar) and rem.args[1] == 2
            and _call(rem.args[0], prims.iota.default))


def _pair_swap_rope(r):
    """``r`` = float32(y) * cos + float32(swap(y)) * (sin * sign): (y, cos view, sin view) or None."""
    if not _call(r, aten.add.Tensor):
        return None
    for plain, rotated in ((r.args[0], r.args[1]), (r.args[1], r.args[0])):
        if not (_call(plain, aten.mul.Tensor) and _call(rotated, aten.mul.Tensor)):
            continue
        for yf, cos in ((plain.args[0], plain.args[1]), (plain.args[1], plain.args[0])):
            if not (_call(yf, _CONVERT) and yf.args[1] == torch.float32):
                continue
            y = yf.args[0]
            for swf, signed_sin in ((rotated.args[0], rotated.args[1]), (rotated.args[1], rotated.args[0])):
                if not (_call(swf, _CONVERT) and swf.args[1] == torch.float32 and _call(signed_sin, aten.mul.Tensor)):
                    continue
                rev = _up_views(swf.args[0])
                if not (_call(rev, prims.rev.default) and list(rev.args[1]) in ([-1], [_val(rev).dim() - 1])
                        and _val(rev).shape[-1] == 2 and _up_views(rev.args[0]) is y):
                    continue
                sin, sign = signed_sin.args[:2]
                if not _is_pair_sign(sign):
                    sin, sign = sign, sin
                if _is_pair_sign(sign):
                    return y, cos, sin
    return None


def _projection_part(x, width: int, through_shared_views: bool = False):
    """Where ``x`` (a view of ``width`` columns) comes from: a column slice of a fused projection's output, its bias
    added on the way. Returns (the projection's output, bias or None, first column) or None."""
    n = _up_views(x, through_shared_views)  # shared: diffusers' RMSNorm reads its input twice
    first_col = 0
    if _call(n, operator.getitem) and _call(n.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split, index = n.args[0], n.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim not in (-1, _val(split.args[0]).dim() - 1):
            return None
        sizes = split.args[1]
        first_col = sum(sizes[:index]) if isinstance(sizes, (list, tuple)) else index * sizes
        n = _up_views(split.args[0])
    n, bias = _split_bias(n)
    src = _val(n)
    if not (isinstance(src, torch.Tensor) and src.is_contiguous() and first_col + width <= src.shape[-1]):
        return None
    return n, bias, first_col


class _QkCandidate:
    def __init__(self, cast, inverse, k_mean, src, bias, first_col, weight, eps, cos, sin, heads, second=None):
        self.cast, self.inverse, self.k_mean = cast, inverse, k_mean
        self.src, self.bias, self.first_col, self.weight, self.eps = src, bias, first_col, weight, eps
        self.cos, self.sin, self.heads = cos, sin, heads
        self.second = second  # (src2, bias2, first_col2, weight2, tokens_a): a joint block's second stream, or None


def _qk_candidate(cast: fx.Node):
    """``cast`` = static e4m3 cast of [rotary(rms_norm(part of a fused projection)) - K's mean]."""
    found = _static_cast_source(cast)
    if found is None:
        return None
    z, inverse = found
    k_mean = None
    z = _skip_round_trip(z)
    if _call(z, aten.sub.Tensor):
        z, k_mean = z.args[:2]
        if not (isinstance(_val(k_mean), torch.Tensor) and _val(k_mean).is_contiguous()):
            return None
        z = _skip_round_trip(z)
    return _qk_parts(cast, z, inverse, k_mean)


def _fp8_form_takes(node: fx.Node) -> bool:
    """Whether a static e4m3 cast a few operations after ``node`` (the rotary's 16-bit output) is one the FP8 form
    matches (``_qk_candidate``): then that form takes the chain whole from the cast, or with QK_NORM_ROPE off,
    inductor keeps it (the A/B rows' meaning)."""
    frontier, seen = list(node.users), set()
    for _ in range(6):  # float32, [- K's mean], * inverse, clamp (one or two), the cast
        following = []
        for n in frontier:
            if n in seen or not isinstance(n, fx.Node):
                continue
            seen.add(n)
            if _call(n, _CONVERT) and n.args[1] == FP8_DTYPE and _qk_candidate(n) is not None:
                return True
            following.extend(n.users)
        frontier = following
    return False


def _qk16_candidate(node: fx.Node):
    """``node`` = the 16-bit rounding of rotary(rms_norm(part of a fused projection)) read as such (not FP8
    attention's static cast, which ``_qk_candidate`` takes whole)."""
    if not (_call(node, _CONVERT) and node.args[1] in (torch.bfloat16, torch.float16)):
        return None
    found = _qk_parts(node, node.args[0], None, None)  # the pattern first: the downstream walk only for a rotary
    return found if found is not None and not _fp8_form_takes(node) else None


def _normed_streams(y, diffusers_rms: bool = False):
    """The RMSNorms behind the rotary's input ``y``: [(x, weight, eps)] for one norm, or two for a concatenation of
    two normalized streams along the tokens (FLUX's dual-stream blocks: text, then image); None otherwise."""
    if _call(y, aten.cat.default) and len(y.args[0]) == 2 and QK_NORM_ROPE_JOINT:
        dim = y.args[1] if len(y.args) > 1 else y.kwargs.get("dim", 0)
        if dim not in (1, -3):
            return None
        norms = [_rms_norm_source(part, diffusers_rms) for part in y.args[0]]
        return norms if all(n is not None for n in norms) else None
    norm = _rms_norm_source(y, diffusers_rms)
    return [norm] if norm is not None else None


def _qk_parts(final: fx.Node, z, inverse, k_mean):
    """The rotary and norm(s) behind ``z`` (float32) and the projection(s) they read, for the node ``final`` that the
    operation replaces: a _QkCandidate or None."""
    # Qwen-Image's form (QK_NORM_ROPE_DIFFUSERS_RMS) only for the 16-bit operation, the one it was written for
    qwen_form = QK_NORM_ROPE_DIFFUSERS_RMS and inverse is None
    rope = _pair_swap_rope(z)
    streams = _normed_streams(rope[0], qwen_form) if rope is not None else None
    out = _val(final)
    if streams is None or out.dim() != 4 or not out.is_contiguous():
        return None
    batch, seq, heads, d = out.shape
    (_, cos4, sin4), eps = rope, streams[0][2]
    # K's mean is one vector per head, (1, 1, heads, D) as AttentionScales keeps it
    if k_mean is not None and tuple(_val(k_mean).shape) != (1, 1, heads, d):
        return None
    parts, tokens = [], []
    for x, weight, stream_eps in streams:
        xv = _val(x)
        if (xv.dim() != 4 or xv.shape[0] != batch or tuple(xv.shape[2:]) != (heads, d) or stream_eps != eps
                or _val(weight).shape[0] != d):
            return None
        part = _projection_part(x, heads * d, qwen_form)
        if part is None or _val(part[0]).numel() != batch * xv.shape[1] * _val(part[0]).shape[-1]:
            return None
        parts.append((*part, weight))
        tokens.append(xv.shape[1])
    if sum(tokens) != seq or len({p[1] is None for p in parts}) != 1:  # both streams with a bias or neither
        return None
    tables = []
    for table in (cos4, sin4):  # (1, S, 1, D) views of (S, D) tables: tokens on dim 1, as x has them
        if tuple(_val(table).shape) != (1, seq, 1, d):
            return None
        source = _up_views(table)
        if not (tuple(_val(source).shape) == (seq, d) and _val(source).is_contiguous()):
            if not qwen_form:
                return None
            source = table  # a table the graph builds (Qwen-Image's): the rewrite materializes it as (S, D)
        tables.append(source)
    if not _kernel_takes(out, lambda kernels: kernels.qk_norm_rope_supported(d)):
        return None
    (src, bias, first_col, weight), second = parts[0], None
    if len(parts) == 2:
        second = (*parts[1], tokens[0])
    return _QkCandidate(final, inverse, k_mean, src, bias, first_col, weight, eps, *tables, heads, second)


def _table_rows(graph: fx.Graph, table: fx.Node) -> fx.Node:
    """A rotary table as the operation reads it, (S, D) contiguous: ``table`` itself, or a (1, S, 1, D) table
    reshaped and, where that is not contiguous, copied (the rows of a table the graph builds)."""
    val = _val(table)
    if val.dim() == 2:
        return table
    rows = _node(graph, aten.reshape.default, table, [val.shape[1], val.shape[3]])
    if _val(rows).is_contiguous():
        return rows
    copy = graph.call_function(aten.clone.default, (rows,), {"memory_format": torch.contiguous_format})
    copy.meta["val"] = _fake(lambda t: t.clone(memory_format=torch.contiguous_format), rows)
    return copy


def _rewrite_qk(graph: fx.Graph, c: _QkCandidate) -> None:
    out = _val(c.cast)
    with graph.inserting_before(c.cast):
        src = _node(graph, aten.reshape.default, c.src, [-1, _val(c.src).shape[-1]])
        second = ()
        if c.second is not None:
            src2, bias2, first_col2, weight2, tokens_a = c.second
            src2 = _node(graph, aten.reshape.default, src2, [-1, _val(src2).shape[-1]])
            second = (src2, bias2, first_col2, weight2, tokens_a)
        cos, sin = (_table_rows(graph, table) for table in (c.cos, c.sin))
        if c.inverse is None:  # the 16-bit form: no mean, no cast
            fused = _node(graph, torch.ops.omni_accel.qk_norm_rope.default, src, c.bias, c.first_col, c.heads,
                          c.weight, c.eps, cos, sin, out.dtype, _pdl(out.device), *second)
        else:
            fused = _node(graph, torch.ops.omni_accel.qk_norm_rope_fp8.default, src, c.bias, c.first_col, c.heads,
                          c.weight, c.eps, cos, sin, c.k_mean, c.inverse, _pdl(out.device), *second)
        result = _node(graph, aten.reshape.default, fused, list(out.shape))
    c.cast.replace_all_uses_with(result)


# ---------------------------------------------------------- LayerNorm + modulate + static cast(s), the AdaLN input
def _static_fp8_casts(node: fx.Node):
    """Every use of ``node`` is a static e4m3 cast (``_static_fp8_cast`` per use, views first): [(cast, inverse)], or
    None. One to three uses: a norm whose output feeds one FP8 linear, two (FLUX's single blocks: q / k / v and MLP)
    or three (separate q, k and v projections)."""
    casts = []

    def collect(n) -> bool:
        for user in n.users:
            if _call(user, *_VIEWS):
                if not collect(user):
                    return False
            elif (found := _cast_from_float32(user)) is not None:
                casts.append(found)
            else:
                return False
        return True

    return casts if collect(node) and 1 <= len(casts) <= 3 else None


def _layernorm_source(node):
    """``node`` = 16-bit of (x - mean) * rsqrt(var + eps) from var_mean(float32(x), -1, correction=0): (x, eps)."""
    if not (_call(node, _CONVERT) and node.args[1] in (torch.bfloat16, torch.float16)):
        return None
    mul = node.args[0]
    if not (_call(mul, aten.mul.Tensor) and len(mul.users) == 1):
        return None
    sub, rsqrt = mul.args[:2] if _call(mul.args[1], aten.rsqrt.default) else mul.args[1::-1]
    if not (_call(rsqrt, aten.rsqrt.default) and _call(sub, aten.sub.Tensor)):
        return None
    total = rsqrt.args[0]
    if not (_call(total, aten.add.Tensor, aten.add.Scalar) and isinstance(total.args[1], float)):
        return None
    var, mean = total.args[0], sub.args[1]
    if not (_call(var, operator.getitem) and var.args[1] == 0 and _call(mean, operator.getitem) and mean.args[1] == 1
            and var.args[0] is mean.args[0] and _call(var.args[0], aten.var_mean.correction)):
        return None
    stats = var.args[0]
    xf = stats.args[0]
    dims = stats.args[1] if len(stats.args) > 1 else stats.kwargs.get("dim")
    if (sub.args[0] is not xf or stats.kwargs.get("correction", 1) != 0 or not stats.kwargs.get("keepdim", False)
            or list(dims or ()) not in ([-1], [_val(xf).dim() - 1])):
        return None
    x = xf.args[0] if _call(xf, _CONVERT) and xf.args[1] == torch.float32 else xf
    return x, total.args[1]


def _modulation(node):
    """``node`` = y * (1 + scale) + shift with scale / shift of one row (batch 1, broadcast over the tokens):
    (y, scale source, shift source) as (C,)-viewable nodes, or None."""
    if not _call(node, aten.add.Tensor):
        return None
    for product, shift in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (_call(product, aten.mul.Tensor) and len(product.users) == 1):
            continue
        for y, one_plus in ((product.args[0], product.args[1]), (product.args[1], product.args[0])):
            if not (_call(one_plus, aten.add.Tensor) and one_plus.args[1] == 1):
                continue
            scale = one_plus.args[0]
            row = _val(y).shape[-1] if isinstance(_val(y), torch.Tensor) else None
            if all(isinstance(_val(t), torch.Tensor) and _val(t).numel() == row and _val(t).stride(-1) == 1
                   for t in (scale, shift)):
                return y, scale, shift
    return None


class _NormCandidate:
    def __init__(self, y16, casts, a, b, scale, shift, eps, int8=None):
        self.y16, self.casts, self.a, self.b, self.scale, self.shift, self.eps = y16, casts, a, b, scale, shift, eps
        self.int8 = int8  # [(int8 node, scale node)] of the int8 linears' row quantizations, instead of casts


def _norm_candidate(node: fx.Node):
    """``node`` = the modulated 16-bit norm output whose every use is a static e4m3 cast, or an int8 linear's row
    quantization (the same values for each: one operation computes them once)."""
    if not (_call(node, aten.add.Tensor) and isinstance(_val(node), torch.Tensor)
            and _val(node).dtype in (torch.bfloat16, torch.float16)):
        return None
    int8 = _int8_row_quantizations(node) if INT8 and LAYERNORM_INT8 else None
    casts = _static_fp8_casts(node) if int8 is None else []
    mod = _modulation(node) if casts is not None else None
    norm = _layernorm_source(mod[0]) if mod is not None else None
    if norm is None:
        return None
    x, eps = norm
    out = _val(node)
    if out.dim() != 3 or out.shape[0] != 1:
        return None
    parts = x.args[0] if _call(x, aten.cat.default) and x.args[1] in (1, -2) and len(x.args[0]) == 2 else [x]
    if not all(isinstance(_val(p), torch.Tensor) and _val(p).is_contiguous() and _val(p).shape[-1] == out.shape[-1]
               for p in parts):
        return None
    a, b = (parts[0], parts[1]) if len(parts) == 2 else (parts[0], None)
    rows_a = _val(a).numel() // out.shape[-1]
    if b is not None and not _kernel_takes(out, lambda kernels: kernels.layernorm_modulate_rows(rows_a) is not None):
        return None
    return _NormCandidate(node, casts, a, b, mod[1], mod[2], eps, int8)


def _rewrite_norm(graph: fx.Graph, c: _NormCandidate) -> None:
    cols = _val(c.y16).shape[-1]
    if c.int8 is not None:
        _rewrite_norm_int8(graph, c, cols)
        return
    # after every input (each cast's own inverse scale is defined before that cast); the uses of an earlier cast
    # that now come before the operation are put back in order by the topological sort after the pass
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max((cast for cast, _ in c.casts), key=order.__getitem__)
    with graph.inserting_before(last):
        a, b, scale, shift = _norm_operands(graph, c, cols)
        inverses = [inverse for _, inverse in c.casts] + [None, None]
        fused = _node(graph, torch.ops.omni_accel.layernorm_modulate_fp8.default, a, b, scale, shift, c.eps,
                      *inverses[:3], _pdl(_val(c.a).device))
        results = [_node(graph, aten.reshape.default, _node(graph, aten.select.int, fused, 0, i),
                         list(_val(cast).shape)) for i, (cast, _) in enumerate(c.casts)]
    for (cast, _), result in zip(c.casts, results):
        cast.replace_all_uses_with(result)


def _norm_operands(graph: fx.Graph, c: _NormCandidate, cols: int) -> tuple:
    """The norm operations' (a, b or None, scale, shift) as the kernels take them: rows of ``cols``, (cols,) vectors."""
    a = _node(graph, aten.reshape.default, c.a, [-1, cols])
    b = _node(graph, aten.reshape.default, c.b, [-1, cols]) if c.b is not None else None
    scale = _node(graph, aten.reshape.default, c.scale, [cols])
    return a, b, scale, _node(graph, aten.reshape.default, c.shift, [cols])


def _rewrite_norm_int8(graph: fx.Graph, c: _NormCandidate, cols: int) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min((int8 for int8, _ in c.int8), key=order.__getitem__)):
        fused = _node(graph, torch.ops.omni_accel.layernorm_modulate_int8.default, *_norm_operands(graph, c, cols),
                      c.eps, _val(c.y16).dtype, _pdl(_val(c.a).device))
        # every linear's (int8, scale) pair: the same values, in its own view's shape
        _replace_int8_rows(graph, fused, c.int8)


# ------------------------------------------------------- SageAttention's operands from the q / k kernels' inputs
def _is_op(node, name: str) -> bool:
    """Whether ``node`` calls the op ``name`` ("namespace::op"): by name, for ops registered only where their module
    was imported."""
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload) and node.target.name() == name)


class _SageCandidate:
    def __init__(self, node, q_norm, k_norm, value):
        self.node, self.q_norm, self.k_norm, self.value = node, q_norm, k_norm, value


def _normed_view_source(x):
    """The 16-bit ``omni_accel::qk_norm_rope`` node that ``x`` views whole as (batch, seq, heads, D) and that nothing
    else reads, or None."""
    n = _up_views(x)
    if not (_call(n, torch.ops.omni_accel.qk_norm_rope.default) and len(n.users) == 1):
        return None
    val, rows = _val(x), _val(n)
    if val is None or val.dim() != 4 or not val.is_contiguous() or val.numel() != rows.numel():
        return None
    return n


def _schema_args(node: fx.Node) -> dict:
    """An op call's arguments by the op schema's names (defaults where not given)."""
    schema = node.target._schema.arguments
    return {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            for i, a in enumerate(schema)}


def _normed_parts(norm: fx.Node) -> tuple:
    """A qk_norm_rope node's (src, bias, first column, weight, src2, bias2, first column 2, weight2) and the common
    (heads, eps, cos, sin, dtype, tokens_a), read by the op schema's argument names (defaults where not given)."""
    args = _schema_args(norm)
    part = tuple(args[name] for name in ("src", "bias", "first_col", "weight", "src2", "bias2", "first_col2",
                                         "weight2"))
    return part, tuple(args[name] for name in ("heads", "eps", "cos", "sin", "out_dtype", "tokens_a"))


def _sage_candidate(node: fx.Node):
    """``node`` = sage_quantize(q, k, v) with q and k views of two 16-bit q / k kernels that share the heads, eps,
    rotary tables, dtype and stream split, and a head dim the kernels take."""
    if not SAGE_FROM_NORMS:
        return None
    q, k, value = node.args[:3]
    norms = [_normed_view_source(x) for x in (q, k)]
    if None in norms or norms[0] is norms[1]:
        return None
    (q_part, q_common), (k_part, k_common) = (_normed_parts(n) for n in norms)
    v = _val(value)
    if q_common != k_common or v is None or v.dim() != 4 or _val(q).shape != v.shape or _val(k).shape != v.shape:
        return None
    heads, cos = q_common[0], _val(q_common[2])
    # the fused op's layout: value (batch, positions of the rotary tables, heads, each part's head dim)
    if (v.shape[2] != heads or v.shape[1] != cos.shape[0]
            or any(_val(part[3]).numel() != v.shape[-1] for part in (q_part, k_part))):
        return None
    if not _kernel_takes(v, lambda kernels: kernels.qk_norm_rope_supported(v.shape[-1])):
        return None
    return _SageCandidate(node, norms[0], norms[1], value)


def _rewrite_sage(graph: fx.Graph, c: _SageCandidate) -> None:
    (q_part, common), (k_part, _) = _normed_parts(c.q_norm), _normed_parts(c.k_norm)
    heads, eps, cos, sin, dtype, tokens_a = common
    with graph.inserting_before(c.node):
        fused = _node(graph, torch.ops.omni_accel.sage_quantize_normed.default, *q_part, *k_part, tokens_a, heads,
                      eps, cos, sin, dtype, c.value)
        for user in list(c.node.users):  # getitem(sage_quantize, i) for each of its six outputs
            item = _node(graph, operator.getitem, fused, user.args[1])
            user.replace_all_uses_with(item)


# --------------------------------------- a block's gated residual into the int8 GEMM's epilogue (GATED_RESIDUAL_INT8)
class _ResidualCandidate:
    def __init__(self, final, gemm, gate, residual):
        # final: the node whose value is replaced (the add, or its 16-bit rounding in the float32 form); gemm: the
        # int8_mm_rescale node; gate: a node of N values; residual: a contiguous node of the output's shape
        self.final, self.gemm, self.gate, self.residual = final, gemm, gate, residual


def _int8_gemm_behind(node):
    """The ``omni_accel::int8_mm_rescale`` node whose output ``node`` is, through views [and a float32 widening,
    exact], each used once, the GEMM too; else None."""
    n = node
    if _call(n, _CONVERT) and n.args[1] == torch.float32 and len(n.users) == 1:  # Wan's ``ff_output.float()``
        n = n.args[0]
    n = _up_views(n)
    return n if _is_op(n, "omni_accel::int8_mm_rescale") and len(n.users) == 1 else None


def _gated_residual_candidate(node: fx.Node):
    """``node`` = residual + gate * y (either order in both) with y (views of) an int8 GEMM's 16-bit output that
    nothing else reads, gate one row of N values broadcast over the tokens ((1, 1, N), (1, N) or (N,)) and residual
    a contiguous tensor of the output's shape and dtype: FLUX's and Qwen-Image's blocks. Or ``node`` = that sum
    computed in float32 and rounded to the GEMM's dtype, the residual a 16-bit tensor of that dtype [widened] (Wan's
    blocks: ``(hidden.float() + y * gate).type_as(hidden)``, a float32 gate)."""
    if not (INT8 and GATED_RESIDUAL_INT8):
        return None
    total, widened = node, False
    if _call(node, _CONVERT) and node.args[1] in (torch.bfloat16, torch.float16):
        total, widened = node.args[0], True
    if not (_call(total, aten.add.Tensor) and not total.kwargs) or (widened and len(total.users) != 1):
        return None
    out = _val(node)
    if not isinstance(out, torch.Tensor) or out.dtype not in (torch.bfloat16, torch.float16):
        return None
    for residual, product in ((total.args[0], total.args[1]), (total.args[1], total.args[0])):
        if not (_call(product, aten.mul.Tensor) and len(product.users) == 1):
            continue
        if widened and _call(residual, _CONVERT) and residual.args[1] == torch.float32:
            residual = residual.args[0]  # the kernel reads the 16-bit tensor itself (its widening is exact)
        for y, gate in ((product.args[0], product.args[1]), (product.args[1], product.args[0])):
            gemm = _int8_gemm_behind(y)
            if gemm is not None and _residual_fits(out, _val(gemm), _val(y), _val(gate), _val(product),
                                                   _val(residual), widened):
                return _ResidualCandidate(node, gemm, gate, residual)
    return None


def _residual_fits(out, gemm, y, gate, product, residual, widened: bool) -> bool:
    """The values' shapes and dtypes as ``_gated_residual_candidate`` needs them (fake tensors, or None)."""
    if not all(isinstance(t, torch.Tensor) for t in (gemm, y, gate, product, residual)):
        return False
    rows, cols = gemm.shape
    # one gate value per output column, the same for every token (a per-token gate has rows x N values)
    if gate.numel() != cols or gate.shape[-1] != cols or not gate.dtype.is_floating_point:
        return False
    if gemm.dtype != out.dtype or y.shape[-1] != cols or y.numel() != rows * cols:
        return False
    # no broadcast beyond the GEMM's rows: the gate adds no dimension, the residual has the output's shape
    if product.shape != y.shape or out.shape != y.shape or residual.shape != out.shape:
        return False
    if product.dtype != (torch.float32 if widened else out.dtype):
        return False
    return residual.dtype == out.dtype and residual.is_contiguous() and _residual_kernel_takes(gemm)


def _residual_kernel_takes(gemm: torch.Tensor) -> bool:
    """Whether the GEMM's kernel on its GPU takes the residual (int8_gemm_triton.residual_in_gemm); off a GPU the op
    runs its torch reference, which takes any call."""
    if not gemm.is_cuda:
        return True
    from . import int8_gemm_triton

    return int8_gemm_triton.residual_in_gemm(gemm.shape[0], gemm.device)


def _rewrite_gated_residual(graph: fx.Graph, c: _ResidualCandidate) -> None:
    args = _schema_args(c.gemm)
    rows, cols = _val(c.gemm).shape
    with graph.inserting_before(c.final):
        gate = _node(graph, aten.reshape.default, c.gate, [cols])
        residual = _node(graph, aten.reshape.default, c.residual, [rows, cols])
        fused = _node(graph, torch.ops.omni_accel.int8_mm_rescale_residual.default,
                      *(args[name] for name in ("x_int8", "w_int8", "x_scale", "w_scale", "bias")), gate, residual,
                      args["out_dtype"])
        out = _node(graph, aten.reshape.default, fused, list(_val(c.final).shape))
    c.final.replace_all_uses_with(out)


def _match(node: fx.Node):
    """(REWRITES kind, rewrite function, candidate) of the first pattern ``node`` ends, or None."""
    if _is_op(node, "omni_accel::sage_quantize"):  # six outputs: no other pattern ends there
        found = _sage_candidate(node)
        return ("sage_quantize_normed", _rewrite_sage, found) if found is not None else None
    found = _candidate(node) if _call(node, aten.cat.default) else _lone_gelu_candidate(node)
    if found is None and not _call(node, aten.cat.default):
        found = _lone_gelu_gemm_candidate(node)
    if isinstance(found, _GemmCandidate):
        return found.kind, _rewrite_gemm, found
    if found is not None:
        kind = (("gelu" if found.a is None else "concat_gelu") + ("_fp8" if found.inverse is not None else "")
                + ("_int8" if found.int8_scale is not None else ""))
        return kind, _rewrite, found
    if QK_NORM_ROPE and _call(node, _CONVERT) and (found := _qk_candidate(node)) is not None:
        return "qk_norm_rope_fp8", _rewrite_qk, found
    if QK_NORM_ROPE_16 and (found := _qk16_candidate(node)) is not None:
        return "qk_norm_rope", _rewrite_qk, found
    if LAYERNORM and (found := _norm_candidate(node)) is not None:
        return f"layernorm_modulate_{'int8' if found.int8 is not None else 'fp8'}", _rewrite_norm, found
    if (found := _gated_residual_candidate(node)) is not None:
        return "gated_residual_int8", _rewrite_gated_residual, found
    return None


def _residual_in_gemm_key() -> str:
    """The int8_gemm_triton switches that residual_in_gemm reads (which GEMMs the pass moves the residual into), for
    the cache key ("" where Triton is missing: no int8 kernels)."""
    try:
        from . import int8_gemm_triton
    except ImportError:
        return ""
    g = int8_gemm_triton
    return (f"{int(g.RESIDUAL_WARP_SPECIALIZED)}{int(g.WARP_SPECIALIZE)}{int(g.PERSISTENT_TMA)}"
            f"{getattr(g, 'FEW_ROWS', '')}")


class EpilogueFusionPass(CustomGraphPass):
    """The post-grad pass (``torch.compile(options={"post_grad_custom_post_pass": GRAPH_PASS})``)."""

    def __call__(self, graph: fx.Graph) -> None:
        done = 0
        for node in list(graph.nodes):
            if node.graph is not graph or not node.users:  # erased, or left without uses by an earlier rewrite
                continue
            try:
                match = _match(node)
            except Exception:  # noqa: BLE001 -- an unexpected graph shape is left to inductor, never an error
                logger.debug("omni_accel: epilogue fusion skipped %s", node, exc_info=True)
                continue
            if match is not None:
                kind, rewrite, candidate = match
                rewrite(graph, candidate)
                REWRITES[kind] += 1
                done += 1
        if gemm_tuning.TUNED_GEMMS:
            done += self._tune_gemms(graph, done)
        if done:
            stable_topological_sort(graph)
            graph.eliminate_dead_code()
            logger.debug("omni_accel: %d epilogues fused", done)

    @staticmethod
    def _tune_gemms(graph: fx.Graph, done: int) -> int:
        """After the patterns above, which read the linears as mm / addmm: the 16-bit ones left become tuned GEMMs
        (the linears those rewrites left without a live use go first). How many."""
        if done:
            stable_topological_sort(graph)
            graph.eliminate_dead_code()
        tuned = 0
        for node in list(graph.nodes):
            if node.graph is graph and node.users and (operands := _tuned_gemm_candidate(node)) is not None:
                _rewrite_tuned_gemm(graph, node, operands)
                REWRITES["tuned_gemm"] += 1
                tuned += 1
        return tuned

    def uuid(self):
        # inductor's FX graph cache keys compiled graphs on this: a change to the pass or its kernel recompiles
        here = os.path.dirname(os.path.abspath(__file__))
        # (int8_gemm_triton.py: residual_in_gemm decides which gated residuals the pass moves into the GEMM)
        files = get_hash_for_files((os.path.join(here, "epilogue_fusion.py"), os.path.join(here, "epilogue_triton.py"),
                                    os.path.join(here, "gemm_tuning.py"), os.path.join(here, "int8_gemm_triton.py")))
        return (f"{files.hex() if isinstance(files, bytes) else files}-qk{int(QK_NORM_ROPE)}{int(QK_NORM_ROPE_16)}"
                f"{int(QK_NORM_ROPE_JOINT)}{int(QK_NORM_ROPE_DIFFUSERS_RMS)}"
                f"-ln{int(LAYERNORM)}"
                f"-pdl{int(PDL)}-int8{int(INT8)}{int(GELU_INT8)}{int(LAYERNORM_INT8)}{int(GATED_RESIDUAL_INT8)}"
                f"{_residual_in_gemm_key()}-sage{int(SAGE_FROM_NORMS)}"
                f"-gg{int(GELU_GEMM)}-tg{int(gemm_tuning.TUNED_GEMMS)}{gemm_tuning.MIN_GFLOP}")


GRAPH_PASS = EpilogueFusionPass()
