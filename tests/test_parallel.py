"""Parallelism for real: torchrun --nproc_per_node=2|4 on CPU with gloo, tiny pipelines of every family.

Each launch runs tests/parallel_worker.py, which computes the single-process reference on every rank before
accelerate, then the parallel output, and writes per-rank JSON; the tests here assert per case. Launches are few
and batched (torchrun start + imports cost ~10 s each): one of 2 ranks, one of 4, one of 8 (cfg x ulysses x tp in
one mesh), plus the example, the CLI and the failure tests. Set OMNI_ACCEL_SKIP_PARALLEL=1 to skip.
"""

from __future__ import annotations

import json
import os
import socket
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


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return _launch("eight", 8, tmp_path_factory.mktemp("par8"), timeout=300)


CASES_2 = [
    *(f"ulysses-{f}" for f in ("flux", "flux2", "qwen_image", "qwen_image_edit", "z_image", "sd3", "wan", "wan_i2v",
                              "wan22", "flux_kontext")),
    *(f"ulysses-{f}-odd" for f in ("flux", "flux2", "qwen_image", "z_image", "sd3", "wan", "flux_kontext")),
    *(f"ring-{f}-odd" for f in ("flux", "flux2", "qwen_image", "z_image", "sd3", "wan")),
    *(f"cfg-{f}" for f in ("qwen_image", "qwen_image_edit", "wan", "wan22")),
    *(f"tp-{f}" for f in ("flux", "flux2", "qwen_image", "wan", "wan_i2v", "sd3", "sd3_5", "z_image")),
    *(f"vae-{f}-odd" for f in ("flux", "z_image", "sd3", "flux2")),
    "vae-flux-5rows",
    "vae-flux-attention",
    "ulysses+vae-flux-odd",
    "ulysses-flux-compile",
    "ulysses-flux-odd-lora-after",  # LoRA loaded after accelerate(sp=2): restore, load, accelerate on every rank
    "cfg-qwen_image-lora-before",
    "cfg-sd3-odd",  # batched CFG: the doubled batch split over the CFG ranks
    "cfg-z_image-odd",
]
CACHE_CASES_2 = [
    *(f"cache-tea-ulysses-{f}-odd" for f in ("flux", "qwen_image", "wan", "z_image")),
    "cache-tea-ring-sd3-odd",
    *(f"cache-tea-cfg-{f}" for f in ("qwen_image", "wan", "sd3")),
    "cache-dit-tp-flux",
    "cache-fb-tp-flux",
]
CASES_4 = ["usp-flux-odd", "sp2xcfg2-qwen_image-odd", "tp2xring2-flux", "vae4-flux", "tp2xulysses2-flux-odd",
           "tp4-flux", "ulysses4-flux-odd", "ring4-flux-odd", "ulysses4-sd3-odd", "ring4-qwen_image-odd",
           "usp-qwen_image-odd", "usp-wan-odd", "cfg2xring2-wan-odd", "sp2xcfg2-sd3-odd", "vae4-flux-6rows",
           "cfg2xring2-qwen_image-odd-compile"]
CACHE_CASES_4 = ["cache-tea-sp2xcfg2-qwen_image-odd"]
CASES_8 = ["cfg2xulysses2xtp2-qwen_image-odd"]
CACHE_CASES_8 = ["cache-tea-cfg2xulysses2xtp2-qwen_image-odd"]
BATCHED_CFG = ["cfg-sd3-odd", "cfg-z_image-odd"]


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
    _check_modes_ran(results, name)


def _check_modes_ran(results: list[dict], name: str) -> None:
    """The knobs of the case really split the work (a pass that silently did nothing would match the reference)."""
    knobs = results[0].get("knobs", {})
    if max(knobs.get("sp") or 1, knobs.get("ulysses") or 1, knobs.get("ring") or 1) > 1:
        assert all(r["sp_attention_calls"] > 0 for r in results), f"{name}: no sequence-parallel attention ran"
    if (knobs.get("cfg_parallel") or 1) > 1:
        assert all(r["counters"].get("cfg_parallel.split_steps", 0) > 0 for r in results), f"{name}: CFG not split"
    if knobs.get("compile"):
        assert all("compile" in r["applied"] for r in results), f"{name}: compile was not applied"


@pytest.mark.parametrize("name", CASES_2)
def test_two_ranks(two, name):
    _check(two, name)


@pytest.mark.parametrize("name", CASES_4)
def test_four_ranks(four, name):
    _check(four, name)


@pytest.mark.parametrize("name", CASES_8)
def test_eight_ranks(eight, name):
    _check(eight, name)


