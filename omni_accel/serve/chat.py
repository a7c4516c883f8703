"""``/v1/chat/completions``: the request schema, message parsing, and the response / SSE chunk shapes.

Two uses, as in vLLM-Omni: an omni speech model (the thinker answers in text -- streamed as it writes -- and the
talker speaks it; ``modalities`` ``["text"]`` or ``["text", "audio"]``, ``audio: {voice, format}``; ``image_url`` and
``input_audio`` parts of the last user message go to the thinker where its engine takes them) and a diffusion model
(the last user message's text, with an ``image_url`` part for an edit pipeline, becomes an image returned as an
``image_url`` content part; ``height`` / ``width`` / ``num_inference_steps`` / ``guidance_scale`` / ``seed`` from the
body, what the ``openai`` client's ``extra_body`` sends). Shapes follow OpenAI's chat API, so the official client parses them unchanged.
"""

from __future__ import annotations

import base64
import binascii
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .errors import bad_request
from .jobs import Job, JobKind

AUDIO_FORMATS = ("wav", "pcm16", "flac", "mp3")
AUDIO_EXPIRY_S = 3600  # message.audio.expires_at: this server keeps no audio for later turns; an hour is nominal
MAX_MESSAGES = 64
DATA_URL_PREFIX = "data:"


class ChatAudio(BaseModel):
    model_config = ConfigDict(extra="forbid")
    voice: str | dict | None = Field(None, description="a voice of the model (GET /v1/audio/voices)")
    format: Literal["wav", "pcm16", "flac", "mp3"] = "wav"


class ChatCompletionRequest(BaseModel):
    """Body of POST /v1/chat/completions. OpenAI fields that do not apply (tools, logprobs, top_p, user, ...) are
    accepted and ignored; ``n`` must be 1."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    modalities: list[Literal["text", "audio", "image"]] | None = None
    audio: ChatAudio | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    max_tokens: int | None = Field(None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(None, ge=1, le=8192)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    # vLLM-Omni: per-stage sampling ([thinker, talker, ...]); the talker's entry sets its sampling here
    sampling_params_list: list[dict[str, Any]] | None = None
    # diffusion models (extra_body with the openai client)
    height: int | None = Field(None, ge=1, le=16384)
    width: int | None = Field(None, ge=1, le=16384)
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    true_cfg_scale: float | None = Field(None, ge=0.0, le=100.0)
    negative_prompt: str | None = None
    lora: dict[str, Any] | None = Field(None, description='{"name" | "path", "scale"}: a LoRA adapter for this request')


@dataclass
class ParsedMessages:
    """What the models take from ``messages``: the system prompt, the turns as (role, text), the last user message's
    text, and the media parts (raw bytes) of the last user message."""

    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)
    last_user_text: str = ""
    images: list[bytes] = field(default_factory=list)
    audios: list[tuple[bytes, str]] = field(default_factory=list)  # (bytes, format)
    media_messages: list[int] = field(default_factory=list)  # indices of the messages with image / audio parts


def _decode_data_url(url: Any, param: str) -> bytes:
    if not isinstance(url, str) or not url.startswith(DATA_URL_PREFIX) or ";base64," not in url:
        raise bad_request(f"{param} must be a data URL (data:image/png;base64,...); this server fetches no remote "
                          "URLs.", param)
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param} is not valid base64.", param) from None


def _parts(content: Any, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        return []
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise bad_request(f"{param} must be a string or a list of content parts.", param)
    return content


def parse_messages(messages: list[dict[str, Any]]) -> ParsedMessages:
    """Validate ``messages`` (roles, content parts) and collect what the models take; 400 naming the bad field."""
    out = ParsedMessages()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"messages[{i}].role={role!r} is not one of system, developer, user, assistant.",
                              f"messages[{i}].role")
        texts, images, audios = [], [], []
        for j, part in enumerate(_parts(message.get("content"), f"messages[{i}].content")):
            param = f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url" and isinstance(part.get("image_url"), dict):
                images.append(_decode_data_url(part["image_url"].get("url"), f"{param}.image_url.url"))
            elif kind == "input_audio" and isinstance(part.get("input_audio"), dict):
                audio = part["input_audio"]
                data = _decode_data_url(f"data:audio;base64,{audio.get('data', '')}", f"{param}.input_audio.data")
                audios.append((data, str(audio.get("format", "wav"))))
            else:
                raise bad_request(f"{param} has type={kind!r}; this server takes text, image_url and input_audio "
                                  "parts.", f"{param}.type")
        text = "\n".join(texts)
        if images or audios:
            out.media_messages.append(i)
        if role in ("system", "developer"):
            out.system = text if out.system is None else out.system + "\n" + text
            continue
        out.turns.append((role, text))
        if role == "user":
            out.last_user_text, out.images, out.audios = text, images, audios
    if not out.turns or out.turns[-1][0] != "user":
        raise bad_request("messages must end with a user message.", "messages")
    return out


# ------------------------------------------------------------------------------------------------ responses
def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def audio_id() -> str:
    return "audio_" + secrets.token_hex(12)


def completion(cid: str, model: str, content: Any, *, audio: dict | None = None, finish: str = "stop",
               usage: dict | None = None) -> dict:
    """A ``chat.completion`` object with one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if audio is not None:
        message["audio"] = audio
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}


