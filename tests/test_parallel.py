"""Parallelism for real: torchrun --nproc_per_node=2|4 on CPU with gloo, tiny pipelines of every family.

Each launch runs tests/parallel_worker.py, which computes the single-process reference on every rank before
accelerate, then the parallel output, and writes per-rank JSON; the tests here assert per case. Launches are few
and batched (torchrun start + imports cost ~10 s each). Set OMNI_ACCEL_SKIP_PARALLEL=1 to skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "parallel_worker.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]

pytestmark = pytest.mark.skipif(os.environ.get("OMNI_ACCEL_SKIP_PARALLEL") == "1", reason="parallel tests skipped")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", OMNI_ACCEL_PG_TIMEOUT="60", PYTHONPATH=str(ROOT))
    env.pop("OMNI_ACCEL_PARALLEL_CASES", None)
    return env


def _launch(suite: str, nproc: int, tmp: Path, timeout: int) -> list[dict]:
    proc = subprocess.run(TORCHRUN + [f"--nproc_per_node={nproc}", str(WORKER), suite, str(tmp)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)
    files = [tmp / f"{suite}.rank{r}.json" for r in range(nproc)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        raise AssertionError(f"torchrun {suite} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch("two", 2, tmp_path_factory.mktemp("par2"), timeout=600)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch("four", 4, tmp_path_factory.mktemp("par4"), timeout=420)


CASES_2 = [
    *(f"ulysses-{f}" for f in ("flux", "flux2", "qwen_image", "qwen_image_edit", "z_image", "sd3", "wan", "wan_i2v",
                              "wan22", "flux_kontext")),
    *(f"ulysses-{f}-odd" for f in ("flux", "flux2", "qwen_image", "z_image", "sd3", "wan", "flux_kontext")),
    *(f"ring-{f}-odd" for f in ("flux", "flux2", "qwen_image", "z_image", "sd3", "wan")),
    *(f"cfg-{f}" for f in ("qwen_image", "qwen_image_edit", "wan", "wan22")),
    *(f"tp-{f}" for f in ("flux", "flux2", "qwen_image", "wan", "sd3", "sd3_5", "z_image")),
    *(f"vae-{f}-odd" for f in ("flux", "z_image", "sd3", "flux2")),
    "vae-flux-attention",
    "ulysses+vae-flux-odd",
    "ulysses-flux-compile",
]
CACHE_CASES_2 = [
    *(f"cache-tea-ulysses-{f}-odd" for f in ("flux", "qwen_image", "wan", "z_image")),
    "cache-tea-ring-sd3-odd",
    *(f"cache-tea-cfg-{f}" for f in ("qwen_image", "wan")),
    "cache-dit-tp-flux",
    "cache-fb-tp-flux",
]
CASES_4 = ["usp-flux-odd", "sp2xcfg2-qwen_image-odd", "tp2xring2-flux", "vae4-flux", "tp2xulysses2-flux-odd",
           "tp4-flux"]


def _check(per_rank: list[dict], name: str) -> None:
    results = [next((r for r in d["results"] if r["name"] == name), None) for d in per_rank]
    assert all(r is not None for r in results), f"{name}: not run on every rank"
    first = results[0]
    if first["status"] == "skipped":
        pytest.skip(first["reason"])
    if first["status"] == "error" and first.get("stage") == "reference":
        pytest.skip(f"the plain tiny pipeline itself fails here: {first['error']}")
    for r in results:
        assert r["status"] == "ran", f"{name} rank error: {r.get('error')}\n{r.get('traceback', '')}"
        assert r["max_abs_diff"] <= r["tol"], f"{name}: image differs by {r['max_abs_diff']}"
        scale = max(1.0, r["transformer_scale"])
        assert r["transformer_max_abs_diff"] <= r["tol"] * scale, (
            f"{name}: transformer output differs by {r['transformer_max_abs_diff']} (scale {scale})")
        if r.get("restore_exact") is not None:
            assert r["restore_exact"], f"{name}: restore() did not bring back the plain output"
    # non-zero ranks return the same images as rank 0
    assert len({r["checksum"] for r in results}) == 1, f"{name}: ranks returned different images"
    knobs = name.split("-")[0]
    if knobs.split("+")[0] in ("ulysses", "ring", "usp") or "sp2" in knobs or "ring2" in knobs or "ulysses2" in knobs:
        assert all(r["sp_attention_calls"] > 0 for r in results), f"{name}: no sequence-parallel attention ran"
    if "cfg" in knobs:
        assert all(r["counters"].get("cfg_parallel.split_steps", 0) > 0 for r in results), f"{name}: CFG not split"


@pytest.mark.parametrize("name", CASES_2)
def test_two_ranks(two, name):
    _check(two, name)


@pytest.mark.parametrize("name", CASES_4)
def test_four_ranks(four, name):
    _check(four, name)


@pytest.mark.parametrize("name", CACHE_CASES_2)
def test_cache_with_parallelism(two, name):
    """sp / ring / cfg_parallel / tp with a cache: output equal to the same cache in one process (<= 1e-4, fp32),
    the same per-step decisions on every rank and as in one process, and report()["cache"] per branch right."""
    results = [next(r for r in d["results"] if r["name"] == name) for d in two]
    for r in results:
        assert r["status"] == "ran", f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
        assert r["max_abs_diff"] <= r["tol"], f"{name}: image differs from the same cache alone by {r['max_abs_diff']}"
        scale = max(1.0, r["transformer_scale"])
        assert r["transformer_max_abs_diff"] <= r["tol"] * scale, f"{name}: {r['transformer_max_abs_diff']}"
        if r.get("restore_exact") is not None:
            assert r["restore_exact"], f"{name}: restore() + the same cache did not give the reference again"
    assert len({r["checksum"] for r in results}) == 1, f"{name}: ranks returned different images"
    if "ulysses" in name or "ring" in name:
        assert all(r["sp_attention_calls"] > 0 for r in results), f"{name}: no sequence-parallel attention ran"
    if "-tp-" in name:  # cache-dit: its own decisions; the block forwards must match one process on every rank
        ref = results[0]["reference_cache"]["block_forwards"]
        assert ref < 12, f"{name}: the cache skipped no block ({ref} of 12)"  # 2 blocks x 6 steps
        assert [r["cache"]["block_forwards"] for r in results] == [ref] * len(results)
        return
    for rank, r in enumerate(results):
        ref, got = r["reference_cache"]["branches"], r["cache"]["branches"]
        assert ref.keys() == got.keys()
        assert sum(b["reused"] for t in ref.values() for b in t.values()) > 0, f"{name}: nothing reused"
        for tname, branches in ref.items():
            assert got[tname].keys() == branches.keys()
            for label, want in branches.items():
                have = got[tname][label]
                if "-cfg-" in name:  # each CFG rank runs one branch; the other only in the unsplit first step
                    assert r["cache"]["rank_branch"] == ("cond", "uncond")[rank]
                    if label == r["cache"]["rank_branch"]:
                        assert have["steps"] == want["steps"], (rank, label, have, want)
                        assert (have["computed"], have["reused"]) == (want["computed"], want["reused"])
                    else:
                        assert have["steps"] == "C" + "-" * (len(want["steps"]) - 1), (rank, label, have)
                        assert have["other_rank"] == len(want["steps"]) - 1
                else:  # sp: every rank takes every decision, the same as one process
                    assert have == want, (rank, label, have, want)
                    assert r["cache"]["decision_ranks"] == [0, 1]


ERRORS = ["degrees-vs-world", "degrees-vs-world-product", "cfg-without-true-cfg", "ulysses-vs-heads", "tp-vs-heads",
          "cfg-call-without-negative", "cfg-after-refusal", "cache-dit-with-sp"]


@pytest.mark.parametrize("name", ERRORS)
def test_bad_input_raises_on_every_rank(two, name):
    for d in two:
        e = next(e for e in d["errors"] if e["name"] == name)
        assert e["raised"], f"rank {d['rank']}: {name} did not raise AccelError: {e['message']}"


def test_compared_with_diffusers_context_parallelism(two):
    """Ours matches the plain pipeline in every case; diffusers' enable_parallelism outcome is recorded (it needs a
    GPU as shipped, and sequence lengths divisible by the degree) -- see docs/parallelism.md."""
    rows = two[0]["diffusers"]
    assert rows, "the comparison did not run"
    for row in rows:
        assert row["ours_max_abs_diff"] <= 1e-4, row
        print(row)
    even = next(r for r in rows if r["case"].startswith("even"))
    if "diffusers_max_abs_diff" in even:
        assert even["diffusers_max_abs_diff"] <= 1e-4, even


FAILING = """
import os, sys, time, torch
sys.path.insert(0, {root!r})
import omni_accel
from omni_accel.testing import tiny_pipeline, run
pipe, kw = tiny_pipeline("flux")
omni_accel.accelerate(pipe, sp=2)
run(pipe, kw)  # one good call on both ranks
if int(os.environ["RANK"]) == 1:
    open({stamp!r}, "w").write(repr(time.time()))
    raise RuntimeError("rank 1 fails on purpose")
