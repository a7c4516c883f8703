"""``/v1/videos``: OpenAI's Videos API (with vLLM-Omni's extra fields) over a video pipeline (Wan 2.1 / 2.2, T2V and
I2V), as jobs on the shared job mechanism (serve/jobs.py).

* ``POST /v1/videos`` (multipart form: ``prompt``, ``model``, ``seconds``, ``size``, ``input_reference`` and the
  extras ``negative_prompt``, ``width`` / ``height``, ``num_frames``, ``fps``, ``num_inference_steps``,
  ``guidance_scale``, ``guidance_scale_2``, ``boundary_ratio``, ``flow_shift``, ``seed``) validates everything
  before admission and answers the job object at once (``status: queued``); the job runs whether or not its client
  stays.
* ``GET /v1/videos/{id}`` (progress 0-100 from the denoising steps), ``GET /v1/videos`` (cursor pages),
  ``DELETE /v1/videos/{id}`` (cancels a queued or running job and frees its files), ``GET /v1/videos/{id}/content``
  (the MP4; ``variant=thumbnail``: the first frame as PNG).

Finished videos live in a bounded store on disk (``--video-dir``; at most ``--video-store-count`` videos and
``--video-store-mb`` MiB, the oldest finished ones evicted first). ``seconds`` x ``fps`` becomes ``num_frames``,
rounded to the model's k * 4 + 1 rule; the job reports the frames it makes and the rounding.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal

from fastapi import FastAPI, File, Form, Query, UploadFile
from fastapi.responses import JSONResponse, Response

from .engine import Limits, LoadedModel, add_step_callback, flow_shift_key, random_seed, request_cost
from .errors import ApiError, bad_request
from .images import decode_upload
from .jobs import CANCELLED, COMPLETED, FAILED, Job, JobKind, JobQueue, submit_or_raise
from .schemas import ERROR_RESPONSES, HARD_MAX_PROMPT, MAX_GUIDANCE, MAX_SEED, parse_size

logger = logging.getLogger("omni_accel.serve")

ROUTE = "/v1/videos"
BUILTIN_VIDEO_ID = "omni-accel-builtin-video"
MAX_FPS = 120
POLL_AFTER_MS = 500  # what GET /v1/videos/{id} suggests to the openai client's poll loop
FILE_RE = re.compile(r"^video_[0-9a-f]{32}\.(mp4|png)$")


# ------------------------------------------------------------------------------------------------ frames
def frames_for(model: LoadedModel, num_frames: int | None, seconds: float | None, fps: int) -> tuple[int, str | None]:
    """The frames a request gets and, when they differ from what it asked for, why: ``seconds`` x ``fps`` (or
    ``num_frames``) rounded to the nearest count the model makes (frame_multiple * k + 1)."""
    m = model.frame_multiple
    if num_frames is not None:
        wanted, asked = num_frames, f"num_frames={num_frames}"
    elif seconds is not None:
        wanted = max(1, round(seconds * fps))
        asked = f"seconds={seconds:g} x fps={fps} = {wanted} frames"
    else:
        return model.native_frames or 1, None
    frames = max(0, round((wanted - 1) / m)) * m + 1
    if frames == wanted:
        return frames, None
    return frames, (f"{asked}; {model.pipeline_class} makes {m} * k + 1 frames, so {frames} ({frames / fps:.3g} s at "
                    f"{fps} fps)")


def seconds_of(value: str | None) -> float | None:
    """OpenAI's ``seconds`` (a string such as "4") as a number of seconds."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise bad_request(f"seconds={value!r} is not a positive number of seconds (e.g. '4')", "seconds",
                          "invalid_value")
    return seconds


# ------------------------------------------------------------------------------------------------ the call
@dataclass
class VideoRequest:
    """The params of one video job (plain data; the reference image is a PIL image)."""

    prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    seed: int
    negative_prompt: str | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    image: Any = None
    frames_note: str | None = None
    lora: Any = None  # a serve.lora.LoraChoice, or None for the base model

    @property
    def cost(self) -> float:
        return request_cost(1, self.width, self.height, self.steps, self.num_frames)


