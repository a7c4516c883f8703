"""Attention kernel microbenchmark on DiT shapes: SDPA (cuDNN, Flash, mem-efficient), SageAttention, flash-attn 2-4.

    # on one H200, every shape and every backend that is installed
    python benchmarks/bench_attention.py --log-clocks --out benchmarks/results/bench_attention_h200.json
    # a subset
    python benchmarks/bench_attention.py --shapes flux,qwen_image --backends sdpa_cudnn,sage --iters 100
    # FlashAttention-4's Hopper kernel, one row per tile asked for, beside its own choice and cuDNN
    python benchmarks/bench_attention.py --shapes flux,wan --inputs randn --fa4-tiles --backends sdpa_cudnn,fa4
    # omni_accel's TMA-fed 8-bit attention kernel, one row per tile, beside cuDNN and SageAttention's kernel
    python benchmarks/bench_attention.py --shapes flux,wan --inputs randn --tma-tiles \
        --backends sdpa_cudnn,omni_sage_kernel,omni_int8_block_fp8_core
    # smoke test on the CPU (fp32, tiny shapes, SDPA math / default only; seconds)
    python benchmarks/bench_attention.py --device cpu --tiny --out /tmp/bench_attention.json

Shapes (batch 1, non-causal, no mask): FLUX 1024² (S 4608 = 4096 image + 512 text, 24 heads x 128), Qwen-Image
1024² (S 4352 = 4096 + 256 text, 24 x 128), Wan-14B 480x832 81 frames (S 32760 = 21 x 30 x 52, 40 x 128) and a small
one (S 1024, 24 x 128). q/k/v are made in the model layout (B, S, H, D) -- what the attention processors hand to
diffusers' dispatcher -- and every kernel is called the way it is called in a pipeline:
- ``sdpa_*``: ``F.scaled_dot_product_attention`` on ``permute(0, 2, 1, 3)`` views (no copy) inside
  ``sdpa_kernel(<backend>)``, as omni_accel's attention pass and diffusers' native backend call it,
- ``sage``: ``sageattn(tensor_layout="HND")`` on contiguous (B, H, S, D) copies made before timing;
  ``sage_nhd``: ``sageattn(tensor_layout="NHD")`` on the (B, S, H, D) tensors, as diffusers' ``sage`` backend calls
  it; ``sage_no_smooth_k``: HND with ``smooth_k=False``, to show what subtracting K's token mean buys;
  ``omni_sage_prepared``: omni_accel's quantization of Q, K and V (compiled by inductor) and the package's Hopper
  kernel through ``omni_accel::sage_attention_quantized`` (``sage_attention.PREP_IN_GRAPH``), ``omni_sage_kernel``
  the kernel alone, ``omni_sage_prep_kernels`` the quantization in omni_accel's Triton kernels
  (``sage_attention.PREP_KERNELS``) before the kernel,
- ``flash_attn`` / ``fa3`` / ``fa4``: ``flash_attn_func`` of the flash-attn / FlashAttention-3 / flash-attn-4
  (``flash_attn.cute``, compiled at its first call by the CuTe DSL) packages on (B, S, H, D).

Two input sets per shape: ``randn`` (q, k, v ~ N(0, 1)) and ``outliers``, which mimics DiT activations: q and k are
scaled per (head, channel) by lognormal factors exp(sigma z - sigma²) (mean square 1, so the logit scale stays that
of randn and only the channel imbalance differs), and k gets a per-channel offset shared by all tokens. The offset
does not change the exact result (it adds the same q·offset to every logit of a query) but widens k's INT8 range --
the case SageAttention's smooth_k exists for -- so INT8 error shows up instead of hiding behind benign inputs.

Timing: after ``--warmup`` calls (the first one includes Triton JIT for Sage), CUDA events around a run of
back-to-back calls, ``ms`` = median over ``--iters`` runs of the per-call time. A run holds enough calls to last
about 1 ms, because with one call per event pair a small shape's time is mostly the CPU launch latency, while in a
transformer forward the CPU runs ahead of the GPU; ``ms_isolated`` is the one-call-per-event-pair time.
TFLOP/s = 4 x S² x D x H x B / time. Error: against SDPA MATH in float32 on the same (upcast) inputs, computed in
chunks of queries (``--ref-chunk-mib`` of scores per chunk) so Wan's 32760² scores never exist at once:
``max_abs_err`` and ``rel_err`` (Frobenius). ``rel_err_rounding_floor`` is the reference rounded to the input dtype:
what a kernel with a perfect fp32 accumulation still shows (about 1.6e-3 for bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable, NamedTuple
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_transformer import ClockLog  # noqa: E402
from benchmarks.timing import package_version as _version  # noqa: E402
from benchmarks.timing import sample_ms, write_result  # noqa: E402
from omni_accel.deps import installed  # noqa: E402 -- a dotted name whose parent is missing counts as missing

T_START = time.perf_counter()

# name -> (S, H, D), batch 1
SHAPES: dict[str, tuple[int, int, int]] = {
    "short": (256, 24, 128),
    "small": (1024, 24, 128),
    "sd3": (4429, 24, 64),  # SD3.5 1024²: 4096 image + 333 text tokens, 24 heads x 64
    "flux": (4608, 24, 128),
    "qwen_image": (4352, 24, 128),
    "wan": (32760, 40, 128),
    # where FlashAttention-4 starts to beat cuDNN (auto's key-count threshold): Wan 480x832 at 21 and 41 frames,
    # FLUX at 2048² (16,384 image + 512 text tokens)
    "wan_21f": (9360, 40, 128),
    "wan_41f": (17160, 40, 128),
    "flux_2048": (16896, 24, 128),
}
# the smoke test passes a small --ref-chunk-mib so that the reference runs in several query chunks here too
TINY_SHAPES: dict[str, tuple[int, int, int]] = {"tiny_a": (64, 2, 16), "tiny_b": (96, 3, 32)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INPUTS = ("randn", "outliers")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------------- kernels
class Kernel(NamedTuple):  # not a dataclass: the smoke test loads this file without a sys.modules entry
    name: str
    layout: str  # "BSHD": takes and returns (B, S, H, D); "BHSD": (B, H, S, D)
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    note: str


def _sdpa(backend: SDPBackend | None) -> Callable:
    def call(q, k, v):
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        with ctx:
            out = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
        return out.permute(0, 2, 1, 3)

    return call


def _sage(layout: str, smooth_k: bool) -> Callable:
    from sageattention import sageattn

    def call(q, k, v):
        return sageattn(q, k, v, tensor_layout=layout, is_causal=False, smooth_k=smooth_k)

    return call


def _quantized_once(quantize: Callable, kernel: Callable) -> Callable:
    """call(q, k, v) for the kernel-only rows: ``quantize(q, k, v)`` once per input set (the last one kept), then
    ``kernel(operands, q)`` on every call. In a compiled model the quantization fuses into the kernels before
    attention, so timing it here would overstate what a step pays."""
    cache: dict = {}

    def call(q, k, v):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if key not in cache:
            cache.clear()
            cache[key] = quantize(q, k, v)
        return kernel(cache[key], q)

    return call


def _omni_tma(warp_specialize: bool, tile: tuple[int, int, int, int] | None = None) -> Callable:
    """omni_accel's int8 / e4m3 attention kernel in its TMA form (``fp8_attention_triton.launch(design=...)``),
    kernel only, on operands quantized once (mode "int8_block_fp8"); autotuned, or with one ``tile``."""
    from omni_accel.kernels import fp8_attention_triton
    from omni_accel.kernels.fp8_attention import K_BLOCKS, quantize_qkv

    def kernel(operands, q):
        return fp8_attention_triton.launch(*operands, q.shape[-1] ** -0.5, torch.empty_like(q), True, True,
                                           interpreted=False, k_block=K_BLOCKS["int8_block_fp8"],
                                           design="tma_ws" if warp_specialize else "tma", tile=tile)

    return _quantized_once(lambda q, k, v: quantize_qkv(q, k, v, "int8_block_fp8", tma_aligned=True), kernel)


def _omni(mode: str, core_only: bool) -> Callable:
    """omni_accel's FP8 attention (attention="fp8"). ``core_only`` times the kernel alone, quantizing each input
    set once: in a compiled model inductor fuses the quantization into the RMSNorm + RoPE kernel before it, so the
    whole-call figure (eager quantization, several memory passes) overstates what a step pays."""
    from omni_accel.kernels.fp8_attention import K_BLOCKS, MODES, fp8_attention, fp8_attention_core, quantize_qkv

    if not core_only:
        return lambda q, k, v: fp8_attention(q, k, v, mode=mode)
    return _quantized_once(lambda q, k, v: quantize_qkv(q, k, v, mode), lambda operands, q: fp8_attention_core(
        *operands, q.shape[-1] ** -0.5, q.dtype, *MODES[mode], K_BLOCKS.get(mode, 0)))


def _omni_sage_prepared(kernel_only: bool) -> Callable:
    """omni_accel's SageAttention path with ``sage_attention.PREP_IN_GRAPH``: Q, K and V quantized by torch ops that
    inductor compiles (``PREP_KERNELS`` off; here the quantization alone, in a compiled model fused into the kernels
    that produce Q, K, V), then the package's Hopper kernel through ``omni_accel::sage_attention_quantized``.
    ``kernel_only`` times the op alone on operands quantized once."""
    from omni_accel.kernels import sage_attention as sage

    if not kernel_only:
        compiled = torch.compile(sage.prepared_attention, dynamic=False)

        def traced(q, k, v):
            with mock.patch.object(sage, "PREP_KERNELS", False):  # read while tracing, guarded after
                return compiled(q, k, v, None)

        return traced
    return _quantized_once(sage._reference_operands, lambda operands, q: sage.sage_attention_quantized(
        *operands, q.shape[-1] ** -0.5, q.dtype))


def _omni_sage_prep_kernels() -> Callable:
    """The same with ``sage_attention.PREP_KERNELS``: Q, K and V quantized by omni_accel's four Triton kernels (op
    omni_accel::sage_quantize), then the package's Hopper kernel."""
    from omni_accel.kernels import sage_attention as sage
    from omni_accel.kernels import sage_prep_triton

    def call(q, k, v):
        operands = sage_prep_triton.quantize(q, k, v)
        return sage.sage_attention_quantized(*operands, q.shape[-1] ** -0.5, q.dtype)

    return call


