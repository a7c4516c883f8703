"""The FastAPI app of ``omni-accel serve``: OpenAI-compatible image endpoints over the batching engine."""

from __future__ import annotations

import asyncio
import base64
import collections
import hmac
import json
import logging
import threading
import time
import uuid
from typing import Literal

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, Job, Limits, LoadedModel, QueueFull, random_seed
from .errors import ApiError, StreamAborted, bad_request, error_body, queue_full_error, timeout_error
from .images import decode_upload, fit_area
from .metrics import ServeMetrics
from .schemas import (
    ERROR_RESPONSES, HARD_MAX_N, HARD_MAX_PROMPT, HARD_MAX_STEPS, SIZE_DESCRIPTION, Health, ImageData,
    ImageGenerationRequest, ImagesResponse, ModelCard, ModelList, parse_size,
)

logger = logging.getLogger("omni_accel.serve")

PUBLIC_PATHS = ("/health", "/metrics", "/openapi.json", "/docs", "/redoc", "/files/")


# ------------------------------------------------------------------------------------------- ASGI middleware
class _Guard:
    """Outermost layer: request metrics, the API key and the body-size limit -- all before any body is parsed.

    The body is read here (up to the limit) and replayed to the app, so an oversized upload is answered 413 after
    draining it (a client that is still sending would otherwise see a broken pipe instead of the answer)."""

    def __init__(self, app, *, metrics: ServeMetrics, api_key: str | None, max_body: int):
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.max_body = max_body
        self.drain_cap = max(4 * max_body, 64 * 2**20)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 499}  # no response sent: the client went away

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_wrapper)
        except StreamAborted:
            # a stream that failed after its header (already logged): returning without the body's end makes
            # uvicorn close the connection, which is how the client learns that the body is incomplete
            pass
        finally:
            self.metrics.observe_request(scope.get("path", ""), status["code"], time.perf_counter() - t0)

    async def _reply(self, scope, receive, send, err: ApiError):
        await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)

    async def _handle(self, scope, receive, send):
        path = scope.get("path", "")
        if self.api_key is not None and not path.startswith(PUBLIC_PATHS):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                err = ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' with the key "
                                    "the server was started with (--api-key)", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                return await self._reply(scope, receive, send, err)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = None
        for k, v in scope.get("headers") or []:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = None
        too_big = declared is not None and declared > self.max_body
        if too_big and declared > self.drain_cap:
            return await self._reply(scope, receive, send, self._too_large(declared))
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_body:
                too_big = True
                chunks = []
            elif not too_big:
                chunks.append(body)
            if not message.get("more_body") or total > self.drain_cap:
                break
        if too_big:
            return await self._reply(scope, receive, send, self._too_large(max(total, declared or 0)))
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int) -> ApiError:
        return ApiError(413, f"the request body ({size} bytes) is larger than the limit of {self.max_body} bytes "
                             "(omni-accel serve --max-body-mb)", code="request_too_large")


