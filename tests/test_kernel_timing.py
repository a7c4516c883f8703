"""omni_accel/kernels/timing.py on the CPU: the rounds' order and what one measurement counts."""

import types

import pytest
import torch

from omni_accel.kernels import timing


def test_every_way_is_measured_once_per_round_the_start_rotating():
    order = []
    ways = {name: name for name in "abc"}
    per_round = timing.in_rounds(ways, 4, lambda way: order.append(way) or float(len(order)))
    assert "".join(order) == "abc" + "bca" + "cab" + "abc"
    assert per_round == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}


def test_calls_ms_times_the_repeats_back_to_back_by_the_wall_clock_off_a_gpu(monkeypatch):
    clock = {"s": 0.0}
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock["s"]))

    def call():
        clock["s"] += 0.002

    assert timing.calls_ms(call, 5, torch.device("cpu")) == pytest.approx(10.0)
    times = timing.rounds_ms({"x": call, "y": lambda: None}, 3, 2, torch.device("cpu"))
    assert times["x"] == pytest.approx([6.0, 6.0]) and times["y"] == [0.0, 0.0]
