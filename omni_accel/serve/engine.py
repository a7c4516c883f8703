"""The image side of ``omni-accel serve``: the served model, its limits, the pipeline call of one batch, and the
image job kind on the shared job mechanism (serve/jobs.py).

The image queue's worker takes the oldest pending request and every other pending request of the same shape
(size, steps, guidance, true CFG, negative prompt or not) -- up to ``max_concurrency`` requests and
``max_batch_images`` images -- and calls the pipeline once with the list of their prompts and one seeded generator
per image, so a batched image is the image the same request would get alone. Edits never batch. A running batch
whose requests are all cancelled is aborted at the next denoising step (single process only: ranks must stay in
step).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .jobs import Aborted, Job, JobKind, JobQueue  # noqa: F401 -- Aborted: raised by the step callback

logger = logging.getLogger("omni_accel.serve")

BUILTIN_ID = "omni-accel-builtin"
DEFAULT_STEPS = 28  # for a pipeline whose __call__ names no default
DEFAULT_FPS = 16  # for a video family whose adapter names no frame rate
MAX_REFERENCES = 16  # what a multi-reference pipeline is trusted with (the server's --max-input-images is lower)


@dataclass
class Limits:
    """Per-request limits of the server (all configurable on the command line). ``max_size`` / ``max_pixels`` /
    ``max_cost`` left at None are sized to the served model by ``resolved``."""

    max_n: int = 4
    max_steps: int = 100
    max_size: int | None = None  # largest side in pixels (None: twice the model's native side)
    max_pixels: int | None = None  # largest output width*height (None: max_size squared)
    max_cost: float | None = None  # megapixel-steps of one request (None: a multiple of a native-size request)
    max_frames: int | None = None  # frames of one video (None: about twice the video model's native frames)
    max_body_bytes: int = 20 * 2**20
    max_upload_bytes: int = 20 * 2**20
    max_input_pixels: int = 4096 * 4096  # decoded pixels of one uploaded image (decompression bombs)
    max_input_images: int = 4
    request_timeout_s: float = 300.0

    def resolved(self, model: "LoadedModel") -> "Limits":
        """These limits with the model-sized ones filled in: the largest side defaults to twice the model's
        native one, the cost bound to a multiple of one native-size image (or clip) at the model's default steps
        (COST_HEADROOM; VIDEO_COST_HEADROOM), a video's frames to twice its native count (a CPU worker must not be
        held for many minutes by one request at the default limits)."""
        m = model.size_multiple
        max_size = self.max_size or max(m, 2 * max(model.native_size) // m * m)
        frames = model.native_frames or 1
        native_cost = request_cost(1, model.native_size[0], model.native_size[1], model.default_steps, frames)
        headroom = VIDEO_COST_HEADROOM if model.native_frames else COST_HEADROOM
        max_frames = self.max_frames
        if max_frames is None and model.native_frames:
            max_frames = (2 * (model.native_frames - 1)) // model.frame_multiple * model.frame_multiple + 1
        return dataclasses.replace(
            self, max_size=max_size, max_pixels=self.max_pixels or max_size * max_size,
            max_cost=self.max_cost or round(headroom * native_cost, 3), max_frames=max_frames)


COST_HEADROOM = 8.0  # the default cost bound of an image model, in native-size, default-step images
VIDEO_COST_HEADROOM = 2.0  # ... of a video model, in native clips


def request_cost(images: int, width: int, height: int, steps: int, frames: int = 1) -> float:
    """Megapixel-steps: the unit of the per-request cost bound and of the worker's time estimates (the transformer
    works on every pixel of every image or frame at every step)."""
    return images * frames * width * height * steps / 1e6


@dataclass
class LoadedModel:
    """The served pipeline and what the server needs to know about it."""

    pipe: Any
    id: str
    family: str
    defaults: dict
    native_size: tuple[int, int]  # (width, height)
    size_multiple: int
    can_edit: bool
    accepted: frozenset = frozenset()
    max_references: int = 1  # reference images an edit takes at most (several for multi-reference pipelines)
    min_reference_side: int = 1  # smallest side of a reference image the pipeline accepts
    native_frames: int | None = None  # video pipelines: the default clip length in frames
    frame_multiple: int = 1  # video pipelines: frames come as frame_multiple * k + 1 (the VAE's time compression)
    fps: int | None = None  # video pipelines: frames per second of the clips it was trained on
    created: int = field(default_factory=lambda: int(time.time()))
    lora: Any = None  # a serve.lora.LoraManager when the server offers LoRA adapters
    # facts of the pipeline the routes read, kept in a copy without it (``without_pipeline``)
    pipeline_name: str = ""
    scheduler_name: str = ""
    flow_shift_key: str | None = None  # the scheduler's flow-shift setting (a per-request flow_shift sets it)
    experts: int = 1  # transformers taking turns over the steps (Wan 2.2 A14B: 2)

    @classmethod
    def from_pipeline(cls, pipe: Any, model_id: str, defaults: dict | None = None,
                      native_size: tuple[int, int] | None = None) -> "LoadedModel":
        """Wrap an (already accelerated or plain) pipeline."""
        from ..cli import call_parameters
        from ..pipelines import adapter_for

        adapter = adapter_for(pipe)
        defaults = dict(defaults or {})
        params = call_parameters(pipe)
        multiple = adapter.size_multiple(pipe)  # video pipelines (Wan) name their VAE's spatial factor apart
        vae_scale = multiple // 2
        for key in ("num_inference_steps", "guidance_scale", "height", "width", "num_frames"):
            default = params[key].default if key in params else None
            if key not in defaults and default not in (None, inspect.Parameter.empty):
                defaults[key] = default
        if native_size is None:
            if defaults.get("width") and defaults.get("height"):
                native_size = (int(defaults["width"]), int(defaults["height"]))
            else:
                sample = getattr(pipe, "default_sample_size", None)
                side = int(sample) * vae_scale if sample else 1024
                native_size = (side, side)
        temporal = getattr(pipe, "vae_scale_factor_temporal", None)
        scheduler = getattr(pipe, "scheduler", None)
        video = temporal is not None and "num_frames" in params
        return cls(pipe=pipe, id=model_id, family=adapter.family, defaults=defaults, native_size=native_size,
                   size_multiple=multiple, can_edit=adapter.is_edit_pipeline(pipe), accepted=frozenset(params),
                   max_references=MAX_REFERENCES if adapter.takes_several_references(pipe) else 1,
                   min_reference_side=adapter.min_reference_side or multiple,
                   native_frames=int(defaults.get("num_frames") or 1) if video else None,
                   frame_multiple=int(temporal) if video else 1,
                   fps=int(adapter.extra.get("fps", DEFAULT_FPS)) if video else None,
                   pipeline_name=type(pipe).__name__, scheduler_name=type(scheduler).__name__,
                   flow_shift_key=flow_shift_key(scheduler),
                   experts=sum(getattr(pipe, name, None) is not None for name in ("transformer", "transformer_2")))

    @property
    def pipeline_class(self) -> str:
        return self.pipeline_name or type(self.pipe).__name__

    def without_pipeline(self) -> "LoadedModel":
        """This model's description without its pipeline: all the routes read, for an ingress whose replicas hold
        the pipeline (serve/ray_app.py)."""
        return dataclasses.replace(self, pipe=None, lora=self.lora.catalog() if self.lora is not None else None)

    @property
    def default_steps(self) -> int:
        return int(self.defaults.get("num_inference_steps") or DEFAULT_STEPS)


def flow_shift_key(scheduler) -> str | None:
    """The scheduler's flow-shift setting: UniPC's ``flow_shift`` (Wan's default) or FlowMatch's ``shift``."""
    config = getattr(scheduler, "config", None) or {}
    for key in ("flow_shift", "shift"):
        if key in config:
            return key
    return None


# ------------------------------------------------------------------------------------------------ one call
def build_call_kwargs(model: LoadedModel, spec: dict) -> dict:
    """The pipeline kwargs of a batch ``spec`` (plain data: identical on every rank)."""
    import torch

    wanted: dict[str, Any] = {
        "prompt": list(spec["prompts"]),
        "height": spec["height"],
        "width": spec["width"],
        "num_inference_steps": spec["steps"],
        "guidance_scale": spec.get("guidance_scale"),
        "true_cfg_scale": spec.get("true_cfg_scale"),
        "negative_prompt": list(spec["negative_prompts"]) if spec.get("negative_prompts") else None,
        "num_images_per_prompt": 1,
        "output_type": "pil",
    }
    for key, value in model.defaults.items():
        if key not in ("height", "width", "num_inference_steps", "guidance_scale") and key not in wanted:
            wanted[key] = value
    # FLUX.1 Kontext rescales the output to max_area (default 1024^2) and snaps references to its preferred
    # resolutions unless told not to: keep exactly the requested size, for generations and edits alike
    wanted["max_area"] = spec["height"] * spec["width"]
    wanted["_auto_resize"] = False
    if spec["op"] == "edit":
        images = spec["images"]
        wanted["image"] = images[0] if len(images) == 1 else list(images)
    kwargs = {k: v for k, v in wanted.items() if v is not None and k in model.accepted}
    kwargs["generator"] = [torch.Generator("cpu").manual_seed(int(s)) for s in spec["seeds"]]
    return kwargs


def run_spec(model: LoadedModel, spec: dict, should_abort: Callable[[], bool] | None = None) -> list:
    """Call the pipeline for one batch; returns the PIL images in prompt order. ``should_abort`` (a JobControl
    when the job queue calls) is asked at every step and hears the steps done."""
    import torch

    if model.lora is not None:  # every rank puts the call's adapter (or the base: scale 0) in place
        model.lora.activate(spec.get("lora"))
    kwargs = build_call_kwargs(model, spec)
    add_step_callback(model, kwargs, should_abort, spec["steps"])
    with torch.inference_mode():
        out = model.pipe(**kwargs)
    from ..cli import _to_pil_list

    images = _to_pil_list(out.images)
    want = (spec["width"], spec["height"])
    if len(images) != len(spec["prompts"]) or any(im.size != want for im in images):
        raise RuntimeError(f"the pipeline returned {len(images)} image(s) of {[im.size for im in images][:3]} "
                           f"for {len(spec['prompts'])} of {want}")
    return images


def add_step_callback(model: LoadedModel, kwargs: dict, control: Callable[[], bool] | None, steps: int) -> None:
    """diffusers' ``callback_on_step_end``: stop the call when ``control()`` says every job of it was cancelled,
    and report the steps done to ``control.progress`` (a JobControl has it)."""
    if control is None or "callback_on_step_end" not in model.accepted:
        return
    progress = getattr(control, "progress", None)

    def _callback(_pipe, index, _t, _kw):
        if control():
            raise Aborted()
        if progress is not None:
            progress(index + 1, steps)
        return {}

    kwargs["callback_on_step_end"] = _callback


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ image jobs
@dataclass
class ImageRequest:
    """The params of one image job."""

    op: str  # "generate" | "edit"
    prompt: str
    n: int
    width: int
    height: int
    steps: int
    seed: int
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None
    images: list = field(default_factory=list)
    lora: Any = None  # a serve.lora.LoraChoice, or None for the base model

    @property
    def seeds(self) -> list[int]:
        return [(self.seed + i) % 2**63 for i in range(self.n)]

    @property
    def cost(self) -> float:
        return request_cost(self.n, self.width, self.height, self.steps)

    @property
    def key(self) -> tuple | None:
        """Requests with equal keys can share one pipeline call; edits never batch (None); requests with
        different LoRA adapters (or scales) never share one."""
        if self.op != "generate":
            return None
        return (self.width, self.height, self.steps, self.guidance_scale, self.true_cfg_scale,
                self.negative_prompt is not None, self.lora.key if self.lora is not None else None)


class ImageKind(JobKind):
    """Image jobs: batched by shape up to ``max_batch_images`` images a call; results are (PNG, seed) lists."""

    name = "image"

    def __init__(self, model: LoadedModel, max_batch_images: int, metrics: Any = None):
        self.model = model
        self.max_batch_images = max(1, max_batch_images)
        self.metrics = metrics

    def job(self, request: ImageRequest, route: str) -> Job:
        return Job(kind=self, route=route, params=request, cost=request.cost, key=request.key)

    def fits(self, batch: list[Job], job: Job) -> bool:
        return sum(j.params.n for j in batch) + job.params.n <= self.max_batch_images

    def spec(self, batch: list[Job]) -> dict:
        return batch_spec([job.params for job in batch])

    def finish(self, batch: list[Job], images: list, seconds: float) -> list:
        encoded = [png_bytes(im) for im in images]
        if self.metrics is not None:
            self.metrics.observe_batch(self.model, len(batch), len(images), seconds)
        results, offset = [], 0
        for job in batch:
            results.append(list(zip(encoded[offset:offset + job.params.n], job.params.seeds)))
            offset += job.params.n
        return results


def batch_spec(batch: list[ImageRequest]) -> dict:
    """The plain-data description of one pipeline call for ``batch`` (what a distributed server broadcasts)."""
    first = batch[0]
    return {
        "kind": ImageKind.name,
        "op": first.op,
        "prompts": [r.prompt for r in batch for _ in range(r.n)],
        "negative_prompts": ([r.negative_prompt for r in batch for _ in range(r.n)]
                             if first.negative_prompt is not None else None),
        "seeds": [s for r in batch for s in r.seeds],
        "width": first.width, "height": first.height, "steps": first.steps,
        "guidance_scale": first.guidance_scale, "true_cfg_scale": first.true_cfg_scale,
        "images": first.images,
        "lora": first.lora.as_dict() if first.lora is not None else None,
    }


def image_queue(model: LoadedModel, *, max_queue: int = 32, max_concurrency: int = 4, max_batch_images: int = 8,
                executor: Callable | None = None, on_idle: Callable | None = None, idle_s: float = 30.0,
                can_abort: bool = True, metrics: Any = None) -> JobQueue:
    """The job queue of an image model: ``executor(spec, control)`` runs one batch (default: ``run_spec`` here;
    rank 0 of a distributed server broadcasts first). Its image kind is ``queue.kinds["image"]``."""
    queue = JobQueue("images", executor or (lambda spec, control: run_spec(model, spec, control)),
                     max_queue=max_queue, max_batch=max_concurrency, metrics=metrics, on_idle=on_idle, idle_s=idle_s,
                     can_abort=can_abort,
                     gauges=(metrics.queue_depth, metrics.running) if metrics is not None else None)
    queue.kinds["image"] = ImageKind(model, max_batch_images, metrics)
    return queue


def random_seed() -> int:
    return secrets.randbelow(2**31)
