"""Step caches (issue #4) on every family's tiny pipeline: tea_cache, cache_dit and fb_cache.

Random weights have no smooth trajectory, so these tests check mechanics, not quality: block forwards counted,
reuse happens with a permissive threshold, threshold 0 is bit-identical to plain, CFG branches keep separate
state, state resets per call, restore is exact, bad cache_config keys are refused. Quality is measured on the
built-in trained model by benchmarks/bench_cache.py.
"""

import inspect
import json
import logging
import sys

import pytest
import torch

import omni_accel
from omni_accel import AccelError
from omni_accel.testing import run, tiny_pipeline

STEPS = 5
# families and the transformer overrides giving every cached block list >= 2 blocks (cache-dit always computes
# the first Fn=1 block of each list, so a 1-block list has nothing to skip)
FAMILIES = {
    "flux": {},
    "flux2": {"num_layers": 2, "num_single_layers": 2},
    "qwen_image": {},
    "wan": {},
    "wan22": {},
    "sd3": {},
    "z_image": {"n_layers": 2},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pipe(request):
    pipe, kwargs = tiny_pipeline(request.param, **FAMILIES[request.param])
    kwargs = dict(kwargs, num_inference_steps=STEPS)
    return request.param, pipe, kwargs, run(pipe, kwargs)


def _cached_run(pipe, kwargs, cache, cache_config):
    omni_accel.accelerate(pipe, cache=cache, cache_config=cache_config)
    try:
        out = run(pipe, kwargs)
        report = pipe.omni_accel.report()
    finally:
        omni_accel.restore(pipe)
    return out, report


def _transformers(pipe):
    from omni_accel.pipelines import adapter_for

    return adapter_for(pipe).transformers_of(pipe)


def _region_blocks(pipe):
    """Blocks per transformer forward inside TeaCache's regions (the same for both Wan 2.2 experts)."""
    from omni_accel.pipelines import adapter_for

    adapter = adapter_for(pipe)
    counts = {sum(len(getattr(t, r.block_list)) for r in adapter.teacache.regions)
              for _, t in adapter.transformers_of(pipe)}
    assert len(counts) == 1
    return counts.pop()


def test_tea_cache_every_family(family_pipe):
    family, pipe, kwargs, plain = family_pipe
    # threshold 0: every step computed, output bit-identical to plain
    out, rep = _cached_run(pipe, kwargs, "tea_cache", {"threshold": 0.0})
    call = rep["last_call"]
    assert torch.equal(out, plain), family
    assert call.get("cache.reused", 0) == 0
    assert call["cache.computed"] == call["transformer_forwards"]
    applied = [p for p in rep["applied"] if p["pass"] == "cache"][0]
    assert applied["backend"] == "tea_cache"
    # permissive threshold: reuse happens, fewer block forwards, first and last steps computed
    out, rep = _cached_run(pipe, kwargs, "tea_cache", {"threshold": 1e6})
    call = rep["last_call"]
    assert call["cache.reused"] > 0, family
    assert call["cache.computed"] + call["cache.reused"] == call["transformer_forwards"]
    per_forward = _region_blocks(pipe)
    assert call["cache.block_forwards"] == call["cache.computed"] * per_forward  # reused steps run no block
    assert not torch.equal(out, plain)
    assert torch.isfinite(out).all()
    # restore is exact
    assert torch.equal(run(pipe, kwargs), plain)


def test_cache_dit_and_fb_cache_every_family(family_pipe):
    family, pipe, kwargs, plain = family_pipe
    out, rep = _cached_run(pipe, kwargs, "cache_dit", {"residual_diff_threshold": 0.0})
    assert torch.equal(out, plain), family
    full_blocks = rep["last_call"]["cache.block_forwards"]
    assert full_blocks > 0
    out, rep = _cached_run(pipe, kwargs, "fb_cache", {"residual_diff_threshold": 1e6, "max_warmup_steps": 1})
    applied = [p for p in rep["applied"] if p["pass"] == "cache"][0]
    assert applied["Fn_compute_blocks"] == 1 and applied["Bn_compute_blocks"] == 0
    assert rep["last_call"]["cache.block_forwards"] < full_blocks, family
    assert torch.isfinite(out).all()
    order = [list(t._modules) for _, t in _transformers(pipe)]
    pipe_class = type(pipe)
    out, rep = _cached_run(pipe, kwargs, "cache_dit", {})  # defaults valid for the tiny block counts
    assert torch.isfinite(out).all()
    assert torch.equal(run(pipe, kwargs), plain)  # disable_cache + class swap-back: bit-identical
    assert type(pipe) is pipe_class and not hasattr(pipe_class, "_original_call")
    # cache-dit re-inserts mocked block lists at the end of _modules; undo puts the order back (diffusers'
    # FirstBlockCache picks head / tail blocks by named_children order)
    assert [list(t._modules) for _, t in _transformers(pipe)] == order


def test_true_cfg_branches_keep_separate_state():
    pipe, kwargs = tiny_pipeline("qwen_image")
    kwargs = dict(kwargs, num_inference_steps=STEPS)
    omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"threshold": 1e6})
    try:
        run(pipe, kwargs)
        call = pipe.omni_accel.last_call.as_dict()
        tc = pipe.omni_accel.cache_controller.caches["transformer"]
        assert set(tc.states) == {0, 1}  # cond and uncond forwards of each step
        for b in (0, 1):
            # each branch: its own first step computed, last step computed, the middle reused
            assert call[f"cache.computed.transformer.branch{b}"] == 2
            assert call[f"cache.reused.transformer.branch{b}"] == STEPS - 2
        s0, s1 = tc.states[0], tc.states[1]
        assert s0.prev is not s1.prev and not torch.equal(s0.residuals[0]["hidden_states"],
                                                          s1.residuals[0]["hidden_states"])
        # without true CFG (scale 1): one forward per step, one state
        run(pipe, dict(kwargs, true_cfg_scale=1.0))
        assert set(tc.states) == {0}
    finally:
        omni_accel.restore(pipe)


