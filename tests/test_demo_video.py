"""The demo's video tab: the backend logic (clips as MP4, plain vs accelerated, PSNR) and the tab in real headless
Chromium, which must decode and play the H.264 files. The built-in video model when its weights are installed, else
a tiny random Wan.

Needs /usr/bin/chromium (Debian: apt-get install -y chromium) -- the browser test is skipped only when it is absent."""

from __future__ import annotations

import os

import pytest
from conftest import running_demo
from test_demo import CHROMIUM, CHROMIUM_ARGS, ROOT

PROMPT = "a red circle moving from left to right on a blue background"


def test_video_backend_writes_playable_clips_and_compares():
    from omni_accel.demo.app import DemoBackend, Settings
    from omni_accel.testing import tiny_pipeline
    from omni_accel.video_io import decode_mp4

    pipe, _ = tiny_pipeline("wan")
    backend = DemoBackend.from_pipeline(pipe, {"fps": 6, "guidance_scale": 1.0}, "cpu", (32, 32))
    assert backend.video and backend.default_frames == 81  # WanPipeline's own default when the model has none
    out = backend.generate(PROMPT, 32, 32, 3, 0, Settings(cache="tea_cache", cache_threshold=0.3), compare=True,
                           frames=5)
    assert out["error"] is None
    for key in ("video", "plain_video"):
        with open(out[key], "rb") as fh:
            frames, fps = decode_mp4(fh.read())
        assert frames.shape == (5, 32, 32, 3) and fps == 6
    assert len(out["image"]) == 5 and out["psnr"] > 0
    assert "Speed-up" in out["summary"] and "Transformer forwards:** " in out["summary"]
    assert "(plain: 3)" in out["summary"]  # guidance 1.0: one forward per step
    assert "**Saved by the cache:** " in out["summary"] and "transformer forwards reused" in out["summary"]
    bad = backend.generate(PROMPT, 30, 32, 3, 0, Settings())
    assert bad["error"] == "width and height must be multiples of 16 for this model." and bad["video"] is None


def test_missing_builtin_video_model_is_a_note_in_the_tab(monkeypatch, tmp_path):
    import argparse

    import omni_accel.builtin as builtin
    from omni_accel.demo.app import _video_backend

    monkeypatch.setattr(builtin, "builtin_video_model_path", lambda: str(tmp_path / "video_model"))
    args = argparse.Namespace(video_model="builtin", video_default_frames=None, default_steps=None,
                              video_default_size=None)
    backend, note = _video_backend(args, "cpu", None)
    assert backend is None and "No video model" in note and "omni_accel.builtin.train_video" in note
    backend, note = _video_backend(argparse.Namespace(**{**vars(args), "video_model": "none"}), "cpu", None)
    assert backend is None and "--video-model none" in note


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install -y chromium)")
def test_video_tab_in_headless_chromium(tmp_path):
    from playwright import sync_api as playwright

    from omni_accel.testing import tiny_pipeline

    builtin = os.path.join(ROOT, "omni_accel", "builtin", "video_model", "model_index.json")
    pipe, _ = tiny_pipeline("flux")
    pipe.save_pretrained(tmp_path / "tiny_flux")  # the image tab is not under test here: the tiniest model
    args = ["--model", str(tmp_path / "tiny_flux"), "--default-size", "32x32", "--default-steps", "4"]
    if not os.path.exists(builtin):
        wan, _ = tiny_pipeline("wan")
        wan.save_pretrained(tmp_path / "tiny_wan")
        args += ["--video-model", str(tmp_path / "tiny_wan"), "--video-default-size", "32x32",
                 "--video-default-frames", "5"]
    with running_demo(tmp_path, "--max-size", "256", *args) as url:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.get_by_role("tab", name="Video").click(timeout=60_000)
            page.locator("#video-prompt textarea").fill(PROMPT, timeout=30_000)
            page.locator("#video-compare input[type=checkbox]").check()
            page.locator("#video-cache input").click()  # a cache on the accelerated side
            page.get_by_role("option", name="tea_cache").click()
            page.locator("#video-generate").click()
            page.get_by_text("PSNR plain vs accelerated").wait_for(timeout=120_000)
            summary = page.locator("#video-summary").inner_text()
            assert "Plain:" in summary and "Speed-up:" in summary and "cache(tea_cache)" in summary
            for elem in ("#video-accelerated video", "#video-plain video"):
                video = page.locator(elem)
                video.wait_for(state="visible", timeout=30_000)
                # the browser decoded the H.264 stream: frame size and duration known, first frame ready
                page.wait_for_function("e => e.readyState >= 2 && e.videoWidth > 0", arg=video.element_handle(),
                                       timeout=30_000)
                assert video.evaluate("e => e.duration") > 0
            if os.path.exists(builtin):  # real moving shapes: a screenshot worth keeping
                page.screenshot(path=os.path.join(ROOT, "docs", "demo_video.png"), full_page=True)
            browser.close()