def _cudnn_fp8(core_only: bool) -> Callable:
    """cuDNN's FP8 SDPA (attention="fp8" on Hopper with nvidia-cudnn-frontend). ``core_only`` times the cuDNN call
    alone on operands quantized once; the full call adds K smoothing, per-tensor e4m3 quantization (eager here,
    fused into RMSNorm + RoPE under compile) and the output's dequantization."""
    from omni_accel.kernels.cudnn_fp8_attention import cudnn_fp8_attention, cudnn_fp8_sdpa, quantize_operands

    if not core_only:
        return cudnn_fp8_attention
    def kernel(operands, q):
        q8, k8, v8, dq, dk, dv = operands
        out8 = cudnn_fp8_sdpa(q8, k8, v8, dq, dk, dv, 1.0 / dv, q.shape[-1] ** -0.5)
        return (out8.float() * dv).to(q.dtype)

    return _quantized_once(quantize_operands, kernel)


def _first(out):
    # FA3's flash_attn_func returns (out, lse) in some releases, out alone in others
    return out[0] if isinstance(out, (tuple, list)) else out


def _flash_attn() -> Callable:
    from flash_attn import flash_attn_func

    return lambda q, k, v: _first(flash_attn_func(q, k, v, causal=False))


def _fa3() -> Callable:
    from flash_attn_interface import flash_attn_func

    return lambda q, k, v: _first(flash_attn_func(q, k, v, causal=False))


