"""OpenAI-compatible speech endpoints over a SpeechPipeline (omni_accel.ar_bridge.speech).

* ``POST /v1/audio/speech`` -- {model, input, voice, response_format, speed, stream_format}. ``wav``, ``flac`` and
  ``mp3`` (flac / mp3 where soundfile / lameenc is installed) come back as one file; ``pcm`` (16-bit little-endian
  mono at 24 kHz) is streamed as the chunks are made, and ``stream_format="sse"`` streams ``speech.audio.delta``
  events (base64 PCM) then ``speech.audio.done``, as OpenAI's API does.
* ``GET /v1/audio/voices`` -- the model's voices.

Speech requests are jobs on the shared job mechanism (serve/jobs.py), with the image endpoints' rules and flags: a
queue and worker of their own, one request generating at a time, at most ``--max-queue`` more waiting (beyond that
429 + Retry-After), 504 after ``--request-timeout``, a drain on SIGTERM. A client that goes away, or a request that
times out, cancels its job: the pipeline stops at its next talker step or audio chunk and the next request starts.

A stream's 200 header goes out with its first chunk, so anything that fails before it is an ordinary error answer.
A failure after it ends an SSE stream with an ``error`` event and cuts a raw PCM stream (no final chunk: the client
reads an incomplete body), and is logged.

``omni-accel serve --speech-model PATH`` serves these alone, or beside the image endpoints when --model is given
too. Unknown voice / format -> 400 with an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import io
import json
import logging
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field

from .errors import ApiError, StreamAborted, bad_request, pipeline_failure, shutting_down_error, timeout_error
from .jobs import (WAITING, Aborted, ClientGone, Job, JobKind, JobQueue, ShuttingDown, Stream, await_job,
                   submit_or_raise)

logger = logging.getLogger("omni_accel.serve")

HARD_MAX_INPUT = 4096  # OpenAI's limit on `input`
MEDIA = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg"}
_LIBRARY = {"flac": "soundfile", "mp3": "lameenc"}
POLL_S = 0.25  # how often a waiting request checks its deadline and whether its client is still there


def available_formats() -> list[str]:
    """Formats this process can encode: wav and pcm always, flac / mp3 when their library is installed."""
    return ["wav", "pcm"] + [f for f, lib in _LIBRARY.items() if importlib.util.find_spec(lib) is not None]


class SpeechRequest(BaseModel):
    model: str | None = Field(None, description="the served speech model id (optional)")
    input: str = Field(..., min_length=1, max_length=HARD_MAX_INPUT, description="the text to speak")
    voice: str | None = Field(None, description="one of GET /v1/audio/voices (default: the first)")
    response_format: str = Field("wav", description="wav | pcm | flac | mp3 (flac/mp3 where a library is installed)")
    speed: float = Field(1.0, description="0.25..4.0 (resamples: pitch moves with speed)")
    stream_format: Literal["audio", "sse"] = Field("audio", description="'sse' streams base64 PCM events")
    instructions: str | None = Field(None, description="accepted for compatibility; not used by this model")
    seed: int | None = Field(None, description="seed of the DiT noise and talker sampling (default 0)")


@dataclass
class SpeechSettings:
    """What the speech routes need besides the pipeline (from the command line: ``from_args``)."""

    model_id: str
    sampling: dict | None = None  # the talker's sampling: {} greedy, None the model's defaults
    max_codes: int = 2048
    max_queue: int = 32
    request_timeout_s: float = 300.0
    max_upload_bytes: int = 20 * 2**20  # one image or audio part of a chat message
    max_input_pixels: int = 4096 * 4096

    @classmethod
    def from_args(cls, args, model_id: str) -> "SpeechSettings":
        return cls(model_id=model_id, sampling=sampling_of(args), max_codes=args.speech_max_codes,
                   max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                   max_upload_bytes=int(getattr(args, "max_upload_mb", 20.0) * 2**20),
                   max_input_pixels=getattr(args, "max_input_pixels", cls.max_input_pixels))


# -- encoding -----------------------------------------------------------------------------------------------
def pcm16(wave) -> bytes:
    import torch

    return (wave.clamp(-1, 1) * 32767.0).round().to(torch.int16).numpy().tobytes()


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    header = b"RIFF" + struct.pack("<I", 36 + len(pcm)) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return header + b"data" + struct.pack("<I", len(pcm)) + pcm


def encode(wave, sample_rate: int, fmt: str) -> bytes:
    if fmt == "pcm":
        return pcm16(wave)
    if fmt == "wav":
        return wav_bytes(pcm16(wave), sample_rate)
    if fmt == "flac":
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, wave.clamp(-1, 1).numpy(), sample_rate, format="FLAC", subtype="PCM_16")
        return buf.getvalue()
    if fmt == "mp3":
        import lameenc

        enc = lameenc.Encoder()
        enc.set_bit_rate(64)
        enc.set_in_sample_rate(sample_rate)
        enc.set_channels(1)
        return bytes(enc.encode(pcm16(wave)) + enc.flush())
    raise bad_request(f"response_format={fmt!r} is not supported", "response_format", "invalid_value")


# -- decoding (chat's input_audio parts) -----------------------------------------------------------------------
AUDIO_INPUT_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac"}  # input_audio.format -> FFmpeg's demuxer


def decode_audio_upload(data: bytes, fmt: str, *, sample_rate: int, max_seconds: float, max_bytes: int,
                        param: str = "input_audio"):
    """An uploaded clip -> mono float32 samples at ``sample_rate`` (PyAV: FFmpeg's demuxer for ``fmt`` and its
    resampler), or ApiError 400/413. Decoding stops as soon as the clip runs past ``max_seconds``."""
    import av
    import numpy as np

    if fmt not in AUDIO_INPUT_FORMATS:
        raise bad_request(f"{param}: format={fmt!r} is not one of {', '.join(AUDIO_INPUT_FORMATS)}", param,
                          "invalid_value")
    if len(data) > max_bytes:
        raise ApiError(413, f"{param}: the upload is {len(data)} bytes, larger than the limit of {max_bytes} bytes "
                            "(omni-accel serve --max-upload-mb)", param=param, code="upload_too_large")
    limit = int(max_seconds * sample_rate)
    pieces, samples = [], 0
    try:
        with av.open(io.BytesIO(data), mode="r", format=AUDIO_INPUT_FORMATS[fmt]) as container:
            if not container.streams.audio:
                raise bad_request(f"{param}: the {fmt} file holds no audio stream", param, "invalid_audio")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
            for frame in [*container.decode(audio=0), None]:  # None flushes the resampler
                for out in resampler.resample(frame):
                    pieces.append(out.to_ndarray().reshape(-1))
                    samples += pieces[-1].size
                if samples > limit:
                    raise bad_request(f"{param}: the clip is longer than {max_seconds:g} s, the most the model "
                                      "takes per clip; cut it or send several input_audio parts", param,
                                      "audio_too_long")
    except av.error.FFmpegError as exc:
        raise bad_request(f"{param}: not a readable {fmt} file ({exc.__class__.__name__})", param, "invalid_audio")
    if not samples:
        raise bad_request(f"{param}: the clip holds no samples", param, "invalid_audio")
    return np.concatenate(pieces).astype(np.float32)


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# -- the speech job ------------------------------------------------------------------------------------------
class SpeechKind(JobKind):
    """Speech jobs: one at a time (the pipeline holds its engines), never batched; a streamed job emits the
    pipeline's chunks, a whole one results in the pipeline's SpeechResult. Cost: characters of input (Retry-After
    estimates scale with the text)."""

    name = "speech"
    what = "the speech pipeline"

    def job(self, params: dict, route: str = "/v1/audio/speech", stream: Stream | None = None) -> Job:
        return Job(kind=self, route=route, params=params, cost=max(1, len(params["input"])), stream=stream)

    def spec(self, batch: list[Job]) -> dict:
        return dict(batch[0].params, streamed=batch[0].stream is not None)


def speech_executor(pipeline: Any) -> Callable[[dict, Any], Any]:
    """The queue's executor: the pipeline's stream (chunks emitted) or one whole generation, stopped at its next
    talker step or chunk when the job is cancelled."""
    from ..ar_bridge.speech import SpeechCancelled

    def execute(spec: dict, control) -> Any:
        if spec.get("kind") == "chat":  # /v1/chat/completions on the omni model (serve/chat.py)
            from .chat import run_chat

            return run_chat(pipeline, spec, control)
        options = {k: spec[k] for k in ("seed", "speed", "sampling", "max_codes")}
        try:
            if spec["streamed"]:
                for chunk in pipeline.stream(spec["input"], spec["voice"], cancel=control.cancel_event, **options):
                    control.emit(chunk)
                return None
            return pipeline.generate(spec["input"], spec["voice"], cancel=control.cancel_event, **options)
        except SpeechCancelled:
            raise Aborted()

    return execute


def speech_queue(pipeline: Any, settings: "SpeechSettings", metrics: Any, start: bool = True) -> JobQueue:
    queue = JobQueue("speech", speech_executor(pipeline), max_queue=settings.max_queue, max_batch=1, metrics=metrics,
                     gauges=(metrics.speech_queue_depth, metrics.speech_running))
    queue.kinds["speech"] = SpeechKind()
    from .chat import ChatKind

    queue.kinds["chat"] = ChatKind()
    if start:
        queue.start()
    return queue


@dataclass
class SpeechInfo:
    """What the speech routes read from a SpeechPipeline, without the pipeline: an ingress whose replicas hold it
    (serve/ray_app.py) answers voices and checks requests with this."""

    voices: list[str]
    sample_rate: int
    engines: dict
    input_sample_rate: int = 16000  # audio clips a chat message sends to the thinker
    max_input_seconds: float = 30.0

    @classmethod
    def of(cls, pipeline: Any) -> "SpeechInfo":
        return cls(list(pipeline.voices), int(pipeline.sample_rate), dict(getattr(pipeline, "engines", {})),
                   int(getattr(pipeline, "input_sample_rate", 16000)),
                   float(getattr(pipeline, "max_input_seconds", 30.0)))

    def resolve_voice(self, voice: str | None) -> str:
        from ..ar_bridge.speech import match_voice

        return match_voice(self.voices, voice)


async def stream_body(queue: JobQueue, job: Job, first: Any, deadline: float, timeout_s: float, sse: bool,
                      metrics):
    """The streamed body: ``first`` and the chunks after it as PCM (or SSE events). However it ends -- done,
    failed, timed out, or closed because the client left -- the job is cancelled, so the pipeline never keeps
    working for nobody."""
    loop = asyncio.get_running_loop()
    sent = 0
    ended = False  # the body reached its end (done, or an error told to the client): no one left early
    try:
        chunk = first
        while chunk is not Stream.END:
            data = pcm16(chunk)
            sent += len(data)
            yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data
            chunk = await job.stream.get(deadline - loop.time())
            if chunk is WAITING:  # only when the deadline has passed
                queue.cancel(job, "timeout")
                raise timeout_error(timeout_s)
        ended = True
        if sse:
            yield sse_event({"type": "speech.audio.done"})
    except Exception as exc:  # noqa: BLE001 -- the header is out: say it in the stream (SSE) or cut it (PCM)
        ended = True
        queue.cancel(job, "error")
        error = (exc if isinstance(exc, ApiError) else shutting_down_error() if isinstance(exc, ShuttingDown)
                 else pipeline_failure(exc, SpeechKind.what))
        metrics.speech_stream_errors.labels(error.code or "error").inc()
        logger.error("omni_accel.serve: speech stream failed after %d bytes of audio (%s): %s", sent, error.code,
                     error.message)
        if not sse:
            raise StreamAborted(error.message) from exc
        yield sse_event({"type": "error", **error.body()})
    finally:
        if not ended and queue.cancel(job, "disconnect") is not None:  # closed mid-way: the client went away
            logger.info("omni_accel.serve: speech client disconnected after %d bytes; stopping its generation", sent)


# -- routes -------------------------------------------------------------------------------------------------
def install(api: FastAPI, pipeline: Any, settings: SpeechSettings, metrics: Any,
            queue: JobQueue | None = None) -> JobQueue:
    """Add /v1/audio/speech and /v1/audio/voices to ``api``, served by ``pipeline`` (a SpeechPipeline, or its
    SpeechInfo when ``queue`` runs the jobs elsewhere) with ``settings``; returns the routes' job queue (a new one,
    started, unless ``queue`` is given)."""
    from ..errors import AccelError

    queue = queue if queue is not None else speech_queue(pipeline, settings, metrics)
    allowed_models = (settings.model_id, "tts-1", "tts-1-hd", "gpt-4o-mini-tts")

    def check(req: SpeechRequest) -> str:
        if req.model is not None and req.model not in allowed_models:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server speaks with "
                                f"{settings.model_id!r} (see GET /v1/models)", param="model", code="model_not_found")
        formats = available_formats()
        if req.response_format not in formats:
            extra = (f" (install {_LIBRARY[req.response_format]} for {req.response_format})"
                     if req.response_format in _LIBRARY else "")
            raise bad_request(f"response_format={req.response_format!r} is not supported; use one of "
                              f"{', '.join(formats)}{extra}", "response_format", "invalid_value")
        if not 0.25 <= req.speed <= 4.0:
            raise bad_request(f"speed={req.speed} is outside 0.25..4.0", "speed", "invalid_value")
        if req.stream_format == "sse" and req.response_format not in ("pcm", "wav"):
            raise bad_request("stream_format='sse' streams PCM; use response_format 'pcm' (or 'wav')",
                              "stream_format", "invalid_value")
        try:
            return pipeline.resolve_voice(req.voice)
        except AccelError as exc:
            raise bad_request(str(exc), "voice", "invalid_value")

    @api.get("/v1/audio/voices", summary="The voices of the speech model")
    async def voices():
        return {"object": "list", "model": settings.model_id,
                "data": [{"id": v, "name": v, "object": "voice"} for v in pipeline.voices]}

    @api.post("/v1/audio/speech", summary="Speak text (OpenAI audio.speech)", response_class=Response)
    async def speech(req: SpeechRequest, request: Request):
        voice = check(req)
        streamed = req.stream_format == "sse" or req.response_format == "pcm"
        timeout_s = settings.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        params = dict(input=req.input, voice=voice, seed=0 if req.seed is None else req.seed, speed=req.speed,
                      sampling=settings.sampling, max_codes=settings.max_codes)
        job = submit_or_raise(queue, queue.kinds["speech"].job(params, stream=Stream() if streamed else None),
                              what="speech requests")
        try:
            first = await await_job(queue, job, request, timeout_s, deadline=deadline)
        except ClientGone:
            return Response(status_code=499)
        if first is Stream.END:  # a stream without a single chunk; the pipeline raises for that, this is a backstop
            raise ApiError(500, "the speech pipeline produced no audio", type="server_error", code="pipeline_error")
        sr = pipeline.sample_rate
        if streamed:
            sse = req.stream_format == "sse"
            body = stream_body(queue, job, first, deadline, timeout_s, sse, metrics)
            if sse:
                return StreamingResponse(body, media_type="text/event-stream")
            return StreamingResponse(body, media_type=MEDIA["pcm"],
                                     headers={"X-Sample-Rate": str(sr), "X-Channels": "1", "X-Sample-Format": "s16le"})
        audio = await asyncio.to_thread(encode, first.waveform, sr, req.response_format)
        return Response(audio, media_type=MEDIA[req.response_format])

    return queue


def create_speech_app(pipeline: Any, settings: SpeechSettings, *, api_key: str | None = None,
                      max_body: int = 2**20, queue: JobQueue | None = None, metrics: Any = None):
    """A speech-only app: the speech routes, /health, /v1/models, /metrics, OpenAI error bodies, the API-key
    guard (over ``queue`` when given: see ``install``)."""
    from .app import _Guard, install_error_handlers
    from .metrics import ServeMetrics

    metrics = metrics or ServeMetrics()
    api = FastAPI(title="omni_accel speech server", version=__import__("omni_accel").__version__,
                  description="OpenAI-compatible speech with an omni_accel speech pipeline. See docs/speech.md.")
    install_error_handlers(api)
    queue = install(api, pipeline, settings, metrics, queue)

    @api.get("/health")
    async def health():
        return {"status": "stopping" if queue.stopping else "ok", "model": settings.model_id,
                "queue_depth": queue.queue_depth, "running": queue.running}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_id, "object": "model", "owned_by": "omni_accel"}]}

    @api.get("/metrics", response_class=Response, summary="Prometheus metrics (text exposition format)")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app = _Guard(api, metrics=metrics, api_key=api_key, max_body=max_body)
    app.fastapi = api
    app.queues = [queue]
    from . import chat

    chat.install(api, speech=(pipeline, queue, settings))
    return app


# -- CLI (the arguments are in server.py) ------------------------------------------------------------------
def sampling_of(args) -> dict | None:
    return {} if getattr(args, "speech_greedy", False) else None


def folder_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)) or "speech"


def load_pipeline(args):
    from ..ar_bridge.speech import SpeechPipeline
    from ..cli import CliError

    if args.speech_max_codes < 1:
        raise CliError(f"--speech-max-codes {args.speech_max_codes} is invalid: it must be >= 1.")

    return SpeechPipeline(args.speech_model, engine=args.speech_engine, chat=False, compile=args.speech_compile)


def build_speech_server(args, pipeline):
    """The uvicorn server of a speech-only ``omni-accel serve`` around ``pipeline`` (``run`` loads it; tests pass
    one they already have)."""
    from .server import uvicorn_server

    settings = SpeechSettings.from_args(args, args.served_model_name or folder_name(args.speech_model))
    app = create_speech_app(pipeline, settings, api_key=args.api_key, max_body=int(args.max_body_mb * 2**20))
    from .sleep import Sleeper, add_sleep_mode

    add_sleep_mode(app, app.fastapi, [Sleeper(app.queues[0], pipeline)], enabled=args.enable_sleep_mode,
                   auto_wake=not args.no_auto_wake)
    return uvicorn_server(app, args, drains=app.queues), settings


def warmup(pipeline: Any, args) -> None:
    """One short generation, so the first request does not pay for lazy initialisation."""
    from ..errors import AccelError

    with contextlib.suppress(AccelError):  # a random-weight model may speak no codes for it
        pipeline.generate("warm-up", max_codes=8, sampling=sampling_of(args))


def run(args) -> int:
    """Speech-only server (``--speech-model`` without ``--model``)."""
    pipeline = load_pipeline(args)
    if not args.no_warmup:
        warmup(pipeline, args)
    from .server import serve

    server, settings = build_speech_server(args, pipeline)
    print(f"omni-accel serve: speech {settings.model_id} ({pipeline.engines}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    try:
        return serve(server)
    finally:
        pipeline.close()
