"""The Gradio demo: prompt, size, steps, seed and the acceleration toggles; the image, its time and the report;
a side-by-side mode that runs the plain pipeline and the accelerated one and shows both images, both times and the
PSNR between them. A second tab does the same for video (the built-in video model by default, ``--video-model``):
both clips play in the page as H.264 MP4. Any AccelError (a cache backend that is not available yet, a compile mode
the machine cannot do) is shown in the page instead of failing the event."""

from __future__ import annotations

import argparse
import collections
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..cli import COMPILE_CHOICES

logger = logging.getLogger("omni_accel.demo")

CACHE_CHOICES = ("none", "tea_cache", "cache_dit", "fb_cache", "mag_cache")
KEEP_CLIPS = 16  # MP4 files a video tab keeps on disk for the page (older ones are deleted)


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
    p.add_argument("--video-model", default="builtin", metavar="PATH|builtin|none",
                   help="the video tab's pipeline: a local video pipeline folder (e.g. Wan), 'builtin' (default: the "
                        "built-in video model, when its weights are installed) or 'none'")
    p.add_argument("--video-default-size", default=None, metavar="WxH", help="initial video size (default: native)")
    p.add_argument("--video-default-frames", type=int, default=None, help="initial frame count (default: the model's)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up call (without it the first plain run pays for lazy initialisation)")


