"""``omni-accel serve``: arguments, model loading, and the uvicorn (rank 0) / follower (other ranks) entry."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any

logger = logging.getLogger("omni_accel.serve")

MB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import DTYPES, add_acceleration_arguments

    g = p.add_argument_group("model")
    g.add_argument("--model", default=os.environ.get("OMNI_ACCEL_MODEL"),
                   help="local diffusers pipeline folder (env OMNI_ACCEL_MODEL); default: the built-in model")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: omni-accel-builtin, or the folder name of --model)")
    g.add_argument("--dtype", choices=DTYPES, default=os.environ.get("OMNI_ACCEL_DTYPE"),
                   help="weights dtype (default bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--device", default=os.environ.get("OMNI_ACCEL_DEVICE"),
                   help="cpu or cuda[:N] (default cuda if available; under torchrun cuda:LOCAL_RANK)")
    g.add_argument("--default-size", default=None, metavar="WxH",
                   help="size of a request without 'size' (default: the model's native size)")
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up call at start-up")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8091, help="port (default 8091; 0 = any free port)")
    s.add_argument("--api-key", default=os.environ.get("OMNI_ACCEL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health, /metrics, the docs and "
                        "/files/images (env OMNI_ACCEL_API_KEY, which keeps the key out of the process list)")
    s.add_argument("--max-concurrency", type=int, default=4,
                   help="requests of the same shape batched into one pipeline call (default 4)")
    s.add_argument("--max-batch-images", type=int, default=8, help="images per pipeline call at most (default 8)")
    s.add_argument("--max-queue", type=int, default=32,
                   help="requests waiting beyond the running batch; more -> 429 with Retry-After (default 32; "
                        "speech requests have a queue of their own of the same size)")
    s.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may take, queue included; longer -> 504 (default 300)")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM / SIGINT: queued requests are answered 503 at once, running ones get this many "
                        "seconds to finish before they are answered 503 too; then the server exits 0 (default 30)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client may take to send a request's headers; longer -> 408 (default 10)")
    s.add_argument("--idle-timeout", type=float, default=15.0,
                   help="seconds a kept-alive connection may sit idle, and a request body may stall (408) "
                        "(default 15)")
    s.add_argument("--max-connections-per-client", type=int, default=64,
                   help="open connections of one client address at most; more -> 429 (default 64)")
    s.add_argument("--max-connections", type=int, default=None,
                   help="open connections in all at most; more -> 503 (default 4 x (--max-queue + "
                        "--max-concurrency) + 64)")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-n", type=int, default=4, help="images per request at most (default 4)")
    lim.add_argument("--max-steps", type=int, default=100, help="num_inference_steps at most (default 100)")
    lim.add_argument("--max-size", type=int, default=None,
                     help="largest image side in pixels (default: twice the model's native side: 256 for the "
                          "built-in model, 2048 for FLUX.1)")
    lim.add_argument("--max-request-cost", type=float, default=None, metavar="MPX_STEPS",
                     help="cost of one request at most, in megapixel-steps: n x width x height x steps / 1e6 "
                          "(default: 8 requests of one native-size image at the model's default steps, e.g. "
                          "2.6 for the built-in model, 235 for FLUX.1)")
    lim.add_argument("--max-body-mb", type=float, default=20.0, help="request body at most, MiB (default 20)")
    lim.add_argument("--max-upload-mb", type=float, default=20.0, help="one uploaded image at most, MiB (default 20)")
    lim.add_argument("--max-input-pixels", type=int, default=4096 * 4096,
                     help="decoded pixels of one uploaded image at most (default 4096*4096)")
    lim.add_argument("--url-cache", type=int, default=64,
                     help="images kept in memory for response_format=url (default 64)")
    add_acceleration_arguments(p)
    v = p.add_argument_group("video (POST /v1/videos: docs/serving.md)")
    v.add_argument("--video-model", default=os.environ.get("OMNI_ACCEL_VIDEO_MODEL"), metavar="PATH|builtin",
                   help="a Wan 2.1 / 2.2 pipeline folder (text- or image-to-video), or 'builtin': serve /v1/videos "
                        "beside the image endpoints, accelerated with the same flags (env OMNI_ACCEL_VIDEO_MODEL)")
    v.add_argument("--served-video-model-name", default=None,
                   help="the video model id clients use (default: the folder name of --video-model)")
    v.add_argument("--video-dir", default=None,
                   help="folder of the finished videos (default: a temporary folder removed at exit)")
    v.add_argument("--video-store-count", type=int, default=100,
                   help="finished video jobs kept at most; the oldest are evicted (default 100)")
    v.add_argument("--video-store-mb", type=float, default=2048.0,
                   help="MiB of video files kept at most; the oldest are evicted (default 2048)")
    v.add_argument("--video-fps", type=int, default=None,
                   help="frames per second of the clips (default: the model's: 16 for Wan, 8 for the built-in)")
    v.add_argument("--max-frames", type=int, default=None,
                   help="frames of one video at most (default: about twice the model's native clip: 161 for Wan)")
    lo = p.add_argument_group("LoRA adapters (docs/serving.md)")
    lo.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                    help="a LoRA adapter (a folder written by save_lora_weights, or its .safetensors file) served "
                         "as model NAME; repeat for more. Loaded at start-up and never evicted")
    lo.add_argument("--lora-dir", default=None, metavar="ROOT",
                    help="let requests name an adapter folder under ROOT ({\"lora\": {\"path\": \"sub/dir\"}}); "
                         "paths resolving outside ROOT are refused")
    lo.add_argument("--video-lora", action="append", default=[], metavar="NAME=PATH",
                    help="a LoRA adapter of the --video-model, served as model NAME on /v1/videos (repeatable)")
    lo.add_argument("--video-lora-dir", default=None, metavar="ROOT",
                    help="as --lora-dir, for the video model's adapters")
    lo.add_argument("--max-loras", type=int, default=4,
                    help="adapters held in memory at most (least recently used out first; --lora ones stay)")
    lo.add_argument("--max-lora-rank", type=int, default=64,
                    help="the highest adapter rank served: ranks are padded to it so that a compiled pipeline "
                         "switches adapters without recompiling (default 64)")
    sl = p.add_argument_group("sleep mode (docs/serving.md)")
    sl.add_argument("--enable-sleep-mode", action="store_true",
                    help="allow POST /sleep and POST /wake_up (weights to host memory, or to a file on a CPU)")
    sl.add_argument("--no-auto-wake", action="store_true",
                    help="answer requests that arrive while asleep with 503 + Retry-After instead of waking up")
    from .ray_flags import add_arguments as add_ray_arguments

    add_ray_arguments(p)
    sp = p.add_argument_group("speech (docs/speech.md)")
    sp.add_argument("--speech-model", default=os.environ.get("OMNI_ACCEL_SPEECH_MODEL"),
                    help="a Qwen2.5-Omni folder: serve POST /v1/audio/speech and GET /v1/audio/voices (alone, or "
                         "beside the image endpoints when --model is given; env OMNI_ACCEL_SPEECH_MODEL)")
    sp.add_argument("--speech-engine", choices=["vllm", "transformers"], default="vllm",
                    help="engine of the thinker and talker (default vllm; transformers when vLLM is absent)")
    sp.add_argument("--speech-compile", action="store_true", help="torch.compile the token2wav DiT blocks")
    sp.add_argument("--speech-greedy", action="store_true",
                    help="greedy talker (deterministic) instead of the model's sampling defaults")
    sp.add_argument("--speech-max-codes", type=int, default=2048,
                    help="talker codes per request at most (50 a second of audio; default 2048)")


def _model_id(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        from .engine import BUILTIN_ID

        return BUILTIN_ID
    return os.path.basename(os.path.normpath(os.path.expanduser(args.model))) or "model"


def _check_args(args) -> None:
    from ..cli import CliError
    from .app import check_api_key

    for name in ("max_concurrency", "max_batch_images", "max_queue", "max_n", "max_steps", "max_size",
                 "max_input_pixels", "url_cache", "max_connections_per_client", "max_connections",
                 "video_store_count", "video_fps", "max_frames"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: it must be >= 1.")
    for name in ("request_timeout", "max_body_mb", "max_upload_mb", "max_request_cost", "header_timeout",
                 "idle_timeout", "video_store_mb"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise CliError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: it must be > 0.")
    if args.shutdown_grace < 0:
        raise CliError(f"--shutdown-grace {args.shutdown_grace} is invalid: it must be >= 0.")
    if not 0 <= args.port < 65536:
        raise CliError(f"--port {args.port} is not a port number.")
    try:
        check_api_key(args.api_key)
    except ValueError as exc:
        raise CliError(f"--api-key / OMNI_ACCEL_API_KEY: {exc}.")
    from .ray_flags import check_arguments as check_ray_arguments

    check_ray_arguments(args)


def device_dtype_config(args):
    """(device, torch dtype, validated AccelConfig) of the flags: under torchrun each rank takes cuda:LOCAL_RANK."""
    import torch

    from ..cli import _accel_config, _check_attention_early, _resolve_device, _torch_dtype, start_compile_cache

    device = args.device
    if device is None and torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    device = _resolve_device(device)
    dtype = _torch_dtype(args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32"))
    config = _accel_config(args, device)
    _check_attention_early(args.attention, device, dtype)
    if not start_compile_cache(args) and args.compile_cache:  # a server only reads the file
        logger.warning("omni_accel.serve: --compile-cache %s does not exist yet; compiling from scratch. `omni-accel "
                       "generate` with the same flags and --compile-cache %s writes it.", args.compile_cache,
                       args.compile_cache)
    return device, dtype, config


def load_model(args):
    """The image model of the parsed arguments as a LoadedModel; the pipeline is accelerated."""
    import omni_accel

    from ..cli import CliError, _default_size, _load_pipeline_quietly
    from .engine import LoadedModel

    device, dtype, config = device_dtype_config(args)
    native = _default_size(args)
    pipe, defaults, source = _load_pipeline_quietly(args, device, dtype)
    lora = None
    if args.lora or args.lora_dir:  # before accelerate(): the adapter slot's layers are part of the passes' work
        from .lora import LoraManager, parse_lora_flags

        lora = LoraManager(pipe, parse_lora_flags(args.lora), max_loras=args.max_loras, lora_dir=args.lora_dir,
                           max_rank=args.max_lora_rank)
        lora.prepare()
    omni_accel.accelerate(pipe, config=config)
    model = LoadedModel.from_pipeline(pipe, _model_id(args), defaults, native)
    model.lora = lora
    w, h = model.native_size
    if w % model.size_multiple or h % model.size_multiple:
        raise CliError(f"--default-size {w}x{h}: both sides must be multiples of {model.size_multiple}.")
    logger.info("omni_accel.serve: loaded %s as %r (%s, native %dx%d)", source, model.id, model.pipeline_class, w, h)
    return model


def _warmup(model) -> None:
    """One small call so the first request does not pay for lazy initialisation (and compile, when on)."""
    from .engine import run_spec

    m = model.size_multiple
    spec = {"op": "generate", "prompts": ["warm-up"], "negative_prompts": None, "seeds": [0], "width": m * 2,
            "height": m * 2, "steps": 1, "guidance_scale": model.defaults.get("guidance_scale"),
            "true_cfg_scale": None, "images": []}
    if model.can_edit:
        from PIL import Image

        spec["op"], spec["images"] = "edit", [Image.new("RGB", (m * 2, m * 2), (128, 128, 128))]
    try:
        run_spec(model, spec)
    except Exception as exc:  # noqa: BLE001 -- a failing warm-up is logged; requests will report the error
        logger.warning("omni_accel.serve: warm-up call failed: %r", exc)


@dataclasses.dataclass
class ServedModels:
    """The models one server (or one replica) serves: the image model, and a video model and a speech pipeline when
    the flags ask for them. An ingress holds copies without their pipelines (``without_pipelines``)."""

    image: Any = None  # LoadedModel (None: a speech-only server)
    video: Any = None  # LoadedModel of a video pipeline
    speech: Any = None  # SpeechPipeline, or its SpeechInfo

    def without_pipelines(self) -> "ServedModels":
        from .speech import SpeechInfo

        return ServedModels(image=self.image.without_pipeline() if self.image is not None else None,
                            video=self.video.without_pipeline() if self.video is not None else None,
                            speech=SpeechInfo.of(self.speech) if self.speech is not None else None)

    def runners(self) -> dict:
        """The pipeline call of each job kind on this rank (rank 0's executors under a Leader, a follower's
        runners)."""
        from .sleep import run_sleep

        out = {}
        if self.image is not None:
            out["image"] = image_runner(self.image)
            out["sleep"] = lambda spec, control=None: run_sleep(self.image.pipe, spec)
        if self.video is not None:
            from .videos import video_runner

            out["video"] = video_runner(self.video)
            out["sleep_video"] = lambda spec, control=None: run_sleep(self.video.pipe, spec)
        return out


def load_models(args, *, warmup: bool = True) -> ServedModels:
    """Load and accelerate every model of the flags (each rank of a parallel group alike) and warm them up."""
    models = ServedModels()
    if not speech_only(args):
        models.image = load_model(args)
    if args.video_model:
        from .videos import load_video_model

        models.video = load_video_model(args)
    if warmup and not args.no_warmup:  # every rank: the same local calls, no collectives outside the pipeline's own
        if models.image is not None:
            _warmup(models.image)
        if models.video is not None:
            from .videos import warmup as warmup_video

            warmup_video(models.video)
    return models


def load_speech(args, models: ServedModels, *, warmup: bool = False) -> ServedModels:
    """The speech pipeline of ``--speech-model`` (rank 0 only: speech is not parallel)."""
    if getattr(args, "speech_model", None):
        from .speech import load_pipeline
        from .speech import warmup as warmup_speech

        models.speech = load_pipeline(args)
        if warmup and not args.no_warmup:
            warmup_speech(models.speech, args)
    return models


def speech_only(args) -> bool:
    return bool(getattr(args, "speech_model", None)) and args.model is None and args.video_model is None


def limits_of(args):
    from .engine import Limits

    return Limits(max_n=args.max_n, max_steps=args.max_steps, max_size=args.max_size,
                  max_cost=args.max_request_cost, max_body_bytes=int(args.max_body_mb * MB),
                  max_upload_bytes=int(args.max_upload_mb * MB), max_input_pixels=args.max_input_pixels,
                  request_timeout_s=args.request_timeout)


def make_queues(args, models: ServedModels, metrics, *, leader=None, store=None, headroom: int = 0) -> dict:
    """The job queue of each served model, by name ("images", "videos", "speech"), with the flags' bounds.
    ``leader``: rank 0's broadcast-then-call executors (torchrun, a multi-GPU replica). ``store``: where finished
    videos go (None on a replica: its ingress stores them). ``headroom`` widens every queue (a replica's queue also
    holds what its ingress counts as running)."""
    from .distributed import PING_S
    from .engine import image_queue

    fan_out = dict(on_idle=leader.ping if leader else None, idle_s=PING_S, can_abort=leader is None)
    queues = {}
    if models.image is not None:
        queues["images"] = image_queue(models.image, max_queue=args.max_queue + headroom,
                                       max_concurrency=args.max_concurrency, max_batch_images=args.max_batch_images,
                                       metrics=metrics, executor=leader.executor("image") if leader else None,
                                       **fan_out)
    if models.video is not None:
        from .videos import video_queue

        queues["videos"] = video_queue(models.video, store, max_queue=args.max_queue + headroom, metrics=metrics,
                                       executor=leader.executor("video") if leader else None, **fan_out)
    if models.speech is not None:
        from .speech import SpeechSettings, speech_queue

        settings = SpeechSettings.from_args(args, speech_id(args))
        queues["speech"] = speech_queue(models.speech, dataclasses.replace(settings,
                                                                           max_queue=args.max_queue + headroom),
                                        metrics, start=False)
    return queues


def speech_id(args) -> str:
    from .speech import folder_name

    if speech_only(args) and args.served_model_name:
        return args.served_model_name
    return folder_name(args.speech_model)


def build_app(args, models: ServedModels, queues: dict, metrics, *, store=None, world_size: int = 1,
              replicas=None, sleepers=()):
    """The ASGI app of every route over ``queues`` (local job queues, or an ingress's RemoteQueues): the image
    routes, /v1/videos with ``store``, the speech routes, /v1/chat/completions, and the sleep routes over
    ``sleepers``. ``replicas`` (a callable: replica states) makes /health and /metrics report the replicas behind an
    ingress."""
    from . import chat
    from .app import create_app
    from .sleep import add_sleep_mode
    from .speech import SpeechSettings

    limits = limits_of(args)
    settings = SpeechSettings.from_args(args, speech_id(args)) if models.speech is not None else None
    if models.image is None:  # a speech-only server (its app has the chat route)
        from .speech import create_speech_app

        app = create_speech_app(models.speech, settings, api_key=args.api_key, max_body=int(args.max_body_mb * MB),
                                queue=queues["speech"], metrics=metrics)
    else:
        app = create_app(models.image, queues["images"], limits=limits, api_key=args.api_key, metrics=metrics,
                         url_cache=args.url_cache, world_size=world_size, body_timeout_s=args.idle_timeout,
                         replicas=replicas)
        if models.video is not None:  # /v1/videos beside the image routes, with the video model's queue
            from . import videos

            video_limits = dataclasses.replace(limits, max_frames=args.max_frames).resolved(models.video)
            videos.install(app.fastapi, models.video, queues["videos"], store, video_limits, models.video.fps)
        speech = None
        if models.speech is not None:  # speech routes beside the image ones, with a queue of their own
            from .speech import install

            install(app.fastapi, models.speech, settings, metrics, queue=queues["speech"])
            speech = (models.speech, queues["speech"], settings)
        chat.install(app.fastapi, image=app.image_service, speech=speech)
    add_sleep_mode(app, app.fastapi, list(sleepers), enabled=args.enable_sleep_mode, auto_wake=not args.no_auto_wake)
    app.queues = list(queues.values())
    return app


def sleepers_of(models: ServedModels, queues: dict, leader=None) -> list:
    """The sleep mode of each model's queue (under torchrun the sleep runs on every rank, as a call does)."""
    from .sleep import Sleeper

    out = []
    if "images" in queues:
        out.append(Sleeper(queues["images"], models.image.pipe, leader.executor("sleep") if leader else None))
    if "videos" in queues:
        out.append(Sleeper(queues["videos"], models.video.pipe, leader.executor("sleep_video") if leader else None))
    if "speech" in queues:
        out.append(Sleeper(queues["speech"], models.speech))
    return out


def video_store(args, models: ServedModels):
    """The bounded store of finished videos (None without a video model)."""
    if models.video is None:
        return None
    from . import videos

    settings = videos.VideoSettings.from_args(args)
    return videos.VideoStore(settings.folder, settings.max_count, settings.max_bytes)


def build_server(args, model, *, video_model=None, leader=None, world_size: int = 1):
    """(uvicorn.Server, the image job queue) for rank 0 / a single process; ``server.drains`` are all its job
    queues and ``server.cleanups`` what to close after them (``serve`` does both)."""
    from .metrics import ServeMetrics

    models = load_speech(args, ServedModels(image=model, video=video_model))
    metrics = ServeMetrics()
    store = video_store(args, models)
    queues = make_queues(args, models, metrics, leader=leader, store=store)
    app = build_app(args, models, queues, metrics, store=store, world_size=world_size,
                    sleepers=sleepers_of(models, queues, leader))
    for queue in queues.values():
        queue.start()
    server = uvicorn_server(app, args, drains=list(queues.values()))
    server.cleanups = [store.close] if store is not None else []
    return server, queues["images"]


def uvicorn_server(app, args, drains=()):
    """The uvicorn server of ``app`` with the connection guards of the flags and the drain on SIGTERM / SIGINT."""
    import uvicorn

    from .transport import DrainingServer, guarded_protocol

    log_level = "warning" if getattr(args, "verbose", 0) == 0 else "info"
    max_connections = args.max_connections or 4 * (args.max_queue + args.max_concurrency) + 64
    protocol = guarded_protocol(header_timeout_s=args.header_timeout, max_per_client=args.max_connections_per_client,
                                max_connections=max_connections)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level, access_log=False,
                            http=protocol, timeout_keep_alive=max(1, round(args.idle_timeout)),
                            timeout_graceful_shutdown=5, h11_max_incomplete_event_size=64 * 1024)
    return DrainingServer(config, drains=list(drains), grace_s=args.shutdown_grace)


