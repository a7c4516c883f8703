"""The model, the bounded queue and the batching worker of ``omni-accel serve``.

One worker thread owns the pipeline (a diffusers pipeline is not safe to call from two threads). It takes the
oldest pending request and every other pending request of the same shape (kind, size, steps, guidance, true CFG,
negative prompt or not) -- up to ``max_concurrency`` requests and ``max_batch_images`` images -- and calls the
pipeline once with the list of their prompts and one seeded generator per image, so a batched image is the image
the same request would get alone. Requests wait in a bounded queue (``max_queue``; full -> 429); a request that is
cancelled (client gone, timeout) before its batch starts is dropped; a running batch whose requests are all
cancelled is aborted at the next denoising step (single process only: ranks must stay in step).
"""

from __future__ import annotations

import collections
import concurrent.futures
import inspect
import io
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger("omni_accel.serve")

BUILTIN_ID = "omni-accel-builtin"


@dataclass
class Limits:
    """Per-request limits of the server (all configurable on the command line)."""

    max_n: int = 4
    max_steps: int = 100
    max_size: int = 2048  # largest side in pixels
    max_pixels: int = 2048 * 2048  # largest output width*height
    max_body_bytes: int = 20 * 2**20
    max_upload_bytes: int = 20 * 2**20
    max_input_pixels: int = 4096 * 4096  # decoded pixels of one uploaded image (decompression bombs)
    max_input_images: int = 4
    request_timeout_s: float = 300.0


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
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_pipeline(cls, pipe: Any, model_id: str, defaults: dict | None = None,
                      native_size: tuple[int, int] | None = None) -> "LoadedModel":
        """Wrap an (already accelerated or plain) pipeline."""
        from ..cli import call_parameters
        from ..pipelines import adapter_for

        adapter = adapter_for(pipe)
        defaults = dict(defaults or {})
        params = call_parameters(pipe)
        multiple = adapter.size_multiple(pipe)
        vae_scale = multiple // 2
        if native_size is None:
            if defaults.get("width") and defaults.get("height"):
                native_size = (int(defaults["width"]), int(defaults["height"]))
            else:
                sample = getattr(pipe, "default_sample_size", None)
                side = int(sample) * vae_scale if sample else 1024
                native_size = (side, side)
        for key in ("num_inference_steps", "guidance_scale"):
            if key not in defaults and key in params and params[key].default is not inspect.Parameter.empty:
                defaults[key] = params[key].default
        return cls(pipe=pipe, id=model_id, family=adapter.family, defaults=defaults, native_size=native_size,
                   size_multiple=multiple, can_edit=adapter.is_edit_pipeline(pipe), accepted=frozenset(params))

    @property
    def pipeline_class(self) -> str:
        return type(self.pipe).__name__


# ------------------------------------------------------------------------------------------------ one call
class Aborted(Exception):
    """Raised from the step callback when every request of the running batch was cancelled."""


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
    """Call the pipeline for one batch; returns the PIL images in prompt order."""
    import torch

    kwargs = build_call_kwargs(model, spec)
    if should_abort is not None and "callback_on_step_end" in model.accepted:
        def _callback(_pipe, _i, _t, _kw):
            if should_abort():
                raise Aborted()
            return {}

        kwargs["callback_on_step_end"] = _callback
    with torch.inference_mode():
        out = model.pipe(**kwargs)
    from ..cli import _to_pil_list

    images = _to_pil_list(out.images)
    want = (spec["width"], spec["height"])
    if len(images) != len(spec["prompts"]) or any(im.size != want for im in images):
        raise RuntimeError(f"the pipeline returned {len(images)} image(s) of {[im.size for im in images][:3]} "
                           f"for {len(spec['prompts'])} of {want}")
    return images


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ jobs
@dataclass
class Job:
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
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: bool = False
    started: bool = False
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def seeds(self) -> list[int]:
        return [(self.seed + i) % 2**63 for i in range(self.n)]

    @property
    def key(self) -> tuple | None:
        """Requests with equal keys can share one pipeline call; edits never batch (None)."""
        if self.op != "generate":
            return None
        return (self.width, self.height, self.steps, self.guidance_scale, self.true_cfg_scale,
                self.negative_prompt is not None)


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"queue full, retry after {retry_after}s")
        self.retry_after = retry_after