def _fa4() -> Callable:
    from flash_attn.cute.interface import flash_attn_func

    return lambda q, k, v: _first(flash_attn_func(q, k, v, causal=False))


def _fa4_tile(tile: tuple[int, int, bool, bool]) -> Callable:
    """FA4's forward with a requested Hopper tile (``fa4_attention.TILE_CANDIDATES``), into a fresh output."""
    from flash_attn.cute.interface import _flash_attn_fwd

    if torch.cuda.get_device_capability()[0] != 9:  # FA4 would apply the tile on another GPU too, untuned
        raise RuntimeError("the tile rows are Hopper's (compute capability 9.x)")

    from omni_accel.kernels.fa4_attention import tile_keywords

    options = tile_keywords(tile)
    return lambda q, k, v: _flash_attn_fwd(q, k, v, causal=False, **options)[0]


def _fa4_tile_candidates() -> list:
    from omni_accel.kernels.fa4_attention import TILE_CANDIDATES, tile_name

    return [(f"fa4_{tile_name(tile)}", "BSHD", (lambda tile=tile: _fa4_tile(tile)),
             f"FlashAttention-4, Hopper tile {tile_name(tile)} asked for", "flash_attn.cute")
            for tile in TILE_CANDIDATES]


def _omni_fa4() -> Callable:
    from omni_accel.kernels.fa4_attention import fa4_attention

    return lambda q, k, v: fa4_attention(q, k, v, None)


