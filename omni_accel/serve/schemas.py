"""Pydantic schemas of the HTTP API (they are also its OpenAPI spec, served at /openapi.json).

Field names and shapes follow the OpenAI Images API, so the official ``openai`` client works unchanged; fields that
OpenAI does not have (``seed``, ``num_inference_steps``, ``guidance_scale``, ``true_cfg_scale``,
``negative_prompt``) are extras (with the ``openai`` client pass them in ``extra_body``). OpenAI fields that do not
apply to a diffusion model (``quality``, ``style``, ``user``, ``background``, ...) are accepted and ignored.
The request models are built per server (``generation_request_model(limits)``), so the schema advertises the
configured limits (``omni-accel serve --max-n`` etc.) and validation answers 400 with the limit and its flag. Numbers
are strict: ``n: 10.0`` or ``true_cfg_scale: false`` are refused, not coerced.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator

HARD_MAX_PROMPT = 4000
MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100.0
# request fields bounded by a server flag: the flag is named in the 400 answer
LIMIT_FLAGS = {"n": "--max-n", "num_inference_steps": "--max-steps", "num_frames": "--max-frames",
               "width": "--max-size", "height": "--max-size"}
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


def generation_request_model(limits) -> type[BaseModel]:
    """The body of POST /v1/images/generations with ``limits`` (a resolved ``Limits``) as its bounds."""

    class ImageGenerationRequest(BaseModel):
        """Body of POST /v1/images/generations."""

        model_config = ConfigDict(extra="ignore", json_schema_extra={
            "example": {"prompt": "a red circle on a blue background", "n": 1, "response_format": "b64_json",
                        "seed": 0}})

        prompt: StrictStr = Field(..., min_length=1, max_length=HARD_MAX_PROMPT, description="the text prompt")
        model: StrictStr | None = Field(None, max_length=256, description="the served model id (see GET /v1/models);"
                                                                          " omitted = the served model")
        n: StrictInt = Field(1, ge=1, le=limits.max_n, description="images to generate (server limit --max-n)")
        size: StrictStr | None = Field(None, max_length=16, description=size_description(limits))
        response_format: Literal["b64_json", "url"] = Field(
            "b64_json", description="b64_json (default): base64 PNG in the response; url: a link to "
                                    "/v1/images/files/{id}.png on this server, kept in memory for the last "
                                    "--url-cache images")
        seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED,
                                       description="extra: random seed of the first image; image i uses seed + i. "
                                                   "Omitted = random (returned)")
        num_inference_steps: StrictInt | None = Field(None, ge=1, le=limits.max_steps,
                                                      description="extra: denoising steps (server limit "
                                                                  "--max-steps); omitted = the model's default")
        guidance_scale: StrictFloat | None = Field(None, ge=0.0, le=MAX_GUIDANCE,
                                                   description="extra: guidance_scale of the pipeline")
        true_cfg_scale: StrictFloat | None = Field(None, ge=0.0, le=MAX_GUIDANCE,
                                                   description="extra: true CFG scale (FLUX, Qwen-Image); with FLUX "
                                                               "the negative prompt only acts when this is > 1")
        negative_prompt: StrictStr | None = Field(None, max_length=HARD_MAX_PROMPT,
                                                  description="extra: negative prompt")
        lora: dict | None = Field(None, description='extra: a LoRA adapter for this request, {"name": NAME, "scale": '
                                                    '1.0} (an adapter of --lora) or {"path": "sub/dir"} (under '
                                                    '--lora-dir); omitted = the base model (or the adapter named by '
                                                    'model)')
        quality: str | None = Field(None, max_length=64, description="OpenAI field, ignored")
        style: str | None = Field(None, max_length=64, description="OpenAI field, ignored")
        user: str | None = Field(None, max_length=256, description="OpenAI field, ignored")

        @field_validator("size")
        @classmethod
        def _check_size(cls, v):
            parse_size(v)
            return v

    return ImageGenerationRequest


def size_description(limits) -> str:
    return (SIZE_DESCRIPTION + f" This server allows at most {limits.max_size} pixels a side (--max-size) and "
            f"{limits.max_cost:g} megapixel-steps per request (n x width x height x steps / 1e6, "
            "--max-request-cost).")


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
    limits: dict | None = Field(None, description="this server's per-request limits: max_n, max_steps, max_size, "
                                                  "max_request_cost (megapixel-steps)")
    root: str | None = Field(None, description="a LoRA adapter's folder")
    parent: str | None = Field(None, description="a LoRA adapter's base model (vLLM's convention)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "loading", "stopping", "degraded", "unavailable"]
    model: str
    queue_depth: int
    running: int
    world_size: int
    replicas: dict[str, int] | None = Field(None, description="behind a Ray Serve ingress: the model replicas by "
                                                              "state (running, starting -- restarting or scaling "
                                                              "up --, stopping)")


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
