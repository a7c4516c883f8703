"""Timing shared by the benchmark scripts: per-call milliseconds by CUDA events on a GPU, perf_counter elsewhere."""

from __future__ import annotations

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