# --tma-tiles: one row per tile of the TMA attention kernel, (BLOCK_M, BLOCK_N, warps, stages) without / with warp
# specialization: the autotuner's lists and neighbours of them
TMA_TILES = {False: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 128, 4, 3)],
             True: [(64, 128, 4, 3), (64, 128, 4, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3),
                    (64, 64, 4, 3)]}


def _tma_tile_candidates() -> list:
    from omni_accel.kernels.fp8_attention_triton import tile_name

    return [(f"omni_tma{'_ws' if ws else ''}_{tile_name(tile)}", "BSHD",
             (lambda ws=ws, tile=tile: _omni_tma(ws, tile)), f"TMA kernel{', warp specialized' if ws else ''}, "
             f"tile {tile_name(tile)}; kernel only", "triton") for ws in (False, True) for tile in TMA_TILES[ws]]


def kernels_for(device: torch.device, wanted: set[str] | None, tma_tiles: bool = False,
                fa4_tiles: bool = False) -> tuple[list[Kernel], dict[str, str]]:
    """The kernels that can run here (restricted to ``wanted`` if given; with ``tma_tiles`` / ``fa4_tiles`` also one
    row per tile of the TMA attention kernel / of FlashAttention-4's Hopper kernel), and why each of the others
    cannot."""
    candidates: list[tuple[str, str, Callable[[], Callable], str, str | None]] = [
        # name, layout, builder, note, package that must be importable
        ("sdpa_math", "BSHD", lambda: _sdpa(SDPBackend.MATH), "SDPA math kernel, input dtype", None),
        ("sdpa_default", "BSHD", lambda: _sdpa(None), "SDPA, its own kernel choice", None),
        ("sdpa_cudnn", "BSHD", lambda: _sdpa(SDPBackend.CUDNN_ATTENTION), "SDPA cuDNN", None),
        ("sdpa_flash", "BSHD", lambda: _sdpa(SDPBackend.FLASH_ATTENTION), "SDPA FlashAttention-2", None),
        ("sdpa_efficient", "BSHD", lambda: _sdpa(SDPBackend.EFFICIENT_ATTENTION), "SDPA mem-efficient", None),
        ("sage", "BHSD", lambda: _sage("HND", True), "sageattn HND, smooth_k", "sageattention"),
        ("sage_nhd", "BSHD", lambda: _sage("NHD", True), "sageattn NHD (diffusers' call)", "sageattention"),
        ("sage_no_smooth_k", "BHSD", lambda: _sage("HND", False), "sageattn HND, smooth_k=False", "sageattention"),
        ("omni_sage_prepared", "BSHD", lambda: _omni_sage_prepared(False), "omni_accel: Q / K / V quantized by "
         "inductor-compiled torch ops, then SageAttention's Hopper kernel", "sageattention"),
        ("omni_sage_kernel", "BSHD", lambda: _omni_sage_prepared(True), "same, the kernel alone on operands "
         "quantized once", "sageattention"),
        ("omni_sage_prep_kernels", "BSHD", _omni_sage_prep_kernels, "omni_accel: Q / K / V quantized by its Triton "
         "kernels, then SageAttention's Hopper kernel", "sageattention"),
        ("omni_int8_fp8", "BSHD", lambda: _omni("int8_fp8", False), "omni_accel fp8 attention: int8 QK (per token), "
         "e4m3 PV; incl. eager quantization", "triton"),
        ("omni_int8_fp8_core", "BSHD", lambda: _omni("int8_fp8", True), "same, kernel only", "triton"),
        ("omni_fp8_core", "BSHD", lambda: _omni("fp8", True), "omni_accel fp8 attention: e4m3 QK and PV, kernel only",
         "triton"),
        ("omni_int8_core", "BSHD", lambda: _omni("int8", True), "omni_accel: int8 QK, bf16 PV, kernel only", "triton"),
        ("omni_int8_block_fp8_core", "BSHD", lambda: _omni("int8_block_fp8", True), "omni_accel fp8 attention: int8 "
         "Q per token, K per block of 128 keys, e4m3 PV; kernel only", "triton"),
        ("omni_int8_block_fp8_tma_core", "BSHD", lambda: _omni_tma(False), "the same arithmetic, TMA-fed kernel; "
         "kernel only", "triton"),
        ("omni_int8_block_fp8_tma_ws_core", "BSHD", lambda: _omni_tma(True), "the same, TMA-fed and warp "
         "specialized; kernel only", "triton"),
        ("omni_cudnn_fp8", "BSHD", lambda: _cudnn_fp8(False), "omni_accel fp8 attention on cuDNN's FP8 SDPA: "
         "smoothed K, per-tensor e4m3 q/k/v, e4m3 out; incl. eager quantization", "cudnn"),
        ("omni_cudnn_fp8_core", "BSHD", lambda: _cudnn_fp8(True), "same, cuDNN call + output dequantization only",
         "cudnn"),
        ("flash_attn", "BSHD", _flash_attn, "flash-attn flash_attn_func", "flash_attn"),
        ("fa3", "BSHD", _fa3, "FlashAttention-3 flash_attn_func", "flash_attn_interface"),
        ("fa4", "BSHD", _fa4, "FlashAttention-4 (CuTe DSL, flash-attn-4 package) flash_attn_func", "flash_attn.cute"),
        ("omni_fa4", "BSHD", _omni_fa4, "omni_accel's omni_accel::fa4_attention op (attention='fa4'): flash-attn-4 "
         "behind a torch custom op", "flash_attn.cute"),
    ]
    for asked, tiles in ((tma_tiles, _tma_tile_candidates), (fa4_tiles, _fa4_tile_candidates)):
        if asked:
            rows = tiles()
            candidates += rows
            wanted = None if wanted is None else wanted | {row[0] for row in rows}
    # on the CPU only the two SDPA entries that have CPU kernels: the smoke test checks the harness, not kernels
    cpu_ok = {"sdpa_math", "sdpa_default"}
    # the GPU run leaves sdpa_math out unless asked: it materializes the S x S scores (bf16 Wan: 86 GB)
    not_by_default_on_gpu = {"sdpa_math": "unfused, S x S scores in memory; add it with --backends"}
    kernels, skipped = [], {}
    for name, layout, build, note, package in candidates:
        if wanted is not None and name not in wanted:
            continue
        if wanted is None and device.type == "cuda" and name in not_by_default_on_gpu:
            skipped[name] = not_by_default_on_gpu[name]
            continue
        if device.type != "cuda" and name not in cpu_ok:
            skipped[name] = "needs CUDA"
            continue
        if package is not None and not installed(package):
            skipped[name] = f"{package} not installed"
            continue
        try:
            kernels.append(Kernel(name, layout, build(), note))
        except Exception as exc:  # noqa: BLE001 -- a package that imports but breaks costs its row only
            skipped[name] = f"import failed: {exc!r}"
    return kernels, skipped


