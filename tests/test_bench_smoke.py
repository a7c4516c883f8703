"""benchmarks/bench_transformer.py and bench_attention.py in tiny CPU modes: the GPU runs' code paths, in seconds."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_transformer", os.path.join(ROOT, "benchmarks",
                                                                                    "bench_transformer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



@pytest.fixture
def bench_peers(monkeypatch):
    """benchmarks/bench_peers.py as a module (registered under its name: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("bench_peers", os.path.join(ROOT, "benchmarks", "bench_peers.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_peers", module)
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


def test_clock_log_falls_back_field_by_field_and_drops_what_no_driver_answers():
    bench = _bench()
    # an older driver: no power.draw.instant (whole query rejected), throttle_ names, hw_slowdown "[N/A]"
    answers = {"clocks.sm": "1980", "power.draw": "650.5", "clocks_throttle_reasons.sw_power_cap": "Active",
               "clocks_throttle_reasons.sw_thermal_slowdown": "Not Active",
               "clocks_throttle_reasons.hw_slowdown": "[N/A]", "temperature.gpu": "61"}

    def query(fields):
        if any(f not in answers for f in fields):
            return None
        return [bench.parse_smi_value(answers[f]) for f in fields]

    fields = bench.choose_smi_fields(query)
    assert fields == {"sm_mhz": "clocks.sm", "power_w": "power.draw",
                      "sw_power_cap": "clocks_throttle_reasons.sw_power_cap",
                      "sw_thermal": "clocks_throttle_reasons.sw_thermal_slowdown", "temp_c": "temperature.gpu"}
    stats = bench.summarize_clock_samples([{"sm_mhz": 1900.0, "power_w": 600.0, "sw_power_cap": 1.0, "temp_c": 60.0},
                                           {"sm_mhz": 1700.0, "power_w": 700.0, "sw_power_cap": 0.0, "temp_c": 62.0,
                                            "sw_thermal": 1.0}])
    assert stats == {"sm_clock_mhz": 1800, "sm_clock_min_mhz": 1700, "power_w": 650, "power_max_w": 700,
                     "sw_power_cap_frac": 0.5, "thermal_slowdown_frac": 1.0, "temp_c": 61.0, "clock_samples": 2}


def test_attention_bench_tiny_cpu_matches_the_fp32_reference(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(ROOT, "benchmarks",
                                                                                  "bench_attention.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "attention.json"
    # a tiny chunk size: the fp32 reference runs in many query chunks here, as it does for Wan's 32760 on the GPU
    assert bench.main(["--device", "cpu", "--tiny", "--iters", "2", "--ref-chunk-mib", "0.002",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    keys = {(r["shape"], r["input"], r["backend"]) for r in result["rows"]}
    assert keys == {(s, i, b) for s in bench.TINY_SHAPES for i in ("randn", "outliers")
                    for b in ("sdpa_math", "sdpa_default")}
    for r in result["rows"]:
        assert "error" not in r, r
        assert r["finite"] and r["ms"] > 0 and r["tflops"] > 0
        # fp32 on the CPU: only summation order differs from the reference; a layout or chunking slip is O(1)
        assert math.isfinite(r["rel_err"]) and r["rel_err"] < 1e-3, r
    assert "sdpa_cudnn" in result["skipped"] and result["env"]["torch"]


def _graphs_check():
    spec = importlib.util.spec_from_file_location(
        "check_cuda_graphs_families", os.path.join(ROOT, "benchmarks", "check_cuda_graphs_families.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_graphs_check_runs_its_case_on_cpu_and_says_the_graphs_did_not_replay(capsys):
    """On CPU the compile pass leaves the graphs off, so the check must fail the case for the missing replays while
    its output and restore comparisons hold (the GPU run is where it passes)."""
    import pytest
    import torch

    check = _graphs_check()
    row = check.check_case("wan22", torch.device("cpu"))
    assert row["failures"] == ["no graph replay"]
    assert row["graph_stats"] == [] and row["restore_exact"]
    assert row["max_abs_diff_max_vs_compile"] == 0.0 and row["max_abs_diff_max_vs_eager"] < check.COMPILE_TOLERANCE
    with pytest.raises(SystemExit) as exc:
        check.main(["--cases", "flux,nope"])
    assert exc.value.code == 2
    assert "unknown cases ['nope']; choose from flux, flux_kontext," in capsys.readouterr().err


def test_peers_bench_tiny_cpu_rows_summary_and_table(bench_peers, tmp_path, capsys, monkeypatch):
    """bench_peers.py's GPU-run code on tiny models: one peer and one of ours per model, the ratio summary and the
    README table from the result file (with the back-to-back loop column, asked for by --loop-forwards); a row that
    cannot run here is listed as skipped with the reason."""
    out = tmp_path / "peers.json"
    assert bench_peers.main(["--device", "cpu", "--tiny", "--models", "flux", "--configs",
                       "diffusers_eager,ours_bf16,torchao_fp8_rowwise", "--loop-forwards", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"diffusers_eager", "ours_bf16"} and not any("error" in r for r in rows.values())
    assert rows["diffusers_eager"]["rel_err_vs_eager"] == 0.0 and rows["ours_bf16"]["rel_err_vs_eager"] < 1e-4
    assert {"ms_per_step", "tflops", "first_call_s", "peak_mem_gib"} <= set(rows["ours_bf16"])
    assert result["skipped"][0]["config"] == "torchao_fp8_rowwise"
    summary = result["summary"]["flux"]
    assert summary["ours_best_lossless"] == "ours_bf16"
    assert summary["lossless_vs_diffusers_eager"] == round(rows["diffusers_eager"]["ms"] / rows["ours_bf16"]["ms"], 3)
    assert rows["ours_bf16"]["ms_loop"] > 0 and rows["ours_bf16"]["ms_per_step_loop"] == rows["ours_bf16"]["ms_loop"]
    assert summary["lossless_vs_diffusers_eager_loop"] == round(
        rows["diffusers_eager"]["ms_loop"] / rows["ours_bf16"]["ms_loop"], 3)
    capsys.readouterr()
    assert bench_peers.main(["--table-from", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| flux | ours_bf16 |" in table and "| flux | diffusers_eager |" in table
    assert "| ms/step in a loop |" in table
    with pytest.raises(SystemExit):
        bench_peers.main(["--loop-forwards", "-1", "--out", str(tmp_path / "x.json")])
    assert "--loop-forwards -1: give a number of forwards (>= 1), or 0 for none" in capsys.readouterr().err


def test_peers_bench_rounds_alternate_the_order_and_pair_the_ratios(bench_peers, tmp_path, capsys):
    """--rounds 3 times each config three times in the order A B, B A, A B: one row per config with the median of its
    rounds (and each round's figure), every round's row kept, and each config's speed-up over the first config
    within each round; a row that changes the weights in place is refused with rounds, and so is --rounds 0."""
    out = tmp_path / "peers.json"
    assert bench_peers.main(["--device", "cpu", "--tiny", "--models", "flux", "--configs",
                             "diffusers_eager,ours_bf16", "--rounds", "3", "--loop-forwards", "2",
                             "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["round"], r["config"]) for r in result["round_rows"]] == [
        (0, "diffusers_eager"), (0, "ours_bf16"), (1, "ours_bf16"), (1, "diffusers_eager"), (2, "diffusers_eager"),
        (2, "ours_bf16")]
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"diffusers_eager", "ours_bf16"}
    ours_rounds = [r for r in result["round_rows"] if r["config"] == "ours_bf16"]
    assert rows["ours_bf16"]["ms_rounds"] == [r["ms"] for r in ours_rounds]
    assert rows["ours_bf16"]["ms"] == round(sorted(r["ms"] for r in ours_rounds)[1], 3)
    assert rows["ours_bf16"]["rounds"] == 3 and rows["ours_bf16"]["first_call_s"] == ours_rounds[0]["first_call_s"]
    assert rows["ours_bf16"]["ms_min"] == min(r["ms_min"] for r in ours_rounds) and "round" not in rows["ours_bf16"]
    assert rows["ours_bf16"]["tflops"] == round(ours_rounds[0]["tflops"] * ours_rounds[0]["ms"]
                                                / rows["ours_bf16"]["ms"], 1)
    eager_rounds = [r for r in result["round_rows"] if r["config"] == "diffusers_eager"]
    paired = result["paired"]["flux"]
    assert paired["baseline"] == "diffusers_eager" and set(paired) == {"baseline", "ours_bf16"}
    assert paired["ours_bf16"]["ratios"] == [round(e["ms"] / o["ms"], 4) for e, o in zip(eager_rounds, ours_rounds)]
    assert paired["ours_bf16"]["median_ratio"] == round(sorted(paired["ours_bf16"]["ratios"])[1], 4)
    assert len(paired["ours_bf16"]["loop_ratios"]) == 3
    assert result["summary"]["flux"]["lossless_vs_diffusers_eager"] == round(
        rows["diffusers_eager"]["ms"] / rows["ours_bf16"]["ms"], 3)
    capsys.readouterr()
    assert bench_peers.main(["--device", "cpu", "--tiny", "--configs", "ours_bf16,torchao_int8", "--rounds", "2",
                             "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err == ("error: --rounds 2 would run torchao_int8 (it changes the weights in place) "
                                       "before other rows of a later round; time it with --rounds 1 in its own "
                                       "invocation.\n")
    with pytest.raises(SystemExit):
        bench_peers.main(["--rounds", "0", "--out", str(tmp_path / "x.json")])
    assert "--rounds 0: give the number of times to time each config (>= 1)" in capsys.readouterr().err


def test_graph_timings_cycle_through_enough_input_copies_to_miss_l2():
    """timing.rotation_copies: enough copies of an input to pass 256 MiB (several GPUs' L2), never fewer than two."""
    from benchmarks import timing

    assert timing.rotation_copies(28 * 2**20) == 10 and timing.rotation_copies(100 * 2**20) == 3
    assert timing.rotation_copies(2**30) == 2 and timing.rotation_copies(0) == 2


def test_gc_pauses_counts_the_collections_inside_the_block_only():
    """timing.GcPauses: the garbage collections a timed forward paid for, so a row slowed by a full collection (host
    time that a synchronised forward shows as GPU idle) is told from a slower kernel."""
    import gc

    from benchmarks import timing

    gc.collect()  # outside the block: not counted
    with timing.GcPauses() as pauses:
        gc.collect()
        gc.collect(0)
    gc.collect()
    summary = pauses.summary()
    assert summary["collections_by_generation"] == [1, 0, 1] and summary["ms"] > 0
    assert pauses._observe not in gc.callbacks


def test_peers_rounds_carry_errors_deadlines_and_partly_timed_configs(bench_peers):
    """combine_rounds: a config timed in one round of two counts one round and drops its round number; a failed round
    leaves the timed one's figures and names its error; a deadline passed in a later round stays on the row."""
    def timed(config, round_index, ms, **extra):
        return {"model": "flux", "config": config, "round": round_index, "ms": ms, "ms_min": ms - 1,
                "ms_max": ms + 1, "tflops": 100.0, **extra}

    rows = bench_peers.combine_rounds([
        timed("a", 0, 10.0), {"model": "flux", "config": "b", "round": 0, "error": "boom"}, timed("b", 1, 20.0),
        timed("a", 1, 12.0, deadline_passed=True), timed("c", 0, 5.0)])
    by = {r["config"]: r for r in rows}
    assert by["a"]["ms"] == 11.0 and by["a"]["ms_rounds"] == [10.0, 12.0] and by["a"]["deadline_passed"]
    assert by["a"]["ms_min"] == 9.0 and by["a"]["ms_max"] == 13.0 and by["a"]["tflops"] == round(100 * 10 / 11, 1)
    assert by["b"]["ms"] == 20.0 and by["b"]["rounds"] == 1 and by["b"]["error"] == "round 0: boom"
    assert by["c"]["rounds"] == 1 and "round" not in by["c"] and "round" not in by["b"]
    plain = [{"model": "flux", "config": "a", "ms": 1.0}]
    assert bench_peers.combine_rounds(plain) == plain


def test_peers_bench_static_attention_scales_row_on_the_cpu(bench_peers, tmp_path, monkeypatch, cudnn_fp8_on_cpu):
    """The three configs of the static-attention-scales GPU run, on a tiny FLUX with cuDNN's FP8 arithmetic emulated:
    the static row calibrates and freezes every attention module, the per-call row attaches none, both stay lossy
    within the FP8 stack's bound."""
    for name in ("ours_fp8_fp8attn_mk", "ours_fp8_fp8attn_static"):
        monkeypatch.setattr(bench_peers.ROWS[name], "cuda_only", False)  # the CPU op emulates cuDNN's FP8 SDPA
    out = tmp_path / "peers.json"
    assert bench_peers.main(["--device", "cpu", "--tiny", "--models", "flux", "--configs",
                       "diffusers_best,ours_fp8_fp8attn_mk,ours_fp8_fp8attn_static", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"diffusers_best", "ours_fp8_fp8attn_mk", "ours_fp8_fp8attn_static"}
    assert not any("error" in r for r in rows.values()), rows
    static, per_call = rows["ours_fp8_fp8attn_static"], rows["ours_fp8_fp8attn_mk"]
    assert "fp8_attention_scales" not in per_call
    assert static["fp8_attention_scales"]["static"] > 0 and static["fp8_attention_scales"]["observing"] == 0
    assert 0 < static["rel_err_vs_eager"] < 0.05 and 0 < per_call["rel_err_vs_eager"] < 0.05


def test_peers_bench_blocks_host_profile_and_a_row_without_graphs(bench_peers, tmp_path, monkeypatch, capsys):
    """--blocks keeps N blocks per stack at full width (FLUX: N dual + 2N single), --host-profile records where the
    host spends a forward, and a row with cuda_graphs=False sets OMNI_ACCEL_CUDA_GRAPHS=0 for itself only."""
    monkeypatch.delenv("OMNI_ACCEL_CUDA_GRAPHS", raising=False)
    monkeypatch.setattr(bench_peers.ROWS["ours_bf16"], "cuda_graphs", False)
    out = tmp_path / "peers.json"
    assert bench_peers.main(["--device", "cpu", "--tiny", "--models", "flux", "--blocks", "1", "--host-profile",
                       "--configs", "ours_bf16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["specs"]["flux"]["cfg"]["num_layers"] == 1 and result["specs"]["flux"]["cfg"]["num_single_layers"] == 2
    assert result["specs"]["flux"]["shape"].endswith("1 block(s) per stack only")
    (row,) = result["rows"]
    assert "error" not in row and row["cuda_graphs_env"] == "0" and "OMNI_ACCEL_CUDA_GRAPHS" not in os.environ
    assert row["host_profile"]["host_ms"] > 0 and row["host_profile"]["top_cpu"]
    assert bench_peers.with_blocks(bench_peers.SPECS["wan81"](True), 0) == bench_peers.SPECS["wan81"](True)
    with pytest.raises(SystemExit) as exit_info:
        bench_peers.main(["--device", "cpu", "--tiny", "--blocks", "-1", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "--blocks -1: give the number of blocks to keep per stack (>= 1), or 0 for all" in capsys.readouterr().err


def test_first_call_bench_splits_setup_calibration_and_forwards(tmp_path, capsys):
    """bench_first_call.py on a tiny FLUX: the static-FP8 row calibrates once, reports its passes' setup seconds
    and dynamo's compile phases, and the first-call sum is setup + calibration + forward 1; bad flags exit 2."""
    spec = importlib.util.spec_from_file_location("bench_first_call",
                                                  os.path.join(ROOT, "benchmarks", "bench_first_call.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "first_call.json"
    cache = tmp_path / "tiny.compile-cache"
    assert bench.main(["--device", "cpu", "--tiny", "--warm-cache", "--cprofile", "3", "--configs",
                       "diffusers_eager,ours_fp8_static,ours_fp8_fp8attn", "--save-compile-cache", str(cache),
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["compile_cache_saved_bytes"] == cache.stat().st_size > 0
    rows = {r["config"]: r for r in result["rows"]}
    assert rows["ours_fp8_fp8attn"] == {"config": "ours_fp8_fp8attn", "skipped": "needs CUDA"}
    static, plain = rows["ours_fp8_static"], rows["diffusers_eager"]
    phases = static["phases_s"]
    assert phases["calibration_forward"] > 0 and "calibration_forward" not in plain["phases_s"]
    assert static["first_call_s"] == round(phases["setup"] + phases["calibration_forward"] + phases["forward_1"], 2)
    assert set(static["setup_s_by_pass"]) >= {"quant", "compile"} and plain["setup_s_by_pass"] is None
    assert static["compile_times"] and len(static["cprofile"]["by_cumulative"]) == 3
    assert static["restored_exactly"] is True and plain["restored_exactly"] is True
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--cprofile", "-2"])
    assert exit_info.value.code == 2
    assert "--cprofile -2: give how many functions to keep (>= 1), or 0 for no profile" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--host-copy-gib", "-1"])
    assert exit_info.value.code == 2
    assert "--host-copy-gib -1.0: give the size to copy in GiB (> 0), or 0 for no copy test" in capsys.readouterr().err


def test_kernel_gaps_sum_the_idle_between_kernels_and_name_both_sides(bench_peers, monkeypatch):
    intervals = [("nvjet_gemm", 0.0, 10.0), ("triton_poi_fused_add", 12.0, 20.0),
                 ("triton_poi_fused_mul", 15.0, 18.0),  # inside the one before it: no gap, and not "before" later
                 ("cudnn_generated_fort_native_sdpa", 30.0, 40.0), ("nvjet_gemm", 40.0, 50.0)]
    gaps = bench_peers.kernel_gaps(list(reversed(intervals)))  # any order in
    assert gaps["total_ms"] == 0.012 and gaps["count"] == 2 and gaps["over_5us"] == 1
    assert gaps["over_5us_ms"] == 0.01 and gaps["before_kind_ms"] == {"attention": 0.01, "other fused": 0.002}
    assert gaps["longest"][0] == {"us": 10.0, "after": "triton_poi_fused_add", "before":
                                  "cudnn_generated_fort_native_sdpa"}
    assert bench_peers.kernel_gaps([])["count"] == 0


def test_loop_profile_counts_overlapping_kernels_once_and_the_gaps_between_forwards(bench_peers):
    """--profile-loop's figures: busy time is the union of the device intervals (a kernel launched early under PDL
    overlaps the one before it), idle the loop's event time minus that, both per forward; the gap between two
    forwards is one of the gaps."""
    forward = [("nvjet_gemm", 0.0, 100.0), ("triton_poi_fused_add", 90.0, 150.0)]  # 150 us busy, 10 overlapping
    loop = forward + [(name, start + 400.0, end + 400.0) for name, start, end in forward]  # 250 us between forwards
    summary = bench_peers.loop_summary(loop, 0.7, 2, {"cudaStreamSynchronize": 2})
    assert summary["busy_ms_per_forward"] == 0.15 and summary["idle_ms_per_forward"] == 0.2
    assert summary["ms_per_forward"] == 0.35 and summary["forwards"] == 2
    assert summary["gaps"]["count"] == 1 and summary["gaps"]["total_ms"] == 0.25
    assert summary["host_waits"] == {"cudaStreamSynchronize": 2}


def test_peers_bench_refuses_a_negative_loop_profile(bench_peers, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_peers.main(["--profile-loop", "-1"])
    assert exit_info.value.code == 2
    assert "--profile-loop -1: give a number of forwards (>= 1), or 0 for none" in capsys.readouterr().err


def test_fp8_epilogues_bench_tiny_cpu_rows(tmp_path):
    """bench_fp8_epilogues.py's GPU-run code on tiny shapes, its Triton rows in Triton's interpreter (a subprocess:
    TRITON_INTERPRET must be set before triton is imported): every way of every case runs, and the library kernel's
    output is no further from the float32 formula than inductor's in e4m3, at most twice as far in bf16 (the
    interpreter truncates to bf16 where the GPU rounds)."""
    out = tmp_path / "epilogues.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fp8_epilogues.py"), "--device",
                           "cpu", "--tiny", "--iters", "1", "--reps", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    ways = {(r["case"], r.get("way")) for r in rows}
    assert {("concat_gelu_fp8", "inductor"), ("concat_gelu_fp8", "triton"), ("concat_gelu_bf16", "triton"),
            ("qk_norm_rope_fp8", "inductor"), ("qk_norm_rope_fp8", "triton"), ("scaled_mm", None)} <= ways
    err = {(r["case"], r.get("way")): r.get("max_abs_err") for r in rows}
    assert err[("concat_gelu_fp8", "triton")] <= err[("concat_gelu_fp8", "inductor")] + 1e-6
    assert err[("concat_gelu_bf16", "triton")] <= 2 * err[("concat_gelu_bf16", "inductor")]


def test_fp8_epilogues_bench_refuses_an_unknown_case(tmp_path):
    """A misspelt case would otherwise time nothing and write an empty result file."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fp8_epilogues.py"), "--device",
                           "cpu", "--tiny", "--cases", "layernorm_int8,layernorm_wan", "--out",
                           str(tmp_path / "epilogues.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not (tmp_path / "epilogues.json").exists()
    assert ("--cases: unknown ['layernorm_wan']; choose from epilogue, int8, layernorm_int8, layernorm_int8_wan, qk, "
            "ceiling, gemm") in proc.stderr


def test_gemm_gelu_bench_tiny_cpu_rows_and_its_refusal(tmp_path, capsys):
    """bench_gemm_gelu.py's GPU-run code on tiny shapes (the concatenation kernel in Triton's interpreter: a
    subprocess): every way of both cases runs, the GELU-in-the-GEMM ways are as close to the float32 formula as
    inductor's (their float32 reference here), the split proj_out as the concatenated one; a negative warm-up is
    refused with the fix."""
    out = tmp_path / "gemm_gelu.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gemm_gelu.py"), "--device", "cpu",
                           "--tiny", "--iters", "1", "--reps", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    err = {(r["case"], r.get("stream"), r["way"]): r.get("rel_err") for r in rows}
    assert set(err) == {("ff_up", s, w) for s in ("image", "text") for w in ("gemm_only", "inductor", "cublaslt_gelu")} \
        | {("single", None, w) for w in ("concat_kernel", "split", "split_copy", "gemms_only")}
    for stream in ("image", "text"):
        assert err[("ff_up", stream, "cublaslt_gelu")] <= err[("ff_up", stream, "inductor")] + 1e-6
    assert err[("single", None, "split")] <= 2 * err[("single", None, "concat_kernel")]
    spec = importlib.util.spec_from_file_location("bench_gemm_gelu",
                                                  os.path.join(ROOT, "benchmarks", "bench_gemm_gelu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--device", "cpu", "--tiny", "--warm-s", "-1", "--out", str(out)])
    assert "--warm-s -1.0: give the seconds of warm-up GEMMs (>= 0), or 0 for none" in capsys.readouterr().err


def test_int8_residual_bench_checks_every_way_bit_for_bit_in_the_interpreter(tmp_path, capsys):
    """bench_int8_residual.py's GPU-run code on tiny shapes in Triton's interpreter (a subprocess): above FEW_ROWS
    rows every way runs -- the plain GEMM, the separate add, the library's twin and the warp-specialized twin with
    each epilogue IO -- and, at a few rows, the first three; each way's output equals the reference bit for bit
    (0 mismatches over the values checked); --checks 0, and the CPU without the interpreter, are refused with the
    fix."""
    out = tmp_path / "int8_residual.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_int8_residual.py"), "--device",
                           "cpu", "--tiny", "--iters", "1", "--reps", "1", "--checks", "1", "--warm-s", "0",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    ways = {(r["shape_name"], r["way"]) for r in rows}
    basic = ("gemm_only", "separate", "twin")
    assert ways == {("tiny_many_rows", w) for w in basic + tuple(f"ws_io{io}" for io in range(4))} \
        | {("tiny_few_rows", w) for w in basic}
    assert all(r["mismatches"] == 0 and r["checked_values"] == r["shape"][0] * r["shape"][2] for r in rows), rows
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_int8_residual.py"), "--device",
                           "cpu", "--tiny", "--checks", "0", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "--checks 0: give at least 1 call to check each way on" in proc.stderr
    env.pop("TRITON_INTERPRET")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_int8_residual.py"), "--device",
                           "cpu", "--tiny", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and ("--device cpu: the Triton kernels run off a GPU only in Triton's interpreter; "
                                     "set TRITON_INTERPRET=1 in the environment") in proc.stderr, proc.stderr[-2000:]


def test_attention_study_int8_rounding_has_one_scale_per_head_and_run_of_tokens():
    """study_fp8_attention_error.py's int8 Q / K: each (run of tokens, head) group is rounded to 255 levels of its
    own max |x| (error <= half a level, the max itself exact), a short last run gets its own scale, and a large value
    in one group does not coarsen another."""
    spec = importlib.util.spec_from_file_location("study", os.path.join(ROOT, "benchmarks",
                                                                         "study_fp8_attention_error.py"))
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    import torch

    x = torch.randn(2, 10, 3, 8, generator=torch.Generator().manual_seed(0))
    x[0, 0, 1, 2] = 50.0  # token 0, head 1: only its own group's scale grows
    for tokens in (1, 4):
        rounded = study.int8_rounded(x, tokens)
        assert rounded.shape == x.shape
        for start in range(0, 10, tokens):
            group, got = x[:, start:start + tokens], rounded[:, start:start + tokens]
            step = group.abs().amax(dim=(1, 3), keepdim=True) / 127.0
            assert ((got - group).abs() <= step / 2 + 1e-6).all()
            assert torch.equal(got.abs().amax(dim=(1, 3)), group.abs().amax(dim=(1, 3)))
    assert (study.int8_rounded(x, 4)[0, 4:, 1] - x[0, 4:, 1]).abs().max() < 4.0 / 254  # |x| < 4 outside token 0


def test_fp8_quality_adherence_scores_captions_and_counts_flipped_verdicts(capsys):
    """bench_fp8_quality.py --adherence: the dataset's own renders meet their captions; the same renders shifted by
    one caption miss most, every verdict they lose counts as right -> wrong against the renders, none the other way,
    and each image falls below 30 dB of its reference."""
    import torch

    sys.path.insert(0, ROOT)
    from benchmarks import bench_fp8_quality as quality
    from omni_accel.builtin import dataset as ds

    params = ds.sample_params(6, torch.Generator().manual_seed(0), p_omit_size=0, p_omit_position=0)
    renders, captions = ds.render(params, 128), ds.captions_of(params)
    right, verdicts = quality.adherence(renders, captions)
    assert right == {"captions": 6, "all_right": 1.0,
                     "fraction_right": dict.fromkeys(("bg_color", "color", "position", "shape", "size"), 1.0)}
    shifted, _ = quality.adherence(renders.roll(1, 0), captions, renders, verdicts)
    assert shifted["all_right"] < 0.5 and all(f < 1 for f in shifted["fraction_right"].values())
    still_right = round(sum(6 * f for f in shifted["fraction_right"].values()))  # 6 captions x 5 stated properties
    assert (shifted["verdicts_right_to_wrong"], shifted["verdicts_wrong_to_right"]) == (30 - still_right, 0)
    assert shifted["psnr_below_30_db"] == 6 and len(shifted["psnr"]) == 6
    with pytest.raises(SystemExit):
        quality.main(["--adherence", "-3"])
    assert "--adherence -3: give a number of captions >= 0" in capsys.readouterr().err


def test_fp8_quality_refuses_sage_rows_on_the_cpu(capsys):
    """bench_fp8_quality.py --modes sage / int8_sage run SageAttention's CUDA kernel: on the CPU the run stops before
    loading anything, naming the rows and the fix."""
    sys.path.insert(0, ROOT)
    from benchmarks import bench_fp8_quality as quality

    with pytest.raises(SystemExit):
        quality.main(["--modes", "int8,int8_sage", "--out", "/nonexistent/x.json"])
    assert ("--modes 'int8,int8_sage': int8_sage run SageAttention's CUDA kernel; add --device cuda (with the "
            "sageattention package installed) or leave them out") in capsys.readouterr().err


def test_fp8_quality_fp32_row_measures_bf16_rounding_against_the_reference(tmp_path):
    """bench_fp8_quality.py --modes fp32: the float32 model against the bf16 reference -- close (bf16's own rounding,
    well above the 30 dB bound), not identical (a row that could not differ would show nothing)."""
    sys.path.insert(0, ROOT)
    from benchmarks import bench_fp8_quality as quality

    out = tmp_path / "noise.json"
    assert quality.main(["--modes", "fp32", "--prompts", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"]["fp32"]
    assert len(row["psnr"]) == 2 and 30 < row["psnr_min"] < float("inf")


def test_fp8_quality_table_row_serves_every_step_of_the_built_in_model_its_own_rows(tmp_path, monkeypatch):
    """bench_fp8_quality.py --modes table: the modulation table on the trained built-in model's 20-step calls, every
    modulation linear served from it; on the CPU a GEMM over the steps rounds each row as its GEMV does, so the images
    equal the bf16 reference's bit for bit: each step took its own step's rows."""
    sys.path.insert(0, ROOT)
    from benchmarks import bench_fp8_quality as quality
    from omni_accel.testing import record_modulation_takes

    outcomes = record_modulation_takes(monkeypatch)
    out = tmp_path / "table.json"
    assert quality.main(["--modes", "table", "--prompts", "1", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"]["table"]
    assert row["psnr_min"] == float("inf") and outcomes and all(outcomes)


def test_requantized_hidden_rounds_twice_within_a_row_step_and_leaves_the_attention_part_once():
    """bench_fp8_quality.py's emulation of a feed-forward hidden state quantized per group in its GEMM's epilogue and
    requantized per row: the per-token quantization after it finds the row's own scale and the twice-rounded
    integers; each value is within one row step of the original (half a group step + half a row step), the
    attention columns are quantized once, as directly, a group as wide as the row gives the direct rounding, and
    the double rounding does move some values; a width that groups do not divide is refused."""
    sys.path.insert(0, ROOT)
    from benchmarks.bench_fp8_quality import requantized_hidden
    from omni_accel.kernels.int8 import quantize_rows_int8

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16 + 64, generator=gen) * torch.logspace(-1, 1, 80)
    x[1, 3] = 40.0  # a row whose largest value is an attention column: the hidden part rounds to that row's scale
    x[2] = 0.0  # a zero row stays zero
    x = x.to(torch.bfloat16)
    direct_int8, direct_scale = quantize_rows_int8(x)
    got_int8, got_scale = quantize_rows_int8(requantized_hidden(x, 16, skip=16))
    assert torch.equal(got_scale, direct_scale) and torch.equal(got_int8[:, :16], direct_int8[:, :16])
    error = (got_int8.float() * got_scale - x.float()).abs()
    assert bool((error <= direct_scale * (1 + 1e-3)).all())
    assert (got_int8 != direct_int8).any() and (got_int8 - direct_int8).abs().max() <= 1
    assert not got_int8[2].any() and got_scale[1] == x[1].float().abs().max() / 127
    whole_int8, _ = quantize_rows_int8(requantized_hidden(x, 80))
    assert torch.equal(whole_int8, direct_int8)
    with pytest.raises(ValueError, match="requantized_hidden: 64 columns are not a multiple of group=48"):
        requantized_hidden(x, 48, skip=16)


def test_fp8_quality_requant_row_hooks_every_feed_forward_down_projection(tmp_path, monkeypatch):
    """bench_fp8_quality.py's hidden-state hooks on the built-in model (2 dual blocks, 4 single blocks) after
    quant="int8": they sit on the 2 x 2 down projections and the 4 proj_out layers, all int8 linears, and in a
    forward each replaces its input by requantized_hidden's (the single blocks' first 256 columns, the attention
    output, left to the row scale); --modes int8_requant_g16 runs and its images stay close to bf16."""
    sys.path.insert(0, ROOT)
    import omni_accel
    from benchmarks import bench_fp8_quality as quality
    from omni_accel.builtin import load_builtin
    from omni_accel.kernels.int8 import Int8Linear

    pipe = load_builtin(dtype=torch.bfloat16)
    omni_accel.accelerate(pipe, quant="int8")
    calls, real = [], quality.requantized_hidden
    monkeypatch.setattr(quality, "requantized_hidden", lambda x, group, skip=0: calls.append((group, skip)) or
                        real(x, group, skip))
    handles = quality.hidden_state_hooks(pipe.transformer, 16)
    modules = dict(pipe.transformer.named_modules())
    hooked = [name for name, m in modules.items() if m._forward_pre_hooks]
    assert len(handles) == 8 and all(isinstance(modules[name], Int8Linear) for name in hooked), hooked
    hidden = torch.randn(1, 16, 64, dtype=torch.bfloat16)
    pipe.transformer(hidden_states=hidden, encoder_hidden_states=torch.randn(1, 8, 128, dtype=torch.bfloat16),
                     pooled_projections=torch.randn(1, 128, dtype=torch.bfloat16), timestep=torch.tensor([0.5]),
                     img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3))
    assert sorted(calls) == [(16, 0)] * 4 + [(16, 256)] * 4
    for handle in handles:
        handle.remove()
    omni_accel.restore(pipe)

    out = tmp_path / "requant.json"
    assert quality.main(["--modes", "int8_requant_g16", "--prompts", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"]["int8_requant_g16"]
    assert row["requantized_layers"] == 8 and len(row["psnr"]) == 2 and row["psnr_min"] > 30


def test_flux_dev_linear_share_counts_the_flops_a_bf16_fallback_keeps():
    """study_fp8_attention_error.py's FLOP shares: FLUX.1-dev's linears split 22 / 22 / 28 / 28 % over the dual
    blocks' MLPs, the single blocks' proj_mlp, their proj_out and every attention projection; one block is 1.75 %;
    the built-in model's last single block is named as FLUX.1-dev's (index 37)."""
    sys.path.insert(0, ROOT)
    from benchmarks.study_fp8_attention_error import flux_dev_linear_share as share

    groups = [["*ff.*", "*ff_context.*"], ["single_transformer_blocks.*.proj_mlp"],
              ["single_transformer_blocks.*.proj_out"], ["*attn.to_*", "*attn.add_*"]]
    assert [share(g) for g in groups] == [0.2222, 0.2222, 0.2778, 0.2778]
    assert share(sum(groups, [])) == 1.0 and share([]) == 0.0
    assert share(["transformer_blocks.0.*"]) == share(["single_transformer_blocks.3.*"]) == 0.0175


def test_peers_summary_keeps_int8_rows_out_of_the_fp8_ratios_and_refuses_two_in_place_rows(bench_peers, tmp_path,
                                                                                          capsys):
    """bench_peers.py: an int8 row is compared with torchao's int8 and diffusers' best, never counted as ours' best
    FP8 (a format against the same format), and a lossy attention beside bf16 linears counts as neither; two rows
    that quantize the weights in place are refused in one run."""
    rows = [{"model": "flux", "config": c, "ms": ms, "lossless": lossless} for c, ms, lossless in (
        ("diffusers_best", 130.0, True), ("ours_fp8_dynamic_fa_pdl", 90.0, False), ("ours_int8_pdl", 80.0, False),
        ("torchao_fp8_rowwise", 110.0, False), ("torchao_int8", 100.0, False), ("ours_bf16_mk_pdl_sage", 70.0, False),
        ("ours_int8_fp8attn_tma", 85.0, False))]  # int8 linears with FP8 attention: an int8 row, not an FP8 one
    summary = bench_peers.summarize(rows)["flux"]
    assert summary["ours_best_fp8"] == "ours_fp8_dynamic_fa_pdl" and summary["ours_best_int8"] == "ours_int8_pdl"
    assert summary["fp8_vs_torchao"] == round(110 / 90, 3) and summary["int8_vs_torchao_int8"] == 1.25
    assert summary["int8_vs_diffusers_best"] == round(130 / 80, 3)
    assert bench_peers.main(["--device", "cpu", "--tiny", "--configs", "torchao_fp8_rowwise,torchao_int8",
                       "--out", str(tmp_path / "x.json")]) == 2
    assert ("--configs has 2 rows that change the weights in place (['torchao_fp8_rowwise', 'torchao_int8']); the "
            "second would quantize the first one's weights. Run each in its own invocation.") in capsys.readouterr().err


def test_fp8_gemm_bench_tiny_cpu_times_fp8_and_int8_linears(tmp_path):
    """bench_fp8_gemm.py on the CPU: the bf16, e4m3 and int8 GEMMs and the two quantized linears compiled whole
    (int8 also under max-autotune), each with its error against the exact product (int8's below e4m3's on Gaussian
    data), and a modulation-shaped matrix-vector row, bf16 against the compiled int8 weight-only layer."""
    out = tmp_path / "gemm.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fp8_gemm.py"), "--device", "cpu",
                    "--tiny", "--iters", "1", "--int8-autotune", "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True)
    row, gemv = json.loads(out.read_text())["rows"]
    assert "error" not in row and "error" not in gemv, (row, gemv)
    for key in ("bf16_gemm_ms", "fp8_gemm_ms", "int8_gemm_ms", "fp8_linear_compiled_ms", "int8_linear_compiled_ms",
                "int8_autotuned_linear_compiled_ms"):
        assert row[key] > 0, key
    assert row["int8_linear_rel_err"] < 0.015 and row["int8_linear_rel_err"] < row["fp8_linear_rel_err"]
    assert row["int8_autotuned_linear_rel_err"] == pytest.approx(row["int8_linear_rel_err"], rel=1e-3)
    # the modulation row: one token, the int8 weight-only layer compiled as a reduction
    assert gemv["M"] == 1 and gemv["bf16_gemv_ms"] > 0 and gemv["int8_weight_only_compiled_ms"] > 0
    assert gemv["int8_weight_only_rel_err"] < 0.015


def test_formats_study_rounds_rows_and_smoothing_leaves_the_product_unchanged():
    """study_fp8_attention_error.py --studies formats: int8 rows are within half a step of their own max / 127, a
    calibrated amax clips beyond it, and SmoothQuant's x / s, W * s leaves an unrounded linear's output unchanged
    (the emulation patches and restores the module)."""
    spec = importlib.util.spec_from_file_location("study", os.path.join(ROOT, "benchmarks",
                                                                         "study_fp8_attention_error.py"))
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    import torch

    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-1, 1, 6)[:, None]
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert ((study.rows_rounded(x, "int8") - x).abs() <= step / 2 + 1e-6).all()
    assert study.rows_rounded(x, "int8", torch.tensor(0.5)).abs().max() <= 0.5 + 1e-6  # clipped at the calibration
    assert torch.equal(study.rows_rounded(x, "bf16"), x)
    linear = torch.nn.Linear(32, 8)
    plain = linear(x)
    s = {"l": torch.rand(32) + 0.5}
    with study.EmulatedLinears([("l", linear)], "bf16", "bf16", smoothing=s):
        smoothed = linear(x)
    torch.testing.assert_close(smoothed, plain, rtol=1e-5, atol=1e-5)
    assert "forward" not in vars(linear)


def test_peers_flag_a_row_whose_output_does_not_follow_new_inputs(bench_peers, monkeypatch):
    """bench_peers.py checks every row once more on new inputs after timing: a forward that hands back what it
    computed for the timed inputs (a CUDA graph replay missing a kernel) is flagged and kept out of the ratios; a
    correct forward is not, and the inputs are put back for the profile that follows."""
    lin = torch.nn.Linear(8, 8)

    def model(hidden_states, encoder_hidden_states):
        return (lin(hidden_states) + encoder_hidden_states.mean(),)

    inputs = {"hidden_states": torch.randn(2, 8), "encoder_hidden_states": torch.randn(3, 8)}
    timed = dict(inputs)
    reference = bench_peers.eager_reference(model, inputs)
    assert torch.equal(inputs["hidden_states"], timed["hidden_states"])
    with torch.no_grad():
        stale = model(**inputs)
        good = bench_peers.fresh_input_check(lambda: model(**inputs), inputs, reference, 0.0)
        bad = bench_peers.fresh_input_check(lambda: stale, inputs, reference, 0.0)
    assert good == {"rel_err_fresh_inputs": 0.0}
    assert bad["fresh_inputs_disagree"] and bad["rel_err_fresh_inputs"] > 0.5
    assert torch.equal(inputs["hidden_states"], timed["hidden_states"])
    rows = [{"model": "flux", "config": c, "ms": ms, "lossless": False, **extra} for c, ms, extra in (
        ("diffusers_best", 130.0, {}), ("ours_int8", 100.0, {}), ("ours_int8_sage", 80.0, bad))]
    assert bench_peers.summarize(rows)["flux"]["ours_best_int8"] == "ours_int8"


def test_the_readme_peers_tables_are_what_their_result_files_say(bench_peers, tmp_path, monkeypatch, capsys):
    """README.md's peers-table blocks are regenerated from the result files their markers name
    (``bench_peers.py --readme``): the check passes on the README as committed, and a hand-edited figure fails it
    and is put back by regenerating."""
    readme = os.path.join(ROOT, "README.md")
    assert bench_peers.TABLE_BLOCK.search(open(readme).read()), "README.md has no peers-table block"
    assert bench_peers.main(["--readme", readme, "--check"]) == 0
    edited = tmp_path / "README.md"
    text = open(readme).read()
    block = bench_peers.TABLE_BLOCK.search(text)
    hand_edited = re.sub(r"(\| diffusers_best \| )[0-9.]+", r"\g<1>1.0", block["body"], count=1)
    assert hand_edited != block["body"]
    edited.write_text(text.replace(block["body"], hand_edited))
    assert bench_peers.main(["--readme", str(edited), "--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    assert bench_peers.main(["--readme", str(edited)]) == 0 and edited.read_text() == text
    plain = tmp_path / "plain.md"
    plain.write_text("no table here\n")
    assert bench_peers.main(["--readme", str(plain)]) == 2
    assert f"error: {plain} has no '<!-- peers-table: FILES -->'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_peers.main(["--check"])
    assert "--check compares a markdown file's peers-table blocks" in capsys.readouterr().err


def _load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, gpu_only", [("bench_gemm_algos", "cuBLASLt's algorithms need a CUDA GPU"),
                                            ("bench_attention_plans", "cuDNN's attention plans need a CUDA GPU"),
                                            ("bench_side_stream_gemv", "streams and CUDA graphs need a CUDA GPU")])
def test_plan_and_algorithm_benches_refuse_the_cpu_and_bad_options_with_the_fix(name, gpu_only, tmp_path, capsys):
    module = _load_benchmark(name)
    out = str(tmp_path / "x.json")
    with pytest.raises(SystemExit):
        module.main(["--device", "cpu", "--out", out])
    assert f"--device cpu: {gpu_only}; run with --device cuda" in capsys.readouterr().err


def test_gemm_algos_refuses_a_bad_quack_tile_name_with_the_form(tmp_path, capsys):
    module = _load_benchmark("bench_gemm_algos")
    with pytest.raises(SystemExit):
        module.main(["--quack", "256x192_coop", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert ("--quack: quack GEMM config '256x192_coop' is not a config name: use 'default' or "
            "'<tile_m>x<tile_n>_<pp|coop>_c<cluster_m>x<cluster_n>', e.g. '256x192_coop_c2x1'") in err


def test_gemm_algos_summary_weighs_each_shape_by_its_calls_and_keeps_torch_where_no_candidate_wins():
    module = _load_benchmark("bench_gemm_algos")
    rows = [{"gemm": "a", "calls_per_step": 10, "way": "torch", "us_graph": 100.0, "vs_torch": 1.0},
            {"gemm": "a", "calls_per_step": 10, "way": "algo_0", "us_graph": 99.0, "vs_torch": 1.01},
            {"gemm": "a", "calls_per_step": 10, "way": "algo_3", "us_graph": 91.0, "vs_torch": 1.1},
            {"gemm": "a", "calls_per_step": 10, "way": "algo_4", "error": "refused"},
            {"gemm": "b", "calls_per_step": 2, "way": "torch", "us_graph": 50.0, "vs_torch": 1.0},
            {"gemm": "b", "calls_per_step": 2, "way": "algo_0", "us_graph": 49.0, "vs_torch": 0.95}]
    summary = module.summarize(rows)
    assert summary["shapes"]["a"] == {"torch_us": 100.0, "best": "algo_3", "best_us": 91.0, "vs_torch": 1.1}
    assert summary["shapes"]["b"]["best"] == "algo_0" and summary["shapes"]["b"]["vs_torch"] == 0.95
    assert summary["step_ms_torch"] == 1.1 and summary["step_ms_best"] == 1.009  # b keeps torch's 50 us


def test_gemm_algos_fused_single_block_gemm_applies_the_gelu_to_the_mlp_columns_only_and_gets_a_verdict():
    module = _load_benchmark("bench_gemm_algos")
    gen = torch.Generator().manual_seed(0)
    x, w_t = torch.randn(3, 4, generator=gen), torch.randn(4, module.GELU_TAIL_FROM + 5, generator=gen)
    bias = torch.randn(module.GELU_TAIL_FROM + 5, generator=gen)
    plain = torch.addmm(bias, x, w_t)
    got = module.gelu_tail_(plain.clone())
    assert torch.equal(got[:, :module.GELU_TAIL_FROM], plain[:, :module.GELU_TAIL_FROM])
    torch.testing.assert_close(got[:, module.GELU_TAIL_FROM:],
                               torch.nn.functional.gelu(plain[:, module.GELU_TAIL_FROM:], approximate="tanh"))
    torch.testing.assert_close(got, module.reference(x, w_t, bias, None, "bias_gelu_tail"))
    rows = [{"gemm": g, "calls_per_step": c, "way": "torch", "us_graph": us, "vs_torch": 1.0}
            for g, c, us in (("single_qkv", 38, 300.0), ("single_mlp_gelu", 38, 400.0), ("single_qkv_mlp", 0, 680.0))]
    rows.append({"gemm": "single_qkv_mlp", "calls_per_step": 0, "way": "quack_default", "us_graph": 650.0,
                 "vs_torch": 1.05})
    rows.append({"gemm": "single_qkv", "calls_per_step": 38, "way": "algo_0", "us_graph": 310.0, "vs_torch": 0.97})
    summary = module.summarize(rows)
    assert summary["single_fusion"] == {"separate_us": 700.0, "fused_us": 680.0, "fused_speedup": 1.0294}
    assert summary["step_ms_torch"] == 11.4  # single_qkv's 38 calls; the fused shape (0 calls per step) adds nothing


def test_quack_rows_and_the_gemm_benchmark_name_tiles_the_library_takes(bench_peers):
    from omni_accel.kernels import quack_gemm

    row = bench_peers.ROWS["ours_bf16_mk_pdl_tunedquack"]
    assert row.quack_configs == bench_peers.QUACK_TILES and row.tuned_gemm and "quack" in row.needs
    assert bench_peers.ROWS["ours_bf16_mk_pdl_tunedlt"].quack_configs == ()
    names = list(bench_peers.QUACK_TILES) + _load_benchmark("bench_gemm_algos").QUACK_CONFIGS.split(",")
    for name in names:
        quack_gemm.check_name(name)  # raises on a name the library would refuse


def test_torchao_fp8_row_quantizes_only_the_bf16_linears_of_a_model_with_float32_modules(bench_peers, monkeypatch):
    """Wan keeps its time embedder in float32 (diffusers' _keep_in_fp32_modules), which torchao's per-row FP8
    refuses: the row's filter takes every bf16 linear and leaves those out, as diffusers' TorchAoConfig does."""
    transformer = bench_peers.build_transformer(bench_peers.wan81_spec(True), torch.device("cpu"), torch.bfloat16)
    linears = {name: m for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    kept = sorted(name for name, m in linears.items() if not bench_peers.bf16_linear(m, name))
    assert kept and all("time_embedder" in name for name in kept)
    assert all(linears[name].weight.dtype == torch.float32 for name in kept)
    assert sum(bench_peers.bf16_linear(m, name) for name, m in linears.items()) == len(linears) - len(kept)
    assert not bench_peers.bf16_linear(torch.nn.LayerNorm(4).to(torch.bfloat16), "norm")
    # and the row hands that filter to torchao (a stand-in records the call; the compile after it is not run here)
    calls = []
    stand_in = types.SimpleNamespace(
        Float8DynamicActivationFloat8WeightConfig=lambda granularity: ("fp8", granularity), PerRow=lambda: "per-row",
        quantize_=lambda model, config, filter_fn=None: calls.append((model, config, filter_fn)))
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", stand_in)
    monkeypatch.setattr(bench_peers, "_cudnn_regional_compile", lambda model, inputs: "compiled")
    assert bench_peers._torchao_fp8(None, transformer, {}, "wan81") == "compiled"
    assert calls == [(transformer, ("fp8", "per-row"), bench_peers.bf16_linear)]


def _tiny_model(bench_peers, model: str):
    """(transformer, pipeline, inputs) of a bench_peers model in its tiny CPU form."""
    from benchmarks.bench_transformer import build_pipeline, build_transformer, make_inputs

    bench_peers.ensure_adapters()
    spec = bench_peers.SPECS[model](True)
    transformer = build_transformer(spec, torch.device("cpu"), torch.float32)
    return transformer, build_pipeline(spec, transformer), make_inputs(spec, torch.device("cpu"), transformer.dtype)


def test_frozen_modulation_probe_answers_from_recorded_outputs_and_undoes(bench_peers):
    """The probe rows' modulation linears return one plain forward's outputs: the same model output for the
    benchmark's inputs with every modulation linear swapped out of the forward, and the undo puts them back."""
    transformer, pipe, inputs = _tiny_model(bench_peers, "flux")
    with torch.no_grad():
        reference = transformer(**inputs)[0]
    fn, undo = bench_peers._frozen_modulation(bench_peers._plain)(pipe, transformer, inputs, "flux")
    recorded = [m for m in transformer.modules() if isinstance(m, bench_peers._RecordedOutputLinear)]
    assert len(recorded) == 5  # every block's AdaLN linear and norm_out's, as the FLUX adapter names them
    returned = []
    hooks = [m.register_forward_hook(lambda m, args, out: returned.append(out is m.recorded)) for m in recorded]
    with torch.no_grad():
        assert torch.equal(fn()[0], reference)
    assert returned == [True] * 5  # each answered with its recorded tensor, no GEMV
    for hook in hooks:
        hook.remove()
    undo()
    assert not any(isinstance(m, bench_peers._RecordedOutputLinear) for m in transformer.modules())
    assert not any("recorded" in m._buffers for m in transformer.modules())
    with torch.no_grad():
        assert torch.equal(transformer(**inputs)[0], reference)


def test_frozen_modulation_probe_over_the_int8_stack_and_out_of_the_summary(bench_peers):
    """Over the int8 stack's real setup the probe freezes the same five linears (the stack leaves them plain) and
    gives the stack's own output; its rows never count among the summary's best; a family without modulation
    linears is refused by name."""
    transformer, pipe, inputs = _tiny_model(bench_peers, "flux")
    int8 = bench_peers._ours(quant="int8", fuse_if_supported=True)
    fn, undo = int8(pipe, transformer, inputs, "flux")
    with torch.no_grad():
        stack_out = fn()[0]
    undo()
    fn, undo = bench_peers._frozen_modulation(int8)(pipe, transformer, inputs, "flux")
    try:
        assert sum(isinstance(m, bench_peers._RecordedOutputLinear) for m in transformer.modules()) == 5
        with torch.no_grad():
            assert torch.equal(fn()[0], stack_out)
    finally:
        undo()
    assert bench_peers.ROWS["ours_int8_frozenmod"].probe and not bench_peers.ROWS["ours_int8"].probe

    rows = [{"model": "flux", "config": name, "ms": ms, "lossless": lossless, **extra}
            for name, ms, lossless, extra in (("diffusers_best", 130.0, True, {}),
                                              ("ours_bf16_mk_pdl", 125.0, True, {}),
                                              ("ours_bf16_mk_pdl_frozenmod", 120.0, True, {"probe": True}),
                                              ("ours_int8", 88.0, False, {}),
                                              ("ours_int8_frozenmod", 85.0, False, {"probe": True}))]
    summary = bench_peers.summarize(rows)["flux"]
    assert summary["ours_best_lossless"] == "ours_bf16_mk_pdl" and summary["ours_best_int8"] == "ours_int8"
    assert summary["lossless_vs_diffusers_best"] == round(130.0 / 125.0, 3)

    wan_transformer, wan_pipe, _ = _tiny_model(bench_peers, "wan81")
    with pytest.raises(RuntimeError, match="wan81: the family names no modulation linears"):
        bench_peers._frozen_modulation(bench_peers._plain)(wan_pipe, wan_transformer, {}, "wan81")


def test_step_floor_records_the_forwards_products_with_qkv_fused_and_every_attention_call(bench_peers):
    """One tiny FLUX forward recorded: each block's q / k / v (and the text stream's) as one product of three widths,
    the per-sample modulation products left out, every block's attention call, and the FLOPs of both the analytic
    count's (the linears' plus the embedders' and the output projection's)."""
    from benchmarks import step_floor
    from benchmarks.bench_transformer import analytic_flops

    transformer, pipe, inputs = _tiny_model(bench_peers, "flux")
    spec = bench_peers.SPECS["flux"](True)
    calls = step_floor.record(lambda: transformer(**inputs))
    gemms = [c for c in calls if isinstance(c, step_floor.Gemm)]
    attention = [c for c in calls if isinstance(c, step_floor.Attention)]
    cfg, d = spec["cfg"], transformer.inner_dim
    blocks = cfg["num_layers"] + cfg["num_single_layers"]
    assert len(attention) == blocks
    qkv = [c for c in gemms if c.cols == 3 * d and c.inner == d]
    assert [c.rows for c in qkv] == [spec["n_img"], spec["n_txt"]] * cfg["num_layers"] + [
        spec["n_img"] + spec["n_txt"]] * cfg["num_single_layers"]
    assert min(c.rows for c in gemms) >= step_floor.MIN_ROWS  # no one-row modulation product
    flops = analytic_flops(spec)
    outside_blocks = 2 * d * (spec["n_img"] * transformer.x_embedder.in_features
                              + spec["n_txt"] * transformer.context_embedder.in_features
                              + spec["n_img"] * transformer.proj_out.out_features)
    assert sum(c.flops for c in gemms) == flops["linear"] + outside_blocks
    assert sum(c.flops for c in attention) == flops["attention"]
    apart = step_floor.record(lambda: transformer(**inputs), fuse_qkv=False)  # as the default 16-bit stack runs
    assert not [c for c in apart if isinstance(c, step_floor.Gemm) and c.cols == 3 * d and c.inner == d]
    assert sum(c.flops for c in apart if isinstance(c, step_floor.Gemm)) == flops["linear"] + outside_blocks


def test_step_floor_refuses_a_forward_whose_attention_it_cannot_replay():
    """Masked attention, attention the recorder does not see as one call (written as matrix products), and SDPA
    calls that took its math fallback beside fused ones are refused rather than left out of the floor."""
    from benchmarks import step_floor

    q = torch.randn(1, 2, 16, 8)
    mask = torch.zeros(16, 16, dtype=torch.bool).fill_diagonal_(True)
    with pytest.raises(ValueError, match="masked or causal attention; the floor replays unmasked, non-causal"):
        step_floor.record(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    with pytest.raises(ValueError, match="no fused attention call in the forward"):
        step_floor.record(lambda: torch.softmax(q @ q.transpose(-1, -2), -1) @ q)

    def one_on_the_math_fallback():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        with sdpa_kernel(SDPBackend.MATH):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with pytest.raises(ValueError, match="2 scaled_dot_product_attention calls but 1 ran one of its fused kernels"):
        step_floor.record(one_on_the_math_fallback)
    assert len(step_floor.record(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))) == 1


def test_the_bf16_rows_around_the_16_bit_graph_choice_differ_in_the_graph_alone(bench_peers):
    """ours_bf16_mk_pdl_nograph is the default bf16 row with the whole-forward graph off (OMNI_ACCEL_CUDA_GRAPHS=0)
    for every family; ours_bf16_mk_pdl_graph asks for compile='max'."""
    rows = bench_peers.ROWS
    base, nograph, graph = rows["ours_bf16_mk_pdl"], rows["ours_bf16_mk_pdl_nograph"], rows["ours_bf16_mk_pdl_graph"]
    assert base.cuda_graphs and not nograph.cuda_graphs and nograph.setup is base.setup
    assert base.setup.knobs == {"attention": "auto", "compile": True}
    assert graph.setup.knobs == {"attention": "auto", "compile": "max"} and graph.cuda_graphs


def test_step_floor_fuses_only_consecutive_products_of_one_input_and_one_width():
    from benchmarks.step_floor import Gemm, fuse_projections

    mlp, q, k, v = (Gemm(80, 32, 128, True, 1), Gemm(80, 32, 32, True, 1), Gemm(80, 32, 32, True, 1),
                    Gemm(80, 32, 32, True, 1))
    other_input, no_bias = Gemm(80, 32, 32, True, 2), Gemm(80, 32, 32, False, 2)
    fused = fuse_projections([mlp, q, k, v, other_input, no_bias])
    assert [(c.cols, c.input_ptr, c.bias) for c in fused] == [(128, 1, True), (96, 1, True), (32, 2, True),
                                                               (32, 2, False)]
    assert q.cols == 32  # the recorded calls are left as they were


def test_step_floor_rows_replay_zeros_of_the_output_shape_and_refuse_an_unknown_gemm(bench_peers):
    """Both floor rows run on the CPU, return zeros of the model output's shape (their output is not the model's),
    touch no module, and stay out of the summary's ratios as probes."""
    from benchmarks import step_floor

    transformer, pipe, inputs = _tiny_model(bench_peers, "flux")
    weights = {name: p.clone() for name, p in transformer.named_parameters()}
    for name in ("floor_bf16", "floor_bf16_unfused", "floor_int8"):
        row = bench_peers.ROWS[name]
        assert row.probe
        fn, undo = row.setup(pipe, transformer, inputs, "flux")
        with torch.no_grad():
            out = fn()
        assert out.shape == transformer(**inputs)[0].shape and not out.any()
        undo()
    assert all(torch.equal(p, weights[name]) for name, p in transformer.named_parameters())
    with pytest.raises(ValueError, match=r"gemm='fp4': use one of \('bf16', 'int8'\)"):
        step_floor.floor_forward([], "fp4", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"attention='int4': use one of \('bf16', 'fp8'\)"):
        step_floor.floor_forward([], "int8", torch.device("cpu"), attention="int4")


def test_step_floor_fp8_attention_runs_cudnns_fp8_op_on_e4m3_operands_of_the_recorded_shapes(monkeypatch):
    """The FP8-attention floor calls omni_accel::cudnn_fp8_sdpa (emulated on the CPU) once per recorded attention
    call, on e4m3 (batch, tokens, heads, head dim) operands; a GPU without cuDNN's FP8 attention is refused."""
    from benchmarks import step_floor
    from omni_accel.kernels import cudnn_fp8_attention as fp8

    call = step_floor.Attention(((1, 2, 16, 8),) * 3, ((256, 8, 16, 1),) * 3, torch.bfloat16)
    seen = []
    real = fp8.cudnn_fp8_sdpa
    monkeypatch.setattr(fp8, "cudnn_fp8_sdpa", lambda q8, *rest: seen.append((q8.shape, q8.dtype)) or real(q8, *rest))
    step_floor.floor_forward([call, call], "int8", torch.device("cpu"), attention="fp8")()
    assert seen == [((1, 16, 2, 8), torch.float8_e4m3fn)] * 2
    monkeypatch.setattr(fp8, "unavailable_reason", lambda device: "the package is not installed")
    buffers = step_floor._Buffers(torch.device("cpu"))
    buffers.device = torch.device("cuda")  # as a GPU without the package would be
    with pytest.raises(RuntimeError, match="the FP8 attention floor needs cuDNN's FP8 attention: the package is not"):
        step_floor._fp8_attention_call(call, buffers)


def test_floor_rows_measure_no_error_and_the_table_says_so(bench_peers, tmp_path, capsys):
    out = tmp_path / "floor.json"
    assert bench_peers.main(["--device", "cpu", "--tiny", "--models", "flux", "--configs", "diffusers_eager,floor_bf16",
                             "--schedule-steps", "2", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["floor_bf16"]["rel_err_vs_eager"] is None and "rel_err_fresh_inputs" not in rows["floor_bf16"]
    assert rows["floor_bf16"]["schedule_rel_err_vs_single_forwards"] is None  # no model output to compare
    assert rows["diffusers_eager"]["schedule_rel_err_vs_single_forwards"] == 0.0
    assert rows["floor_bf16"]["probe"] and rows["floor_bf16"]["ms"] > 0
    table = bench_peers.markdown_table(json.loads(out.read_text()))
    assert "| flux | floor_bf16 |" in table and "— (no model output)" in table
    assert rows["diffusers_eager"]["rel_err_vs_eager"] == 0.0


def test_peers_bench_schedule_loop_runs_a_pipeline_calls_timesteps_and_fills_the_table_once(bench_peers, tmp_path,
                                                                                          monkeypatch):
    """--schedule-steps N times N forwards at the timesteps FluxPipeline passes for N steps, inside one pipeline call
    of an accelerated pipeline: the modulation-table row fills its N rows once per call (not per forward), every
    row reports ms per step of the schedule, and --rounds pairs those figures too."""
    from omni_accel import modulation_table
    from omni_accel.testing import run, tiny_pipeline

    pipe, kwargs = tiny_pipeline("flux")
    passed = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: passed.append(k["timestep"]), with_kwargs=True)
    run(pipe, dict(kwargs, num_inference_steps=3))
    hook.remove()
    latents = pipe.transformer.config.in_channels
    inputs = {"hidden_states": torch.zeros(1, (kwargs["height"] // 16) * (kwargs["width"] // 16), latents)}
    assert [t.tolist() for t in bench_peers.schedule_timesteps(pipe, inputs, 3, torch.device("cpu"))] == \
        [t.tolist() for t in passed]

    fills = []
    fill = modulation_table.ModulationTable._fill

    def recording_fill(table, bound, timestep, start):
        fills.append((table.state is not None and table.state.in_call, timestep.shape[0], start))
        return fill(table, bound, timestep, start)

    monkeypatch.setattr(modulation_table.ModulationTable, "_fill", recording_fill)
    out = tmp_path / "peers.json"
    assert bench_peers.main(["--device", "cpu", "--tiny", "--models", "flux", "--configs",
                             "diffusers_eager,ours_bf16_mk_pdl", "--schedule-steps", "3", "--rounds", "2",
                             "--iters", "1", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    for row in rows.values():
        assert row["schedule_steps"] == 3 and row["ms_schedule"] > 0 and len(row["ms_schedule_rounds"]) == 2
        assert row["schedule_rel_err_vs_single_forwards"] < 1e-5  # float32: one GEMM against per-step GEMVs
    compiled = [a for a in rows["ours_bf16_mk_pdl"]["applied"] if a["pass"] == "compile"][0]
    assert compiled["modulation_table"] > 0 and rows["ours_bf16_mk_pdl"]["modulation_table"] is True
    # per round: 3 schedule runs (one untimed) of one fill of 3 rows each; no other forward fills a row (no CUDA
    # graph here: outside a call, the timing's forwards and the error check's, the linears compute themselves)
    assert fills == [(True, 3, 0)] * (2 * 3)
    assert len(result["paired"]["flux"]["ours_bf16_mk_pdl"]["schedule_ratios"]) == 2


def test_attention_ab_rows_are_todays_stack_with_only_the_attention_or_its_tile_changed(bench_peers):
    """The rows that A/B an attention kernel must differ from the stack they name in that alone: a row that kept
    older switches once compared GELU-in-GEMM and q / k kernels along with the attention."""
    import dataclasses

    from omni_accel.kernels import fa4_attention

    rows = bench_peers.ROWS
    setup_only = {"name", "setup", "needs", "cuda_only", "note"}

    def changed(base, row):
        fields = {f.name for f in dataclasses.fields(row) if getattr(row, f.name) != getattr(rows[base], f.name)}
        knobs, base_knobs = dict(row.setup.knobs), dict(rows[base].setup.knobs)
        if knobs.pop("attention") != base_knobs.pop("attention"):
            fields.add("attention")
        assert knobs == base_knobs, (row.name, knobs, base_knobs)  # accelerate() asked for the same otherwise
        return fields - {"setup"}

    for name in ("ours_bf16_mk_pdl_cudnn", "ours_bf16_mk_pdl_fa4"):
        assert changed("ours_bf16_mk_pdl", rows[name]) <= setup_only | {"attention"}, name
    assert changed("ours_int8", rows["ours_int8_fa4"]) <= setup_only | {"attention"}
    # auto against cuDNN in the int8 stack: also SageAttention's preparation switch, which nothing runs without it
    assert changed("ours_int8", rows["ours_int8_auto"]) <= setup_only | {"attention", "sage_prep_kernels"}
    for base in ("ours_bf16_mk_pdl_fa4", "ours_int8_fa4", "ours_bf16_mk_pdl", "ours_int8_auto"):
        for tile in fa4_attention.TILE_CANDIDATES:
            row = rows[f"{base}_t{fa4_attention.tile_name(tile)}"]
            assert row.fa4_tile == tile and changed(base, row) <= setup_only | {"fa4_tile"}
    for base in ("ours_bf16_mk_pdl", "ours_int8_auto"):  # auto's FA4 route timed per shape from 4,096 keys
        row = rows[f"{base}_timed"]
        assert row.fa4_timed_min_tokens == 4096 and changed(base, row) <= setup_only | {"fa4_timed_min_tokens"}
    assert rows["ours_bf16_mk_pdl"].fa4_timed_min_tokens is None  # the library's default: no timing
