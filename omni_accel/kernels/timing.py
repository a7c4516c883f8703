"""Timing of kernel calls, for the choices made at run time (the 16-bit GEMM tuner, FlashAttention-4 against cuDNN)
and the benchmarks: calls launched back to back between two CUDA events, and ways timed in alternating rounds.

A GPU at its power cap moves its clock by 10-30 % within seconds, so ways compared with each other are timed in
rounds, each round timing every way once, each round starting one way later than the one before: a drift reaches
all ways alike, and ratios taken within a round compare like with like."""

from __future__ import annotations

import time
from typing import Callable

import torch


def calls_ms(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Milliseconds of ``repeats`` calls of ``call`` launched back to back: between two CUDA events on a GPU, by the
    wall clock elsewhere."""
    if device.type == "cuda":
        with torch.cuda.device(device):  # the events on that device's current stream, where the calls launch
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    began = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - began) * 1e3


def in_rounds(ways: dict[str, Callable[[], object]], rounds: int,
              measure: Callable[[Callable[[], object]], float]) -> dict[str, list[float]]:
    """Per way, ``measure(way)`` in each of ``rounds`` rounds; every way is measured once per round, the first way of
    each round one later than the round before's."""
    names = list(ways)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            per_round[name].append(measure(ways[name]))
    return per_round


def rounds_ms(ways: dict[str, Callable[[], object]], repeats: int, rounds: int,
              device: torch.device) -> dict[str, list[float]]:
    """Per way, the milliseconds of ``repeats`` back-to-back calls in each of ``rounds`` rounds (``in_rounds``)."""
    return in_rounds(ways, rounds, lambda call: calls_ms(call, repeats, device))
