"""OpenAI-compatible speech endpoints over a SpeechPipeline (omni_accel.ar_bridge.speech).

* ``POST /v1/audio/speech`` -- {model, input, voice, response_format, speed, stream_format}. ``wav`` (and ``flac`` /
  ``mp3`` where soundfile / lameenc is installed) come back as one file; ``pcm`` (16-bit little-endian mono at
  24 kHz) is streamed as the chunks are made, and ``stream_format="sse"`` streams ``speech.audio.delta`` events
  (base64 PCM) then ``speech.audio.done``, as OpenAI's API does.
* ``GET /v1/audio/voices`` -- the model's voices.

``omni-accel serve --speech-model PATH`` serves these alone, or beside the image endpoints when --model is given
too. Unknown voice / format -> 400 with an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import logging
import os
import struct
import sys
import threading
from typing import Any, Iterator, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field

from .errors import ApiError, bad_request

logger = logging.getLogger("omni_accel.serve")

HARD_MAX_INPUT = 4096  # OpenAI's limit on `input`
MEDIA = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg"}
_LIBRARY = {"flac": "soundfile", "mp3": "lameenc"}


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
        soundfile.write(buf, wave.numpy(), sample_rate, format="FLAC")
        return buf.getvalue()
    if fmt == "mp3":
        import lameenc

        enc = lameenc.Encoder()
        enc.set_bit_rate(64)
        enc.set_in_sample_rate(sample_rate)
        enc.set_channels(1)
        return enc.encode(pcm16(wave)) + enc.flush()
    raise bad_request(f"response_format={fmt!r} is not supported", "response_format", "invalid_value")


# -- routes -------------------------------------------------------------------------------------------------
def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _same_threads(threads: int) -> None:
    # a new thread starts with OpenMP's default; vLLM's CPU kernels check that the thread count they run with is
    # the one the engine planned with (the same fix as ar_bridge/stages.py)
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _iterate_in_thread(gen: Iterator[Any], threads: int):
    """An async iterator over a blocking generator, run on one worker thread (the pipeline holds a lock)."""
    q: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    done = object()

    def work() -> None:
        _same_threads(threads)
        try:
            for item in gen:
                loop.call_soon_threadsafe(q.put_nowait, item)
        except BaseException as exc:  # noqa: BLE001 -- handed to the response task
            loop.call_soon_threadsafe(q.put_nowait, exc)
        loop.call_soon_threadsafe(q.put_nowait, done)

    threading.Thread(target=work, name="omni_accel-speech", daemon=True).start()

    async def items():
        while True:
            item = await q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                logger.error("omni_accel.serve: speech stream failed: %r", item)
                return
            yield item

    return items()


def install(api: FastAPI, pipeline: Any, model_id: str, sampling: dict | None = None,
            max_codes: int = 2048) -> None:
    """Add /v1/audio/speech and /v1/audio/voices to ``api``, served by ``pipeline`` (a SpeechPipeline).

    ``sampling``: the talker's sampling ({} = greedy; None = the model's defaults)."""
    from ..errors import AccelError

    threads = _torch_threads()

    def whole(*args: Any, **kwargs: Any):
        _same_threads(threads)
        return pipeline.generate(*args, **kwargs)

    def check(req: SpeechRequest) -> str:
        if req.model is not None and req.model not in (model_id, "tts-1", "tts-1-hd", "gpt-4o-mini-tts"):
            raise ApiError(404, f"the model {req.model!r} does not exist; this server speaks with {model_id!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")
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
        return {"object": "list", "model": model_id,
                "data": [{"id": v, "name": v, "object": "voice"} for v in pipeline.voices]}

    @api.post("/v1/audio/speech", summary="Speak text (OpenAI audio.speech)", response_class=Response)
    async def speech(req: SpeechRequest, request: Request):
        voice = check(req)
        seed = 0 if req.seed is None else req.seed
        sr = pipeline.sample_rate
        if req.stream_format == "sse":
            chunks = _iterate_in_thread(pipeline.stream(req.input, voice, seed=seed, speed=req.speed,
                                                        sampling=sampling, max_codes=max_codes), threads)

            async def events():
                async for chunk in chunks:
                    data = base64.b64encode(pcm16(chunk)).decode()
                    yield f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': data})}\n\n"
                yield f"data: {json.dumps({'type': 'speech.audio.done'})}\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        if req.response_format == "pcm":
            chunks = _iterate_in_thread(pipeline.stream(req.input, voice, seed=seed, speed=req.speed,
                                                        sampling=sampling, max_codes=max_codes), threads)

            async def body():
                async for chunk in chunks:
                    yield pcm16(chunk)

            return StreamingResponse(body(), media_type=MEDIA["pcm"],
                                     headers={"X-Sample-Rate": str(sr), "X-Channels": "1", "X-Sample-Format": "s16le"})
        try:
            result = await asyncio.to_thread(whole, req.input, voice, seed=seed,
                                           speed=req.speed, sampling=sampling, max_codes=max_codes)
        except AccelError as exc:
            raise bad_request(str(exc), "input", "invalid_value")
        return Response(encode(result.waveform, sr, req.response_format), media_type=MEDIA[req.response_format])


def create_speech_app(pipeline: Any, model_id: str, *, api_key: str | None = None, max_body: int = 2**20,
                      sampling: dict | None = None, max_codes: int = 2048):
    """A speech-only app: the speech routes, /health, /v1/models, OpenAI error bodies, the API-key guard."""
    from .app import _Guard, install_error_handlers
    from .metrics import ServeMetrics

    api = FastAPI(title="omni_accel speech server", version=__import__("omni_accel").__version__,
                  description="OpenAI-compatible speech with an omni_accel speech pipeline. See docs/speech.md.")

    install_error_handlers(api)

    @api.get("/health")
    async def health():
        return {"status": "ok", "model": model_id}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "omni_accel"}]}

    install(api, pipeline, model_id, sampling, max_codes)
    app = _Guard(api, metrics=ServeMetrics(), api_key=api_key, max_body=max_body)
    app.fastapi = api
    return app


# -- CLI (the arguments are in server.py) ------------------------------------------------------------------
def sampling_of(args) -> dict | None:
    return {} if getattr(args, "speech_greedy", False) else None


def load_pipeline(args):
    from ..ar_bridge.speech import SpeechPipeline
    from ..cli import CliError

    if args.speech_max_codes < 1:
        raise CliError(f"--speech-max-codes {args.speech_max_codes} is invalid: it must be >= 1.")

    return SpeechPipeline(args.speech_model, engine=args.speech_engine, chat=False, compile=args.speech_compile)


def run(args) -> int:
    """Speech-only server (``--speech-model`` without ``--model``)."""
    import contextlib

    import uvicorn

    from ..errors import AccelError

    pipeline = load_pipeline(args)
    model_id = args.served_model_name or os.path.basename(os.path.normpath(args.speech_model)) or "speech"
    if not args.no_warmup:
        with contextlib.suppress(AccelError):  # a random-weight model may speak no codes for it
            pipeline.generate("warm-up", max_codes=8, sampling=sampling_of(args))
    app = create_speech_app(pipeline, model_id, api_key=args.api_key, max_body=int(args.max_body_mb * 2**20),
                            sampling=sampling_of(args), max_codes=args.speech_max_codes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5))
    print(f"omni-accel serve: speech {model_id} ({pipeline.engines}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        pipeline.close()
    return 0
