"""`omni-accel bench`: plain vs accelerated in one process, on tiny saved pipelines (CPU)."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from omni_accel.bench import _cpu_attention_flops
from omni_accel.cli import main
from omni_accel.testing import tiny_pipeline

STANDARD_ROW = {"model", "config", "world_size", "ms_per_step", "tflops", "peak_mem_gib", "gpu", "torch", "diffusers",
                "shape"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    paths = {}
    for family in ("flux", "qwen_image"):
        pipe, _ = tiny_pipeline(family)
        paths[family] = str(tmp_path_factory.mktemp(family) / family)
        pipe.save_pretrained(paths[family])
    return paths


def _bench(model_dir, out, *flags):
    return main(["bench", "a red fox", "--model", model_dir, "--steps", "2", "--height", "32", "--width", "48",
                 "--device", "cpu", "--repeats", "2", "--out", str(out), *flags])


def test_lossless_rows_equal_outputs_and_a_speedup_from_the_same_run(saved, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert _bench(saved["flux"], out, "--attention", "math") == 0
    result = json.loads(out.read_text())
    plain, accelerated = result["rows"]
    assert plain["config"] == "plain" and accelerated["config"] == "attention=math"
    for row in (plain, accelerated):
        assert STANDARD_ROW <= set(row) and row["world_size"] == 1 and len(row["runs_s"]) == 2
        assert row["shape"] == {"height": 32, "width": 48, "output": [1, 3, 32, 48], "steps": 2, "dtype": "float32"}
        assert row["ms_per_step"] == pytest.approx(row["s_per_call"] / 2 * 1e3, rel=1e-3)
        assert row["tflops"] == pytest.approx(result["flops_per_call"] / row["s_per_call"] / 1e12, rel=0.02)
    assert accelerated["max_abs_diff_vs_plain"] == 0.0 and accelerated["psnr_db_vs_plain"] is None  # identical
    assert accelerated["speedup_vs_plain"] == pytest.approx(plain["s_per_call"] / accelerated["s_per_call"], rel=0.01)
    assert accelerated["transformer_forwards"] == 2 and accelerated["applied"] == ["attention"]
    table = capsys.readouterr().out
    assert "config" in table and "attention=math" in table and "identical" in table


def test_flops_are_counted_on_the_plain_call_attention_included(saved, tmp_path):
    """The CPU SDPA op is counted too (FlopCounterMode alone does not know it): 4 * b * h * s_q * s_k * d."""
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops())
    with counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert counter.get_total_flops() == 4 * 1 * 2 * 8 * 10 * 16
    out = tmp_path / "bench.json"
    assert _bench(saved["flux"], out, "--no-baseline") == 0
    (row,) = json.loads(out.read_text())["rows"]  # no plain call: nothing to compare, no FLOP count
    assert row["config"] == "defaults" and "speedup_vs_plain" not in row and row["tflops"] is None


def test_a_lossy_cache_reports_its_error_and_the_skipped_forwards(saved, tmp_path):
    out = tmp_path / "bench.json"
    flags = ["--steps", "6", "--height", "32", "--width", "32", "--negative-prompt", "blurry", "--true-cfg-scale", "4",
             "--cache", "tea_cache", "--cache-config", '{"threshold": 100.0}']
    assert _bench(saved["qwen_image"], out, *flags) == 0
    plain, cached = json.loads(out.read_text())["rows"]
    assert cached["config"] == "cache=tea_cache,cache_config={'threshold': 100.0}"
    assert cached["transformer_forwards"] == 2 * 6  # true CFG: 2 forwards per step, cached or not
    # only the first and the last step of each CFG branch are computed at this threshold
    assert cached["cache_steps"] == {"backend": "tea_cache", "computed": 4, "reused": 8}
    assert 0 < cached["max_abs_diff_vs_plain"] and 5 < cached["psnr_db_vs_plain"] < 100


@pytest.mark.parametrize("flags, message", [
    (["--repeats", "0"], "error: --repeats 0 is invalid: it must be >= 1 (the median of the timed calls)."),
    (["--warmup", "-1"], "error: --warmup -1 is invalid: it must be >= 0."),
    (["--sp", "0"], "sp=0"),
    (["--steps", "0"], "error: --steps 0 is invalid: it must be a positive integer."),
])
def test_bad_values_are_refused_before_the_model_is_looked_for(capsys, flags, message):
    assert main(["bench", "--model", "/nonexistent/model", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "/nonexistent/model" not in err


def test_out_must_be_a_file(tmp_path, capsys):
    assert main(["bench", "--model", "/nonexistent/model", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert f"error: --out {str(tmp_path)!r} is a folder; give a file path" in capsys.readouterr().err