class Engine:
    """Bounded queue + the batching worker thread. ``executor(spec, should_abort)`` runs one batch (rank 0 of a
    distributed server broadcasts the spec first); ``on_idle`` is called when no work came for ``idle_s``."""

    def __init__(self, model: LoadedModel, *, max_queue: int = 32, max_concurrency: int = 4,
                 max_batch_images: int = 8, executor: Callable | None = None, on_idle: Callable | None = None,
                 idle_s: float = 30.0, can_abort: bool = True, metrics: Any = None):
        self.model = model
        self.max_queue = max_queue
        self.max_concurrency = max_concurrency
        self.max_batch_images = max(max_batch_images, 1)
        self.executor = executor or (lambda spec, abort: run_spec(model, spec, abort))
        self.on_idle = on_idle
        self.idle_s = idle_s
        self.can_abort = can_abort
        self.metrics = metrics
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._stopping = False
        self._avg_batch_s = 1.0
        self._thread = threading.Thread(target=self._loop, name="omni-accel-serve-worker", daemon=True)

    # -- admission ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            for job in self._pending:
                job.cancelled = True
                job.future.cancel()
            self._pending.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def retry_after(self) -> int:
        batches_ahead = len(self._pending) / max(self.max_concurrency, 1) + 1
        return max(1, math.ceil(self._avg_batch_s * batches_ahead))

    def submit(self, job: Job) -> concurrent.futures.Future:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(self.retry_after())
            self._pending.append(job)
            self._gauge()
            self._cond.notify()
        return job.future

    def cancel(self, job: Job) -> str | None:
        """Cancel ``job``: dropped if still queued ("queued"), flagged if running ("running"), None if done."""
        with self._cond:
            if job.future.done():
                return None
            job.cancelled = True
            if not job.started:
                try:
                    self._pending.remove(job)
                except ValueError:
                    pass
                job.future.cancel()
                self._gauge()
                return "queued"
            return "running"

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._pending))
            self.metrics.running.set(len(self._running))

    # -- the worker ---------------------------------------------------------------------------------------
    def _take_batch(self) -> list[Job]:
        first = self._pending.popleft()
        batch, images = [first], first.n
        if first.key is not None:
            for job in list(self._pending):
                if len(batch) >= self.max_concurrency:
                    break
                if job.key == first.key and images + job.n <= self.max_batch_images:
                    self._pending.remove(job)
                    batch.append(job)
                    images += job.n
        for job in batch:
            job.started = True
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    if not self._cond.wait(self.idle_s) and self.on_idle is not None and not self._pending:
                        break
                if self._stopping:
                    return
                if not self._pending:
                    batch = None
                else:
                    batch = self._take_batch()
                    self._running = batch
                    self._gauge()
            if batch is None:
                try:
                    self.on_idle()
                except Exception:  # noqa: BLE001
                    logger.exception("omni_accel.serve: idle hook failed")
                continue
            self._run_batch(batch)
            with self._cond:
                self._running = []
                self._gauge()

    def _run_batch(self, batch: list[Job]) -> None:
        first = batch[0]
        spec = {
            "op": first.op,
            "prompts": [job.prompt for job in batch for _ in range(job.n)],
            "negative_prompts": ([job.negative_prompt for job in batch for _ in range(job.n)]
                                 if first.negative_prompt is not None else None),
            "seeds": [s for job in batch for s in job.seeds],
            "width": first.width, "height": first.height, "steps": first.steps,
            "guidance_scale": first.guidance_scale, "true_cfg_scale": first.true_cfg_scale,
            "images": first.images,
        }
        abort = (lambda: all(job.cancelled for job in batch)) if self.can_abort else None
        t0 = time.perf_counter()
        try:
            images = self.executor(spec, abort)
            encoded = [png_bytes(im) for im in images]
        except Aborted:
            logger.info("omni_accel.serve: batch of %d request(s) aborted: all cancelled", len(batch))
            for job in batch:
                job.future.cancel()
            return
        except BaseException as exc:  # noqa: BLE001 -- answer every request of the batch, keep serving
            logger.exception("omni_accel.serve: pipeline call failed")
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        elapsed = time.perf_counter() - t0
        self._avg_batch_s = 0.7 * self._avg_batch_s + 0.3 * elapsed
        if self.metrics is not None:
            self.metrics.observe_batch(self.model, len(batch), len(images), elapsed)
        offset = 0
        for job in batch:
            part = encoded[offset:offset + job.n]
            offset += job.n
            if not job.future.done():
                job.future.set_result(list(zip(part, job.seeds)))


def random_seed() -> int:
    return secrets.randbelow(2**31)


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