def psnr(a, b) -> float:
    """PSNR in dB between two images -- or two clips (lists of frames) -- of the same size (inf when identical)."""
    import numpy as np

    pixels = lambda m: np.stack([np.asarray(f.convert("RGB"), dtype=np.float64)  # noqa: E731
                                 for f in (m if isinstance(m, list) else [m])])
    x, y = pixels(a), pixels(b)
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
    """Owns one pipeline; switches between plain and accelerated (restore / accelerate) as the UI asks. A video
    pipeline (one whose call takes num_frames) returns clips, written as MP4 files for the page."""

    def __init__(self, pipe, defaults: dict, device: str, native_size: tuple[int, int], size_multiple: int,
                 fps: int | None = None):
        from ..cli import DEFAULT_FPS, call_parameters

        self.pipe = pipe
        self.defaults = dict(defaults)
        self.device = device
        self.native_size = native_size
        self.size_multiple = size_multiple
        self.accepted = call_parameters(pipe)
        self.video = "num_frames" in self.accepted
        self.fps = int(fps or self.defaults.get("fps") or DEFAULT_FPS)
        self.current: Settings | None = None  # None = plain (not accelerated)
        self._lock = threading.Lock()
        self._clips: collections.deque[str] = collections.deque()
        self._clip_dir: str | None = None

    @classmethod
    def from_pipeline(cls, pipe, defaults: dict | None = None, device: str = "cpu",
                      native_size: tuple[int, int] | None = None) -> "DemoBackend":
        from ..cli import call_parameters
        from ..serve.engine import LoadedModel

        defaults = dict(defaults or {})
        params = call_parameters(pipe)
        if native_size is None and "num_frames" in params and not defaults.get("width"):
            # a video pipeline without its own defaults: its call signature's size (Wan: 832 x 480)
            size = [params[k].default for k in ("width", "height") if k in params]
            if len(size) == 2 and all(isinstance(v, int) for v in size):
                native_size = (size[0], size[1])
        info = LoadedModel.from_pipeline(pipe, "demo", defaults, native_size)
        return cls(pipe, info.defaults, device, info.native_size, info.size_multiple)

    @property
    def default_frames(self) -> int:
        value = self.defaults.get("num_frames")
        if value is None and "num_frames" in self.accepted:
            value = self.accepted["num_frames"].default
        return int(value or 1)

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

    def _call(self, prompt: str, width: int, height: int, steps: int, seed: int, frames: int | None = None):
        """(an image, or a clip as a list of frames; seconds)."""
        import torch

        from ..cli import _to_pil_list

        kwargs = {"prompt": prompt, "height": int(height), "width": int(width), "num_inference_steps": int(steps),
                  "generator": torch.Generator("cpu").manual_seed(int(seed)), "output_type": "pil"}
        if self.video:
            kwargs["num_frames"] = int(frames or self.default_frames)
        for key, value in self.defaults.items():
            if key not in kwargs and key in self.accepted and key not in ("height", "width", "num_inference_steps"):
                kwargs[key] = value
        kwargs = {k: v for k, v in kwargs.items() if k in self.accepted}
        self.branches = self._branches(kwargs)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.pipe(**kwargs)
        seconds = time.perf_counter() - t0
        if self.video:
            return _to_pil_list(out.frames[0]), seconds
        return _to_pil_list(out.images[:1])[0], seconds

    def _branches(self, kwargs: dict) -> int:
        """Transformer forwards per step of the plain pipeline: 2 when the call runs true classifier-free guidance."""
        from ..pipelines import adapter_for

        adapter = adapter_for(self.pipe)
        arg = adapter.cfg_scale_arg
        scale = kwargs.get(arg, self.accepted[arg].default if arg in self.accepted else None) if arg else None
        negative = kwargs.get(adapter.negative_prompt_arg or "negative_prompt")
        needs_negative = adapter.extra.get("cfg_needs_negative", True)
        guided = isinstance(scale, (int, float)) and scale > adapter.extra.get("cfg_threshold", 1.0)
        return 2 if guided and (negative is not None or not needs_negative) and adapter.cfg != "batched_cfg" else 1

    def _clip_file(self, frames: list) -> str:
        """The clip as an MP4 the page can play; the oldest files beyond KEEP_CLIPS are deleted."""
        from ..video_io import encode_mp4

        if self._clip_dir is None:
            self._clip_dir = tempfile.mkdtemp(prefix="omni_accel_demo_")
        path = os.path.join(self._clip_dir, f"{uuid.uuid4().hex}.mp4")
        with open(path, "wb") as fh:
            fh.write(encode_mp4(frames, self.fps))
        self._clips.append(path)
        while len(self._clips) > KEEP_CLIPS:
            old = self._clips.popleft()
            if os.path.exists(old):
                os.remove(old)
        return path

    def generate(self, prompt: str, width: int, height: int, steps: int, seed: int, settings: Settings,
                 compare: bool = False, frames: int | None = None) -> dict:
        """{"image", "seconds", "report", "plain_image", "plain_seconds", "psnr", "error", "summary"}; a video
        backend puts its clips (lists of frames) under "image" / "plain_image" and their MP4 files under "video" /
        "plain_video"."""
        from ..errors import AccelError

        out: dict[str, Any] = {"image": None, "seconds": None, "report": None, "plain_image": None,
                               "plain_seconds": None, "psnr": None, "error": None, "video": None, "plain_video": None}
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
                    out["plain_image"], out["plain_seconds"] = self._call(prompt, width, height, steps, seed, frames)
                self._set(settings)
                out["image"], out["seconds"] = self._call(prompt, width, height, steps, seed, frames)
                out["report"] = self.pipe.omni_accel.report()
                if self.video:
                    out["video"] = self._clip_file(out["image"])
                    if out["plain_image"] is not None:
                        out["plain_video"] = self._clip_file(out["plain_image"])
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


def _attention_choices(backend: DemoBackend) -> list[str]:
    from ..kernels.attention import available_backends

    try:
        return ["auto"] + [b for b in available_backends(backend.device.split(":")[0]) if b != "auto"]
    except Exception:  # noqa: BLE001
        return ["auto"]


