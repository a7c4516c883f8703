"""StagePipeline: an AR stage and a diffusion stage in one process, overlapped.

    stages = StagePipeline(ar=enhancer, diffusion=lambda p: pipe(prompt=p).images[0])
    images = stages.run(["a fox", "a cat", "a boat"])
    stages.last_stats         # this run: wall time, per-stage busy time, time both were busy
    stages.compare(requests)  # the speed-up: serial wall time / pipelined wall time, both measured

Requests flow AR -> diffusion. The AR stage runs on a worker thread, the diffusion stage on the calling thread:
while the DiT works on request n the AR stage works on request n+1 (``lookahead`` requests at most ahead).
Results come back in request order; an error in either stage stops both and is raised; the worker thread is
always joined before ``run`` returns.

One run cannot tell its own speed-up: when the stages share cores (or the GIL) each one is slower while the other
runs, so the stage busy times of an overlapped run add up to more than a serial run takes. The speed-up is only
ever the ratio of two measured wall times (``compare``).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

_DONE = object()


@dataclass
class StageStats:
    """What one ``run`` measured. Busy times are this run's: in an overlapped run they include the slowdown each
    stage suffers from the other, so ``busy_sum_s`` is *not* what a serial run would take."""

    requests: int = 0
    overlapped: bool = True
    wall_s: float = 0.0
    ar_busy_s: float = 0.0
    diffusion_busy_s: float = 0.0
    both_busy_s: float = 0.0  # time both stages were running at once (not time saved)
    spans: list = field(default_factory=list)  # (request, stage, start, end), seconds from the run's start

    @property
    def busy_sum_s(self) -> float:
        return self.ar_busy_s + self.diffusion_busy_s

    def as_dict(self) -> dict:
        return {"requests": self.requests, "overlapped": self.overlapped, "wall_s": round(self.wall_s, 4),
                "ar_busy_s": round(self.ar_busy_s, 4), "diffusion_busy_s": round(self.diffusion_busy_s, 4),
                "both_busy_s": round(self.both_busy_s, 4), "busy_sum_s": round(self.busy_sum_s, 4)}


@dataclass
class StageComparison:
    """Serial and pipelined runs of the same requests, alternated; each side's best (shortest) wall time."""

    serial: StageStats
    pipelined: StageStats
    runs: list[StageStats]

    @property
    def speedup(self) -> float:
        """Serial wall time / pipelined wall time: > 1 when overlapping the stages paid, < 1 when it cost."""
        return self.serial.wall_s / self.pipelined.wall_s

    @property
    def stage_slowdown(self) -> float:
        """Stage busy time pipelined / serial: how much the stages slowed each other down while overlapped."""
        return self.pipelined.busy_sum_s / self.serial.busy_sum_s

    def as_dict(self) -> dict:
        return {"speedup": round(self.speedup, 3), "serial_wall_s": round(self.serial.wall_s, 4),
                "pipelined_wall_s": round(self.pipelined.wall_s, 4), "stage_slowdown": round(self.stage_slowdown, 3),
                "best": {"serial": self.serial.as_dict(), "pipelined": self.pipelined.as_dict()},
                "runs": [r.as_dict() for r in self.runs]}


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


class StagePipeline:
    """``ar(request) -> intermediate`` then ``diffusion(intermediate) -> result``, overlapped across requests."""

    def __init__(self, ar: Callable[[Any], Any], diffusion: Callable[[Any], Any], lookahead: int = 1):
        if lookahead < 1:
            raise ValueError("lookahead must be >= 1")
        self.ar = ar
        self.diffusion = diffusion
        self.lookahead = lookahead
        self.last_stats: StageStats | None = None

    def run(self, requests: Sequence[Any], overlap: bool = True) -> list[Any]:
        """Results of every request, in order. ``overlap=False`` runs the stages one after the other (baseline)."""
        t0 = time.perf_counter()
        stats = StageStats(requests=len(requests), overlapped=overlap)
        spans_ar: list[tuple[float, float]] = []
        spans_dit: list[tuple[float, float]] = []

        def timed(fn, arg, spans, i, name):
            s = time.perf_counter() - t0
            out = fn(arg)
            e = time.perf_counter() - t0
            spans.append((s, e))
            stats.spans.append((i, name, round(s, 4), round(e, 4)))
            return out

        results: list[Any] = []
        if not overlap:
            for i, r in enumerate(requests):
                results.append(timed(self.diffusion, timed(self.ar, r, spans_ar, i, "ar"), spans_dit, i, "diffusion"))
        else:
            handoff: queue.Queue = queue.Queue(maxsize=self.lookahead)
            stop = threading.Event()
            threads = torch.get_num_threads()

            def worker() -> None:
                # a new thread starts with the OpenMP default; vLLM's CPU kernels check that the thread count they
                # run with is the one the engine planned with, so the worker uses the caller's
                torch.set_num_threads(threads)
                try:
                    for i, r in enumerate(requests):
                        if stop.is_set():
                            return
                        item = (i, timed(self.ar, r, spans_ar, i, "ar"), None)
                        while not stop.is_set():
                            try:
                                handoff.put(item, timeout=0.05)
                                break
                            except queue.Full:
                                continue
                except BaseException as exc:  # handed to the caller's thread
                    handoff.put((None, None, exc))
                    return
                handoff.put((None, _DONE, None))

            thread = threading.Thread(target=worker, name="omni_accel-ar-stage", daemon=True)
            thread.start()
            try:
                while True:
                    i, item, exc = handoff.get()
                    if exc is not None:
                        raise exc
                    if item is _DONE:
                        break
                    results.append(timed(self.diffusion, item, spans_dit, i, "diffusion"))
            finally:
                stop.set()
                while thread.is_alive():  # drain so a blocked put can finish, then join
                    try:
                        handoff.get_nowait()
                    except queue.Empty:
                        pass
                    thread.join(timeout=0.05)
        stats.wall_s = time.perf_counter() - t0
        stats.ar_busy_s = sum(e - s for s, e in spans_ar)
        stats.diffusion_busy_s = sum(e - s for s, e in spans_dit)
        stats.both_busy_s = _overlap(spans_ar, spans_dit)
        self.last_stats = stats
        return results

    def compare(self, requests: Sequence[Any], repeats: int = 2) -> StageComparison:
        """Run ``requests`` serially and pipelined ``repeats`` times each, alternating so that load from elsewhere
        on the machine hits both alike; the speed-up is the ratio of the best wall times. Warm the stages up
        first: the first call of a stage often pays one-off costs."""
        if repeats < 1:
            raise ValueError("repeats must be >= 1")
        runs: list[StageStats] = []
        for _ in range(repeats):
            for overlap in (False, True):
                self.run(requests, overlap=overlap)
                runs.append(self.last_stats)
        fastest = {flag: min((r for r in runs if r.overlapped is flag), key=lambda r: r.wall_s)
                   for flag in (False, True)}
        return StageComparison(serial=fastest[False], pipelined=fastest[True], runs=runs)
