"""Caching tuned for video: the published Wan 2.1 TeaCache polynomials chosen by the transformer's config, and
cache="mag_cache" (diffusers' MagCache, calibrated on the first call) on the families diffusers supports, refused
with the reason elsewhere. Tiny random pipelines: mechanics, not quality (benchmarks/bench_video_cache.py measures
quality on the built-in video model)."""

import types

import pytest
import torch

import omni_accel
from omni_accel import AccelError
from omni_accel.cache.tea_cache import published_for
from omni_accel.pipelines import adapter_for
from omni_accel.pipelines.wan import WAN21_TEACACHE
from omni_accel.testing import run, tiny_pipeline

# diffusers' configs of the four Wan 2.1 checkpoints (scripts/convert_wan_to_diffusers.py), the keys that matter
T2V_1_3B = dict(num_layers=30, num_attention_heads=12, attention_head_dim=128, in_channels=16, image_dim=None)
T2V_14B = dict(num_layers=40, num_attention_heads=40, attention_head_dim=128, in_channels=16, image_dim=None)
I2V_14B = dict(num_layers=40, num_attention_heads=40, attention_head_dim=128, in_channels=36, image_dim=1280)


def _pipe_with(config: dict, name: str = "", experts: int = 1):
    """A stand-in pipeline holding transformers with this config (published_for reads configs and names only)."""
    transformer = types.SimpleNamespace(config={**config, "_name_or_path": name})
    pipe = types.SimpleNamespace(config=types.SimpleNamespace(_name_or_path=name), transformer=transformer,
                                 transformer_2=transformer if experts == 2 else None)
    return pipe


@pytest.mark.parametrize("config, name, model", [
    (T2V_1_3B, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan2.1-T2V-1.3B"),
    (T2V_14B, "/models/wan14b", "Wan2.1-T2V-14B"),
    (I2V_14B, "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "Wan2.1-I2V-14B-480P"),
    (I2V_14B, "/ckpt/Wan2.1-I2V-14B-720P-Diffusers", "Wan2.1-I2V-14B-720P"),
])
def test_published_wan_polynomial_follows_the_config(config, name, model):
    from omni_accel.pipelines.wan import ADAPTER

    assert published_for(ADAPTER, _pipe_with(config, name)).model == model


def test_published_wan_polynomial_is_not_guessed_for_other_models(caplog):
    from omni_accel.pipelines.wan import ADAPTER

    assert published_for(ADAPTER, _pipe_with(T2V_14B, experts=2)) is None  # Wan 2.2 A14B: same config, 2 experts
    assert published_for(ADAPTER, _pipe_with({**T2V_1_3B, "num_layers": 8})) is None
    with caplog.at_level("WARNING"):  # I2V without 480P / 720P in its name: the first, with a warning naming both
        assert published_for(ADAPTER, _pipe_with(I2V_14B, "/ckpt/my_i2v")).model == "Wan2.1-I2V-14B-480P"
    assert "Wan2.1-I2V-14B-480P, Wan2.1-I2V-14B-720P" in caplog.text


def test_published_numbers_are_the_sources():
    """TeaCache4Wan2.1 (use_ret_steps) and DiffSynth-Studio's wan_video TeaCache give these, highest power first."""
    table = {p.model: (p.coefficients[0], p.coefficients[-1], p.threshold, p.warmup_steps, p.final_steps)
             for p in WAN21_TEACACHE}
    assert table == {
        "Wan2.1-T2V-1.3B": (-5.21862437e04, -4.99875664e-02, 0.05, 5, 0),
        "Wan2.1-T2V-14B": (-3.03318725e05, -3.15583525e-01, 0.10, 5, 0),
        "Wan2.1-I2V-14B-480P": (2.57151496e05, 1.32517977e-01, 0.20, 5, 0),
        "Wan2.1-I2V-14B-720P": (8.10705460e03, -4.17769401e-02, 0.20, 5, 0),
    }


def test_tea_cache_applies_the_published_settings_on_a_matching_wan():
    """A tiny Wan whose config claims the 1.3B T2V architecture: the 1.3B polynomial, threshold 0.05, 5 warm-up
    steps, no final steps -- unless cache_config says otherwise."""
    pipe, kwargs = tiny_pipeline("wan")
    pipe.transformer.register_to_config(**T2V_1_3B)
    kwargs = dict(kwargs, num_inference_steps=7)
    omni_accel.accelerate(pipe, cache="tea_cache")
    try:
        run(pipe, kwargs)
        applied = [p for p in pipe.omni_accel.report()["applied"] if p["pass"] == "cache"][0]
        steps = pipe.omni_accel.report()["cache"]["branches"]["transformer"]["cond"]["steps"]
    finally:
        omni_accel.restore(pipe)
    assert applied["coefficients_source"] == "published (Wan2.1-T2V-1.3B)"
    assert applied["threshold"] == 0.05 and applied["warmup_steps"] == 5 and applied["final_steps"] == 0
    assert steps.startswith("CCCCC") and len(steps) == 7
    omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"threshold": 0.3, "warmup_steps": 1})
    try:
        applied = [p for p in pipe.omni_accel.report()["applied"] if p["pass"] == "cache"][0]
    finally:
        omni_accel.restore(pipe)
    assert (applied["threshold"], applied["warmup_steps"], applied["final_steps"]) == (0.3, 1, 0)


