"""OpenAI-compatible speech endpoints over a SpeechPipeline (omni_accel.ar_bridge.speech).

* ``POST /v1/audio/speech`` -- {model, input, voice, response_format, speed, stream_format}. ``wav``, ``flac`` and
  ``mp3`` (flac / mp3 where soundfile / lameenc is installed) come back as one file; ``pcm`` (16-bit little-endian
  mono at 24 kHz) is streamed as the chunks are made, and ``stream_format="sse"`` streams ``speech.audio.delta``
  events (base64 PCM) then ``speech.audio.done``, as OpenAI's API does.
* ``GET /v1/audio/voices`` -- the model's voices.

Admission follows the image endpoints' rules with the same flags: one speech request runs at a time (the pipeline
holds a lock), at most ``--max-queue`` more wait (beyond that 429 + Retry-After), and a request not answered within
``--request-timeout`` gets 504. A client that goes away, or a request that times out, sets the generation's cancel
event: the pipeline stops at its next talker step or audio chunk and the next request starts.

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
import math
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field

from .errors import ApiError, StreamAborted, bad_request, queue_full_error, timeout_error

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

    @classmethod
    def from_args(cls, args, model_id: str) -> "SpeechSettings":
        return cls(model_id=model_id, sampling=sampling_of(args), max_codes=args.speech_max_codes,
                   max_queue=args.max_queue, request_timeout_s=args.request_timeout)


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


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# -- admission ----------------------------------------------------------------------------------------------
class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class SpeechAdmission:
    """One speech request runs at a time, at most ``max_queue`` wait in arrival order, more are refused (429).

    The slot is handed back by ``leave`` when the generation thread has ended -- not when the HTTP answer ends -- so
    a request whose client left holds it only until the pipeline has stopped, and the next one never queues behind
    the pipeline's own lock where its deadline could not be enforced."""

    def __init__(self, max_queue: int, metrics: Any):
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting = 0
        self.running = 0
        self._slot = asyncio.Semaphore(1)  # FIFO: waiters are woken in arrival order
        self._avg_run_s: float | None = None  # measured run time (running average), for Retry-After
        self._started = 0.0

    def retry_after(self) -> int:
        """Seconds until a waiting place frees: the running request's expected remaining time (1 s before any
        request was measured)."""
        if not self.running or self._avg_run_s is None:
            return 1
        return max(1, math.ceil(self._avg_run_s - (time.monotonic() - self._started)))

    async def enter(self, request: Request, deadline: float, timeout_s: float) -> None:
        """Wait for the slot: ApiError 429 when the queue is full, 504 at ``deadline`` (``timeout_s`` after the
        request came); ClientGone if the client leaves while waiting (its place is given up, it never runs)."""
        if self._slot.locked() and self.waiting >= self.max_queue:
            self.metrics.rejected.inc()
            wait_s = self.retry_after()
            raise queue_full_error(self.waiting, self.max_queue, wait_s, what="speech requests")
        loop = asyncio.get_running_loop()
        acquire = asyncio.ensure_future(self._slot.acquire())
        self._set_waiting(+1)
        try:
            while not acquire.done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.metrics.cancelled.labels("queued", "timeout").inc()
                    raise timeout_error(timeout_s)
                await asyncio.wait({acquire}, timeout=min(POLL_S, remaining))
                if not acquire.done() and await request.is_disconnected():
                    self.metrics.cancelled.labels("queued", "disconnect").inc()
                    raise ClientGone()
        except BaseException:
            self._give_up(acquire)
            raise
        finally:
            self._set_waiting(-1)
        self._started = time.monotonic()
        self._set_running(1)

    def leave(self) -> None:
        """The generation thread ended: the pipeline is free for the next request."""
        seconds = time.monotonic() - self._started
        self._avg_run_s = seconds if self._avg_run_s is None else 0.7 * self._avg_run_s + 0.3 * seconds
        self._set_running(0)
        self._slot.release()

    def _give_up(self, acquire: asyncio.Future) -> None:
        if acquire.done() and not acquire.cancelled():  # the slot came at the last moment: hand it on
            self._slot.release()
        else:
            acquire.cancel()

    def _set_waiting(self, delta: int) -> None:
        self.waiting += delta
        self.metrics.speech_queue_depth.set(self.waiting)

    def _set_running(self, value: int) -> None:
        self.running = value
        self.metrics.speech_running.set(value)


