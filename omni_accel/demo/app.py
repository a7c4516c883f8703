"""The Gradio demo: prompt, size, steps, seed and the acceleration toggles; the image, its time and the report;
a side-by-side mode that runs the plain pipeline and the accelerated one and shows both images, both times and the
PSNR between them. Any AccelError (a cache backend that is not available yet, a compile mode the machine cannot do)
is shown in the page instead of failing the event."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..cli import COMPILE_CHOICES

logger = logging.getLogger("omni_accel.demo")

CACHE_CHOICES = ("none", "tea_cache", "cache_dit", "fb_cache")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import DTYPES

    p.add_argument("--model", default=os.environ.get("OMNI_ACCEL_MODEL"),
                   help="local diffusers pipeline folder (env OMNI_ACCEL_MODEL); default: the built-in model")
    p.add_argument("--dtype", choices=DTYPES, default=os.environ.get("OMNI_ACCEL_DTYPE"), help="weights dtype")
    p.add_argument("--device", default=os.environ.get("OMNI_ACCEL_DEVICE"), help="cpu or cuda[:N]")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--max-steps", type=int, default=50, help="largest steps on the slider (default 50)")
    p.add_argument("--max-size", type=int, default=1024, help="largest side on the size sliders (default 1024)")
    p.add_argument("--default-size", default=None, metavar="WxH", help="initial size (default: native)")
    p.add_argument("--default-steps", type=int, default=None, help="initial steps (default: the model's)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up call (without it the first plain run pays for lazy initialisation)")


def psnr(a, b) -> float:
    """PSNR in dB between two images of the same size (inf when identical)."""
    import numpy as np

    x = np.asarray(a.convert("RGB"), dtype=np.float64)
    y = np.asarray(b.convert("RGB"), dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"images differ in size: {x.shape} vs {y.shape}")
    mse = float(np.mean((x - y) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


@dataclass(frozen=True)
class Settings:
    attention: str = "auto"
    compile: str = "off"
    cache: str = "none"
    cache_threshold: float = 0.0

    def accelerate_kwargs(self, device: str) -> dict:
        kw: dict[str, Any] = {"attention": self.attention, "compile": self.compile, "device": device}
        if self.cache != "none":
            kw["cache"] = self.cache
            if self.cache_threshold > 0:
                kw["cache_config"] = {"threshold": float(self.cache_threshold)}
        return kw


class DemoBackend:
    """Owns the pipeline; switches between plain and accelerated (restore / accelerate) as the UI asks."""

    def __init__(self, pipe, defaults: dict, device: str, native_size: tuple[int, int], size_multiple: int):
        self.pipe = pipe
        self.defaults = dict(defaults)
        self.device = device
        self.native_size = native_size
        self.size_multiple = size_multiple
        self.current: Settings | None = None  # None = plain (not accelerated)
        self._lock = threading.Lock()

    @classmethod
    def from_pipeline(cls, pipe, defaults: dict | None = None, device: str = "cpu",
                      native_size: tuple[int, int] | None = None) -> "DemoBackend":
        from ..serve.engine import LoadedModel

        info = LoadedModel.from_pipeline(pipe, "demo", defaults, native_size)
        return cls(pipe, info.defaults, device, info.native_size, info.size_multiple)

    def _set(self, settings: Settings | None) -> None:
        import omni_accel

        if settings == self.current:
            return
        if self.current is not None:
            omni_accel.restore(self.pipe)
            self.current = None
        if settings is not None:
            omni_accel.accelerate(self.pipe, **settings.accelerate_kwargs(self.device))  # AccelError -> caller
            self.current = settings

    def _call(self, prompt: str, width: int, height: int, steps: int, seed: int):
        import inspect

        import torch

        from ..cli import _to_pil_list

        klass = getattr(type(self.pipe), "_omni_accel_original_class", type(self.pipe))
        accepted = inspect.signature(klass.__call__).parameters
        kwargs = {"prompt": prompt, "height": int(height), "width": int(width), "num_inference_steps": int(steps),
                  "generator": torch.Generator("cpu").manual_seed(int(seed)), "output_type": "pil"}
        for key, value in self.defaults.items():
            if key not in kwargs and key in accepted and key not in ("height", "width", "num_inference_steps"):
                kwargs[key] = value
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        scale = kwargs.get("true_cfg_scale")
        self.branches = 2 if scale is not None and scale > 1 and kwargs.get("negative_prompt") is not None else 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.pipe(**kwargs)
        return _to_pil_list(out.images[:1])[0], time.perf_counter() - t0

    def generate(self, prompt: str, width: int, height: int, steps: int, seed: int, settings: Settings,
                 compare: bool = False) -> dict:
        """{"image", "seconds", "report", "plain_image", "plain_seconds", "psnr", "error", "summary"}."""
        from ..errors import AccelError

        out: dict[str, Any] = {"image": None, "seconds": None, "report": None, "plain_image": None,
                               "plain_seconds": None, "psnr": None, "error": None}
        prompt = (prompt or "").strip()
        m = self.size_multiple
        if not prompt:
            out["error"] = "Type a prompt first."
        elif int(width) % m or int(height) % m:
            out["error"] = f"width and height must be multiples of {m} for this model."
        if out["error"]:
            out["summary"] = f"**Error:** {out['error']}"
            return out
        with self._lock:
            try:
                if compare:
                    self._set(None)
                    out["plain_image"], out["plain_seconds"] = self._call(prompt, width, height, steps, seed)
                self._set(settings)
                out["image"], out["seconds"] = self._call(prompt, width, height, steps, seed)
                out["report"] = self.pipe.omni_accel.report()
            except AccelError as exc:
                out["error"] = str(exc)
            except Exception as exc:  # noqa: BLE001 -- show it, keep the demo alive
                logger.exception("omni_accel.demo: generation failed")
                out["error"] = f"{exc.__class__.__name__}: {exc}"
        if out["image"] is not None and out["plain_image"] is not None:
            out["psnr"] = psnr(out["plain_image"], out["image"])
        out["summary"] = self.summary(out, steps, getattr(self, "branches", 1), self._blocks_per_forward())
        return out

    def _blocks_per_forward(self) -> int:
        """Transformer blocks one forward runs (cache-dit counts what it saved in blocks)."""
        from ..pipelines import adapter_for

        adapter = adapter_for(self.pipe)
        return max((len(adapter.blocks_of(t)) for _, t in adapter.transformers_of(self.pipe)), default=0)

    @staticmethod
    def summary(out: dict, steps: int, branches: int = 1, blocks_per_forward: int = 0) -> str:
        lines = []
        if out.get("error"):
            lines.append(f"**Error:** {out['error']}")
        if out.get("seconds") is not None:
            lines.append(f"**Accelerated:** {out['seconds']:.2f} s")
        if out.get("plain_seconds") is not None:
            lines.append(f"**Plain:** {out['plain_seconds']:.2f} s")
            if out.get("seconds"):
                lines.append(f"**Speed-up:** {out['plain_seconds'] / out['seconds']:.2f}x")
        if out.get("psnr") is not None:
            lines.append(f"**PSNR plain vs accelerated:** {out['psnr']:.2f} dB")
        last = (out.get("report") or {}).get("last_call") or {}
        if last:
            full = int(steps) * branches  # what the plain pipeline runs (x2 with true CFG)
            lines.append(f"**Transformer forwards:** {last.get('transformer_forwards')} (plain: {full})")
            saved = cache_savings(last, full * blocks_per_forward)
            if saved:
                lines.append(f"**Saved by the cache:** {saved}")
            passes = [p["pass"] + (f"({p['backend']})" if "backend" in p else "")
                      for p in out["report"].get("applied", [])]
            lines.append("**Applied:** " + (", ".join(dict.fromkeys(passes)) or "nothing"))
        return "  \n".join(lines) or "Nothing yet."


def cache_savings(last_call: dict, plain_blocks: int) -> str | None:
    """What the step cache saved in the last call, from its own counters: TeaCache reuses whole transformer
    forwards (each still counts as a forward: the hook decides inside it); cache-dit skips blocks inside them."""
    if "cache.reused" in last_call:
        reused, computed = last_call["cache.reused"], last_call.get("cache.computed", 0)
        return f"{reused} of {reused + computed} transformer forwards reused, {computed} computed"
    if "cache.block_forwards" in last_call and plain_blocks:
        ran = last_call["cache.block_forwards"]
        return f"{max(0, plain_blocks - ran)} of {plain_blocks} block forwards skipped, {ran} computed"
    return None


def build_demo(backend: DemoBackend, *, max_steps: int = 50, max_size: int = 1024):
    """The gr.Blocks of the demo (not launched)."""
    import gradio as gr

    from ..kernels.attention import available_backends

    try:
        attention = ["auto"] + [b for b in available_backends(backend.device.split(":")[0]) if b != "auto"]
    except Exception:  # noqa: BLE001
        attention = ["auto"]
    m = backend.size_multiple
    w0, h0 = backend.native_size
    steps0 = int(backend.defaults.get("num_inference_steps") or 4)
    top = max(max_size, w0, h0)
    with gr.Blocks(title="omni_accel demo", analytics_enabled=False) as demo:
        gr.Markdown("## omni_accel demo\nGenerate with an accelerated pipeline; tick *side by side* to compare "
                    "with the plain pipeline (same seed).")
        with gr.Row():
            with gr.Column(scale=1):
                prompt = gr.Textbox(label="Prompt", lines=2, elem_id="prompt",
                                    placeholder="a red circle on a blue background")
                with gr.Row():
                    width = gr.Slider(m, top, value=w0, step=m, label="Width", elem_id="width")
                    height = gr.Slider(m, top, value=h0, step=m, label="Height", elem_id="height")
                steps = gr.Slider(1, max(max_steps, steps0), value=steps0, step=1, label="Steps", elem_id="steps")
                seed = gr.Number(value=0, precision=0, label="Seed", elem_id="seed")
                with gr.Accordion("Acceleration", open=True):
                    attn = gr.Dropdown(attention, value="auto", label="Attention backend", elem_id="attention")
                    comp = gr.Radio(list(COMPILE_CHOICES), value="off", label="torch.compile", elem_id="compile")
                    cache = gr.Dropdown(list(CACHE_CHOICES), value="none", label="Step cache", elem_id="cache")
                    thr = gr.Slider(0.0, 1.0, value=0.0, step=0.01, label="Cache threshold (0 = backend default)",
                                    elem_id="threshold")
                compare = gr.Checkbox(value=False, label="Side by side: plain vs accelerated", elem_id="compare")
                button = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=2):
                summary = gr.Markdown("Nothing yet.", elem_id="summary")
                with gr.Row():
                    image = gr.Image(label="Accelerated", type="pil", elem_id="accelerated-image", format="png",
                                     height=320)
                    plain = gr.Image(label="Plain", type="pil", elem_id="plain-image", format="png", height=320)
                report = gr.JSON(label="pipe.omni_accel.report()", elem_id="report")

        def on_generate(p, w, h, s, sd, a, c, ca, t, cmp):
            out = backend.generate(p, int(w), int(h), int(s), int(sd or 0),
                                   Settings(attention=a, compile=c, cache=ca, cache_threshold=float(t)), bool(cmp))
            return out["summary"], out["image"], out["plain_image"], out["report"]

        button.click(on_generate, [prompt, width, height, steps, seed, attn, comp, cache, thr, compare],
                     [summary, image, plain, report], concurrency_limit=1)
    return demo


def theme():
    import gradio as gr

    # system fonts only: the default theme pulls Google Fonts, which an offline browser waits for
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


def run(args) -> int:
    from ..cli import CliError, _default_size, _load_pipeline_quietly, _resolve_device, _torch_dtype

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise CliError("omni-accel demo needs the demo extra: pip install 'omni-accel[demo]'")
    import torch

    device = _resolve_device(args.device)
    dtype = _torch_dtype(args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32"))
    args.offload = None
    native = _default_size(args)
    if args.default_steps is not None and args.default_steps < 1:
        raise CliError(f"--default-steps {args.default_steps} is invalid: it must be >= 1.")
    pipe, defaults, source = _load_pipeline_quietly(args, device, dtype)
    if args.default_steps is not None:
        defaults["num_inference_steps"] = args.default_steps
    backend = DemoBackend.from_pipeline(pipe, defaults, device, native)
    if not args.no_warmup:
        m = backend.size_multiple
        try:
            backend._call("warm-up", m * 2, m * 2, 1, 0)
        except Exception as exc:  # noqa: BLE001
            logger.warning("omni_accel.demo: warm-up failed: %r", exc)
    demo = build_demo(backend, max_steps=args.max_steps, max_size=args.max_size)
    print(f"omni-accel demo: {source} on http://{args.host}:{args.port}", flush=True)
    demo.queue(default_concurrency_limit=1).launch(server_name=args.host, server_port=args.port, share=False,
                                                   inbrowser=False, ssr_mode=False, theme=theme(), quiet=True,
                                                   footer_links=[])
    return 0
