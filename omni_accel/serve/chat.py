"""``/v1/chat/completions``: the request schema, message parsing, and the response / SSE chunk shapes.

Two uses, as in vLLM-Omni: an omni speech model (the thinker answers in text, the talker speaks it; ``modalities``
``["text"]`` or ``["text", "audio"]``, ``audio: {voice, format}``) and a diffusion model (the last user message's
text, with an ``image_url`` part for an edit pipeline, becomes an image returned as an ``image_url`` content part;
``height`` / ``width`` / ``num_inference_steps`` / ``guidance_scale`` / ``seed`` from the body, what the ``openai``
client's ``extra_body`` sends). Shapes follow OpenAI's chat API, so the official client parses them unchanged.
"""

from __future__ import annotations

import base64
import binascii
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import bad_request

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


def transcript_pieces(text: str, chunks_so_far: int, expected_chunks: int, sent: int) -> tuple[str, int]:
    """The part of ``text`` to send with the ``chunks_so_far``-th audio chunk of about ``expected_chunks``: the
    transcript advances with the audio (whole words), so text and sound arrive together; returns (piece, new sent)."""
    if expected_chunks <= chunks_so_far:
        return text[sent:], len(text)
    target = len(text) * chunks_so_far // max(expected_chunks, 1)
    while target < len(text) and not text[target].isspace():
        target += 1
    target = max(target, sent)
    return text[sent:target], target