# ---------------------------------------------------------------------------------------------------- inputs
def make_inputs(s: int, h: int, d: int, kind: str, dtype: torch.dtype, device: torch.device, seed: int,
                sigma: float, k_offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of shape (1, S, H, D) in ``dtype``; drawn in float32 so both sets share the same base values."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    q, k, v = randn(1, s, h, d), randn(1, s, h, d), randn(1, s, h, d)
    if kind == "outliers":
        # lognormal per (head, channel), E[f²] = 1: a few channels tens of times larger than others, same in every
        # token -- the structure of DiT q/k activations -- at randn's overall logit scale
        q = q * torch.exp(sigma * randn(h, d) - sigma**2)
        k = k * torch.exp(sigma * randn(h, d) - sigma**2) + k_offset * randn(h, d)
    elif kind != "randn":
        raise ValueError(f"unknown input kind {kind!r}")
    return q.to(dtype), k.to(dtype), v.to(dtype)


@contextlib.contextmanager
def exact_fp32_matmul():
    """Full fp32 GEMMs (no TF32) for the reference, whatever the process default is."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_mib: float) -> torch.Tensor:
    """fp32 SDPA MATH of the (upcast) inputs, (B, S, H, D); queries in chunks whose fp32 score block is at most
    ``chunk_mib`` MiB, since the math kernel materializes the whole B x H x Sq x Skv score matrix."""
    b, s, h, _ = q.shape
    qf, kf, vf = (x.float().permute(0, 2, 1, 3) for x in (q, k, v))
    chunk = max(1, int(chunk_mib * 2**20) // (b * h * s * 4))
    out = torch.empty_like(qf)
    with exact_fp32_matmul(), sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        for start in range(0, s, chunk):
            out[:, :, start:start + chunk] = F.scaled_dot_product_attention(qf[:, :, start:start + chunk], kf, vf)
    return out.permute(0, 2, 1, 3)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative Frobenius error) of ``out`` against ``ref``."""
    diff = out.float() - ref
    return diff.abs().max().item(), (diff.norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_kernel(fn: Callable[[], object], device: torch.device, iters: int, warmup: int,
                target_ms: float = 1.0) -> dict:
    """Per-call milliseconds of ``fn``: isolated (one call per timed sample) and streamed (enough back-to-back
    calls per sample to last ``target_ms``, so launch latency overlaps the previous call as in a forward)."""
    for _ in range(max(1, warmup)):
        fn()
    sync(device)
    isolated = statistics.median(sample_ms(fn, device, max(3, min(iters, 10))))
    reps = max(1, min(100, math.ceil(target_ms / max(isolated, 1e-6))))

    def run() -> None:
        for _ in range(reps):
            fn()

    times = [t / reps for t in sample_ms(run, device, iters)]
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_isolated": isolated,
            "calls_per_sample": reps}


# ------------------------------------------------------------------------------------------------------ rows
def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, S, H, D) -> the kernel's layout; a contiguous copy for BHSD, made before timing."""
    return x if layout == "BSHD" else x.permute(0, 2, 1, 3).contiguous()


