"""The FastAPI app of ``omni-accel serve``: OpenAI-compatible image endpoints over the image job queue."""

from __future__ import annotations

import asyncio
import base64
import collections
import hmac
import json
import logging
import threading
import time
import types
import uuid
from typing import Callable, Literal

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import ImageRequest, Limits, LoadedModel, random_seed, request_cost
from .errors import ApiError, StreamAborted, bad_request, error_body
from .jobs import ClientGone, JobQueue, await_job, submit_or_raise
from .images import decode_upload, fit_area
from .metrics import ServeMetrics
from .schemas import (
    ERROR_RESPONSES, HARD_MAX_PROMPT, LIMIT_FLAGS, MAX_GUIDANCE, MAX_SEED, Health, ImageData, ImagesResponse,
    ModelCard, ModelList, generation_request_model, parse_size, size_description,
)

logger = logging.getLogger("omni_accel.serve")

PUBLIC_PATHS = ("/health", "/metrics", "/openapi.json", "/docs", "/redoc", "/files/")


# ------------------------------------------------------------------------------------------- ASGI middleware
def check_api_key(api_key: str | None) -> None:
    """An API key that could never be sent correctly is refused, not served: an empty key (which would turn
    authentication off while every client believes it is on) or one with surrounding whitespace (the header's
    token is stripped before the comparison)."""
    if api_key is None:
        return
    if not api_key.strip():
        raise ValueError("the API key is empty: pass a non-empty key, or leave --api-key / OMNI_ACCEL_API_KEY unset "
                         "to serve without authentication")
    if api_key != api_key.strip():
        raise ValueError("the API key has leading or trailing whitespace, which no client can send: remove it")