# ---------------------------------------------------------------------------------------------- mag_cache
MAG_FAMILIES = {"wan": {}, "wan_i2v": {}, "flux": {}, "flux2": {"num_layers": 2, "num_single_layers": 2},
                "qwen_image": {}}


@pytest.mark.parametrize("family", sorted(MAG_FAMILIES))
def test_mag_cache_calibrates_on_the_first_call_then_skips(family):
    pipe, kwargs = tiny_pipeline(family, **MAG_FAMILIES[family])
    kwargs = dict(kwargs, num_inference_steps=6)
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, cache="mag_cache", cache_config={"threshold": 10.0, "max_skip_steps": 5})
    try:
        calibrated = run(pipe, kwargs)  # diffusers' calibration: nothing skipped
        first = pipe.omni_accel.report()
        cached = run(pipe, kwargs)
        second = pipe.omni_accel.report()
    finally:
        omni_accel.restore(pipe)
    assert torch.equal(calibrated, plain)
    ratios = second["cache"]["mag_ratios"]
    assert len(ratios) == 6 and ratios[0] == 1.0 and second["cache"]["calibrated_from_steps"] == 6
    assert second["cache"]["block_forwards"] < first["cache"]["block_forwards"]
    assert torch.isfinite(cached).all() and not torch.equal(cached, plain)
    assert torch.equal(run(pipe, kwargs), plain)  # restore is exact


def test_mag_cache_given_ratios_follow_each_calls_step_count(capsys):
    pipe, kwargs = tiny_pipeline("wan")
    blocks = len(pipe.transformer.blocks)
    # ratio 2 = a 100 % error per step, above threshold 0: every step computed, whatever the call's step count
    # (diffusers interpolates the given ratios to it; a wrong count would break its step bookkeeping)
    omni_accel.accelerate(pipe, cache="mag_cache", cache_config={"mag_ratios": [2.0] * 4, "threshold": 0})
    try:
        for steps in (4, 7, 3):
            plain_forwards = steps * 2  # CFG: cond + uncond per step
            run(pipe, dict(kwargs, num_inference_steps=steps))
            assert pipe.omni_accel.report()["cache"]["block_forwards"] == plain_forwards * blocks
        assert pipe.transformer.is_cache_enabled
    finally:
        omni_accel.restore(pipe)
    assert not pipe.transformer.is_cache_enabled
    assert "MagCache" not in capsys.readouterr().out


@pytest.mark.parametrize("family, overrides, kwargs, message", [
    ("sd3", {}, {}, "not available for family 'sd3': SD3Transformer2DModel has no diffusers cache support"),
    ("z_image", {"n_layers": 2}, {}, "not available for family 'z_image': ZImageTransformer2DModel has no diffusers"),
    ("wan22", {}, {}, "with 2 transformers (transformer, transformer_2) is not supported"),
    ("wan", {}, {"cache_config": {"threshold": -1}}, "cache_config threshold=-1 must be a number >= 0."),
    ("wan", {}, {"cache_config": {"max_skip_steps": 0}}, "cache_config max_skip_steps=0 must be an integer >= 1."),
    ("wan", {}, {"cache_config": {"mag_ratios": "1,1"}}, "cache_config mag_ratios='1,1' must be a list of numbers"),
    ("wan", {}, {"cache_config": {"rel_l1": 0.1}}, "cache_config key(s) 'rel_l1' not known to cache='mag_cache'"),
    ("wan", {}, {"compile": True}, "cache='mag_cache' with compile=True is not supported together yet"),
])
def test_mag_cache_refusals_name_the_reason_and_patch_nothing(family, overrides, kwargs, message):
    pipe, _ = tiny_pipeline(family, **overrides)
    with pytest.raises(AccelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        omni_accel.accelerate(pipe, cache="mag_cache", **kwargs)
    assert not hasattr(pipe, "omni_accel")
    assert all(not getattr(t, "is_cache_enabled", False) for _, t in adapter_for(pipe).transformers_of(pipe))


def test_video_cache_benchmark_runs_on_a_tiny_wan(tmp_path):
    """benchmarks/bench_video_cache.py end to end on a tiny random Wan: one row per cache at its defaults, each with
    block forwards below plain and per-frame PSNR / SSIM against the plain clip."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_video_cache.py")
    spec = importlib.util.spec_from_file_location("bench_video_cache", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench_video_cache.json"
    bench.main(["--tiny", "--prompts", "1", "--steps", "6", "--out", str(out)])
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "tea_cache", "mag_cache", "cache_dit"]
    plain = rows.pop("plain")["block_forwards"]
    assert plain == 6 * 2 * 4  # steps x CFG branches x blocks
    for method, row in rows.items():
        assert 0 < row["block_forwards"] < plain, method
        assert len(row["psnr_per_frame"]) == 1 and len(row["psnr_per_frame"][0]) == 5  # 1 clip x 5 frames
        assert row["psnr_worst_frame"] <= row["psnr_mean"] and 0 < row["ssim_worst_frame"] <= 1
