"""16-bit linears on the cuBLASLt algorithm that a timing under load picks, instead of torch's call.

Why: for a linear with a bias (and for the GELU epilogue) torch runs the first algorithm of cuBLASLt's heuristic list;
its other calls let cuBLAS choose. The heuristic models the GPU at full clocks; at a 700 W cap an H100 ran some of
FLUX's GEMMs faster on another candidate, in two runs of paired rounds (``benchmarks/bench_gemm_algos.py``, results
``gemm_algos_rounds_{a,b}_h100_20261206.json``): a dual block's down projection by 4.7 / 7.3 %, the q / k / v
projections by 2.3-2.8 %. The same candidate moved by up to 4.6 % between the two runs, and the heuristic's own first
candidate timed 0.98-1.04x torch's call, so a pick needs a margin above that spread. Which candidate wins depends on
the GPU, its power limit and the cuBLAS build, so it is measured where the model runs rather than shipped.

How: the first call of each (device, shape, strides, alignments, dtype, epilogue) times torch's call and the
heuristic's first ``CANDIDATES`` algorithms (for operands as aligned as these) in ``ROUNDS`` rounds, every way in
turn, and keeps the candidate whose median ratio to torch's time in the same round is largest -- if it is at least
``MIN_GAIN``; else torch's call stays. That costs about 0.1-0.2 s per shape in the first forward. Calls smaller than
``MIN_GFLOP`` (FLUX's text-stream output projection, the modulation GEMVs) keep torch's call untimed: their launch
would be much of what the timing sees. A call made while a CUDA graph is being captured never times (it takes torch's
call unless the shape was already tuned), and a cuBLASLt call that fails falls back to torch's for that shape.

The result differs from torch's call by the summation order of the chosen algorithm (all accumulate in float32 and
round once): the same class of difference as between two GPUs, and the pick may differ between processes.
``TUNED_GEMMS`` (module switch, off by default: the whole-forward measurement is still to come) turns it on for the
graph pass of ``compile=True`` -- the 16-bit linears become ``omni_accel::linear_tuned`` and ``linear_gelu`` /
``concat_linear`` tune their GEMMs; off, every op is torch's call. ``choices()`` says what was picked
(``report()["tuned_gemms"]``).

``QUACK_CONFIGS`` (module switch, empty by default) adds the GEMMs of the ``quack-kernels`` package on the named tile
configurations (``quack_gemm``) to the candidates timed on Hopper and newer, where quack is installed; each name
compiles once per epilogue in the first forward. A quack call that fails later gives its shape back to torch's call.
"""

from __future__ import annotations

import logging
import statistics
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import AccelError
from . import cublaslt, quack_gemm, timing

logger = logging.getLogger(__name__)

TUNED_GEMMS = False
CANDIDATES = 8  # the heuristic's first entries timed (at FLUX's shapes the winners were among them, up to the 8th)
ROUNDS = 7
MIN_GAIN = 1.04  # above the 0.98-1.04x that the heuristic's first candidate timed against torch's call
MIN_GFLOP = 20.0
EPILOGUES = ("none", "bias", "gelu_bias", "accumulate")
QUACK_CONFIGS: tuple[str, ...] = ()  # quack tile configurations also timed, e.g. ("256x192_coop_c2x1",)

_lock = threading.Lock()
_choices: dict[tuple, object] = {}  # key -> cublaslt.Algorithm, QuackChoice, or None for torch's call
_ratios: dict[tuple, float] = {}  # key -> the chosen way's median ratio over torch's call
# (config name, epilogue) whose first call failed, or that was among the ways when timing a shape failed: not tried
# again (until reset())
_quack_failed: set[tuple[str, str]] = set()


def torch_call(x, w_t, bias, epilogue: str, out: torch.Tensor | None) -> torch.Tensor:
    """What torch runs for this linear (what the compiled graph ran before this module)."""
    if epilogue == "gelu_bias":
        return torch._addmm_activation(bias, x, w_t, use_gelu=True)
    if epilogue == "accumulate":
        return out.addmm_(x, w_t)
    return torch.addmm(bias, x, w_t) if epilogue == "bias" else torch.mm(x, w_t)


def lt_epilogue(epilogue: str) -> str:
    """cuBLASLt's epilogue for ``epilogue`` (accumulating is beta = 1, not an epilogue)."""
    return "none" if epilogue == "accumulate" else epilogue


def paired_ratio(torch_times: list[float], way_times: list[float]) -> float:
    """The median over rounds of torch's time over the way's in the same round."""
    return statistics.median(t / w for t, w in zip(torch_times, way_times))