run(pipe, kw)  # rank 0 waits in a collective for a rank that is gone
"""


def test_failing_rank_ends_the_whole_job_quickly(tmp_path):
    script = tmp_path / "fail.py"
    stamp = tmp_path / "failed_at"
    script.write_text(FAILING.format(root=str(ROOT), stamp=str(stamp)))
    env = dict(_env(), OMNI_ACCEL_PG_TIMEOUT="20")
    proc = subprocess.run(TORCHRUN + ["--nproc_per_node=2", str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    ended = time.time()
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stdout + proc.stderr
    elapsed = ended - float(stamp.read_text())
    print(f"the job ended {elapsed:.1f} s after rank 1 failed")
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after a rank failed"


def test_cli_generate_under_torchrun(tmp_path):
    """`torchrun --nproc_per_node=2 -m omni_accel generate ... --sp 2`: accelerate() initialises the process group."""
    pytest.importorskip("omni_accel.cli")
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("flux")
    pipe.save_pretrained(tmp_path / "tiny_flux")
    out = tmp_path / "out.png"
    cmd = TORCHRUN + ["--nproc_per_node=2", "-m", "omni_accel", "generate", "a red fox", "--model",
                      str(tmp_path / "tiny_flux"), "--steps", "2", "--height", "32", "--width", "48", "--sp", "2",
                      "-o", str(out), "--report", "none"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert out.exists()
