"""The built-in model: it loads, generates at the default settings, and its errors are clear."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from omni_accel.builtin import BUILTIN_DEFAULTS, builtin_model_path, load_builtin
from omni_accel.builtin import dataset as ds
from omni_accel.builtin import metric as M
from omni_accel.errors import AccelError

CAPTIONS = [
    "a large red circle in the top left on a blue background",
    "a large yellow square in the center on a black background",
    "a large white ring in the bottom right on a green background",
    "a large orange triangle in the right on a purple background",
]


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return load_builtin()


def test_shipped_model_folder_is_small_and_complete():
    path = builtin_model_path()
    assert os.path.isfile(os.path.join(path, "model_index.json"))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    assert total <= 30 * 2**20, f"model folder is {total / 2**20:.1f} MB"


def test_generates_default_settings_and_follows_captions(pipe):
    assert type(pipe).__name__ == "FluxPipeline"
    settings = dict(BUILTIN_DEFAULTS)
    if isinstance(settings.get("negative_prompt"), str):  # FluxPipeline wants one negative prompt per prompt
        settings["negative_prompt"] = [settings["negative_prompt"]] * len(CAPTIONS)
    out = pipe(CAPTIONS, generator=torch.Generator().manual_seed(0), **settings).images
    assert len(out) == len(CAPTIONS)
    assert out[0].size == (BUILTIN_DEFAULTS["width"], BUILTIN_DEFAULTS["height"])
    scores = [M.score(im, c) for im, c in zip(out, CAPTIONS)]
    # What the shipped (short-trained) model reliably does; see docs/builtin_model.md for the measured
    # adherence: the background color is right, a shape is drawn, mostly in the right cell. The shape's
    # color is not yet reliable, so it is not asserted here.
    assert all(s["bg_color"] for s in scores), scores
    assert sum(s["position"] for s in scores) >= 2, scores
    for im, c in zip(out, CAPTIONS):
        assert M.analyze(im)["area"] > 0.003, f"no shape drawn for {c!r}"


def test_missing_folder_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(AccelError, match="does not exist") as e:
        load_builtin(str(missing))
    assert str(missing) in str(e.value) and "--model" in str(e.value)


def _copy(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(builtin_model_path(), dst)
    return dst


def test_corrupt_model_index_is_a_clear_error(tmp_path):
    dst = _copy(tmp_path)
    (dst / "model_index.json").write_text("{not json")
    with pytest.raises(AccelError, match="corrupt") as e:
        load_builtin(str(dst))
    assert str(dst) in str(e.value) and "re-install" in str(e.value)


def test_corrupt_weights_are_a_clear_error(tmp_path):
    dst = _copy(tmp_path)
    (dst / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(AccelError, match="corrupt") as e:
        load_builtin(str(dst))
    assert "transformer" in str(e.value) and str(dst) in str(e.value)


def test_error_is_a_value_error():
    assert issubclass(AccelError, ValueError)


def test_metric_agrees_with_dataset():
    d = ds.CaptionedShapes(seed=5, length=30, exclude_heldout=False)
    for i in range(len(d)):
        img, cap = d[i]
        s = M.score(img, cap)
        assert all(s.values()), (cap, s)


def test_dataset_is_seeded_and_follows_caption_grammar():
    a, b = ds.CaptionedShapes(seed=3, length=5), ds.CaptionedShapes(seed=3, length=5)
    for i in range(5):
        (ia, ca), (ib, cb) = a[i], b[i]
        assert ca == cb and np.array_equal(np.asarray(ia), np.asarray(ib))
        p = ds.parse_caption(ca)
        assert p["color"] != p["bg"]
        assert (p["color"], p["shape"], p["bg"]) not in ds.HELDOUT_TRIPLES
    with pytest.raises(ValueError, match="caption"):
        ds.parse_caption("a dog on a sofa")


def test_metric_accepts_arrays():
    img, cap = ds.CaptionedShapes(seed=9, length=1)[0]
    arr = np.asarray(img)
    assert M.score(arr, cap) == M.score(img, cap) == M.score(arr.astype(np.float32) / 255, cap)
