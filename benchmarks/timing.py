"""Shared by the benchmark scripts: per-call milliseconds (CUDA events on a GPU, perf_counter elsewhere) and the
writing of the raw result file."""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import torch


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
    times = []
    for _ in range(groups):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return times


def write_result(path: str, result: dict) -> None:
    """Write ``result`` as indented JSON to ``path``, creating its folder (scripts call this after every row too,
    so that a crash later keeps what was measured)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