def test_vae_parallel_uneven_bands(two):
    """5 latent rows on 2 ranks: the decoders saw bands of 3 and 2 rows (and the decode matched, in _check)."""
    _check(two, "vae-flux-5rows")
    bands = [next(r for r in d["results"] if r["name"] == "vae-flux-5rows")["band_rows"] for d in two]
    assert bands == [[3], [2]], bands


@pytest.mark.parametrize("name", BATCHED_CFG)
def test_batched_cfg_splits_every_step(two, name):
    """Batched CFG needs no unsplit first step: every forward of the call is split by batch."""
    for d in two:
        r = next(r for r in d["results"] if r["name"] == name)
        assert r["counters"].get("cfg_parallel.split_steps") == 3, r["counters"]  # 3 steps, one forward each
        assert r["counters"].get("cfg_parallel.unsplit_forwards", 0) == 0, r["counters"]


@pytest.mark.parametrize("name", CACHE_CASES_2)
def test_cache_with_parallelism(two, name):
    """sp / ring / cfg_parallel / tp with a cache: output equal to the same cache in one process (<= 1e-4, fp32),
    the same per-step decisions on every rank and as in one process, and report()["cache"] per branch right."""
    _check_cache(two, name)


@pytest.mark.parametrize("name", CACHE_CASES_4)
def test_cache_with_parallelism_four_ranks(four, name):
    _check_cache(four, name)


@pytest.mark.parametrize("name", CACHE_CASES_8)
def test_cache_with_parallelism_eight_ranks(eight, name):
    _check_cache(eight, name)


def _check_cache(per_rank: list[dict], name: str) -> None:
    results = [next(r for r in d["results"] if r["name"] == name) for d in per_rank]
    n = len(results)
    for r in results:
        assert r["status"] == "ran", f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
        assert r["max_abs_diff"] <= r["tol"], f"{name}: image differs from the same cache alone by {r['max_abs_diff']}"
        scale = max(1.0, r["transformer_scale"])
        assert r["transformer_max_abs_diff"] <= r["tol"] * scale, f"{name}: {r['transformer_max_abs_diff']}"
        if r.get("restore_exact") is not None:
            assert r["restore_exact"], f"{name}: restore() + the same cache did not give the reference again"
    assert len({r["checksum"] for r in results}) == 1, f"{name}: ranks returned different images"
    _check_modes_ran(results, name)
    knobs = results[0]["knobs"]
    if "-tp-" in name:  # cache-dit: its own decisions; the block forwards must match one process on every rank
        ref = results[0]["reference_cache"]["block_forwards"]
        assert ref < 12, f"{name}: the cache skipped no block ({ref} of 12)"  # 2 blocks x 6 steps
        assert [r["cache"]["block_forwards"] for r in results] == [ref] * len(results)
        return
    cfg = knobs.get("cfg_parallel") or 1
    two_forwards = any("uncond" in t for t in results[0]["reference_cache"]["branches"].values())  # true CFG
    for rank, r in enumerate(results):
        ref, got = r["reference_cache"]["branches"], r["cache"]["branches"]
        assert ref.keys() == got.keys()
        assert sum(b["reused"] for t in ref.values() for b in t.values()) > 0, f"{name}: nothing reused"
        cfg_rank = rank // (n // cfg)  # cfg is the slowest mesh coordinate
        for tname, branches in ref.items():
            assert got[tname].keys() == branches.keys()
            for label, want in branches.items():
                have = got[tname][label]
                if cfg > 1 and two_forwards:  # each CFG rank runs one branch; the other only in the unsplit first step
                    assert r["cache"]["rank_branch"] == ("cond", "uncond")[cfg_rank]
                    if label == r["cache"]["rank_branch"]:
                        assert have["steps"] == want["steps"], (rank, label, have, want)
                        assert (have["computed"], have["reused"]) == (want["computed"], want["reused"])
                    else:
                        assert have["steps"] == "C" + "-" * (len(want["steps"]) - 1), (rank, label, have)
                        assert have["other_rank"] == len(want["steps"]) - 1
                else:  # sp, or batched CFG (one forward holds both halves): every decision as in one process
                    assert have == want, (rank, label, have, want)
        # the ranks that take the same decisions: this CFG branch's ranks; all of them under batched CFG
        per_branch = n // cfg if two_forwards else n
        first = rank // per_branch * per_branch
        assert r["cache"]["decision_ranks"] == list(range(first, first + per_branch)), r["cache"]