def _tab(backend: DemoBackend, prefix: str, *, max_steps: int, max_size: int, placeholder: str):
    """One tab's controls and outputs (elem_ids start with ``prefix``) wired to ``backend.generate``."""
    import gradio as gr

    m = backend.size_multiple
    w0, h0 = backend.native_size
    steps0 = int(backend.defaults.get("num_inference_steps") or 4)
    top = max(max_size, w0, h0)
    with gr.Row():
        with gr.Column(scale=1):
            prompt = gr.Textbox(label="Prompt", lines=2, elem_id=f"{prefix}prompt", placeholder=placeholder)
            with gr.Row():
                width = gr.Slider(m, top, value=w0, step=m, label="Width", elem_id=f"{prefix}width")
                height = gr.Slider(m, top, value=h0, step=m, label="Height", elem_id=f"{prefix}height")
            inputs = [prompt, width, height]
            if backend.video:  # the Wan VAE takes 4k + 1 frames
                frames0 = backend.default_frames
                inputs.append(gr.Slider(1, max(81, frames0), value=frames0, step=4, label="Frames",
                                        elem_id=f"{prefix}frames"))
            steps = gr.Slider(1, max(max_steps, steps0), value=steps0, step=1, label="Steps",
                              elem_id=f"{prefix}steps")
            seed = gr.Number(value=0, precision=0, label="Seed", elem_id=f"{prefix}seed")
            with gr.Accordion("Acceleration", open=True):
                attn = gr.Dropdown(_attention_choices(backend), value="auto", label="Attention backend",
                                   elem_id=f"{prefix}attention")
                comp = gr.Radio(list(COMPILE_CHOICES), value="off", label="torch.compile", elem_id=f"{prefix}compile")
                cache = gr.Dropdown(list(CACHE_CHOICES), value="none", label="Step cache", elem_id=f"{prefix}cache")
                thr = gr.Slider(0.0, 1.0, value=0.0, step=0.01, label="Cache threshold (0 = backend default)",
                                elem_id=f"{prefix}threshold")
            compare = gr.Checkbox(value=False, label="Side by side: plain vs accelerated", elem_id=f"{prefix}compare")
            button = gr.Button("Generate", variant="primary", elem_id=f"{prefix}generate")
        with gr.Column(scale=2):
            summary = gr.Markdown("Nothing yet.", elem_id=f"{prefix}summary")
            with gr.Row():
                if backend.video:
                    shown = gr.Video(label="Accelerated", elem_id=f"{prefix}accelerated", format="mp4", height=320,
                                     autoplay=True, loop=True)
                    plain = gr.Video(label="Plain", elem_id=f"{prefix}plain", format="mp4", height=320, autoplay=True,
                                     loop=True)
                else:
                    shown = gr.Image(label="Accelerated", type="pil", elem_id=f"{prefix}accelerated-image",
                                     format="png", height=320)
                    plain = gr.Image(label="Plain", type="pil", elem_id=f"{prefix}plain-image", format="png",
                                     height=320)
            report = gr.JSON(label="pipe.omni_accel.report()", elem_id=f"{prefix}report")

    def on_generate(p, w, h, *rest):
        frames = rest[0] if backend.video else None
        s, sd, a, c, ca, t, cmp = rest[1:] if backend.video else rest
        out = backend.generate(p, int(w), int(h), int(s), int(sd or 0),
                               Settings(attention=a, compile=c, cache=ca, cache_threshold=float(t)), bool(cmp),
                               frames=int(frames) if frames else None)
        media = ("video", "plain_video") if backend.video else ("image", "plain_image")
        return out["summary"], out[media[0]], out[media[1]], out["report"]

    button.click(on_generate, inputs + [steps, seed, attn, comp, cache, thr, compare], [summary, shown, plain, report],
                 concurrency_limit=1)


