"""benchmarks/bench_transformer.py in its tiny CPU mode: the same code path as the GPU run, in seconds."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_transformer", os.path.join(ROOT, "benchmarks",
                                                                                    "bench_transformer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_writes_rows_for_every_model(tmp_path):
    bench = _bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--tiny", "--no-compile", "--iters", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["errors"], result["errors"]
    rows = {(r["model"], r["config"]): r for r in result["rows"]}
    assert {("flux", "eager"), ("flux", "auto"), ("flux", "offload_block"), ("qwen_image", "eager"),
            ("wan", "auto")} <= set(rows)
    for r in rows.values():
        assert r["world_size"] == 1 and r["ms_per_step"] > 0 and r["finite"]
        assert {"tflops", "peak_mem_gib", "gpu", "torch", "diffusers", "shape", "max_abs_err"} <= set(r)
        if r["lossless"]:  # no compile here: every lossless config runs the same kernels as eager on CPU
            assert r["max_abs_err"] < 1e-2, r["config"]
        else:  # FP8 rows: bf16 -> e4m3 error, bounded
            assert r["rel_err_ok"] and 0 < r["rel_err"] < 0.05, r["config"]
    assert ("flux", "fp8+auto") in rows and ("flux", "kernels+auto") in rows
    # the analytic FLOP count matches an nn.Linear hook count (up to the one-token modulation linears)
    for model, flops in result["flops"].items():
        assert abs(flops["linear_hooked"] - flops["linear"]) / flops["linear"] < 0.05, model


def test_analytic_flux_flops_match_the_published_74_tflop():
    bench = _bench()
    assert abs(bench.analytic_flops(bench.flux_spec(tiny=False))["total"] / 1e12 - 74.4) < 0.1
