"""Shared by the benchmark scripts: per-call milliseconds (CUDA events on a GPU, perf_counter elsewhere) and the
writing of the raw result file."""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from typing import Callable

import torch

from omni_accel.kernels.timing import calls_ms, in_rounds


class GcPauses:
    """Python's garbage collections while the block runs: how many per generation and their total milliseconds. A
    full collection in a process holding a compiler's objects takes milliseconds of host time, which a timed forward
    that synchronises at its end shows as GPU idle time; this tells such a row from a slower kernel."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.ms = 0.0
        self._started = 0.0

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._started) * 1e3

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._observe)

    def summary(self) -> dict:
        return {"collections_by_generation": list(self.collections), "ms": round(self.ms, 3)}


def sample_ms(fn: Callable[[], object], device: torch.device, iters: int) -> list[float]:
    """``iters`` timed calls of ``fn`` (no warm-up: callers warm up as their measurement needs)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def back_to_back_ms(fn: Callable[[], object], device: torch.device, calls: int, groups: int) -> list[float]:
    """Per-call milliseconds of ``calls`` calls launched back to back between two events (no sync in between, as a
    denoising loop runs its steps), one figure per group. Unlike ``sample_ms``, the host's work before each call's
    first GPU launch overlaps the previous call's kernels, as it does in a pipeline."""
    return [calls_ms(fn, calls, device) / calls for _ in range(groups)]  # CUDA events on a GPU, else the wall clock


# Bytes of inputs a graph of calls cycles through: several times an H100 / H200's 50-60 MiB of L2, so that a kernel
# replayed on the same small input is not served from the cache
L2_ROTATION_BYTES = 256 * 2**20


def rotation_copies(nbytes: int) -> int:
    """How many copies of an input of ``nbytes`` a graph cycles through to exceed ``L2_ROTATION_BYTES`` (at least 2)."""
    return max(2, -(-L2_ROTATION_BYTES // nbytes)) if nbytes > 0 else 2


def graph_ms(calls: list[Callable[[], object]], iters: int) -> float:
    """ms per call of ``calls`` replayed from one CUDA graph of all of them (no host launch cost in the figure: what a
    compiled forward's graph pays), median of ``iters`` replays. Warm-up calls run on a side stream first."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return statistics.median(sample_ms(graph.replay, torch.device("cuda"), iters)) / len(calls)


def capture_graph(fn: Callable[[], object], reps: int = 1) -> "torch.cuda.CUDAGraph":
    """One CUDA graph of ``reps`` calls of ``fn`` (one warm-up call on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def graph_rounds_ms(graphs: dict, iters: int, rounds: int) -> dict[str, list[float]]:
    """Per graph, the median ms of ``iters`` replays in each of ``rounds`` rounds, the graphs replayed in turn with
    the start rotating (``omni_accel.kernels.timing.in_rounds``: a drift of the clocks, 10-30 % within seconds on a
    GPU at its power cap, reaches all of them alike and ratios within a round compare like with like)."""
    replays = {name: graph.replay for name, graph in graphs.items()}
    return in_rounds(replays, rounds, lambda replay: statistics.median(sample_ms(replay, torch.device("cuda"), iters)))


def package_version(package: str) -> str | None:
    """The installed distribution's version, or None where it is not installed (for the result files' env)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def write_result(path: str, result: dict) -> None:
    """Write ``result`` as indented JSON to ``path``, creating its folder (scripts call this after every row too,
    so that a crash later keeps what was measured)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