def run_video_spec(model: LoadedModel, spec: dict, control: Callable[[], bool] | None = None):
    """One pipeline call for a video spec: frames as a float array F x H x W x 3 in [0, 1]. ``boundary_ratio`` and
    ``flow_shift`` of the request hold for this call only (the pipeline's config and scheduler are put back)."""
    import torch

    if model.lora is not None:  # every rank puts the job's adapter (or the base: scale 0) in place
        model.lora.activate(spec.get("lora"))
    wanted = {
        "prompt": spec["prompt"], "negative_prompt": spec.get("negative_prompt"), "height": spec["height"],
        "width": spec["width"], "num_frames": spec["num_frames"], "num_inference_steps": spec["steps"],
        "guidance_scale": spec.get("guidance_scale"), "guidance_scale_2": spec.get("guidance_scale_2"),
        "image": spec.get("image"), "output_type": "np",
    }
    for key, value in model.defaults.items():
        wanted.setdefault(key, value)
    kwargs = {k: v for k, v in wanted.items() if v is not None and k in model.accepted}
    kwargs["generator"] = torch.Generator("cpu").manual_seed(int(spec["seed"]))
    add_step_callback(model, kwargs, control, spec["steps"])
    pipe = model.pipe
    saved_ratio, saved_scheduler = pipe.config.get("boundary_ratio"), pipe.scheduler
    try:
        if spec.get("boundary_ratio") is not None:
            pipe.register_to_config(boundary_ratio=spec["boundary_ratio"])
        if spec.get("flow_shift") is not None:
            key = flow_shift_key(pipe.scheduler)
            pipe.scheduler = type(saved_scheduler).from_config(saved_scheduler.config, **{key: spec["flow_shift"]})
        with torch.inference_mode():
            frames = pipe(**kwargs).frames
    finally:
        if spec.get("boundary_ratio") is not None:
            pipe.register_to_config(boundary_ratio=saved_ratio)
        pipe.scheduler = saved_scheduler
    frames = frames[0] if getattr(frames, "ndim", 0) == 5 or isinstance(frames, list) else frames
    want = (spec["num_frames"], spec["height"], spec["width"])
    if tuple(frames.shape[:3]) != want:
        raise RuntimeError(f"the pipeline returned frames of shape {tuple(frames.shape)} for {want}")
    return frames