ERRORS = {  # name -> a piece of the message that names the bad value or the fix
    "degrees-vs-world": "do not match the world size 2",
    "degrees-vs-world-product": "= 4 do not match the world size 2",
    "cfg-without-true-cfg": "is guidance-distilled",
    "ulysses-vs-heads": "ulysses=2 does not divide the 1 attention heads",
    "tp-vs-heads": "tp=2 does not divide the 1 attention heads",
    "cfg-call-without-negative": "has no negative_prompt",
    "cfg-after-refusal": "",  # not an error: the call after a refused one runs (message = its output shape)
    "cache-dit-with-sp": "cache='cache_dit' with sp=2",
    "cfg-batched-call-without-cfg-sd3": "guidance_scale=1.0 must be > 1.0",
    "cfg-batched-call-without-cfg-z_image": "guidance_scale=0.0 must be > 0.0",
    "vae-parallel-wan": "video VAEs are not supported",
    "vae-parallel-qwen_image": "video VAEs are not supported",
}


@pytest.mark.parametrize("name", ERRORS)
def test_bad_input_raises_on_every_rank(two, name):
    for d in two:
        e = next(e for e in d["errors"] if e["name"] == name)
        assert e["raised"], f"rank {d['rank']}: {name} did not raise AccelError: {e['message']}"
        assert ERRORS[name] in e["message"], f"rank {d['rank']}: {name}: unexpected message {e['message']!r}"


def test_compared_with_diffusers_context_parallelism(two):
    """Ours matches the plain pipeline in every case; diffusers' enable_parallelism outcome is recorded (it needs a
    GPU as shipped, and sequence lengths divisible by the degree). The rows docs/parallelism.md cites
    (benchmarks/results/parallel_vs_diffusers_cpu.json, written by benchmarks/parallel_vs_diffusers_cpu.py) must
    list the same cases and, for the same diffusers version, the same diffusers outcome as this run."""
    from importlib.metadata import version

    rows = two[0]["diffusers"]
    assert rows, "the comparison did not run"
    for row in rows:
        assert row["ours_max_abs_diff"] <= 1e-4, row
        print(row)
    even = next(r for r in rows if r["case"].startswith("even"))
    if "diffusers_max_abs_diff" in even:
        assert even["diffusers_max_abs_diff"] <= 1e-4, even
    recorded = json.loads((ROOT / "benchmarks" / "results" / "parallel_vs_diffusers_cpu.json").read_text())
    assert [r["case"] for r in recorded["rows"]] == [r["case"] for r in rows]
    assert all(r["ours_max_abs_diff"] <= 1e-4 for r in recorded["rows"]), recorded["rows"]
    if recorded["diffusers"] == version("diffusers"):
        outcome = lambda r: ("diffusers_max_abs_diff" in r, "diffusers_error" in r)  # noqa: E731
        assert [outcome(r) for r in recorded["rows"]] == [outcome(r) for r in rows], "stale results file"


FAILING = """
import os, sys, time
sys.path.insert(0, ROOT)
import omni_accel
from omni_accel.testing import tiny_pipeline, run

rank = int(os.environ["RANK"])
log = LOG.format(rank=rank)
pipe, kw = tiny_pipeline("flux")
omni_accel.accelerate(pipe, sp=2)
run(pipe, kw)  # one good call on both ranks
if rank == 1:
    open(log, "w").write(f"failed {time.time()!r} on purpose")
    raise RuntimeError("rank 1 fails on purpose")
try:
    run(pipe, kw)  # rank 0 is inside a collective with a rank that is gone
except Exception as exc:
    open(log, "w").write(f"error {time.time()!r} {type(exc).__name__}: {exc}")
    raise
open(log, "w").write(f"finished {time.time()!r}")
"""


def _failing_script(tmp_path: Path) -> tuple[Path, str]:
    script = tmp_path / "fail.py"
    log = str(tmp_path / "rank{rank}.log")
    script.write_text(FAILING.replace("ROOT", repr(str(ROOT))).replace("LOG", repr(log)))
    return script, log