def pick(per_round: dict[str, list[float]], min_gain: float) -> tuple[str, float]:
    """(the way to keep, its median paired ratio over ``"torch"``) from each way's times in the same rounds: the way
    with the largest median of torch's time over its own, round by round, where that is at least ``min_gain``."""
    best, best_ratio = "torch", 1.0
    for way, times in per_round.items():
        if way == "torch":
            continue
        ratio = paired_ratio(per_round["torch"], times)
        if ratio >= min_gain and ratio > best_ratio:
            best, best_ratio = way, ratio
    return best, best_ratio


def _time_rounds(ways: dict[str, Callable[[], object]], calls: int, rounds: int,
                 device: torch.device) -> dict[str, list[float]]:
    """ms of ``calls`` back-to-back calls of each way, ``rounds`` times, every way in turn (the start rotating),
    after one call of each (a first call may compile or allocate)."""
    for fn in ways.values():
        fn()
    return timing.rounds_ms(ways, calls, rounds, device)


@dataclass(frozen=True)
class QuackChoice:
    """A shape's pick among quack's kernels: the configuration's name and quack's config object."""

    name: str
    config: object

    def run(self, x, w_t, bias, epilogue: str, out) -> torch.Tensor:
        return quack_gemm.linear(x, w_t, bias, epilogue, out, self.config)


def _quack_ways(x, w_t, bias, epilogue: str, scratch) -> dict[str, tuple[QuackChoice, Callable[[], object]]]:
    """``QUACK_CONFIGS``' kernels for this call where quack runs here: name -> (choice, call). A configuration
    whose first call fails (mostly its compile, which is per epilogue, not per shape) is left out for that epilogue
    for the rest of the process, with one warning."""
    if not QUACK_CONFIGS or quack_gemm.available(x.device) is not None:
        return {}
    ways = {}
    for name in QUACK_CONFIGS:
        if (name, epilogue) in _quack_failed:
            continue
        try:
            choice = QuackChoice(name, quack_gemm.config(name, x.device))
            call = (lambda choice=choice: choice.run(x, w_t, bias, epilogue, scratch))
            call()
        except Exception as exc:  # noqa: BLE001 -- quack raises what its compiler raises; the others still time
            logger.warning("omni_accel: quack GEMM %s left out for the %s epilogue (first at %s x %s; %s: %s)",
                           name, epilogue, tuple(x.shape), w_t.shape[1], type(exc).__name__, exc)
            _quack_failed.add((name, epilogue))
            continue
        ways[f"quack_{name}"] = (choice, call)
    return ways


def _tune(key: tuple, x, w_t, bias, epilogue: str, out) -> object:
    m, k = x.shape
    n = w_t.shape[1]
    scratch = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if out is not None:
        scratch.copy_(out)
    ways: dict[str, Callable[[], object]] = {"torch": lambda: torch_call(x, w_t, bias, epilogue, scratch)}
    candidates = {}
    for algo in cublaslt.algorithms(m, n, k, x.dtype, lt_epilogue(epilogue), CANDIDATES, x.device.index or 0,
                                    *cublaslt.leading_dims(x, w_t), alignments=key[-1]):
        name = f"algo_{algo.rank}"
        candidates[name] = algo
        ways[name] = (lambda algo=algo: cublaslt.matmul(x, w_t, bias, scratch, algo, lt_epilogue(epilogue),
                                                         accumulate=epilogue == "accumulate"))
    quack = _quack_ways(x, w_t, bias, epilogue, scratch)
    for name, (choice, call) in quack.items():
        candidates[name], ways[name] = choice, call
    per_call_ms = 2 * m * n * k / 500e12 * 1e3  # at ~500 TFLOP/s: about 2 ms per timed group of calls
    calls = max(3, round(2.0 / per_call_ms))
    try:
        per_round = _time_rounds(ways, calls, ROUNDS, x.device)
    except Exception as exc:  # noqa: BLE001 -- quack raises what its compiler raises: the shape is timed without it
        if not quack or not _refusal(exc, quack_involved=True):
            raise
        # which way raised is not known: quack's are left out for this epilogue from now on, and a second error
        # (one of torch's or cuBLASLt's ways) is raised
        logger.warning("omni_accel: an error while timing %s with quack's GEMMs among the ways (%s: %s); timed "
                       "again without them, and quack left out for the %s epilogue", key, type(exc).__name__, exc,
                       epilogue)
        _quack_failed.update((choice.name, epilogue) for choice, _ in quack.values())
        per_round = _time_rounds({name: fn for name, fn in ways.items() if name not in quack}, calls, ROUNDS,
                                 x.device)
    way, ratio = pick(per_round, MIN_GAIN)
    _ratios[key] = round(ratio, 4)
    logger.debug("omni_accel: GEMM %s -> %s (%.3fx torch's call)", key, way, ratio)
    return candidates.get(way)


