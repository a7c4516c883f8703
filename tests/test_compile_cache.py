"""save_compile_cache / load_compile_cache: a second machine's first call finds the first machine's compiles.

Two processes on two fresh inductor cache folders stand for the two machines: the first compiles the tiny FLUX
pipeline and saves, the second loads before it compiles."""

import json
import os
import subprocess
import sys

import pytest
import torch

import omni_accel
from omni_accel.errors import AccelError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(mode: str, path: str, cache_folder: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_folder, TRITON_CACHE_DIR=os.path.join(cache_folder, "triton"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "compile_cache_worker.py"), mode, path],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_saved_compile_cache_turns_the_next_machines_compiles_into_hits(tmp_path):
    path = str(tmp_path / "flux.compile-cache")
    saved = _worker("save", path, str(tmp_path / "machine_a"))
    assert saved["early_save_error"] == (
        f"save_compile_cache({path!r}): this process has compiled nothing yet. Call the pipeline once after "
        "accelerate(..., compile=True) (once per shape you serve), then save.")
    assert saved["bytes"] == os.path.getsize(path) > 0 and saved["fxgraph_cache_miss"] == 2
    loaded = _worker("load", path, str(tmp_path / "machine_b"))
    assert loaded["loaded"]["inductor"] == 2  # the two block kinds' graphs
    assert loaded["fxgraph_cache_hit"] == 2 and loaded["fxgraph_cache_miss"] == 0
    assert torch.equal(torch.load(f"{path}.load.pt"), torch.load(f"{path}.save.pt"))


def test_load_compile_cache_names_the_file_it_cannot_use(tmp_path):
    missing = str(tmp_path / "nothing-here")
    with pytest.raises(AccelError) as err:
        omni_accel.load_compile_cache(missing)
    assert str(err.value) == (f"load_compile_cache({missing!r}): cannot read it (No such file or directory). Give the "
                              "file that omni_accel.save_compile_cache() wrote.")
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a cache")
    with pytest.raises(AccelError) as err:
        omni_accel.load_compile_cache(str(junk))
    assert str(err.value) == (f"load_compile_cache({str(junk)!r}): not a compile cache torch {torch.__version__} can "
                              "read (its checksum or format does not match). Save it again with "
                              "omni_accel.save_compile_cache() on this torch version.")
