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
    "a small green star on a white background",  # size given, position left out
    "a purple square in the bottom on a yellow background",  # size left out
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
    # What the shipped model does (docs/builtin_model.md; 100 held-out captions: background 100 %, shape
    # color 98 %, position 99 %, size 93 %, shape 69 %). Here all six are right on background, color and
    # position on this machine; one miss of color / position is allowed for other CPUs' float rounding.
    # The shape class (69 %) is not asserted.
    assert all(s["bg_color"] for s in scores), scores
    assert sum(s["color"] for s in scores) >= len(CAPTIONS) - 1, scores
    with_pos = [s["position"] for s in scores if "position" in s]
    assert len(with_pos) == 5 and sum(with_pos) >= len(with_pos) - 1, scores
    for im, c in zip(out, CAPTIONS):
        assert M.analyze(im)["area"] > 0.003, f"no shape drawn for {c!r}"


def test_one_image_at_the_defaults_takes_under_five_seconds(pipe):
    """The issue's budget: one image in at most 5 s on 2 CPU cores (measured ~0.5 s on an idle machine). The faster
    of two runs, so a passing burst of load on the CI host does not decide it."""
    import time

    pipe(CAPTIONS[0], **{**BUILTIN_DEFAULTS, "num_inference_steps": 2})  # first call: one-off set-up costs
    seconds = []
    for seed in (0, 1):
        start = time.perf_counter()
        pipe(CAPTIONS[0], generator=torch.Generator().manual_seed(seed), **BUILTIN_DEFAULTS)
        seconds.append(time.perf_counter() - start)
    assert min(seconds) <= 5.0, f"{seconds} s on {torch.get_num_threads()} threads"


def test_a_plain_diffusers_load_gets_one_dtype_and_the_trained_size_is_named():
    """DiffusionPipeline.from_pretrained(path) without torch_dtype loaded the text encoders in fp16 and the
    transformer in fp32 ('mat1 and mat2 must have the same dtype'); FluxPipeline's 1024x1024 default cannot be
    changed from the folder, so its model card names the trained size."""
    from diffusers import DiffusionPipeline

    plain = DiffusionPipeline.from_pretrained(builtin_model_path())
    dtypes = {name: next(m.parameters()).dtype for name, m in plain.components.items()
              if isinstance(m, torch.nn.Module)}
    assert set(dtypes.values()) == {torch.float32}, dtypes
    image = plain(CAPTIONS[0], height=64, width=64, num_inference_steps=1, max_sequence_length=32).images[0]
    assert image.size == (64, 64)
    with open(os.path.join(builtin_model_path(), "README.md")) as fh:
        assert "**It was trained at 128x128 only.**" in fh.read()


def test_load_builtin_renders_the_trained_size_by_default_and_takes_torch_dtype():
    pipe = load_builtin(torch_dtype=torch.float32)  # the diffusers spelling of dtype=
    image = pipe(CAPTIONS[0], num_inference_steps=1, max_sequence_length=32).images[0]
    assert image.size == (128, 128)  # FluxPipeline's own default: 1024x1024, minutes, noise
    with pytest.raises(AccelError) as info:
        load_builtin(dtype=torch.float32, torch_dtype=torch.float16)
    assert str(info.value) == ("load_builtin got dtype=torch.float32 and torch_dtype=torch.float16; give one of "
                               "them.")


def test_call_defaults_and_the_off_size_warning_belong_to_the_builtin_model_only(caplog):
    """One place owns the built-in model's call defaults (every command reads call_defaults); a call at another
    size than the trained one is said, once."""
    import logging

    from diffusers import DiffusionPipeline

    import omni_accel
    from omni_accel.builtin import call_defaults, off_trained_size
    from omni_accel.testing import tiny_pipeline

    pipe = DiffusionPipeline.from_pretrained(builtin_model_path())  # --model omni_accel/builtin/model
    assert call_defaults(pipe) == BUILTIN_DEFAULTS and call_defaults(tiny_pipeline("flux")[0]) == {}
    assert off_trained_size(pipe, 128, 128) is None
    assert off_trained_size(tiny_pipeline("flux")[0], 64, 64) is None
    omni_accel.accelerate(pipe)
    try:
        with caplog.at_level(logging.WARNING, logger="omni_accel"):
            for _ in range(2):
                pipe(CAPTIONS[0], height=64, width=64, num_inference_steps=1, max_sequence_length=32)
    finally:
        omni_accel.restore(pipe)
    assert [r.getMessage() for r in caplog.records if "trained" in r.getMessage()] == [
        "omni_accel: the built-in model was trained at 128x128 only; at 64x64 it draws noise and grids. Call it "
        "with height=128, width=128 (omni_accel.builtin.BUILTIN_DEFAULTS)."]


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


def test_render_alpha_is_the_shape_coverage():
    p = ds.sample_params(3, torch.Generator().manual_seed(1), exclude_heldout=False)
    img, alpha = ds.render(p, 64, return_alpha=True)
    assert torch.equal(img, ds.render(p, 64))
    assert alpha.shape == (3, 1, 64, 64) and 0.002 < float(alpha.mean()) < 0.2
    pal = torch.tensor([ds.COLORS[c] for c in ds.COLOR_NAMES], dtype=torch.float32)
    fg = ((pal[p["color"]] + p["cj"].float()).clamp(0, 255) / 255)[..., None, None]
    bg = ((pal[p["bg"]] + p["bj"].float()).clamp(0, 255) / 255)[..., None, None]
    assert torch.allclose(img, bg * (1 - alpha) + fg * alpha, atol=1e-6)


def test_shipped_vae_keeps_the_shape_color(pipe):
    # The first model's VAE decoded shapes as blobs of the wrong color (reconstructions scored 14 % shape
    # color), which capped the whole model; the shipped VAE must reconstruct dataset images faithfully.
    from omni_accel.builtin.train import shape_weight

    p = ds.sample_params(12, torch.Generator().manual_seed(11), exclude_heldout=False, p_omit_size=0, p_omit_position=0)
    x, alpha = ds.render(p, 128, return_alpha=True)
    w = shape_weight(alpha, 20.0)
    assert float(w.min()) == 1.0 and float(w.max()) == 21.0 and bool((w[alpha > 0] == 21.0).all())
    vae = pipe.vae
    with torch.no_grad():
        rec = vae.decode(vae.encode(x * 2 - 1).latent_dist.mode()).sample
    imgs = ds.to_uint8((rec + 1) / 2)
    scores = [M.score(im, c) for im, c in zip(imgs, ds.captions_of(p))]
    assert all(s["color"] and s["bg_color"] and s["position"] for s in scores), scores