# ------------------------------------------------------------------------------------------------ the store
class VideoStore:
    """The video jobs of this server and their files on disk: every job until it is deleted or evicted; at most
    ``max_count`` finished jobs and ``max_bytes`` of files, the oldest finished ones evicted first."""

    def __init__(self, folder: str | None, max_count: int, max_bytes: int):
        self.owned = folder is None  # a temporary folder, removed at close
        self.folder = tempfile.mkdtemp(prefix="omni_accel_videos_") if folder is None else folder
        os.makedirs(self.folder, exist_ok=True)
        for name in os.listdir(self.folder):  # files of an earlier run: their jobs are gone
            if FILE_RE.match(name):
                os.remove(os.path.join(self.folder, name))
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._jobs: collections.OrderedDict[str, Job] = collections.OrderedDict()  # oldest first
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def path(self, video_id: str, variant: str = "video") -> str:
        return os.path.join(self.folder, f"{video_id}.{'png' if variant == 'thumbnail' else 'mp4'}")

    def add(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.id] = job

    def get(self, video_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(video_id)

    def page(self, after: str | None, limit: int, newest_first: bool) -> tuple[list[Job], bool]:
        with self._lock:
            jobs = list(self._jobs.values())
        if newest_first:
            jobs.reverse()
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                raise bad_request(f"after={after!r} is not a video of this server (it may have been deleted or "
                                  "evicted); list from the start", "after", "invalid_value")
            jobs = jobs[ids.index(after) + 1:]
        return jobs[:limit], len(jobs) > limit

    def save(self, job: Job, mp4: bytes, png: bytes) -> bool:
        """Write a finished job's files; False when the job was deleted meanwhile (nothing written). Raises
        ApiError when the video alone is larger than the store."""
        size = len(mp4) + len(png)
        if size > self.max_bytes:
            raise ApiError(507, f"the video ({size} bytes) is larger than the whole store ({self.max_bytes} bytes, "
                                "--video-store-mb); ask for fewer frames or pixels", type="server_error",
                           code="video_too_large")
        with self._lock:
            if job.id not in self._jobs:
                return False
            for data, variant in ((mp4, "video"), (png, "thumbnail")):
                with open(self.path(job.id, variant), "wb") as fh:
                    fh.write(data)
            self._bytes[job.id] = size
            self._evict(keep=job.id)
        return True

    def finished(self) -> None:
        """A job ended without files (failed, cancelled): keep the count bound."""
        with self._lock:
            self._evict()

    def remove(self, video_id: str) -> Job | None:
        with self._lock:
            job = self._jobs.pop(video_id, None)
            self._drop_files(video_id)
        return job

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _evict(self, keep: str | None = None) -> None:
        done = [vid for vid, job in self._jobs.items() if job.done and vid != keep]
        count = len([job for job in self._jobs.values() if job.done])
        while done and (count > self.max_count or sum(self._bytes.values()) > self.max_bytes):
            victim = done.pop(0)
            logger.info("omni_accel.serve: video store full: evicting %s", victim)
            self._jobs.pop(victim, None)
            self._drop_files(victim)
            count -= 1

    def _drop_files(self, video_id: str) -> None:
        self._bytes.pop(video_id, None)
        for variant in ("video", "thumbnail"):
            try:
                os.remove(self.path(video_id, variant))
            except FileNotFoundError:
                pass


class VideoKind(JobKind):
    """Video jobs: one clip a call (never batched); the frames become an H.264 MP4 and a PNG thumbnail (on the
    worker thread, after the call), which the store of the server that owns the job takes in (``accept``: here, or
    on the ingress when a replica ran the job)."""

    name = "video"
    what = "the video pipeline"

    def __init__(self, model: LoadedModel, store: VideoStore | None, metrics: Any = None):
        self.model = model
        self.store = store
        self.metrics = metrics

    def job(self, request: VideoRequest) -> Job:
        return Job(kind=self, route=ROUTE, params=request, cost=request.cost, id=f"video_{uuid.uuid4().hex}")

    def spec(self, batch: list[Job]) -> dict:
        r = batch[0].params
        return {"kind": self.name, "prompt": r.prompt, "negative_prompt": r.negative_prompt, "width": r.width,
                "height": r.height, "num_frames": r.num_frames, "steps": r.steps, "seed": r.seed,
                "guidance_scale": r.guidance_scale, "guidance_scale_2": r.guidance_scale_2,
                "boundary_ratio": r.boundary_ratio, "flow_shift": r.flow_shift, "image": r.image,
                "lora": r.lora.as_dict() if r.lora is not None else None}

    def finish(self, batch: list[Job], frames: Any, seconds: float) -> list:
        """[(MP4 bytes, thumbnail PNG bytes)] of the clip (None for a job cancelled meanwhile)."""
        from ..video_io import encode_mp4, first_frame_png

        job = batch[0]
        if self.metrics is not None:
            self.metrics.observe_batch(self.model, 1, 0, seconds)
        if job.cancelled:
            return [None]
        return [(encode_mp4(frames, job.params.fps), first_frame_png(frames))]

    def accept(self, job: Job, files: tuple[bytes, bytes] | None) -> None:
        if files is not None and not job.cancelled:
            self.store.save(job, *files)
        return None


def video_queue(model: LoadedModel, store: VideoStore, *, max_queue: int = 32, metrics: Any = None,
                executor: Callable | None = None, on_idle: Callable | None = None, idle_s: float = 30.0,
                can_abort: bool = True) -> JobQueue:
    """The job queue of a video model (one clip a call; rank 0 of a distributed server passes its broadcasting
    ``executor``). Its kind is ``queue.kinds["video"]``."""
    queue = JobQueue("videos", executor or (lambda spec, control: run_video_spec(model, spec, control)),
                     max_queue=max_queue, max_batch=1, metrics=metrics, on_idle=on_idle, idle_s=idle_s,
                     can_abort=can_abort)
    queue.kinds["video"] = VideoKind(model, store, metrics)
    return queue


# ------------------------------------------------------------------------------------------------ routes
def video_object(job: Job, model_id: str, stopping: bool = False) -> dict:
    """A job as OpenAI's Video object, plus the frames it makes, their rate and the rounding."""
    r: VideoRequest = job.params
    status = job.status
    error = None
    if status == CANCELLED:
        status = FAILED
        why = "the server shut down before the video was finished" if stopping else "the job was cancelled"
        error = {"code": "cancelled", "message": why}
    elif status == FAILED:
        from .errors import pipeline_failure

        failure = job.error if isinstance(job.error, ApiError) else pipeline_failure(job.error, VideoKind.what)
        error = {"code": failure.code, "message": failure.message}
    return {
        "id": job.id, "object": "video", "model": model_id, "status": status, "progress": job.progress,
        "created_at": int(job.created_at), "completed_at": int(job.finished_at) if status == COMPLETED else None,
        "expires_at": None, "prompt": r.prompt, "seconds": f"{r.num_frames / r.fps:g}",
        "size": f"{r.width}x{r.height}", "error": error, "remixed_from_video_id": None,
        "num_frames": r.num_frames, "fps": r.fps, "seed": r.seed, "frames_note": r.frames_note,
    }


def install(api: FastAPI, model: LoadedModel, queue: JobQueue, store: VideoStore, limits: Limits,
            default_fps: int) -> None:
    """Add the /v1/videos routes to ``api`` for ``model`` on ``queue`` with the (resolved) ``limits``."""
    kind: VideoKind = queue.kinds["video"]
    models = getattr(api.state, "model_cards", None)
    if models is not None:
        models.append(lambda: _card(model, limits))
        for name in (model.lora.model_names() if model.lora is not None else []):  # adapters, parent = the model
            models.append(lambda name=name: _card(model, limits).model_copy(
                update={"id": name, "root": model.lora.named[name], "parent": model.id}))
    scheduler_shift = model.flow_shift_key
    two_experts = model.experts > 1

    def found(video_id: str) -> Job:
        job = store.get(video_id)
        if job is None:
            raise ApiError(404, f"no video {video_id!r} on this server (deleted, evicted from the store of the "
                                f"newest {store.max_count}, or never made)", param="video_id", code="not_found")
        return job

    adapters = model.lora.model_names() if model.lora is not None else []

    def build(form: dict, image) -> VideoRequest:
        if form["model"] is not None and form["model"] != model.id and form["model"] not in adapters:
            raise ApiError(404, f"the model {form['model']!r} does not exist; this server makes videos with "
                                f"{model.id!r}{' and the LoRA adapters ' + ', '.join(adapters) if adapters else ''} "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        lora = video_lora(form["model"], form["lora"])
        takes_image = "image" in model.accepted
        if image is not None and not takes_image:
            raise bad_request(f"input_reference: {model.pipeline_class} makes videos from text only; serve an "
                              "image-to-video pipeline (e.g. Wan 2.1 I2V) to animate an image", "input_reference",
                              "unsupported_parameter")
        if image is None and takes_image:
            raise ApiError(400, f"missing required parameter: 'input_reference' ({model.pipeline_class} animates an "
                                "image)", param="input_reference", code="missing_required_parameter")
        for name in ("guidance_scale_2", "boundary_ratio"):
            if form[name] is not None and not two_experts:
                raise bad_request(f"{name} applies to Wan 2.2's two experts; {model.id!r} has one transformer",
                                  name, "unsupported_parameter")
        if form["flow_shift"] is not None and scheduler_shift is None:
            raise bad_request(f"flow_shift: the scheduler {model.scheduler_name} has no flow shift",
                              "flow_shift", "unsupported_parameter")
        w, h = size_of(form)
        fps = form["fps"] or default_fps
        seconds = seconds_of(form["seconds"])
        if seconds is not None and form["num_frames"] is not None:
            raise bad_request("send seconds or num_frames, not both", "num_frames", "invalid_value")
        frames, note = frames_for(model, form["num_frames"], seconds, fps)
        if frames > limits.max_frames:
            raise bad_request(f"{note or f'num_frames={frames}'}: more frames than this server allows (at most "
                              f"{limits.max_frames}, --max-frames)", "num_frames" if seconds is None else "seconds",
                              "invalid_value")
        steps = form["num_inference_steps"] or min(model.default_steps, limits.max_steps)
        cost = request_cost(1, w, h, steps, frames)
        if cost > limits.max_cost:
            raise bad_request(f"this video ({w}x{h}, {frames} frames, {steps} steps) costs {cost:.4g} megapixel-steps "
                              f"(frames x width x height x steps / 1e6), more than this server allows per request "
                              f"({limits.max_cost:g}, --max-request-cost); ask for fewer frames, steps or pixels",
                              None, "request_too_costly")
        return VideoRequest(prompt=form["prompt"], width=w, height=h, num_frames=frames, fps=fps, steps=steps,
                            seed=form["seed"] if form["seed"] is not None else random_seed(),
                            negative_prompt=form["negative_prompt"], guidance_scale=form["guidance_scale"],
                            guidance_scale_2=form["guidance_scale_2"], boundary_ratio=form["boundary_ratio"],
                            flow_shift=form["flow_shift"], image=image, frames_note=note, lora=lora)

    def video_lora(name: str | None, lora: str | None):
        """The job's adapter from ``model: NAME`` or the ``lora`` form field (JSON), read and checked now."""
        if lora is not None:
            try:
                lora = json.loads(lora)
            except ValueError:
                raise bad_request(f"lora={lora!r} is not JSON; send e.g. {{\"name\": \"x\", \"scale\": 1.0}}",
                                  "lora")
        from .lora import request_lora

        return request_lora(model.lora, name, lora, flags="--video-lora NAME=PATH or --video-lora-dir ROOT",
                            what=" for its video model")

    def size_of(form: dict) -> tuple[int, int]:
        try:
            parsed = parse_size(form["size"])
        except ValueError as exc:
            raise bad_request(str(exc), "size", "invalid_size")
        if parsed and (form["width"], form["height"]) != (None, None) and (form["width"], form["height"]) != parsed:
            raise bad_request(f"size={form['size']!r} and width/height={form['width']}/{form['height']} disagree; "
                              "send one of them", "size", "invalid_size")
        w, h = parsed or (form["width"] or model.native_size[0], form["height"] or model.native_size[1])
        m = model.size_multiple
        if max(w, h) > limits.max_size or w * h > limits.max_pixels:
            raise bad_request(f"size={w}x{h} is larger than this server allows: at most {limits.max_size} pixels a "
                              f"side and {limits.max_pixels} pixels in all (--max-size)", "size", "invalid_size")
        if w % m or h % m:
            rw, rh = (min(limits.max_size // m * m, max(m, round(side / m) * m)) for side in (w, h))
            raise bad_request(f"size={w}x{h}: width and height must be multiples of {m} for this model; the "
                              f"nearest valid size is '{rw}x{rh}'", "size", "invalid_size")
        return w, h

    async def reference(upload, data_url: str | None, file_id: str | None):
        if file_id is not None:
            raise bad_request("input_reference.file_id is not supported by this server; upload the image, or send "
                              "input_reference.image_url as a data: URL", "input_reference", "unsupported_parameter")
        if isinstance(upload, str):
            raise bad_request("input_reference must be an uploaded image file (multipart), or "
                              "input_reference[image_url] as a data: URL", "input_reference", "invalid_image")
        if upload is not None:
            data = await upload.read(limits.max_upload_bytes + 1)
        elif data_url is not None:
            data = decode_data_url(data_url)
        else:
            return None
        return decode_upload(data, max_bytes=limits.max_upload_bytes, max_pixels=limits.max_input_pixels,
                             param="input_reference")

    @api.post(ROUTE, responses=ERROR_RESPONSES, summary="Create a video job (OpenAI videos.create)")
    async def create_video(
        prompt: str = Form(..., min_length=1, max_length=HARD_MAX_PROMPT, description="the text prompt"),
        model_name: str | None = Form(None, alias="model", max_length=256, description="the served video model"),
        seconds: str | None = Form(None, max_length=16, description="clip length; x fps, rounded to the model's "
                                   "4k+1 frames (reported in the job); or num_frames"),
        size: str | None = Form(None, max_length=16, description="'WIDTHxHEIGHT' (multiples of the size multiple, "
                                f"at most {limits.max_size} a side, --max-size); or width and height"),
        input_reference: UploadFile | str | None = File(None, description="image-to-video: the first frame "
                                                                          "(PNG, JPEG or WebP)"),
        input_reference_url: str | None = Form(None, alias="input_reference[image_url]",
                                               description="image-to-video: the first frame as a data: URL"),
        input_reference_file_id: str | None = Form(None, alias="input_reference[file_id]",
                                                   description="not supported"),
        negative_prompt: str | None = Form(None, max_length=HARD_MAX_PROMPT),
        width: int | None = Form(None, ge=1, le=limits.max_size),
        height: int | None = Form(None, ge=1, le=limits.max_size),
        num_frames: int | None = Form(None, ge=1, le=limits.max_frames,
                                      description="frames (server limit --max-frames); rounded to 4k+1"),
        fps: int | None = Form(None, ge=1, le=MAX_FPS, description=f"frames per second (default {default_fps})"),
        num_inference_steps: int | None = Form(None, ge=1, le=limits.max_steps,
                                               description="denoising steps (server limit --max-steps)"),
        guidance_scale: float | None = Form(None, ge=0.0, le=MAX_GUIDANCE),
        guidance_scale_2: float | None = Form(None, ge=0.0, le=MAX_GUIDANCE,
                                              description="Wan 2.2: guidance of the low-noise expert"),
        boundary_ratio: float | None = Form(None, ge=0.0, le=1.0,
                                            description="Wan 2.2: where the low-noise expert takes over"),
        flow_shift: float | None = Form(None, gt=0.0, le=100.0, description="the scheduler's flow shift"),
        seed: int | None = Form(None, ge=0, le=MAX_SEED),
        n: int = Form(1, ge=1, le=1, description="one video per job"),
        lora: str | None = Form(None, max_length=4096, description='a LoRA adapter as JSON, e.g. {"name": "x", '
                                                                   '"scale": 1.0} (--video-lora / --video-lora-dir)'),
    ):
        form = dict(prompt=prompt, model=model_name, seconds=seconds, size=size, negative_prompt=negative_prompt,
                    width=width, height=height, num_frames=num_frames, fps=fps,
                    num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                    guidance_scale_2=guidance_scale_2, boundary_ratio=boundary_ratio, flow_shift=flow_shift,
                    seed=seed, lora=lora)
        image = await reference(input_reference, input_reference_url, input_reference_file_id)
        job = kind.job(build(form, image))
        store.add(job)
        try:
            submit_or_raise(queue, job, what="video jobs")
        except ApiError:
            store.remove(job.id)
            raise
        job.future.add_done_callback(lambda _future: store.finished())
        return video_object(job, model.id)

    @api.get(ROUTE, summary="List video jobs, newest first (OpenAI videos.list)")
    async def list_videos(after: str | None = Query(None, max_length=64), limit: int = Query(20, ge=1, le=100),
                          order: Literal["asc", "desc"] = Query("desc")):
        jobs, more = store.page(after, limit, newest_first=order == "desc")
        data = [video_object(job, model.id, queue.stopping) for job in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @api.get(ROUTE + "/{video_id}", responses={404: ERROR_RESPONSES[404]},
             summary="A video job (OpenAI videos.retrieve)")
    async def retrieve_video(video_id: str):
        job = found(video_id)
        return JSONResponse(video_object(job, model.id, queue.stopping),
                            headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})

    @api.delete(ROUTE + "/{video_id}", responses={404: ERROR_RESPONSES[404]},
                summary="Delete a video job: cancel it if queued or running, free its files (OpenAI videos.delete)")
    async def delete_video(video_id: str):
        job = found(video_id)
        queue.cancel(job, "deleted")
        store.remove(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @api.get(ROUTE + "/{video_id}/content", response_class=Response, responses={404: ERROR_RESPONSES[404]},
             summary="The MP4, or variant=thumbnail: the first frame as PNG (OpenAI videos.download_content)")
    async def video_content(video_id: str, variant: Literal["video", "thumbnail", "spritesheet"] = Query("video")):
        job = found(video_id)
        if variant == "spritesheet":
            raise bad_request("variant='spritesheet' is not supported; use 'video' or 'thumbnail'", "variant",
                              "unsupported_parameter")
        if job.status != COMPLETED:
            raise ApiError(409, f"the video {video_id!r} is not ready: status {video_object(job, model.id)['status']}"
                                f", progress {job.progress} %", param="video_id", code="video_not_ready")
        try:
            with open(store.path(video_id, variant), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:  # deleted or evicted between the lookup and the read
            raise ApiError(404, f"no video {video_id!r} on this server", param="video_id", code="not_found")
        return Response(data, media_type="video/mp4" if variant == "video" else "image/png")


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 ``data:`` URL (remote URLs are not fetched: the server may have no network, and
    fetching what a client names is a way into the server's network)."""
    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise bad_request("input_reference[image_url] must be a base64 data: URL (data:image/png;base64,...); "
                          "remote URLs are not fetched", "input_reference", "invalid_image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("input_reference[image_url] is not valid base64", "input_reference", "invalid_image")


def _card(model: LoadedModel, limits: Limits):
    from .schemas import ModelCard

    caps = ["videos"] + (["image-to-video"] if "image" in model.accepted else [])
    return ModelCard(id=model.id, created=model.created, family=model.family, pipeline=model.pipeline_class,
                     capabilities=caps, native_size=f"{model.native_size[0]}x{model.native_size[1]}",
                     size_multiple=model.size_multiple,
                     limits={"max_steps": limits.max_steps, "max_size": limits.max_size,
                             "max_frames": limits.max_frames, "max_request_cost": limits.max_cost,
                             "native_frames": model.native_frames, "fps": model.fps})


# ------------------------------------------------------------------------------------------------ CLI
@dataclass
class VideoSettings:
    folder: str | None = None
    max_count: int = 100
    max_bytes: int = 2 * 2**30
    fps: int | None = None

    @classmethod
    def from_args(cls, args) -> "VideoSettings":
        return cls(folder=args.video_dir, max_count=args.video_store_count,
                   max_bytes=int(args.video_store_mb * 2**20), fps=args.video_fps)


def load_video_model(args) -> LoadedModel:
    """The ``--video-model`` pipeline (a folder, or ``builtin``), accelerated with the same flags as the image
    model."""
    import omni_accel

    from ..cli import _load_pipeline_quietly
    from .server import device_dtype_config

    device, dtype, config = device_dtype_config(args)
    if args.video_model == "builtin":
        from ..builtin import BUILTIN_VIDEO_DEFAULTS, BUILTIN_VIDEO_FPS, load_builtin_video
        from ..errors import AccelError

        try:
            pipe = load_builtin_video(dtype=dtype, device="cpu" if args.offload else device)
        except AccelError as exc:
            from ..cli import CliError

            raise CliError(f"--video-model builtin: {exc}")
        defaults, model_id, fps = dict(BUILTIN_VIDEO_DEFAULTS), BUILTIN_VIDEO_ID, BUILTIN_VIDEO_FPS
    else:
        pipe, defaults, _ = _load_pipeline_quietly(argparse.Namespace(**{**vars(args), "model": args.video_model}),
                                                   device, dtype)
        model_id = os.path.basename(os.path.normpath(os.path.expanduser(args.video_model))) or "video-model"
        fps = None
    lora = None
    if args.video_lora or args.video_lora_dir:  # before accelerate(), as for the image model
        from .lora import LoraManager, parse_lora_flags

        lora = LoraManager(pipe, parse_lora_flags(args.video_lora, "--video-lora"), max_loras=args.max_loras,
                           lora_dir=args.video_lora_dir, max_rank=args.max_lora_rank)
        lora.prepare()
    omni_accel.accelerate(pipe, config=config)
    model = LoadedModel.from_pipeline(pipe, args.served_video_model_name or model_id, defaults)
    model.lora = lora
    if model.native_frames is None:
        from ..cli import CliError

        raise CliError(f"--video-model {args.video_model!r} is a {model.pipeline_class}, not a video pipeline "
                       "(serve it with --model)")
    model.fps = args.video_fps or fps or model.fps
    logger.info("omni_accel.serve: loaded the video model %r (%s, native %dx%d, %d frames at %d fps)", model.id,
                model.pipeline_class, *model.native_size, model.native_frames, model.fps)
    return model


def warmup(model: LoadedModel) -> None:
    """One tiny call (1 frame, 1 step) so the first job does not pay for lazy initialisation."""
    from PIL import Image

    m = model.size_multiple
    spec = {"prompt": "warm-up", "width": m, "height": m, "num_frames": 1, "steps": 1, "seed": 0,
            "image": Image.new("RGB", (m, m), (128, 128, 128)) if "image" in model.accepted else None}
    try:
        run_video_spec(model, spec)
    except Exception as exc:  # noqa: BLE001 -- a failing warm-up is logged; jobs will report the error
        logger.warning("omni_accel.serve: video warm-up call failed: %r", exc)


def video_runner(model: LoadedModel):
    return lambda spec, control=None: run_video_spec(model, spec, control)


__all__ = ["VideoKind", "VideoRequest", "VideoSettings", "VideoStore", "frames_for", "install", "load_video_model",
           "run_video_spec", "video_queue", "video_runner"]