def from_layout(out: torch.Tensor, layout: str) -> torch.Tensor:
    return out if layout == "BSHD" else out.permute(0, 2, 1, 3)


def measure(kernel: Kernel, qkv: tuple[torch.Tensor, ...], ref: torch.Tensor, device: torch.device, iters: int,
            warmup: int) -> dict:
    """One kernel on one input set: timing and error (the error from a call made after timing)."""
    args = tuple(to_layout(x, kernel.layout) for x in qkv)
    with torch.no_grad():
        timing = time_kernel(lambda: kernel.call(*args), device, iters, warmup)
        out = from_layout(kernel.call(*args), kernel.layout)
    if tuple(out.shape) != tuple(ref.shape):
        raise RuntimeError(f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    max_abs, rel = errors(out, ref)
    return {**timing, "max_abs_err": max_abs, "rel_err": rel, "finite": bool(torch.isfinite(out).all())}


def shape_rows(name: str, shape: tuple[int, int, int], kernels: list[Kernel], args: argparse.Namespace,
               device: torch.device, dtype: torch.dtype, on_row: Callable[[dict], None], clocks) -> None:
    s, h, d = shape
    flops = 4.0 * s * s * d * h  # batch 1: QK^T and PV, 2 FLOPs per multiply-add each
    for kind in args.inputs.split(","):
        qkv = make_inputs(s, h, d, kind, dtype, device, args.seed, args.outlier_sigma, args.k_offset)
        t0 = time.perf_counter()
        ref = reference(*qkv, chunk_mib=args.ref_chunk_mib)
        sync(device)
        floor = errors(ref.to(dtype), ref)[1]
        log(f"{name} {kind}: reference in {time.perf_counter() - t0:.1f}s (rounding floor rel {floor:.2e})")
        for kernel in kernels:
            base = {"shape": name, "S": s, "H": h, "D": d, "B": 1, "backend": kernel.name, "input": kind,
                    "layout": kernel.layout, "dtype": str(dtype).replace("torch.", ""), "note": kernel.note}
            try:
                clocks.mark()
                got = measure(kernel, qkv, ref, device, args.iters, args.warmup)
                row = {**base, **got, "tflops": flops / (got["ms"] / 1e3) / 1e12, "rel_err_rounding_floor": floor,
                       **clocks.since_mark()}
            except Exception as exc:  # noqa: BLE001 -- a kernel that rejects a shape costs its row only
                row = {**base, "error": f"{type(exc).__name__}: {exc}"[:500],
                       "traceback": traceback.format_exc()[-1500:]}
            on_row(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del qkv, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ env, output
def _driver() -> str | None:
    import subprocess

    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else None


def environment(device: torch.device) -> dict:
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "torch": torch.__version__,
           "triton": _version("triton"), "sageattention": _version("sageattention"),
           "flash_attn": _version("flash_attn") or _version("flash-attn"), "flash_attn_4": _version("flash-attn-4"),
           "python": platform.python_version(),
           "device": str(device)}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), driver=_driver())
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def print_table(rows: list[dict]) -> None:
    print(f"\n{'shape':10s} {'input':9s} {'backend':17s} {'ms':>9s} {'TFLOP/s':>8s} {'max_abs':>9s} {'rel':>9s} "
          f"{'floor':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:10s} {r['input']:9s} {r['backend']:17s} error: {r['error'][:80]}")
            continue
        print(f"{r['shape']:10s} {r['input']:9s} {r['backend']:17s} {r['ms']:9.4f} {r['tflops']:8.1f} "
              f"{r['max_abs_err']:9.3g} {r['rel_err']:9.3g} {r['rel_err_rounding_floor']:8.2g}")