class _Guard:
    """Outermost layer: request metrics, the API key and the body-size limit -- all before any body is parsed.

    The body is read here (up to the limit) and replayed to the app, so an oversized upload is answered 413 after
    draining it (a client that is still sending would otherwise see a broken pipe instead of the answer). A body
    that stalls -- no bytes for ``body_timeout_s`` -- is answered 408 and its connection closed."""

    def __init__(self, app, *, metrics: ServeMetrics, api_key: str | None, max_body: int,
                 body_timeout_s: float = 15.0):
        check_api_key(api_key)
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
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
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                err = ApiError(408, f"the request body stalled: no bytes for {self.body_timeout_s:g} s after "
                                    f"{total} bytes (--idle-timeout)", code="body_timeout",
                               headers={"Connection": "close"})
                return await self._reply(scope, receive, send, err)
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
    """The first of pydantic's errors as an OpenAI error, worded for the field and naming the server flag of a
    configured limit."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
    param = ".".join(loc) or None
    kind, ctx, value = first.get("type", ""), first.get("ctx") or {}, first.get("input")
    if kind == "json_invalid":
        return ApiError(400, "the request body is not valid JSON: " + str(first.get("msg", "")), code="invalid_json")
    if param is None:  # the body as a whole: absent, empty, or not an object
        return ApiError(400, "the request body is missing or is not a JSON object; send an object with at least "
                             "'prompt', e.g. {\"prompt\": \"a red fox\"} (Content-Type: application/json)",
                        code="invalid_body")
    if kind == "missing":
        return ApiError(400, f"missing required parameter: {param!r}", param=param, code="missing_required_parameter")
    message = _describe(kind, ctx, value, param) or str(ctx.get("error") or first.get("msg") or "invalid value")
    return ApiError(400, f"invalid value for {param!r}: {message}", param=param, code="invalid_value")


def _describe(kind: str, ctx: dict, value, param: str) -> str | None:
    flag = LIMIT_FLAGS.get(param)
    if kind in ("less_than_equal", "less_than"):  # the value as sent (a form field's is a string): unquoted
        bound = ctx.get("le", ctx.get("lt"))
        allowed = "this server allows" if flag else "allowed"
        return f"{value} is more than {allowed} (at most {bound}{', ' + flag if flag else ''})"
    if kind in ("greater_than_equal", "greater_than"):
        return f"{value} is less than the minimum of {ctx.get('ge', ctx.get('gt'))}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{value!r} is not an integer"
    if kind in ("float_type", "float_parsing"):
        return f"{value!r} is not a number"
    if kind in ("string_type", "string_too_long", "string_too_short"):
        return {"string_type": f"{value!r} is not a string",
                "string_too_long": f"longer than {ctx.get('max_length')} characters",
                "string_too_short": "empty"}[kind]
    if kind == "literal_error":
        return f"{value!r} is not one of {ctx.get('expected')}"
    return None


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


def create_app(model: LoadedModel, engine: JobQueue, *, limits: Limits | None = None, api_key: str | None = None,
               metrics: ServeMetrics | None = None, url_cache: int = 64, world_size: int = 1,
               body_timeout_s: float = 15.0, replicas: Callable[[], dict] | None = None):
    """The ASGI app (FastAPI inside the guard middleware); ``engine`` is the model's image job queue
    (``serve.engine.image_queue(model)``, or an ingress's RemoteQueue). ``replicas()``: the replicas behind an
    ingress by state, for /health and /metrics."""
    check_api_key(api_key)  # before anything is built
    limits = (limits or Limits()).resolved(model)
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
    GenerationRequest = generation_request_model(limits)  # noqa: N806 -- a class with this server's bounds

    # -- shared request handling ------------------------------------------------------------------------
    adapters = model.lora.model_names() if model.lora is not None else []

    def check_model(name: str | None) -> None:
        if name is not None and name != model.id and name not in adapters:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model.id!r}"
                                f"{' and the LoRA adapters ' + ', '.join(adapters) if adapters else ''} "
                                "(see GET /v1/models)", param="model", code="model_not_found")

    async def resolve_lora(name: str | None, lora: dict | None):
        """The request's adapter (``model: NAME`` or the ``lora`` field), read and checked before it is queued."""
        from .lora import request_lora

        return await asyncio.to_thread(request_lora, model.lora, name, lora,
                                       flags="--lora NAME=PATH or --lora-dir ROOT")

    def check_size(size: str | None) -> tuple[int, int]:
        try:
            parsed = parse_size(size)
        except ValueError as exc:
            raise bad_request(str(exc), "size", "invalid_size")
        w, h = parsed or model.native_size
        m = model.size_multiple
        largest = limits.max_size // m * m
        if max(w, h) > limits.max_size or w * h > limits.max_pixels:
            raise bad_request(f"size={w}x{h} is larger than this server allows: at most {limits.max_size} pixels a "
                              f"side and {limits.max_pixels} pixels in all (--max-size)", "size", "invalid_size")
        if w % m or h % m:
            rw, rh = (min(largest, max(m, round(side / m) * m)) for side in (w, h))
            raise bad_request(f"size={w}x{h}: width and height must be multiples of {m} for this model; the "
                              f"nearest valid size is '{rw}x{rh}'", "size", "invalid_size")
        return w, h

    def build_request(op: str, *, prompt: str, n: int, size: str | None, seed: int | None, steps: int | None,
                      guidance: float | None, true_cfg: float | None, negative: str | None,
                      lora=None) -> ImageRequest:
        w, h = check_size(size)
        steps = steps if steps is not None else min(model.default_steps, limits.max_steps)
        cost = request_cost(n, w, h, steps)
        if cost > limits.max_cost:
            raise bad_request(f"this request (n={n}, {w}x{h}, {steps} steps) costs {cost:.3g} megapixel-steps (n x "
                              f"width x height x steps / 1e6), more than this server allows per request "
                              f"({limits.max_cost:g}, --max-request-cost); ask for fewer images, steps or pixels",
                              None, "request_too_costly")
        if guidance is None:
            guidance = model.defaults.get("guidance_scale")
        if true_cfg is None:  # the model's defaults (the built-in model runs true CFG with an empty negative)
            true_cfg = model.defaults.get("true_cfg_scale")
        if negative is None:
            negative = model.defaults.get("negative_prompt")
        return ImageRequest(op=op, prompt=prompt, n=n, width=w, height=h, steps=steps,
                            seed=seed if seed is not None else random_seed(), guidance_scale=guidance,
                            true_cfg_scale=true_cfg, negative_prompt=negative, lora=lora)

    def check_references(uploaded: list, fitted: list) -> None:
        """Every reference image, as the pipeline will get it, has the smallest side the pipeline accepts."""
        least = model.min_reference_side
        for sent, got in zip(uploaded, fitted):
            if min(got.size) < least:
                scaled = "" if got.size == sent.size else f" (scaled to {got.size[0]}x{got.size[1]} to fit the output)"
                raise bad_request(f"image: {sent.size[0]}x{sent.size[1]}{scaled} is too small; "
                                  f"{model.pipeline_class} needs reference images of at least {least} pixels on "
                                  "each side", "image", "image_too_small")

    async def execute(params: ImageRequest, route: str, request: Request, response_format: str):
        job = submit_or_raise(engine, engine.kinds["image"].job(params, route))
        try:
            result = await await_job(engine, job, request, limits.request_timeout_s)
        except ClientGone:
            return Response(status_code=499)
        data = []
        for png, seed in result:
            if response_format == "url":
                data.append(ImageData(url=f"{str(request.base_url).rstrip('/')}/files/images/{urls.put(png)}.png",
                                      seed=seed))
            else:
                data.append(ImageData(b64_json=base64.b64encode(png).decode("ascii"), seed=seed))
        return ImagesResponse(created=int(time.time()), data=data, size=f"{params.width}x{params.height}")

    # -- endpoints --------------------------------------------------------------------------------------
    async def generations(body, request: Request):
        check_model(body.model)
        lora = await resolve_lora(body.model, body.lora)
        params = build_request("generate", prompt=body.prompt, n=body.n, size=body.size, seed=body.seed,
                               steps=body.num_inference_steps, guidance=body.guidance_scale,
                               true_cfg=body.true_cfg_scale, negative=body.negative_prompt, lora=lora)
        return await execute(params, "/v1/images/generations", request, body.response_format)

    generations.__annotations__["body"] = GenerationRequest  # a class of this server: not resolvable by name
    api.post("/v1/images/generations", response_model=ImagesResponse, responses=ERROR_RESPONSES,
             summary="Create images from a prompt (OpenAI images.generate)")(generations)

    @api.post("/v1/images/edits", response_model=ImagesResponse, responses=ERROR_RESPONSES,
              summary="Edit image(s) with a prompt (OpenAI images.edit); edit-capable models only")
    async def edits(
        request: Request,
        prompt: str = Form(..., min_length=1, max_length=HARD_MAX_PROMPT, description="the edit instruction"),
        image: list[UploadFile] | None = File(None, description="the input image(s): PNG, JPEG or WebP"),
        image_list: list[UploadFile] | None = File(None, alias="image[]",
                                                   description="several input images (what the openai client "
                                                               "sends for a list)"),
        mask: UploadFile | str | None = File(None, description="not supported: a request with a mask (file or "
                                                               "text) gets 400"),
        model_name: str | None = Form(None, alias="model", max_length=256),
        n: int = Form(1, ge=1, le=limits.max_n, description="images to generate (server limit --max-n)"),
        size: str | None = Form(None, max_length=16, description=size_description(limits) + " Omitted = the size "
                                "of the first image, rounded down to the multiple and capped."),
        response_format: Literal["b64_json", "url"] = Form("b64_json"),
        seed: int | None = Form(None, ge=0, le=MAX_SEED),
        num_inference_steps: int | None = Form(None, ge=1, le=limits.max_steps,
                                               description="denoising steps (server limit --max-steps)"),
        guidance_scale: float | None = Form(None, ge=0.0, le=MAX_GUIDANCE),
        true_cfg_scale: float | None = Form(None, ge=0.0, le=MAX_GUIDANCE),
        negative_prompt: str | None = Form(None, max_length=HARD_MAX_PROMPT),
        lora: str | None = Form(None, max_length=4096, description='a LoRA adapter as JSON, e.g. {"name": "x"}'),
    ):
        check_model(model_name)
        try:
            lora_body = json.loads(lora) if lora is not None else None
        except ValueError:
            raise bad_request(f"lora={lora!r} is not JSON; send e.g. {{\"name\": \"x\", \"scale\": 1.0}}", "lora")
        lora_choice = await resolve_lora(model_name, lora_body)
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
        most = min(limits.max_input_images, model.max_references)
        if len(uploads) > most:
            why = (f"{model.pipeline_class} takes one reference image" if model.max_references == 1 else
                   f"at most {most} are accepted")
            raise bad_request(f"{len(uploads)} images sent; {why}", "image", "too_many_images")
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
        params = build_request("edit", prompt=prompt, n=n, size=size, seed=seed, steps=num_inference_steps,
                               guidance=guidance_scale, true_cfg=true_cfg_scale, negative=negative_prompt,
                               lora=lora_choice)
        params.images = [fit_area(im, params.width, params.height) for im in decoded]
        check_references(decoded, params.images)
        return await execute(params, "/v1/images/edits", request, response_format)

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
                         size_multiple=model.size_multiple,
                         limits={"max_n": limits.max_n, "max_steps": limits.max_steps, "max_size": limits.max_size,
                                 "max_request_cost": limits.max_cost})

    def adapter_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=model.created, family=model.family, pipeline=model.pipeline_class,
                         capabilities=card().capabilities, root=model.lora.named[name], parent=model.id)

    # other routes' models (videos) add theirs; LoRA adapters are listed with parent = the model
    api.state.model_cards = [card] + [lambda name=name: adapter_card(name) for name in adapters]

    @api.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]},
             summary="The served models (LoRA adapters with their parent)")
    async def models():
        return ModelList(data=[make() for make in api.state.model_cards])

    @api.get("/v1/models/{model_id}", response_model=ModelCard, responses={404: ERROR_RESPONSES[404]})
    async def get_model(model_id: str):
        for make in api.state.model_cards:
            found = make()
            if found.id == model_id:
                return found
        check_model(model_id)  # 404 naming the served model
        return card()

    @api.get("/health", response_model=Health, summary="Liveness, queue state (and replicas behind an ingress); "
                                                        "503 while no replica runs")
    async def health():
        states = replicas() if replicas is not None else None
        status = "stopping" if engine.stopping else replica_status(states) if states is not None else "ok"
        body = Health(status=status, model=model.id, queue_depth=engine.queue_depth, running=engine.running,
                      world_size=world_size, replicas=states)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=503 if status == "unavailable" else 200)

    @api.get("/metrics", response_class=Response, summary="Prometheus metrics (text exposition format)")
    async def prometheus():
        metrics.queue_depth.set(engine.queue_depth)
        for state, count in (replicas() if replicas is not None else {}).items():
            metrics.replicas.labels(state).set(count)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app = _Guard(api, metrics=metrics, api_key=api_key, max_body=limits.max_body_bytes, body_timeout_s=body_timeout_s)
    app.fastapi = api  # for app.fastapi.openapi()
    app.limits = limits
    # what other routes on this model's queue reuse (the chat route's images)
    app.image_service = types.SimpleNamespace(model=model, engine=engine, limits=limits, check_model=check_model,
                                              build_request=build_request, resolve_lora=resolve_lora)
    return app


def replica_status(states: dict[str, int]) -> str:
    """ok: every replica runs; degraded: some run while others (re)start; unavailable: none runs."""
    if not states.get("running"):
        return "unavailable"
    return "degraded" if states.get("starting") else "ok"


def openapi_json(app) -> str:
    return json.dumps(app.fastapi.openapi(), indent=1)
