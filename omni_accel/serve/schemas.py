"""Pydantic schemas of the HTTP API (they are also its OpenAPI spec, served at /openapi.json).

Field names and shapes follow the OpenAI Images API, so the official ``openai`` client works unchanged; fields that
OpenAI does not have (``seed``, ``num_inference_steps``, ``guidance_scale``, ``true_cfg_scale``,
``negative_prompt``) are extras (with the ``openai`` client pass them in ``extra_body``). OpenAI fields that do not
apply to a diffusion model (``quality``, ``style``, ``user``, ``background``, ...) are accepted and ignored.
The bounds in the schema are hard caps; the server's configured limits (``omni-accel serve --max-n`` etc.) can be
tighter and are checked per request, answering 400 with the limit in the message.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

HARD_MAX_N = 10
HARD_MAX_STEPS = 1000
HARD_MAX_PROMPT = 4000
SIZE_RE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
SIZE_DESCRIPTION = ("'WIDTHxHEIGHT' in pixels, e.g. '256x256', or 'auto' / omitted for the model's native size. "
                    "Both sides must be multiples of the model's size multiple (16 for FLUX: vae_scale_factor * 2) "
                    "and within the server's --max-size; other sizes are refused with 400 (never silently rounded), "
                    "so the image you get is always the size you asked for.")


def parse_size(value: str | None) -> tuple[int, int] | None:
    """'WxH' -> (width, height); None / 'auto' -> None. Raises ValueError with a clear message."""
    if value is None or value == "auto":
        return None
    m = SIZE_RE.match(value.strip().lower()) if isinstance(value, str) else None
    if not m:
        raise ValueError(f"size={value!r} is not 'WIDTHxHEIGHT' (e.g. '256x256') or 'auto'")
    return int(m.group(1)), int(m.group(2))


class ImageGenerationRequest(BaseModel):
    """Body of POST /v1/images/generations."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "example": {"prompt": "a red circle on a blue background", "n": 1, "size": "256x256",
                    "response_format": "b64_json", "seed": 0}})

    prompt: str = Field(..., min_length=1, max_length=HARD_MAX_PROMPT, description="the text prompt")
    model: str | None = Field(None, max_length=256, description="the served model id (see GET /v1/models); "
                                                                "omitted = the served model")
    n: int = Field(1, ge=1, le=HARD_MAX_N, description="images to generate (server limit --max-n)")
    size: str | None = Field(None, max_length=16, description=SIZE_DESCRIPTION)
    response_format: Literal["b64_json", "url"] = Field(
        "b64_json", description="b64_json (default): base64 PNG in the response; url: a link to "
                                "/v1/images/files/{id}.png on this server, kept in memory for the last --url-cache "
                                "images")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="extra: random seed of the first image; image i "
                                                                  "uses seed + i. Omitted = random (returned)")
    num_inference_steps: int | None = Field(None, ge=1, le=HARD_MAX_STEPS,
                                            description="extra: denoising steps (server limit --max-steps); "
                                                        "omitted = the model's default")
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0, description="extra: guidance_scale of the pipeline")
    true_cfg_scale: float | None = Field(None, ge=0.0, le=100.0,
                                         description="extra: true CFG scale (FLUX, Qwen-Image); with FLUX the "
                                                     "negative prompt only acts when this is > 1")
    negative_prompt: str | None = Field(None, max_length=HARD_MAX_PROMPT, description="extra: negative prompt")
    quality: str | None = Field(None, max_length=64, description="OpenAI field, ignored")
    style: str | None = Field(None, max_length=64, description="OpenAI field, ignored")
    user: str | None = Field(None, max_length=256, description="OpenAI field, ignored")

    @field_validator("size")
    @classmethod
    def _check_size(cls, v):
        parse_size(v)
        return v


class ImageData(BaseModel):
    b64_json: str | None = Field(None, description="base64 PNG (response_format=b64_json)")
    url: str | None = Field(None, description="PNG link (response_format=url)")
    revised_prompt: str | None = None
    seed: int | None = Field(None, description="extra: the seed of this image")


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    size: str | None = Field(None, description="WIDTHxHEIGHT of the images")
    output_format: str = "png"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni_accel"
    family: str | None = None
    pipeline: str | None = None
    capabilities: list[str] = Field(default_factory=list, description="generations, edits")
    native_size: str | None = None
    size_multiple: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "loading", "stopping"]
    model: str
    queue_depth: int
    running: int
    world_size: int


ERROR_RESPONSES = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in {
        400: "invalid request (bad field, size, limit exceeded, not an image, model cannot edit)",
        401: "missing or wrong API key (server started with --api-key)",
        404: "unknown model or path",
        413: "request body or upload larger than the limit",
        429: "queue full; retry after the Retry-After header",
        500: "internal error",
        504: "the request did not finish within --request-timeout",
    }.items()
}