def test_wan22_experts_keep_their_own_state_and_report():
    """Wan 2.2 hands the steps over from the high-noise to the low-noise transformer at its boundary: the second
    expert's first step must be computed (never the first expert's residual reused), and the report lists both."""
    pipe, kwargs = tiny_pipeline("wan22")
    omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"threshold": 1e6})
    try:
        run(pipe, dict(kwargs, num_inference_steps=8))
        report = pipe.omni_accel.report()["cache"]
        caches = pipe.omni_accel.cache_controller.caches
    finally:
        omni_accel.restore(pipe)
    assert caches["transformer"] is not caches["transformer_2"]
    experts = report["branches"]
    high, low = experts["transformer"]["cond"]["steps"], experts["transformer_2"]["cond"]["steps"]
    handover = len(high)
    assert 0 < handover < 8 and low[:handover] == "-" * handover, (high, low)
    assert high[0] == "C" and low[handover] == "C" and low[-1] == "C", (high, low)
    assert "R" in high and "R" in low


def test_state_resets_between_calls_and_steps_change():
    pipe, kwargs = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"threshold": 1e6, "warmup_steps": 1,
                                                                   "final_steps": 1})
    try:
        for steps in (4, 7, 3):
            run(pipe, dict(kwargs, num_inference_steps=steps))
            call = pipe.omni_accel.last_call.as_dict()
            assert call["transformer_forwards"] == steps
            assert call["cache.computed"] == 2, steps  # first and the (new) last step only
            assert call.get("cache.reused", 0) == steps - 2
        # warm-up / final configurable
    finally:
        omni_accel.restore(pipe)
    omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"threshold": 1e6, "warmup_steps": 2,
                                                                   "final_steps": 2})
    try:
        run(pipe, dict(kwargs, num_inference_steps=7))
        assert pipe.omni_accel.last_call.as_dict()["cache.computed"] == 4
    finally:
        omni_accel.restore(pipe)


@pytest.mark.parametrize("cache, bad, valid", [
    ("tea_cache", "thresh", "threshold"),
    ("cache_dit", "Fn_blocks", "Fn_compute_blocks"),
    ("fb_cache", "taylor", "taylorseer"),
])
def test_bad_cache_config_key_names_it_and_lists_valid(cache, bad, valid):
    pipe, kwargs = tiny_pipeline("flux")
    with pytest.raises(AccelError) as err:
        omni_accel.accelerate(pipe, cache=cache, cache_config={bad: 1})
    msg = str(err.value)
    assert repr(bad) in msg and valid in msg and "Valid keys" in msg
    assert "omni_accel" not in vars(pipe)


def test_bad_values_refused_before_patching():
    pipe, _ = tiny_pipeline("flux")
    cases = [
        ("tea_cache", {"threshold": -1}, "threshold"),
        ("tea_cache", {"warmup_steps": "2"}, "warmup_steps"),
        ("tea_cache", {"profile": "/nonexistent/profile.json"}, "profile"),
        ("cache_dit", {"Fn_compute_blocks": 5}, "exceeds"),  # tiny flux: 2 blocks in the unified list
        ("cache_dit", {"scm": "fastest"}, "scm"),
    ]
    for cache, cc, word in cases:
        with pytest.raises(AccelError, match=word):
            omni_accel.accelerate(pipe, cache=cache, cache_config=cc)
        assert "omni_accel" not in vars(pipe)
    with pytest.raises(AccelError, match="not supported together yet"):
        omni_accel.accelerate(pipe, cache="cache_dit", compile=True)
    assert "omni_accel" not in vars(pipe)