def _logged(log: str, rank: int) -> tuple[str, float]:
    """(what rank ``rank`` logged: failed / error / finished, when)."""
    what, when, *_ = Path(log.format(rank=rank)).read_text().split(" ", 2)
    return what, float(when)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failing_rank_makes_every_rank_fail_quickly(tmp_path):
    """Rank 1 fails after one good sp=2 call. The two ranks run as plain processes with the torchrun variables --
    no torchrun agent, so nobody kills the survivor: rank 0's own collective must raise, rank 0 logs the error and
    exits non-zero, and both processes are gone within 30 s of the failure (no hang)."""
    script, log = _failing_script(tmp_path)
    base = dict(_env(), OMNI_ACCEL_PG_TIMEOUT="20", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ended = time.time()
    assert [p.returncode != 0 for p in procs] == [True, True], outputs[0][-3000:]
    assert "rank 1 fails on purpose" in outputs[1]
    failed, failed_at = _logged(log, 1)
    what, errored_at = _logged(log, 0)
    assert failed == "failed"
    assert what == "error", f"rank 0 logged {what!r}, not its own error:\n{outputs[0][-3000:]}"
    print(f"rank 0 raised {errored_at - failed_at:.1f} s and both ranks were gone {ended - failed_at:.1f} s after "
          f"rank 1 failed: {Path(log.format(rank=0)).read_text()[:160]}")
    assert errored_at - failed_at < 30, f"rank 0 raised {errored_at - failed_at:.0f} s after rank 1 failed"
    assert ended - failed_at < 30, f"the ranks took {ended - failed_at:.0f} s to end after rank 1 failed"


def _pixels(path: Path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def _assert_same_image(parallel: Path, single: Path) -> None:
    """Equal up to one 8-bit level: the fp32 outputs differ by ~1e-6, which can flip a rounding to uint8."""
    a, b = _pixels(parallel), _pixels(single)
    assert a.shape == b.shape
    assert abs(a - b).max() <= 1, f"{parallel.name} differs from the single-process image by {abs(a - b).max()}"


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


EXAMPLE = str(ROOT / "examples" / "parallel_generate.py")
# the tiny Qwen-Image call with true CFG; the CLI on the saved tiny pipeline makes the same call (same prompt,
# negative prompt, scale, steps, 32x32, seed 0, default max_sequence_length)
QWEN_FLAGS = ["--negative-prompt", "blurry", "--true-cfg-scale", "4", "--steps", "3"]


@pytest.fixture(scope="module")
def qwen_single_image(tmp_path_factory) -> Path:
    """The reference: examples/parallel_generate.py --tiny qwen_image in one process (no torchrun, degrees 1)."""
    out = tmp_path_factory.mktemp("single") / "single.png"
    _run([sys.executable, EXAMPLE, "--tiny", "qwen_image", *QWEN_FLAGS, "-o", str(out)], timeout=200)
    return out


def test_example_sp2_cfg2_under_torchrun_4(tmp_path, qwen_single_image):
    """examples/parallel_generate.py --tiny qwen_image --sp 2 --cfg-parallel 2 on 4 ranks writes the image the same
    script writes in one process."""
    out = tmp_path / "parallel.png"
    proc = _run(TORCHRUN + ["--nproc_per_node=4", EXAMPLE, "--tiny", "qwen_image", *QWEN_FLAGS, "--sp", "2",
                            "--cfg-parallel", "2", "-o", str(out)], timeout=300)
    assert "'cfg_parallel.split_steps': 2" in proc.stdout, proc.stdout[-3000:]  # 3 steps, the first unsplit
    _assert_same_image(out, qwen_single_image)


def test_cli_generate_under_torchrun(tmp_path, qwen_single_image):
    """`torchrun --nproc_per_node=4 -m omni_accel generate ... --sp 2 --cfg-parallel 2` on the tiny Qwen-Image saved
    to disk: accelerate() initialises the process group, rank 0 writes the image, equal to the one-process image."""
    pytest.importorskip("omni_accel.cli")
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("qwen_image")
    pipe.save_pretrained(tmp_path / "tiny_qwen")
    out = tmp_path / "parallel.png"
    proc = _run(TORCHRUN + ["--nproc_per_node=4", "-m", "omni_accel", "generate", "a red fox in the snow", "--model",
                            str(tmp_path / "tiny_qwen"), "--height", "32", "--width", "32", *QWEN_FLAGS, "--sp", "2",
                            "--cfg-parallel", "2", "--report", "json", "-o", str(out)], timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"sequence_parallel", "cfg_parallel"} <= {p["pass"] for p in report["applied"]}, report["applied"]
    assert report["last_call"].get("cfg_parallel.split_steps") == 2, report["last_call"]
    _assert_same_image(out, qwen_single_image)


def test_cli_bench_under_torchrun(tmp_path):
    """`torchrun --nproc_per_node=2 -m omni_accel bench ... --cfg-parallel 2`: every rank runs both pipelines (the
    parallel one needs both in every call), rank 0 alone prints and writes; the CFG-split output equals the plain."""
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("qwen_image")
    pipe.save_pretrained(tmp_path / "tiny_qwen")
    out = tmp_path / "bench.json"
    proc = _run(TORCHRUN + ["--nproc_per_node=2", "-m", "omni_accel", "bench", "a red fox in the snow", "--model",
                            str(tmp_path / "tiny_qwen"), "--height", "32", "--width", "32", *QWEN_FLAGS,
                            "--cfg-parallel", "2", "--repeats", "2", "--json", "--out", str(out)], timeout=300)
    printed = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1, proc.stdout[-3000:]  # rank 0 only
    plain, parallel = json.loads(out.read_text())["rows"]
    assert plain["world_size"] == parallel["world_size"] == 2 and parallel["config"] == "cfg_parallel=2"
    assert "cfg_parallel" in parallel["applied"] and parallel["max_abs_diff_vs_plain"] <= 1e-4
