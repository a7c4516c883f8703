"""omni-accel demo: the Gradio app in real headless Chromium (Playwright): type a prompt, generate, see the image;
side-by-side mode shows both images and the PSNR. Saves the screenshot to docs/demo.png.

Needs /usr/bin/chromium (Debian: apt-get install -y chromium) -- skipped only when it is absent."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import running_demo

CHROMIUM = "/usr/bin/chromium"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_backend_shows_accel_errors_and_computes_psnr():
    """The logic under the UI, without a browser: an unavailable option is a message, not a crash."""
    from omni_accel.demo.app import DemoBackend, Settings, psnr
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline("flux")
    backend = DemoBackend.from_pipeline(pipe, {"max_sequence_length": 11}, "cpu", (48, 32))
    out = backend.generate("a fox", 48, 32, 2, 0, Settings(attention="sdpa"), compare=True)
    assert out["error"] is None and out["image"].size == (48, 32) and out["plain_image"].size == (48, 32)
    assert out["psnr"] > 30  # the sdpa backend matches the plain pipeline closely
    assert out["report"]["last_call"]["transformer_forwards"] == 2 and "PSNR" in out["summary"]
    assert pipe.omni_accel.call_kwargs["max_sequence_length"] == 11  # the model's call defaults reach the call
    bad = backend.generate("a fox", 48, 32, 2, 0, Settings(attention="no-such-backend"))
    assert bad["error"] and "no-such-backend" in bad["error"] and bad["image"] is None
    assert "Error" in bad["summary"]
    cached = backend.generate("a fox", 48, 32, 2, 0, Settings(cache="tea_cache", cache_threshold=0.3))
    assert cached["error"] or cached["image"] is not None  # NotAvailableYet until caching lands: a message
    again = backend.generate("a fox", 48, 32, 2, 0, Settings())
    assert again["error"] is None and again["image"] is not None  # still works after the errors
    assert psnr(again["image"], again["image"]) == float("inf")


def test_the_summary_shows_what_the_cache_saved():
    """TeaCache reuses whole forwards that still count as forwards: the page said "saved: 0" while the report said
    4 reused. The saving comes from the cache's own counters (cache-dit's in blocks)."""
    from omni_accel.demo.app import DemoBackend, Settings, cache_savings
    from omni_accel.testing import tiny_pipeline

    backend = DemoBackend.from_pipeline(tiny_pipeline("flux")[0], {}, "cpu", (48, 32))
    out = backend.generate("a fox", 48, 32, 6, 0, Settings(cache="tea_cache", cache_threshold=1.0))
    last = out["report"]["last_call"]
    assert last["transformer_forwards"] == 6 and last["cache.reused"] > 0
    assert (f"**Saved by the cache:** {last['cache.reused']} of 6 transformer forwards reused, "
            f"{last['cache.computed']} computed") in out["summary"]
    assert "**Transformer forwards:** 6 (plain: 6)" in out["summary"]
    assert cache_savings({"cache.block_forwards": 8}, 12) == "4 of 12 block forwards skipped, 8 computed"
    assert cache_savings({"transformer_forwards": 6}, 12) is None  # no cache: nothing claimed


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install -y chromium)")
def test_demo_in_headless_chromium(tmp_path):
    import httpx
    from playwright import sync_api as playwright  # pip install playwright (its browser download is not needed)

    from omni_accel.testing import tiny_pipeline

    builtin = os.path.join(ROOT, "omni_accel", "builtin", "model", "model_index.json")
    if os.path.exists(builtin):  # the built-in model draws real shapes: a meaningful screenshot
        model_args = ["--default-size", "128x128", "--default-steps", "8"]
    else:
        pipe, _ = tiny_pipeline("flux")
        pipe.save_pretrained(tmp_path / "tiny_flux")
        model_args = ["--model", str(tmp_path / "tiny_flux"), "--default-size", "96x64", "--default-steps", "4"]
    with running_demo(tmp_path, "--max-size", "256", "--video-model", "none", *model_args) as url:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.locator("#prompt textarea").fill("a large red star in the center on a blue background",
                                                timeout=60_000)
            page.locator("#generate").click()
            page.locator("#accelerated-image img").wait_for(state="visible", timeout=90_000)
            assert "Accelerated:" in page.locator("#summary").inner_text()

            page.locator("#compare input[type=checkbox]").check()
            page.locator("#generate").click()
            page.locator("#plain-image img").wait_for(state="visible", timeout=90_000)
            page.get_by_text("PSNR plain vs accelerated").wait_for(timeout=90_000)
            summary = page.locator("#summary").inner_text()
            assert "Plain:" in summary and "Transformer forwards" in summary
            os.makedirs(os.path.join(ROOT, "docs"), exist_ok=True)
            page.screenshot(path=os.path.join(ROOT, "docs", "demo.png"), full_page=True)
            browser.close()


def test_a_cache_backend_without_its_extra_is_a_message_in_the_page(monkeypatch):
    from omni_accel.demo.app import DemoBackend, Settings
    from omni_accel.testing import tiny_pipeline

    monkeypatch.setitem(sys.modules, "cache_dit", None)  # as without the cache extra
    backend = DemoBackend.from_pipeline(tiny_pipeline("flux")[0], {}, "cpu", (48, 32))
    out = backend.generate("a fox", 48, 32, 2, 0, Settings(cache="cache_dit"))
    assert out["error"] == ("cache='cache_dit' needs the 'cache_dit' package, which is not installed: pip install "
                            "'omni-accel[cache]'; or use cache='tea_cache', which is built in.")
    assert out["summary"].startswith("**Error:** cache='cache_dit' needs")
