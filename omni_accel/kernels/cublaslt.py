"""cuBLASLt's own algorithm list for a 16-bit linear, reached through ctypes from the library torch already loaded.

Why: torch asks cuBLASLt's heuristic for one algorithm per GEMM and runs it. The heuristic ranks its candidates by a
model of the GPU at full clocks; a GPU held at its power cap runs some tile shapes relatively faster than others
(fewer bytes through shared memory and L2 per FLOP cost less energy). ``algorithms()`` returns the heuristic's whole
ranked list for one problem, and ``matmul()`` runs any entry of it, so that a benchmark (and a tuner) can time them
side by side under the same sustained load.

The problem is the linear ``out = x @ w_t (+ bias)(, GELU)`` with ``x`` (M, K) of unit column stride, ``w_t`` (K, N)
of unit row stride (the transposed view of a row-major weight, or of some of its columns) and ``out`` (M, N)
contiguous: in cuBLAS's column-major terms ``out^T = op_T(W^T) @ x^T``, the "TN" layout torch uses for ``F.linear``,
with the bias along ``out^T``'s rows.
``accumulate=True`` adds into ``out`` (beta = 1), the form of ``omni_accel::concat_linear``'s second GEMM.

Nothing here runs on import; the library is found in the process's mapped files after torch has run a GEMM.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch

from ..errors import AccelError

_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
_OP_N, _OP_T = 0, 1
EPILOGUES = {"none": 1, "bias": 4, "gelu": 32, "gelu_bias": 36}
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D
_CONFIG_ATTRS = {"config_id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                 "inner_shape": 7, "cluster_shape": 8}
WORKSPACE_BYTES = 32 * 1024 * 1024  # the most a candidate may ask for: what torch gives cuBLASLt on Hopper


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass
class Algorithm:
    """One entry of cuBLASLt's ranked list for one problem."""
    rank: int
    algo: _Algo
    workspace_size: int
    waves: float
    config: dict


def _library_path() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcublasLt" in line:
                return line.split()[-1]
    raise AccelError("cuBLASLt is not loaded in this process: run a CUDA GEMM with torch first")


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                               ctypes.c_int64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                                   ctypes.POINTER(_HeuristicResult), ctypes.POINTER(ctypes.c_int)]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [ctypes.POINTER(_Algo), ctypes.c_int, vp, sz,
                                                         ctypes.POINTER(sz)]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise AccelError(f"cuBLASLt {what} failed with status {status}")


@functools.lru_cache(maxsize=None)
def _handle(device_index: int) -> int:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle.value


def _set(setter, obj, attr: int, value: ctypes._SimpleCData) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


@functools.lru_cache(maxsize=None)
def _descriptors(m: int, n: int, k: int, dtype: torch.dtype, epilogue: str, ld_w: int, ld_x: int):
    """(matmul desc, A, B, C/D layouts) for the problem, ``ld_w`` / ``ld_x`` the weight's and x's row strides;
    cached: descriptors are host objects reused by every call with the same shapes and strides (the bias pointer,
    the one per-call attribute, is set under ``_call_lock``)."""
    lib = _lib()
    data_type = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}[dtype]
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "matmul desc")
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSA, ctypes.c_int(_OP_T))
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSB, ctypes.c_int(_OP_N))
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_EPILOGUE, ctypes.c_int(EPILOGUES[epilogue]))
    if "bias" in epilogue:
        _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int(data_type))
    layouts = []
    for rows, cols, ld in ((k, n, ld_w), (k, m, ld_x), (n, m, n)):  # W^T, x^T, out^T: column-major
        layout = ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), data_type, rows, cols, ld), "matrix layout")
        layouts.append(layout)
    return (desc, *layouts)


def _config(algo: _Algo) -> dict:
    """The algorithm's configuration attributes (tile, stages, split-K, ...), each read at the size cuBLASLt reports
    for it."""
    config = {}
    for name, attr in _CONFIG_ATTRS.items():
        size = ctypes.c_size_t(0)
        if _lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size)) != 0:
            continue
        buffer, written = (ctypes.c_uint8 * max(size.value, 1))(), ctypes.c_size_t(0)
        if _lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, buffer, size.value,
                                                       ctypes.byref(written)) == 0:
            config[name] = int.from_bytes(bytes(buffer)[:written.value], "little")
    return config


def alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 that divides ``t``'s address: what cuBLASLt's candidates may assume."""
    ptr = t.data_ptr()
    return 256 if ptr % 256 == 0 else ptr & -ptr


def algorithms(m: int, n: int, k: int, dtype: torch.dtype, epilogue: str = "bias", count: int = 32,
               device_index: int = 0, ld_w: int | None = None, ld_x: int | None = None,
               alignments: tuple[int, int, int] = (256, 256, 256)) -> list[Algorithm]:
    """cuBLASLt's ranked algorithms for ``(M, K) @ (K, N)`` with ``epilogue`` (a key of ``EPILOGUES``), best first by
    its heuristic; ``ld_w`` / ``ld_x``: the weight's and x's row strides (default K); ``alignments``: the byte
    alignment of the weight, x and the output (and bias) that every returned algorithm may rely on."""
    if epilogue not in EPILOGUES:
        raise AccelError(f"epilogue={epilogue!r} is not one of {sorted(EPILOGUES)}")
    lib = _lib()
    desc, a, b, c = _descriptors(m, n, k, dtype, epilogue, ld_w or k, ld_x or k)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    try:
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
             ctypes.c_uint64(WORKSPACE_BYTES))
        for attr, value in zip(_PREF_MIN_ALIGNMENT, (*alignments, alignments[2])):  # A = W^T, B = x^T, C, D = out
            _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(value))
        results = (_HeuristicResult * count)()
        returned = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(device_index), desc, a, b, c, c, pref, count, results,
                                                  ctypes.byref(returned)), "heuristic query")
    finally:
        lib.cublasLtMatmulPreferenceDestroy(pref)
    return [Algorithm(i, results[i].algo, int(results[i].workspace_size), float(results[i].waves_count),
                      _config(results[i].algo)) for i in range(returned.value) if results[i].state == 0]


_call_lock = threading.Lock()


def takes(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``matmul`` takes these operands as they are (on a GPU): 16-bit tensors on one device, x (M, K) and w_t
    (K, N) with unit inner strides, row strides of at least K (no overlapping or broadcast rows) in whole 16-byte
    units, 16-byte aligned (cuBLASLt's 16-bit kernels need it), and a bias, if any, a contiguous (N,) vector of the
    same dtype and alignment."""
    if x.dim() != 2 or w_t.dim() != 2 or x.dtype != w_t.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    (m, k), n = x.shape, w_t.shape[1]
    if w_t.device != x.device or w_t.shape[0] != k or min(m, n, k) < 1:
        return False
    if x.stride(1) != 1 or w_t.stride(0) != 1 or x.stride(0) < k or w_t.stride(1) < k:
        return False
    operands = [(x, x.stride(0)), (w_t, w_t.stride(1))]
    if bias is not None:
        if bias.shape != (n,) or bias.stride(0) != 1 or bias.dtype != x.dtype or bias.device != x.device:
            return False
        operands.append((bias, n))
    return all(t.data_ptr() % 16 == 0 and (t.element_size() * ld) % 16 == 0 for t, ld in operands)


def leading_dims(x: torch.Tensor, w_t: torch.Tensor) -> tuple[int, int]:
    """(the weight's row stride, x's row stride) as ``_descriptors`` keys them."""
    return w_t.stride(1), x.stride(0)


def matmul(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, algorithm: Algorithm,
           epilogue: str = "bias", accumulate: bool = False) -> torch.Tensor:
    """``out (+)= x @ w_t (+ bias)(, GELU)`` with ``algorithm`` on the current stream (capturable in a CUDA graph).
    The algorithm must come from ``algorithms()`` for operands at least as aligned as these."""
    m, k = x.shape
    n = w_t.shape[1]
    if not x.is_cuda or ("bias" in epilogue) != (bias is not None) or not takes(x, w_t, bias):
        raise AccelError("cublaslt.matmul takes CUDA tensors x, w_t and a bias exactly when the epilogue adds one, "
                         "as takes() describes them")
    if out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise AccelError(f"cublaslt.matmul writes a contiguous ({m}, {n}) {x.dtype} out on {x.device}; got a "
                         f"{tuple(out.shape)} {out.dtype} tensor on {out.device}")
    lib = _lib()
    index = x.device.index
    desc, a, b, c = _descriptors(m, n, k, x.dtype, epilogue, *leading_dims(x, w_t))
    # the caching allocator hands each stream its own workspace (a CUDA graph keeps it in its pool)
    workspace = torch.empty(max(algorithm.workspace_size, 1), dtype=torch.uint8, device=x.device)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)
    with _call_lock:  # the bias pointer lives on the shared descriptor until the call has read it
        if bias is not None:
            _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        _check(lib.cublasLtMatmul(_handle(index), desc, ctypes.byref(alpha), w_t.data_ptr(), a, x.data_ptr(), b,
                                  ctypes.byref(beta), out.data_ptr(), c, out.data_ptr(), c,
                                  ctypes.byref(algorithm.algo), workspace.data_ptr(), algorithm.workspace_size,
                                  torch.cuda.current_stream(x.device).cuda_stream), "matmul")
    return out