# -- one generation on its own thread ----------------------------------------------------------------------
_END = object()  # the generation is done
_WAITING = object()  # nothing new within the wait


def _same_threads(threads: int) -> None:
    # a new thread starts with OpenMP's default; vLLM's CPU kernels check that the thread count they run with is
    # the one the engine planned with (the same fix as ar_bridge/stages.py)
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class Generation:
    """A blocking generator (the pipeline's stream, or one whole result) run on its own thread. Its items reach
    the event loop through a queue; setting ``cancel`` makes the pipeline stop at its next talker step or chunk;
    ``on_end`` runs on the loop when the thread is done."""

    def __init__(self, produce: Callable[[threading.Event], Iterator[Any]], threads: int,
                 on_end: Callable[[], None]):
        self.cancel = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=self._work, args=(produce, threads, on_end), name="omni_accel-speech",
                         daemon=True).start()

    def _work(self, produce, threads: int, on_end) -> None:
        _same_threads(threads)
        try:
            for item in produce(self.cancel):
                self._on_loop(self._items.put_nowait, item)
            self._on_loop(self._items.put_nowait, _END)
        except BaseException as exc:  # noqa: BLE001 -- handed to the request's task, which answers for it
            self._on_loop(self._items.put_nowait, exc)
        finally:
            self._on_loop(on_end)

    def _on_loop(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self._loop.call_soon_threadsafe(fn, *args)

    async def next(self, timeout: float) -> Any:
        """The next item, _END when the generation is done, _WAITING when nothing came within ``timeout`` s.
        The generation's exception is raised here."""
        try:
            item = await asyncio.wait_for(self._items.get(), max(timeout, 0.0))
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return _WAITING
        if isinstance(item, BaseException):
            raise item
        return item


def failure_error(exc: BaseException) -> ApiError:
    """The answer for an exception from the speech pipeline."""
    from ..errors import AccelError

    if isinstance(exc, AccelError):
        return bad_request(str(exc), "input", "invalid_value")
    return ApiError(500, f"the speech pipeline failed: {exc.__class__.__name__}: {exc}", type="server_error",
                    code="pipeline_error")


async def first_item(generation: Generation, request: Request, deadline: float, timeout_s: float, metrics) -> Any:
    """The first chunk of a stream, or a whole request's result. At the deadline: 504; a client that left:
    ClientGone; a failure: its ApiError. In each case the generation is told to stop."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            item = await generation.next(min(POLL_S, deadline - loop.time()))
            if item is not _WAITING:
                return item
            if loop.time() >= deadline:
                metrics.cancelled.labels("running", "timeout").inc()
                raise timeout_error(timeout_s)
            if await request.is_disconnected():
                metrics.cancelled.labels("running", "disconnect").inc()
                logger.info("omni_accel.serve: speech client disconnected; stopping its generation")
                raise ClientGone()
    except BaseException as exc:  # timeout, client gone, a failure, or this task cancelled at shutdown
        generation.cancel.set()  # nobody will take the audio
        if isinstance(exc, Exception) and not isinstance(exc, (ApiError, ClientGone)):
            raise failure_error(exc) from exc  # the pipeline's own failure
        raise


async def stream_body(generation: Generation, first: Any, deadline: float, timeout_s: float, sse: bool, metrics):
    """The streamed body: ``first`` and the chunks after it as PCM (or SSE events). However it ends -- done,
    failed, timed out, or closed because the client left -- the generation's cancel event is set, so the pipeline
    never keeps working for nobody."""
    loop = asyncio.get_running_loop()
    sent = 0
    ended = False  # the body reached its end (done, or an error told to the client): no one left early
    try:
        chunk = first
        while chunk is not _END:
            data = pcm16(chunk)
            sent += len(data)
            yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data
            chunk = await generation.next(deadline - loop.time())
            if chunk is _WAITING:  # only when the deadline has passed
                metrics.cancelled.labels("running", "timeout").inc()
                raise timeout_error(timeout_s)
        ended = True
        if sse:
            yield sse_event({"type": "speech.audio.done"})
    except Exception as exc:  # noqa: BLE001 -- the header is out: say it in the stream (SSE) or cut it (PCM)
        ended = True
        generation.cancel.set()
        error = exc if isinstance(exc, ApiError) else failure_error(exc)
        metrics.speech_stream_errors.labels(error.code or "error").inc()
        logger.error("omni_accel.serve: speech stream failed after %d bytes of audio (%s): %s", sent, error.code,
                     error.message)
        if not sse:
            raise StreamAborted(error.message) from exc
        yield sse_event({"type": "error", **error.body()})
    finally:
        generation.cancel.set()
        if not ended:  # closed or cancelled mid-way: the client went away
            metrics.cancelled.labels("running", "disconnect").inc()
            logger.info("omni_accel.serve: speech client disconnected after %d bytes; stopping its generation", sent)


# -- routes -------------------------------------------------------------------------------------------------
def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def install(api: FastAPI, pipeline: Any, settings: SpeechSettings, metrics: Any) -> SpeechAdmission:
    """Add /v1/audio/speech and /v1/audio/voices to ``api``, served by ``pipeline`` (a SpeechPipeline) with
    ``settings``; returns the routes' admission (its queue)."""
    from ..errors import AccelError

    threads = _torch_threads()
    admission = SpeechAdmission(settings.max_queue, metrics)
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

    def producer(req: SpeechRequest, voice: str, streamed: bool) -> Callable[[threading.Event], Iterator[Any]]:
        options = dict(seed=0 if req.seed is None else req.seed, speed=req.speed, sampling=settings.sampling,
                       max_codes=settings.max_codes)

        def whole(cancel: threading.Event) -> Iterator[Any]:
            yield pipeline.generate(req.input, voice, cancel=cancel, **options)

        if streamed:
            return lambda cancel: pipeline.stream(req.input, voice, cancel=cancel, **options)
        return whole

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
        try:
            await admission.enter(request, deadline, timeout_s)
        except ClientGone:
            return Response(status_code=499)
        try:
            generation = Generation(producer(req, voice, streamed), threads, admission.leave)
        except BaseException:
            admission.leave()
            raise
        try:
            first = await first_item(generation, request, deadline, timeout_s, metrics)
        except ClientGone:
            return Response(status_code=499)
        if first is _END:  # a stream without a single chunk; the pipeline raises for that, this is a backstop
            raise ApiError(500, "the speech pipeline produced no audio", type="server_error", code="pipeline_error")
        sr = pipeline.sample_rate
        if streamed:
            sse = req.stream_format == "sse"
            body = stream_body(generation, first, deadline, timeout_s, sse, metrics)
            if sse:
                return StreamingResponse(body, media_type="text/event-stream")
            return StreamingResponse(body, media_type=MEDIA["pcm"],
                                     headers={"X-Sample-Rate": str(sr), "X-Channels": "1", "X-Sample-Format": "s16le"})
        audio = await asyncio.to_thread(encode, first.waveform, sr, req.response_format)
        return Response(audio, media_type=MEDIA[req.response_format])

    return admission


def create_speech_app(pipeline: Any, settings: SpeechSettings, *, api_key: str | None = None,
                      max_body: int = 2**20):
    """A speech-only app: the speech routes, /health, /v1/models, /metrics, OpenAI error bodies, the API-key
    guard."""
    from .app import _Guard, install_error_handlers
    from .metrics import ServeMetrics

    metrics = ServeMetrics()
    api = FastAPI(title="omni_accel speech server", version=__import__("omni_accel").__version__,
                  description="OpenAI-compatible speech with an omni_accel speech pipeline. See docs/speech.md.")
    install_error_handlers(api)
    admission = install(api, pipeline, settings, metrics)

    @api.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_id, "queue_depth": admission.waiting,
                "running": admission.running}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_id, "object": "model", "owned_by": "omni_accel"}]}

    @api.get("/metrics", response_class=Response, summary="Prometheus metrics (text exposition format)")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app = _Guard(api, metrics=metrics, api_key=api_key, max_body=max_body)
    app.fastapi = api
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
    return uvicorn_server(app, args), settings


def run(args) -> int:
    """Speech-only server (``--speech-model`` without ``--model``)."""
    from ..errors import AccelError

    pipeline = load_pipeline(args)
    if not args.no_warmup:
        with contextlib.suppress(AccelError):  # a random-weight model may speak no codes for it
            pipeline.generate("warm-up", max_codes=8, sampling=sampling_of(args))
    server, settings = build_speech_server(args, pipeline)
    print(f"omni-accel serve: speech {settings.model_id} ({pipeline.engines}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        pipeline.close()
    return 0