def operand_alignments(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
                       out: torch.Tensor | None) -> tuple[int, int, int]:
    """The byte alignments cuBLASLt is asked for: (weight, x, the least of the output's and the bias's)."""
    outputs = [cublaslt.alignment(out) if epilogue == "accumulate" else 256]  # a new tensor: 512-byte aligned
    if bias is not None:
        outputs.append(cublaslt.alignment(bias))
    return cublaslt.alignment(w_t), cublaslt.alignment(x), min(outputs)


def linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w_t`` with ``epilogue`` -- "none", "bias" (+ bias), "gelu_bias" (tanh-GELU of it + bias) or
    "accumulate" (added into ``out`` in place, returned) -- on the tuned algorithm for this shape where one beat
    torch's call, else torch's call (always off a GPU)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} is not one of {EPILOGUES}")
    if not (TUNED_GEMMS and x.is_cuda and 2 * x.shape[0] * x.shape[1] * w_t.shape[1] >= MIN_GFLOP * 1e9):
        return torch_call(x, w_t, bias, epilogue, out)
    if not cublaslt.takes(x, w_t, bias) or (out is not None and not out.is_contiguous()):
        return torch_call(x, w_t, bias, epilogue, out)
    key = (x.device.index, tuple(x.shape), w_t.shape[1], *cublaslt.leading_dims(x, w_t), x.dtype, epilogue,
           operand_alignments(x, w_t, bias, epilogue, out))
    if key not in _choices:
        if torch.cuda.is_current_stream_capturing():
            return torch_call(x, w_t, bias, epilogue, out)
        with _lock:
            if key not in _choices:
                try:
                    _choices[key] = _tune(key, x, w_t, bias, epilogue, out)
                except Exception as exc:  # noqa: BLE001 -- cuBLASLt's refusal costs the shape its tuning only
                    if not _refusal(exc, quack_involved=False):  # _tune handles quack's own errors
                        raise
                    logger.warning("omni_accel: GEMM tuning of %s failed (%s); torch's call", key, exc)
                    _choices[key] = None
    return run_choice(key, _choices[key], x, w_t, bias, epilogue, out)


def _refusal(exc: BaseException, quack_involved: bool) -> bool:
    """Whether ``exc`` is a kernel refusing a call (the shape then goes back to torch's call) rather than an error
    to raise: cuBLASLt's AccelError, or any error where quack ran -- but never running out of memory, which the
    next call may not."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    return isinstance(exc, AccelError) or quack_involved


def run_choice(key: tuple, algo: object, x, w_t, bias, epilogue: str, out) -> torch.Tensor:
    """The call on ``algo`` (a cuBLASLt algorithm, a QuackChoice, or None for torch's call); a refused call puts the
    shape back on torch's call for good. Both kernels refuse on the host, before launching anything, so an
    "accumulate" they refused has not touched ``out`` and torch's call adds the product once."""
    if algo is None:
        return torch_call(x, w_t, bias, epilogue, out)
    try:
        if isinstance(algo, QuackChoice):
            return algo.run(x, w_t, bias, epilogue, out)
        target = out if epilogue == "accumulate" else torch.empty(x.shape[0], w_t.shape[1], device=x.device,
                                                                  dtype=x.dtype)
        return cublaslt.matmul(x, w_t, bias, target, algo, lt_epilogue(epilogue), accumulate=epilogue == "accumulate")
    except Exception as exc:  # noqa: BLE001 -- a refused call costs the shape its tuning, never the forward
        if not _refusal(exc, isinstance(algo, QuackChoice)):
            raise
        logger.warning("omni_accel: the tuned GEMM %s failed (%s); torch's call from now on", key, exc)
        with _lock:
            _choices[key] = None
        return torch_call(x, w_t, bias, epilogue, out)


def choices() -> dict[str, str]:
    """What the tuning picked: "(M, K) x N <dtype> <epilogue>" -> "torch", "algo_<rank> (<ratio>x)" or
    "quack_<config> (<ratio>x)"."""
    picked = {}
    with _lock:
        entries = list(_choices.items())
    for key, algo in entries:
        _, (m, k), n, _, _, dtype, epilogue, _ = key
        name = f"({m}, {k}) x {n} {str(dtype).replace('torch.', '')} {epilogue}"
        if algo is None:
            picked[name] = "torch"
            continue
        way = f"quack_{algo.name}" if isinstance(algo, QuackChoice) else f"algo_{algo.rank}"
        picked[name] = f"{way} ({_ratios.get(key, 1.0)}x)"
    return picked


def reset() -> None:
    """Forget the tuned choices (the next call of each shape times again)."""
    with _lock:
        _choices.clear()
        _ratios.clear()
        _quack_failed.clear()