# ----------------------------------------------------------------------------------------------- the app
class _UrlStore:
    """The last ``capacity`` PNGs, for response_format=url (kept in memory, served at /files/images/{id}.png)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, data: bytes) -> str:
        key = uuid.uuid4().hex
        with self._lock:
            self._items[key] = data
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return key

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._items.get(key)


def _validation_to_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, "the request body is not valid JSON: " + str(first.get("msg", "")), code="invalid_json")
    if kind == "missing":
        return ApiError(400, f"missing required parameter: {param!r}", param=param, code="missing_required_parameter")
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return ApiError(400, f"invalid value for {param!r}: {msg}" if param else f"invalid request: {msg}", param=param,
                    code="invalid_value")



def install_error_handlers(api: FastAPI) -> None:
    """OpenAI error bodies for our ApiErrors, pydantic validation errors, Starlette's 404 / 405, and anything
    unhandled (500)."""

    @api.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        err = _validation_to_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, kind),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @api.exception_handler(Exception)
    async def _internal_error(_request, exc: Exception):
        if not isinstance(exc, StreamAborted):  # the stream logged its own failure
            logger.exception("omni_accel.serve: unhandled error")
        return JSONResponse(error_body(f"internal server error: {exc.__class__.__name__}", "server_error", None,
                                       "internal_error"), status_code=500)


def create_app(model: LoadedModel, engine: Engine, *, limits: Limits | None = None, api_key: str | None = None,
               metrics: ServeMetrics | None = None, url_cache: int = 64, world_size: int = 1):
    """The ASGI app (FastAPI inside the guard middleware). ``engine`` must be started by the caller."""
    limits = limits or Limits()
    metrics = metrics or engine.metrics or ServeMetrics()
    urls = _UrlStore(url_cache)
    api = FastAPI(
        title="omni_accel image server",
        version=__import__("omni_accel").__version__,
        description="OpenAI-compatible image generation and editing with an omni_accel-accelerated diffusers "
                    "pipeline. Every 4xx/5xx answer carries {\"error\": {\"message\", \"type\", \"param\", "
                    "\"code\"}}. See docs/serving.md.",
    )

    install_error_handlers(api)

    # -- shared request handling ------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model.id:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model.id!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")

    def check_size(size: str | None) -> tuple[int, int]:
        try:
            parsed = parse_size(size)
        except ValueError as exc:
            raise bad_request(str(exc), "size", "invalid_size")
        w, h = parsed or model.native_size
        m = model.size_multiple
        if w % m or h % m:
            rw, rh = max(m, round(w / m) * m), max(m, round(h / m) * m)
            raise bad_request(f"size={w}x{h}: width and height must be multiples of {m} for this model; the "
                              f"nearest valid size is '{rw}x{rh}'", "size", "invalid_size")
        if max(w, h) > limits.max_size or w * h > limits.max_pixels:
            raise bad_request(f"size={w}x{h} is larger than this server allows: at most {limits.max_size} pixels a "
                              f"side and {limits.max_pixels} pixels in all (--max-size)", "size", "invalid_size")
        return w, h

    def build_job(op: str, *, prompt: str, n: int, size: str | None, seed: int | None, steps: int | None,
                  guidance: float | None, true_cfg: float | None, negative: str | None, images=()) -> Job:
        if n > limits.max_n:
            raise bad_request(f"n={n} is more than this server allows (at most {limits.max_n}, --max-n)", "n")
        if steps is not None and steps > limits.max_steps:
            raise bad_request(f"num_inference_steps={steps} is more than this server allows (at most "
                              f"{limits.max_steps}, --max-steps)", "num_inference_steps")
        w, h = check_size(size)
        steps = steps if steps is not None else int(model.defaults.get("num_inference_steps") or 28)
        steps = min(steps, limits.max_steps)
        if guidance is None:
            guidance = model.defaults.get("guidance_scale")
        if true_cfg is None:  # the model's defaults (the built-in model runs true CFG with an empty negative)
            true_cfg = model.defaults.get("true_cfg_scale")
        if negative is None:
            negative = model.defaults.get("negative_prompt")
        return Job(op=op, prompt=prompt, n=n, width=w, height=h, steps=steps,
                   seed=seed if seed is not None else random_seed(), guidance_scale=guidance,
                   true_cfg_scale=true_cfg, negative_prompt=negative, images=list(images))

    async def execute(job: Job, request: Request, response_format: str) -> ImagesResponse:
        if engine.stopping:
            raise ApiError(503, "the server is shutting down", type="server_error", code="unavailable")
        try:
            future = engine.submit(job)
        except QueueFull as exc:
            metrics.rejected.inc()
            raise queue_full_error(engine.queue_depth, engine.max_queue, exc.retry_after)
        waiter = asyncio.wrap_future(future)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.request_timeout_s
        while not waiter.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                stage = engine.cancel(job)
                if stage is not None:
                    metrics.cancelled.labels(stage, "timeout").inc()
                    raise timeout_error(limits.request_timeout_s)
                break
            await asyncio.wait({waiter}, timeout=min(0.25, remaining))
            if not waiter.done() and await request.is_disconnected():
                stage = engine.cancel(job)
                if stage is not None:
                    metrics.cancelled.labels(stage, "disconnect").inc()
                    logger.info("omni_accel.serve: client disconnected; cancelled its %s request", stage)
                    return Response(status_code=499)
        if not waiter.done():
            await asyncio.wait({waiter})
        if waiter.cancelled():
            raise ApiError(503, "the request was cancelled (the server is shutting down or the work was aborted)",
                           type="server_error", code="cancelled")
        exc = waiter.exception()
        if exc is not None:
            from ..errors import AccelError

            if isinstance(exc, AccelError):
                raise ApiError(400, f"the pipeline refused the request: {exc}", code="pipeline_refused")
            raise ApiError(500, f"the pipeline call failed: {exc.__class__.__name__}: {exc}", type="server_error",
                           code="pipeline_error")
        data = []
        for png, seed in waiter.result():
            if response_format == "url":
                data.append(ImageData(url=f"{str(request.base_url).rstrip('/')}/files/images/{urls.put(png)}.png",
                                      seed=seed))
            else:
                data.append(ImageData(b64_json=base64.b64encode(png).decode("ascii"), seed=seed))
        return ImagesResponse(created=int(time.time()), data=data, size=f"{job.width}x{job.height}")

    # -- endpoints --------------------------------------------------------------------------------------
    @api.post("/v1/images/generations", response_model=ImagesResponse, responses=ERROR_RESPONSES,
              summary="Create images from a prompt (OpenAI images.generate)")
    async def generations(body: ImageGenerationRequest, request: Request):
        check_model(body.model)
        job = build_job("generate", prompt=body.prompt, n=body.n, size=body.size, seed=body.seed,
                        steps=body.num_inference_steps, guidance=body.guidance_scale, true_cfg=body.true_cfg_scale,
                        negative=body.negative_prompt)
        return await execute(job, request, body.response_format)

    @api.post("/v1/images/edits", response_model=ImagesResponse, responses=ERROR_RESPONSES,
              summary="Edit image(s) with a prompt (OpenAI images.edit); edit-capable models only")
    async def edits(
        request: Request,
        prompt: str = Form(..., min_length=1, max_length=HARD_MAX_PROMPT, description="the edit instruction"),
        image: list[UploadFile] | None = File(None, description="the input image(s): PNG, JPEG or WebP"),
        image_list: list[UploadFile] | None = File(None, alias="image[]",
                                                   description="several input images (what the openai client "
                                                               "sends for a list)"),
        mask: UploadFile | None = File(None, description="not supported: a request with a mask gets 400"),
        model_name: str | None = Form(None, alias="model", max_length=256),
        n: int = Form(1, ge=1, le=HARD_MAX_N),
        size: str | None = Form(None, max_length=16, description=SIZE_DESCRIPTION + " Omitted = the size of the "
                                                                                  "first image, rounded down to "
                                                                                  "the multiple and capped."),
        response_format: Literal["b64_json", "url"] = Form("b64_json"),
        seed: int | None = Form(None, ge=0, le=2**63 - 1),
        num_inference_steps: int | None = Form(None, ge=1, le=HARD_MAX_STEPS),
        guidance_scale: float | None = Form(None, ge=0.0, le=100.0),
        true_cfg_scale: float | None = Form(None, ge=0.0, le=100.0),
        negative_prompt: str | None = Form(None, max_length=HARD_MAX_PROMPT),
    ):
        check_model(model_name)
        if not model.can_edit:
            raise bad_request(f"the model {model.id!r} ({model.pipeline_class}) cannot edit images; serve an "
                              "edit-capable pipeline (e.g. FLUX.1 Kontext, Qwen-Image-Edit) for /v1/images/edits",
                              None, "edits_not_supported")
        if mask is not None:
            raise bad_request("mask is not supported by this server; send the image and prompt only", "mask",
                              "unsupported_parameter")
        uploads = list(image or []) + list(image_list or [])
        if not uploads:
            raise ApiError(400, "missing required parameter: 'image'", param="image",
                           code="missing_required_parameter")
        if len(uploads) > limits.max_input_images:
            raise bad_request(f"{len(uploads)} images sent; at most {limits.max_input_images} are accepted", "image")
        decoded = []
        for up in uploads:
            data = await up.read(limits.max_upload_bytes + 1)
            decoded.append(decode_upload(data, max_bytes=limits.max_upload_bytes,
                                         max_pixels=limits.max_input_pixels))
        if size is None or size == "auto":
            m = model.size_multiple
            w, h = decoded[0].size
            scale = min(1.0, (min(limits.max_pixels, model.native_size[0] * model.native_size[1]) / (w * h)) ** 0.5)
            w, h = max(m, int(w * scale) // m * m), max(m, int(h * scale) // m * m)
            size = f"{min(w, limits.max_size // m * m)}x{min(h, limits.max_size // m * m)}"
        job = build_job("edit", prompt=prompt, n=n, size=size, seed=seed, steps=num_inference_steps,
                        guidance=guidance_scale, true_cfg=true_cfg_scale, negative=negative_prompt)
        job.images = [fit_area(im, job.width, job.height) for im in decoded]
        return await execute(job, request, response_format)

    @api.get("/files/images/{name}", responses={404: ERROR_RESPONSES[404]}, summary="An image of response_format=url",
             response_class=Response)
    async def image_file(name: str):
        data = urls.get(name.removesuffix(".png"))
        if data is None:
            raise ApiError(404, f"no image {name!r} (images are kept for the last {urls.capacity} only)",
                           code="not_found")
        return Response(data, media_type="image/png")

    def card() -> ModelCard:
        caps = ["generations"] + (["edits"] if model.can_edit else [])
        return ModelCard(id=model.id, created=model.created, family=model.family, pipeline=model.pipeline_class,
                         capabilities=caps, native_size=f"{model.native_size[0]}x{model.native_size[1]}",
                         size_multiple=model.size_multiple)

    @api.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]},
             summary="The served model")
    async def models():
        return ModelList(data=[card()])

    @api.get("/v1/models/{model_id}", response_model=ModelCard, responses={404: ERROR_RESPONSES[404]})
    async def get_model(model_id: str):
        check_model(model_id)
        return card()

    @api.get("/health", response_model=Health, summary="Liveness and queue state")
    async def health():
        return Health(status="stopping" if engine.stopping else "ok", model=model.id,
                      queue_depth=engine.queue_depth, running=engine.running, world_size=world_size)

    @api.get("/metrics", response_class=Response, summary="Prometheus metrics (text exposition format)")
    async def prometheus():
        metrics.queue_depth.set(engine.queue_depth)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app = _Guard(api, metrics=metrics, api_key=api_key, max_body=limits.max_body_bytes)
    app.fastapi = api  # for app.fastapi.openapi()
    return app


def openapi_json(app) -> str:
    return json.dumps(app.fastapi.openapi(), indent=1)