def plot(result: dict, path: str) -> None:
    """Two panels: TFLOP/s per shape and backend (randn inputs), and rel. error per backend and input set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    if not rows:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(backends)
    for i, backend in enumerate(backends):
        xs = [j + i * width for j in range(len(shapes))]
        tf = [next((r["tflops"] for r in rows if r["shape"] == s and r["backend"] == backend
                    and r["input"] == "randn"), 0.0) for s in shapes]
        ax_t.bar(xs, tf, width, label=backend)
        for inp, hatch in zip(INPUTS, ("", "//")):
            err = [next((r["rel_err"] for r in rows if r["shape"] == s and r["backend"] == backend
                         and r["input"] == inp), float("nan")) for s in shapes]
            ax_e.bar([x + (width / 4 if hatch else -width / 4) for x in xs], err, width / 2, hatch=hatch,
                     color=f"C{i}", label=backend if not hatch else None)
    for ax in (ax_t, ax_e):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"{s}\nS={next(r['S'] for r in rows if r['shape'] == s)}" for s in shapes], fontsize=8)
    ax_t.set_ylabel("TFLOP/s (randn inputs)")
    ax_e.set_ylabel("relative error vs fp32 (plain: randn, hatched: outliers)")
    ax_e.set_yscale("log")
    ax_t.legend(fontsize=7)
    env = result["env"]
    fig.suptitle(f"attention, {result['config']['dtype']}, {env.get('gpu') or env.get('cpu')}, torch {env['torch']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--shapes", default=None, help=f"comma list (default all): {','.join(SHAPES)}; with --tiny: "
                    f"{','.join(TINY_SHAPES)}")
    ap.add_argument("--backends", default=None, help="comma list (default: every one available here)")
    ap.add_argument("--inputs", default=",".join(INPUTS), help="comma list of input sets: randn,outliers")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES),
                    help="default bf16 on CUDA; fp32 on the CPU, where bf16's own output rounding (1.6e-3 rel) would "
                         "hide a harness error from the smoke test's 1e-3 bound")
    ap.add_argument("--tma-tiles", action="store_true",
                    help="add one row per tile of omni_accel's TMA attention kernel (with and without warp "
                         "specialization; a tile that does not compile costs its row only)")
    ap.add_argument("--fa4-tiles", action="store_true",
                    help="add one row per Hopper tile of FlashAttention-4's forward (fa4_attention.TILE_CANDIDATES; "
                         "a tile that does not compile costs its row only)")
    ap.add_argument("--iters", type=int, default=None, help="timed samples per kernel (default 30; tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10; tiny 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-clocks", action="store_true",
                    help="SM clock and board power (nvidia-smi, every 100 ms) over each row's calls")
    ap.add_argument("--outlier-sigma", type=float, default=1.0, help="lognormal sigma of the q/k channel scales")
    ap.add_argument("--k-offset", type=float, default=4.0, help="std of k's per-channel offset (outliers set)")
    ap.add_argument("--ref-chunk-mib", type=float, default=1024.0, help="fp32 score MiB per reference chunk")
    ap.add_argument("--out", default="benchmarks/results/bench_attention.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU; use --device cpu --tiny", file=sys.stderr)
        return 2
    table = TINY_SHAPES if args.tiny else SHAPES
    names = args.shapes.split(",") if args.shapes else list(table)
    unknown = [n for n in names if n not in table] + [i for i in args.inputs.split(",") if i not in INPUTS]
    if unknown:
        print(f"error: unknown shape/input {unknown}; shapes here: {list(table)}, inputs: {list(INPUTS)}",
              file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    args.iters = args.iters or (3 if args.tiny else 30)
    args.warmup = args.warmup or (1 if args.tiny else 10)
    kernels, skipped = kernels_for(device, set(args.backends.split(",")) if args.backends else None,
                                   tma_tiles=args.tma_tiles, fa4_tiles=args.fa4_tiles)
    result = {"benchmark": "bench_attention", "env": environment(device),
              "config": {"dtype": str(dtype).replace("torch.", ""), "batch": 1, "causal": False, "mask": None,
                         "iters": args.iters, "warmup": args.warmup, "seed": args.seed,
                         "outlier_sigma": args.outlier_sigma, "k_offset": args.k_offset,
                         "ref_chunk_mib": args.ref_chunk_mib, "shapes": {n: table[n] for n in names}},
              "kernels": {k.name: {"layout": k.layout, "note": k.note} for k in kernels},
              "skipped": skipped, "rows": []}
    log(f"env {result['env']}")
    log(f"kernels: {[k.name for k in kernels]}; skipped: {skipped}")
    def on_row(row: dict) -> None:
        result["rows"].append(row)
        shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()
                 if k not in ("traceback", "note", "layout", "dtype", "B")}
        log(json.dumps(shown))
        write_result(args.out, result)  # after every row: a crash later keeps what was measured

    clocks = ClockLog(enabled=args.log_clocks and device.type == "cuda")
    try:
        for name in names:
            shape_rows(name, table[name], kernels, args, device, dtype, on_row, clocks)
    finally:
        clocks.stop()
    result["total_s"] = round(time.perf_counter() - T_START, 1)
    cudnn_fp8 = sys.modules.get("omni_accel.kernels.cudnn_fp8_attention")
    if cudnn_fp8 is not None:  # shapes cuDNN refused ran in bf16 SDPA inside the op: their fp8 rows are not cuDNN's
        result["cudnn_fp8_refused_shapes"] = cudnn_fp8.refused_shapes()
    write_result(args.out, result)
    print_table(result["rows"])
    try:
        plot(result, args.plot or os.path.splitext(args.out)[0] + ".png")
    except Exception as exc:  # noqa: BLE001 -- matplotlib missing: the JSON is what matters
        log(f"plot skipped: {exc!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