def build_demo(backend: DemoBackend | None, *, max_steps: int = 50, max_size: int = 1024,
               video_backend: DemoBackend | None = None, video_note: str = ""):
    """The gr.Blocks of the demo (not launched): an Image tab and a Video tab (or ``video_note`` saying why not)."""
    import gradio as gr

    with gr.Blocks(title="omni_accel demo", analytics_enabled=False) as demo:
        gr.Markdown("## omni_accel demo\nGenerate with an accelerated pipeline; tick *side by side* to compare "
                    "with the plain pipeline (same seed).")
        with gr.Tabs():
            if backend is not None:
                with gr.Tab("Image", elem_id="image-tab"):
                    _tab(backend, "", max_steps=max_steps, max_size=max_size,
                         placeholder="a red circle on a blue background")
            with gr.Tab("Video", elem_id="video-tab"):
                if video_backend is not None:
                    _tab(video_backend, "video-", max_steps=max_steps, max_size=max_size,
                         placeholder="a red circle moving from left to right on a blue background")
                else:
                    gr.Markdown(video_note or "No video model loaded.", elem_id="video-note")
    return demo


def theme():
    import gradio as gr

    # system fonts only: the default theme pulls Google Fonts, which an offline browser waits for
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


def _size(text: str | None, flag: str) -> tuple[int, int] | None:
    from ..cli import CliError
    from ..serve.schemas import parse_size

    try:
        return parse_size(text) if text else None
    except ValueError as exc:
        raise CliError(f"{flag}: {exc}")


def _warm_up(backend: DemoBackend) -> None:
    """One tiny call, so the first timed plain run does not pay for lazy initialisation."""
    m = backend.size_multiple
    try:
        backend._call("warm-up", m * 2, m * 2, 1, 0, frames=1)
    except Exception as exc:  # noqa: BLE001
        logger.warning("omni_accel.demo: warm-up failed: %r", exc)


def _video_backend(args, device: str, dtype) -> tuple[DemoBackend | None, str]:
    """The video tab's backend and, when there is none, the sentence the tab shows instead."""
    from ..cli import _load_pipeline_quietly
    from ..errors import AccelError

    choice = args.video_model
    if choice in (None, "", "none"):
        return None, "The video tab is off (`--video-model none`)."
    model = argparse.Namespace(model=None if choice == "builtin" else choice, video=True, offload=None)
    try:
        pipe, defaults, source = _load_pipeline_quietly(model, device, dtype)
    except AccelError as exc:
        if choice != "builtin":
            raise
        return None, f"No video model: {exc}"
    if args.video_default_frames is not None:
        defaults["num_frames"] = args.video_default_frames
    if args.default_steps is not None:
        defaults["num_inference_steps"] = args.default_steps
    logger.info("omni_accel.demo: video tab: %s", source)
    return DemoBackend.from_pipeline(pipe, defaults, device, _size(args.video_default_size, "--video-default-size")), ""


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
    _size(args.video_default_size, "--video-default-size")  # a typo costs no model load
    if args.default_steps is not None and args.default_steps < 1:
        raise CliError(f"--default-steps {args.default_steps} is invalid: it must be >= 1.")
    if args.video_default_frames is not None and args.video_default_frames < 1:
        raise CliError(f"--video-default-frames {args.video_default_frames} is invalid: it must be >= 1.")
    pipe, defaults, source = _load_pipeline_quietly(args, device, dtype)
    if args.default_steps is not None:
        defaults["num_inference_steps"] = args.default_steps
    backend = DemoBackend.from_pipeline(pipe, defaults, device, native)
    video, note = (backend, "") if backend.video else _video_backend(args, device, dtype)
    image = None if backend.video else backend  # a video --model gets the video tab only
    if not args.no_warmup:
        for b in {id(b): b for b in (image, video) if b is not None}.values():
            _warm_up(b)
    demo = build_demo(image, max_steps=args.max_steps, max_size=args.max_size, video_backend=video, video_note=note)
    print(f"omni-accel demo: {source} on http://{args.host}:{args.port}", flush=True)
    demo.queue(default_concurrency_limit=1).launch(server_name=args.host, server_port=args.port, share=False,
                                                   inbrowser=False, ssr_mode=False, theme=theme(), quiet=True,
                                                   footer_links=[])
    return 0