def chunk(cid: str, model: str, delta: dict, finish: str | None = None, created: int | None = None) -> dict:
    """A ``chat.completion.chunk`` object (one SSE event of a streamed answer)."""
    return {"id": cid, "object": "chat.completion.chunk", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def message_audio(aid: str, data: bytes, transcript: str) -> dict:
    return {"id": aid, "data": base64.b64encode(data).decode(), "transcript": transcript,
            "expires_at": int(time.time()) + AUDIO_EXPIRY_S}


def image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


# ------------------------------------------------------------------------------------------------ the route
SSE_DONE = "data: [DONE]\n\n"
ROUTE = "/v1/chat/completions"
WORDS_PER_AUDIO_CHUNK_MIN = 1


def _sse(payload: dict) -> str:
    import json

    return f"data: {json.dumps(payload)}\n\n"


def talker_sampling(body: ChatCompletionRequest, default: dict | None) -> dict | None:
    """The talker's sampling from vLLM-Omni's ``sampling_params_list`` ([thinker, talker, ...]) when given."""
    stages = body.sampling_params_list or []
    if len(stages) < 2 or not isinstance(stages[1], dict):
        return default
    keys = ("temperature", "top_k", "top_p", "repetition_penalty")
    return {k: stages[1][k] for k in keys if k in stages[1]}


def _text_tokens(body: ChatCompletionRequest) -> int:
    stages = body.sampling_params_list or []
    thinker = stages[0] if stages and isinstance(stages[0], dict) else {}
    return int(body.max_completion_tokens or body.max_tokens or thinker.get("max_tokens") or 256)


class ChatKind(JobKind):
    """Chat jobs on the speech queue: the thinker's text alone, or text + speech (whole or streamed). Never batched.
    The queue's executor hands ``{"kind": "chat", ...}`` specs to ``run_chat``."""

    name = "chat"
    what = "the omni model"

    def job(self, params: dict, stream: Any = None) -> Job:
        return Job(kind=self, route=ROUTE, params=params, cost=max(1, len(params["input"])), stream=stream)

    def spec(self, batch: list[Job]) -> dict:
        return {"kind": self.name, **batch[0].params, "streamed": batch[0].stream is not None}


def run_chat(pipeline: Any, spec: dict, control: Any) -> Any:
    """One chat spec on the speech pipeline (the speech queue's worker). A streamed job emits ``{"text": piece}``
    as the thinker writes and (with audio) ``{"audio": chunk}`` as the talker and token2wav make them (from the
    thinker's thread and this one: Stream.put takes any thread)."""
    from ..ar_bridge.speech import SpeechCancelled
    from .jobs import Aborted

    conversation = {"system": spec["system"], "history": [tuple(t) for t in spec["history"]]}
    media = {"images": spec.get("images") or (), "audios": spec.get("audios") or ()}
    on_text = (lambda piece: control.emit({"text": piece})) if spec["streamed"] else None
    try:
        if not spec["audio"]:
            stats: dict = {}
            text, tokens = pipeline.reply(spec["input"], max_text_tokens=spec["max_text_tokens"],
                                          conversation=conversation, on_text=on_text, cancel=control.cancel_event,
                                          stats=stats, **media)
            return {"text": text, "tokens": tokens, "prompt_tokens": stats.get("prompt_tokens", 0)}
        options = dict(mode="chat", max_codes=spec["max_codes"], max_text_tokens=spec["max_text_tokens"],
                       sampling=spec["sampling"], seed=spec["seed"], conversation=conversation,
                       cancel=control.cancel_event, **media)
        if not spec["streamed"]:
            return pipeline.generate(spec["input"], spec["voice"], **options)
        for chunk in pipeline.stream(spec["input"], spec["voice"], on_text=on_text, **options):
            control.emit({"audio": chunk})
        return None
    except SpeechCancelled:
        raise Aborted()


def install(api: Any, *, image: Any = None, speech: Any = None) -> None:
    """``POST /v1/chat/completions`` on ``api``: omni chat through ``speech`` (a (pipeline, queue, settings) tuple)
    and images through ``image`` (the image app's service: model, queue, limits, build_request, resolve_lora,
    check_model). A request names the model (``model``); without one, the omni model answers when there is one."""
    import asyncio

    from .errors import ApiError
    from .jobs import ClientGone, Stream, await_job, submit_or_raise

    speech_id = speech[2].model_id if speech is not None else None

    def omni_wanted(model: str | None) -> bool:
        if speech is None:
            return False
        if model is None or model == speech_id:
            return True
        if image is None:
            raise ApiError(404, f"the model {model!r} does not exist; this server chats with {speech_id!r}",
                           param="model", code="model_not_found")
        return False

    @api.post(ROUTE, summary="Chat (OpenAI chat.completions): omni text + audio, or an image from a diffusion model")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        from fastapi.responses import Response

        parsed = parse_messages(body.messages)
        if omni_wanted(body.model):
            answer = omni_chat(body, parsed, request)
        elif image is not None:
            answer = image_chat(body, parsed, request)
        else:
            raise bad_request("this server has no chat model", "model")
        try:
            return await answer
        except ClientGone:
            return Response(status_code=499)

    # -- omni ------------------------------------------------------------------------------------------------
    async def omni_chat(body: ChatCompletionRequest, parsed: ParsedMessages, request: Request):
        from ..errors import AccelError
        from .speech import encode

        pipeline, queue, settings = speech
        modalities = body.modalities or ["text"]
        if "image" in modalities:
            raise bad_request(f"modalities={modalities}: the omni model answers in text and audio", "modalities")
        wants_audio = "audio" in modalities
        audio = body.audio or ChatAudio()
        if wants_audio and body.stream and audio.format != "pcm16":
            raise bad_request(f"audio.format={audio.format!r} cannot be streamed; use 'pcm16' with stream=true",
                              "audio.format")
        voice = None
        if wants_audio:
            try:
                voice = pipeline.resolve_voice(audio.voice if isinstance(audio.voice, str) or audio.voice is None
                                               else audio.voice.get("id"))
            except AccelError as exc:
                raise bad_request(str(exc), "audio.voice")
        images, audios = await asyncio.to_thread(_decode_media, parsed, pipeline, settings, len(body.messages) - 1)
        params = dict(input=parsed.last_user_text, system=parsed.system, history=parsed.turns[:-1],
                      audio=wants_audio, voice=voice, max_text_tokens=_text_tokens(body),
                      max_codes=settings.max_codes, sampling=talker_sampling(body, settings.sampling),
                      seed=0 if body.seed is None else body.seed, images=images, audios=audios)
        if not params["input"].strip() and not (images or audios):
            raise bad_request("the last user message has no text, image or audio", "messages")
        kind = queue.kinds["chat"]
        job = submit_or_raise(queue, kind.job(params, stream=Stream() if body.stream else None),
                              what="speech requests")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.request_timeout_s
        first = await await_job(queue, job, request, settings.request_timeout_s, deadline=deadline)
        cid, model_id = completion_id(), speech_id
        if body.stream:
            return StreamingResponse(_events(queue, job, first, cid, model_id, deadline, settings.request_timeout_s),
                                     media_type="text/event-stream")
        if not wants_audio:
            return completion(cid, model_id, first["text"], usage=_usage(first["prompt_tokens"], first["tokens"]))
        fmt = "pcm" if audio.format == "pcm16" else audio.format
        data = await asyncio.to_thread(encode, first.waveform, first.sample_rate, fmt)
        return completion(cid, model_id, first.text, audio=message_audio(audio_id(), data, first.text),
                          usage=_usage(first.prompt_tokens, len(first.thinker_ids)))

    async def _events(queue, job, first, cid, model_id, deadline, timeout_s):
        """The answer's text deltas as the thinker writes them and (with audio) the pcm16 chunks as the talker and
        token2wav make them, in the order they are made (on the transformers engines the talker runs behind the
        thinker, so audio can come before the text ends; on vLLM all the text comes first). Each audio chunk
        carries the next whole words of the text so far as its transcript; the rest comes with the last event."""
        from .errors import pipeline_failure, timeout_error
        from .jobs import WAITING
        from .speech import pcm16

        loop = asyncio.get_running_loop()
        created, aid = int(time.time()), audio_id()
        text, words, sent, per_chunk = "", None, 0, WORDS_PER_AUDIO_CHUNK_MIN
        ended = False
        try:
            yield _sse(chunk(cid, model_id, {"role": "assistant", "content": ""}, created=created))
            item = first
            while item is not Stream.END:
                if "text" in item:
                    text += item["text"]
                    yield _sse(chunk(cid, model_id, {"content": item["text"]}, created=created))
                else:
                    if words is None:  # the first audio chunk: the text so far sets the pace
                        per_chunk = max(WORDS_PER_AUDIO_CHUNK_MIN, math.ceil(len(_word_pieces(text)) / 8))
                    # the text may still be coming: its last piece can be a word cut short, so it waits
                    words = _word_pieces(text)
                    upto = min(sent + per_chunk, len(words) - 1)
                    piece = "".join(words[sent:upto])
                    sent = max(sent, upto)
                    yield _sse(chunk(cid, model_id, {"audio": {
                        "id": aid, "data": base64.b64encode(pcm16(item["audio"])).decode(), "transcript": piece}},
                        created=created))
                item = await job.stream.get(deadline - loop.time())
                if item is WAITING:
                    queue.cancel(job, "timeout")
                    raise timeout_error(timeout_s)
            final: dict = {}
            if words is not None:
                rest = "".join(_word_pieces(text)[sent:])  # the text may have grown since the last chunk
                final["audio"] = {"id": aid, "expires_at": int(time.time()) + AUDIO_EXPIRY_S,
                                  **({"transcript": rest} if rest else {})}
            yield _sse(chunk(cid, model_id, final, "stop", created))
            ended = True
            yield SSE_DONE
        except Exception as exc:  # noqa: BLE001 -- the header is out: the error goes in the stream
            ended = True
            queue.cancel(job, "error")
            error = exc if isinstance(exc, ApiError) else pipeline_failure(exc, ChatKind.what)
            yield _sse(error.body())
        finally:
            if not ended:
                queue.cancel(job, "disconnect")

    # -- images ----------------------------------------------------------------------------------------------
    async def image_chat(body: ChatCompletionRequest, parsed: ParsedMessages, request: Request):
        from .images import decode_upload, fit_area

        svc = image
        svc.check_model(body.model)
        if parsed.audios:
            raise bad_request("input_audio parts are not taken by an image model", "messages")
        if parsed.images and not svc.model.can_edit:
            raise bad_request(f"the model {svc.model.id!r} ({svc.model.pipeline_class}) cannot edit images; send "
                              "text only", "messages", "edits_not_supported")
        if not parsed.last_user_text.strip():
            raise bad_request("the last user message has no text (the prompt)", "messages")
        lora = await svc.resolve_lora(body.model, body.lora)
        size = None
        if body.width is not None or body.height is not None:
            w, h = svc.model.native_size
            size = f"{body.width or w}x{body.height or h}"
        params = svc.build_request("edit" if parsed.images else "generate", prompt=parsed.last_user_text, n=1,
                                   size=size, seed=body.seed, steps=body.num_inference_steps,
                                   guidance=body.guidance_scale, true_cfg=body.true_cfg_scale,
                                   negative=body.negative_prompt, lora=lora)
        if parsed.images:
            decoded = [decode_upload(data, max_bytes=svc.limits.max_upload_bytes,
                                     max_pixels=svc.limits.max_input_pixels, param="messages")
                       for data in parsed.images[:svc.model.max_references]]
            params.images = [fit_area(im, params.width, params.height) for im in decoded]
        job = submit_or_raise(svc.engine, svc.engine.kinds["image"].job(params, ROUTE))
        result = await await_job(svc.engine, job, request, svc.limits.request_timeout_s)
        png, _seed = result[0]
        content = [image_part(png)]
        cid, model_id = completion_id(), body.model or svc.model.id
        if not body.stream:
            return completion(cid, model_id, content)

        async def events():
            created = int(time.time())
            yield _sse(chunk(cid, model_id, {"role": "assistant", "content": content}, created=created))
            yield _sse(chunk(cid, model_id, {}, "stop", created))
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")


def _usage(prompt: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def _decode_media(parsed: ParsedMessages, pipeline: Any, settings: Any, last: int) -> tuple[list, list]:
    """The last user message's images (PIL, the server's upload and pixel limits) and audio clips (mono samples at
    the thinker's rate), or a 400 when they came in an earlier message."""
    from .images import decode_upload
    from .speech import decode_audio_upload

    earlier = [i for i in parsed.media_messages if i != last]
    if earlier:
        raise bad_request(f"messages[{earlier[0]}] has image or audio parts; this server takes them in the last "
                          "user message only (earlier turns are text)", f"messages[{earlier[0]}].content",
                          "unsupported_content")
    if not (parsed.images or parsed.audios):
        return [], []
    param = f"messages[{last}].content"
    images = [decode_upload(data, max_bytes=settings.max_upload_bytes, max_pixels=settings.max_input_pixels,
                            param=param) for data in parsed.images]
    audios = [decode_audio_upload(data, fmt, sample_rate=pipeline.input_sample_rate,
                                  max_seconds=pipeline.max_input_seconds, max_bytes=settings.max_upload_bytes,
                                  param=param) for data, fmt in parsed.audios]
    return images, audios


def _word_pieces(text: str) -> list[str]:
    """``text`` cut after each run of spaces: pieces that join back into ``text`` exactly."""
    import re

    return re.findall(r"\S+\s*|\s+", text)