def test_tea_cache_with_compile_equal_and_no_recompiles():
    """compile=True + tea_cache: the blocks' own forwards are compiled under the cache hooks, so computed and
    reused steps run the same graphs (one per block type), with no graph break and no recompile; the output and
    every decision equal tea_cache alone."""
    from torch._dynamo.utils import counters

    pipe, kwargs = tiny_pipeline("flux")  # 1 dual-stream + 1 single-stream block: 2 block types
    kwargs = dict(kwargs, num_inference_steps=6)
    tea = dict(cache="tea_cache", cache_config={"threshold": 0.3})
    alone, report = _cached_run(pipe, kwargs, **tea)
    torch._dynamo.reset()
    counters.clear()
    omni_accel.accelerate(pipe, compile=True, **tea)
    try:
        first = run(pipe, kwargs)
        compiled = pipe.omni_accel.report()["cache"]
        graphs = counters["stats"]["unique_graphs"]
        second = run(pipe, kwargs)
        assert counters["stats"]["unique_graphs"] == graphs, "the second call recompiled"
    finally:
        omni_accel.restore(pipe)
    steps = report["cache"]["branches"]["transformer"]["all"]["steps"]
    assert "R" in steps and "C" in steps[1:-1], steps  # reused and computed steps after the first
    assert compiled["branches"] == report["cache"]["branches"]
    assert graphs == 2, f"{graphs} graphs for 2 block types: a step recompiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert (first - alone).abs().max().item() <= 1e-4
    assert torch.equal(first, second)
    assert torch.equal(_cached_run(pipe, kwargs, **tea)[0], alone)  # restore() left tea_cache alone exact


def test_cache_dit_defaults_clamped_to_block_counts():
    pipe, kwargs = tiny_pipeline("qwen_image")  # 2 blocks: Fn=1 Bn=0 fits; Fn=8 would fail in cache-dit
    omni_accel.accelerate(pipe, cache="cache_dit", cache_config={"Bn_compute_blocks": 1, "Fn_compute_blocks": 1})
    try:
        applied = [p for p in pipe.omni_accel.report()["applied"] if p["pass"] == "cache"][0]
        assert (applied["Fn_compute_blocks"], applied["Bn_compute_blocks"]) == (1, 1)
    finally:
        omni_accel.restore(pipe)


def test_profile_and_calibrate(tmp_path, caplog):
    pipe, kwargs = tiny_pipeline("flux")
    kw = {k: v for k, v in kwargs.items() if k not in ("prompt", "output_type", "num_inference_steps")}
    profile = omni_accel.cache.calibrate(pipe, ["a cat"], target_psnr=25.0, steps=8, call_kwargs=kw,
                                         batch_size=1, max_evals=3, output=str(tmp_path / "p.json"))
    for key in ("family", "coefficients", "threshold", "target_psnr", "measured_psnr", "steps"):
        assert key in profile
    assert len(profile["coefficients"]) == 5 and profile["family"] == "flux"
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["threshold"] == profile["threshold"]
    omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"profile": str(tmp_path / "p.json")})
    try:
        applied = [p for p in pipe.omni_accel.report()["applied"] if p["pass"] == "cache"][0]
        assert applied["coefficients_source"] == "profile"
        assert applied["threshold"] == pytest.approx(profile["threshold"])
        with caplog.at_level(logging.WARNING, logger="omni_accel"):
            run(pipe, kwargs)  # 2 steps on a profile calibrated at 8: said once, not silently
            run(pipe, kwargs)
            run(pipe, dict(kwargs, num_inference_steps=8))
    finally:
        omni_accel.restore(pipe)
    assert [r.getMessage() for r in caplog.records if "calibrated at" in r.getMessage()] == [
        f"omni_accel: tea_cache profile {str(tmp_path / 'p.json')!r} was calibrated at 8 steps and this call runs 2: "
        "its quality (min PSNR 25.0 dB) was measured at 8 steps only. Call with num_inference_steps=8, or calibrate "
        "at 2 (omni-accel calibrate --steps 2)."]
    with pytest.raises(AccelError, match="family"):
        bad = dict(saved, family="wan")
        omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"profile": bad})


def test_cli_parser():
    from omni_accel.cache.calibrate import calibrate
    from omni_accel.cli import build_parser

    args = build_parser().parse_args(["calibrate", "--model", "/x", "--target-psnr", "28", "-o", "p.json"])
    assert args.target_psnr == 28.0 and args.output == "p.json" and args.model == "/x"
    args = build_parser().parse_args(["calibrate", "-o", "p.json"])  # the built-in model, like every command
    assert args.model is None
    # one default criterion for the command and the function (the docs once said both ways)
    assert args.criterion == inspect.signature(calibrate).parameters["criterion"].default == "min"


@pytest.mark.parametrize("backend", ["cache_dit", "fb_cache"])
def test_cache_dit_backends_without_the_cache_extra_name_it(monkeypatch, backend):
    pipe, _ = tiny_pipeline("flux")
    monkeypatch.setitem(sys.modules, "cache_dit", None)  # `import cache_dit` now fails, as without the extra
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe, cache=backend)
    assert str(info.value) == (f"cache={backend!r} needs the 'cache_dit' package, which is not installed: pip install "
                               "'omni-accel[cache]'; or use cache='tea_cache', which is built in.")
    assert "omni_accel" not in vars(pipe)