def serve(server, leader=None) -> int:
    """Run ``server`` until it is told to stop (drained on a signal); then stop its job queues and the followers."""
    try:
        server.run()
    finally:
        # under torchrun the running call cannot be aborted (every rank is in it): wait for it before the stop
        # broadcast, which must not interleave with the call's collectives
        for queue in server.drains:
            queue.stop(timeout=None if leader is not None else 30.0)
        if leader is not None:
            leader.stop()
        for cleanup in getattr(server, "cleanups", ()):
            cleanup()
    return 0


def image_runner(model):
    """The pipeline call of an image spec on this rank (rank 0's executor, or a follower's runner)."""
    from .engine import run_spec

    return lambda spec, control=None: run_spec(model, spec, control)


def run(args) -> int:
    from ..cli import CliError

    try:
        import fastapi  # noqa: F401
        import python_multipart  # noqa: F401 -- the module name since 0.0.13 (FastAPI needs it for uploads)
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise CliError(f"omni-accel serve needs the serve extra ({exc.name} is missing): "
                       "pip install 'omni-accel[serve]'")
    _check_args(args)
    if args.ray:  # replicas on Ray Serve behind one ingress (serve/ray_app.py)
        try:
            import ray.serve  # noqa: F401
        except ImportError:
            raise CliError("omni-accel serve --ray needs Ray Serve, which is not installed: "
                           "pip install 'omni-accel[ray]'")
        from .ray_app import run as run_ray

        return run_ray(args)
    if speech_only(args):
        from .speech import run as run_speech

        return run_speech(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        from .. import distributed as odist

        odist.init()
        rank = odist.rank()
    try:
        models = load_models(args)
        if rank != 0:
            from .distributed import follower_loop

            follower_loop(models.runners())
            return 0
        leader = None
        if world > 1:
            from .distributed import Leader

            leader = Leader(models.runners())
        server, _ = build_server(args, models.image, video_model=models.video, leader=leader, world_size=world)
        print(f"omni-accel serve: {describe(models)} on http://{args.host}:{args.port} (world size {world})",
              file=sys.stderr, flush=True)
        return serve(server, leader)
    finally:
        if world > 1:
            from .. import distributed as odist

            odist.shutdown()


def describe(models: ServedModels) -> str:
    """The served models in one line of the start-up message."""
    parts = []
    if models.image is not None:
        parts.append(f"{models.image.id} ({models.image.pipeline_class})")
    if models.video is not None:
        parts.append(f"videos: {models.video.id} ({models.video.pipeline_class})")
    if models.speech is not None:
        parts.append("speech")
    return ", ".join(parts)
