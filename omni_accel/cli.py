"""The ``omni-accel`` command line (also ``python -m omni_accel``).

    omni-accel generate "a red circle on a blue background" -o out.png              # built-in model
    omni-accel generate --video "a red circle moving from left to right on a blue background" -o clip.mp4
    omni-accel generate "a fox" --model ./FLUX.1-dev --device cuda --dtype bfloat16 \\
        --attention auto --compile on -o fox.png
    omni-accel info

Subcommands are registered in ``SUBCOMMANDS`` (name -> (help, add_arguments, run)); serve, demo, calibrate and
bench live in their own modules and are imported only when run. ``main(argv)`` returns the exit code: 0 ok, 2 for bad input (unknown flag
values, an AccelError, a model path that does not exist), 1 for an unexpected failure.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import platform
import sys
import time
import warnings
from typing import Any, Callable

logger = logging.getLogger("omni_accel.cli")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

ENV_VARS = {
    "OMNI_ACCEL_MODEL": "default for --model (a local diffusers pipeline folder); unset = the built-in model",
    "OMNI_ACCEL_DEVICE": "default for --device (cpu, cuda, cuda:1 ...); unset = cuda if available, else cpu",
    "OMNI_ACCEL_DTYPE": "default for --dtype (float32, bfloat16, float16); unset = bfloat16 on cuda, float32 on cpu",
}
ENV_HELP = "configuration precedence: command-line arguments first, then environment variables, then defaults.\n" + \
    "\n".join(f"  {k:18s} {v}" for k, v in ENV_VARS.items())

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_FPS = 16  # Wan 2.1's frame rate; the built-in video model carries its own
COMPILE_CHOICES = ("off", "on", "max")  # AccelConfig takes these words as well as False / True
OUTPUT_DEFAULTS = ("fps",)  # model defaults that describe the written file, not the pipeline call


class CliError(Exception):
    """A user-facing failure: printed as ``error: <message>`` with exit code 2, no traceback."""


# ---------------------------------------------------------------------------------------------- generate
def _add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the text prompt")
    p.add_argument("-o", "--output", default=None,
                   help="output file (default out.png, or out.mp4 with --video). Video pipelines (e.g. Wan): .mp4 "
                        "gets an H.264 MP4, .gif an animated GIF, any other extension the first frame only")
    add_model_arguments(p)
    add_acceleration_arguments(p)
    r = p.add_argument_group("output")
    r.add_argument("--fps", type=int, default=None,
                   help="frames per second of a video file (default: the model's, 8 for the built-in video model, "
                        f"else {DEFAULT_FPS})")
    r.add_argument("--report", choices=["table", "json", "none"], default="table",
                   help="how to print pipe.omni_accel.report() after saving (default table)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model, sampling, dtype and device flags (shared by generate and bench); read by ``_load_pipeline`` and
    ``_call_kwargs``."""
    g = p.add_argument_group("model and sampling")
    g.add_argument("--model", default=os.environ.get("OMNI_ACCEL_MODEL"),
                   help="local diffusers pipeline folder, loaded with DiffusionPipeline.from_pretrained "
                        "(env OMNI_ACCEL_MODEL); default: the built-in model with its own defaults")
    g.add_argument("--video", action="store_true",
                   help="generate a video: the default model becomes the built-in video model (a WanPipeline); "
                        "--model must then be a video pipeline")
    # diffusers' keyword names work as aliases of the short flags (--num-inference-steps = --steps ...)
    g.add_argument("--steps", "--num-inference-steps", dest="steps", type=int, default=None,
                   help="denoising steps (default: the model's)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--height", type=int, default=None, help="image height in pixels (default: the model's)")
    g.add_argument("--width", type=int, default=None, help="image width in pixels (default: the model's)")
    g.add_argument("--guidance", "--guidance-scale", dest="guidance", type=float, default=None,
                   help="guidance_scale of the pipeline (default: the model's)")
    g.add_argument("--true-cfg-scale", type=float, default=None,
                   help="true_cfg_scale for pipelines with true CFG (FLUX, Qwen-Image); needs --negative-prompt")
    g.add_argument("--negative-prompt", default=None, help="negative prompt ('' for an empty one)")
    g.add_argument("--frames", "--num-frames", dest="frames", type=int, default=None,
                   help="num_frames for video pipelines")
    g.add_argument("--dtype", choices=DTYPES, default=os.environ.get("OMNI_ACCEL_DTYPE"),
                   help="weights dtype (env OMNI_ACCEL_DTYPE; default bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--device", default=os.environ.get("OMNI_ACCEL_DEVICE"),
                   help="cpu or cuda[:N] (env OMNI_ACCEL_DEVICE; default cuda if available, else cpu)")


def add_acceleration_arguments(p: argparse.ArgumentParser) -> None:
    """The acceleration flags (shared by generate, serve and demo); read back with ``_accel_config``."""
    a = p.add_argument_group("acceleration (the keywords of omni_accel.accelerate)")
    a.add_argument("--attention", default="auto", help="attention backend (default auto; see `omni-accel info`)")
    a.add_argument("--compile", choices=list(COMPILE_CHOICES), default="off",
                   help="torch.compile: off, on (regional) or max (regional + a CUDA graph of the whole forward)")
    a.add_argument("--offload", choices=["model", "block"], default=None, help="CPU offload mode")
    a.add_argument("--vae-tiling", action="store_true", help="decode the VAE in tiles")
    a.add_argument("--vae-slicing", action="store_true", help="decode the VAE one image at a time")
    a.add_argument("--sp", type=int, default=1, help="sequence-parallel degree")
    a.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (of --sp)")
    a.add_argument("--ring", type=int, default=None, help="ring-attention degree (of --sp)")
    a.add_argument("--cfg-parallel", type=int, default=1, help="CFG-parallel degree")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    a.add_argument("--vae-parallel", type=int, default=1, help="VAE-parallel degree")
    a.add_argument("--cache", default=None, help="step cache backend (tea_cache, cache_dit, fb_cache, mag_cache)")
    a.add_argument("--cache-config", default=None, metavar="JSON",
                   help='cache options as JSON, e.g. \'{"rel_l1": 0.2}\'')
    a.add_argument("--quant", default=None, help="quantization (fp8, fp8_weight_only, int8)")
    a.add_argument("--quant-config", default=None, metavar="JSON",
                   help='quantization options as JSON, e.g. \'{"activations": "static"}\' or \'{"modulation": "int8"}\'')
    a.add_argument("--text-encoder", default=None, help="text-encoder engine (vllm, transformers)")
    a.add_argument("--kernels", action="store_true", help="fused kernels")
    a.add_argument("--fuse-qkv", action="store_true", help="one q/k/v GEMM per stream (flux, flux2, wan)")
    a.add_argument("--compile-cache", default=None, metavar="PATH",
                   help="with --compile on/max: load PATH's compiles before the first call when it exists "
                        "(omni_accel.load_compile_cache); generate writes it after its call when it does not")


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _resolve_device(arg: str | None) -> str:
    import torch

    if arg is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(arg)
    except (RuntimeError, TypeError):
        raise CliError(f"--device {arg!r} is not a device; use cpu or cuda (or cuda:N).")
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device {arg!r}: only cpu and cuda are supported.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {arg!r} was asked for but torch sees no CUDA GPU; use --device cpu.")
    return arg


def _json_flag(args: argparse.Namespace, name: str):
    """The JSON value of the ``--cache-config`` / ``--quant-config`` style flag ``name`` (None when not given)."""
    text = getattr(args, name, None)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"--{name.replace('_', '-')} is not valid JSON ({exc}): {text!r}")


def _accel_config(args: argparse.Namespace, device: str):
    from .config import AccelConfig

    config = AccelConfig(
        sp=args.sp, ulysses=args.ulysses, ring=args.ring, cfg_parallel=args.cfg_parallel, tp=args.tp,
        vae_parallel=args.vae_parallel, cache=args.cache, cache_config=_json_flag(args, "cache_config"),
        offload=args.offload, quant=args.quant, quant_config=_json_flag(args, "quant_config"),
        attention=args.attention, compile=args.compile,
        text_encoder=args.text_encoder, kernels=args.kernels, fuse_qkv=args.fuse_qkv, vae_tiling=args.vae_tiling,
        vae_slicing=args.vae_slicing, device=device,
    )
    config.validate()
    if config.quant is not None:  # quant_config's own checks need no model: before any loading
        from .kernels.quant import check_quant_config

        check_quant_config(config)
    return config


def start_compile_cache(args: argparse.Namespace) -> bool:
    """Load ``--compile-cache`` when the file exists (True); False when there is none or this run is to write it.
    Checked before any model is loaded: the flag needs compiling, and the file's folder must exist."""
    path = getattr(args, "compile_cache", None)
    if path is None:
        return False
    if args.compile == "off":
        raise CliError(f"--compile-cache {path!r} needs --compile on or max: without compiling there is nothing to "
                       "cache.")
    if os.path.exists(path):
        import omni_accel

        loaded = omni_accel.load_compile_cache(path)
        logger.info("omni_accel: compile cache %s loaded (%s)", path, loaded)
        return True
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"--compile-cache {path!r}: its folder {folder!r} does not exist; create it, or give a path "
                       "in an existing folder.")
    return False


def _check_attention_early(name: str, device: str, dtype) -> None:
    """Reject an unknown/unusable attention backend before spending time on loading the model."""
    import torch

    from .kernels.attention import resolve_backend

    resolve_backend(name, torch.device(device), dtype)


def _load_pipeline(args: argparse.Namespace, device: str, dtype) -> tuple[Any, dict, str]:
    """(pipe, the model's call defaults, description). Weights stay on the host when offload is asked for."""
    target = "cpu" if getattr(args, "offload", None) else device
    video = getattr(args, "video", False)
    if args.model is None and video:
        from .builtin import BUILTIN_VIDEO_DEFAULTS, BUILTIN_VIDEO_FPS, load_builtin_video

        pipe = load_builtin_video(dtype=dtype, device=target)  # AccelError naming the training command if absent
        return pipe, {**BUILTIN_VIDEO_DEFAULTS, "fps": BUILTIN_VIDEO_FPS}, "built-in video model"
    if args.model is None:
        try:
            from .builtin import load_builtin
        except ImportError as exc:
            raise CliError(f"the built-in model is not available in this install ({exc}); pass --model PATH.")
        try:
            pipe = load_builtin(dtype=dtype, device=target)
        except (OSError, FileNotFoundError) as exc:
            raise CliError(f"could not load the built-in model: {exc}; pass --model PATH.")
        source = "built-in model"
    else:
        path = os.path.expanduser(args.model)
        if not os.path.exists(path):
            raise CliError(f"--model {args.model!r}: no such folder. Pass a local diffusers pipeline folder (one "
                           "with model_index.json), e.g. one saved by pipe.save_pretrained() or `hf download`.")
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise CliError(f"--model {args.model!r} has no model_index.json: it is not a diffusers pipeline folder.")
        from diffusers import DiffusionPipeline

        try:
            # diffusers >= 0.36 names it ``dtype`` (``torch_dtype`` still works there, with a FutureWarning)
            key = "dtype" if "dtype" in inspect.getsource(DiffusionPipeline.from_pretrained) else "torch_dtype"
            pipe = DiffusionPipeline.from_pretrained(path, **{key: dtype})
        except (OSError, ValueError) as exc:
            raise CliError(f"could not load --model {args.model!r}: {exc}")
        if video and "num_frames" not in call_parameters(pipe):
            raise CliError(f"--video: --model {args.model!r} is a {type(pipe).__name__}, which makes images; pass "
                           "a video pipeline folder (e.g. Wan) or leave --model out for the built-in video model.")
        pipe.to(target)
        source = path
    from .builtin import call_defaults

    return pipe, call_defaults(pipe), source


def _default_size(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--default-size WxH`` of serve / demo, parsed before the model is loaded so a typo costs no load."""
    if not args.default_size:
        return None
    from .serve.schemas import parse_size

    try:
        return parse_size(args.default_size)
    except ValueError as exc:
        raise CliError(f"--default-size: {exc}")


def _load_pipeline_quietly(args: argparse.Namespace, device: str, dtype) -> tuple[Any, dict, str]:
    """``_load_pipeline`` without the pipeline's per-call progress bars: serve and demo keep them out of their logs,
    bench shows one bar over its calls instead."""
    pipe, defaults, source = _load_pipeline(args, device, dtype)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return pipe, defaults, source


def _check_sampling_args(args: argparse.Namespace) -> None:
    for name, value in (("--steps", args.steps), ("--height", args.height), ("--width", args.width),
                        ("--frames", args.frames)):
        if value is not None and value < 1:
            raise CliError(f"{name} {value} is invalid: it must be a positive integer.")
    scale = getattr(args, "true_cfg_scale", None)
    if scale is not None and scale > 1 and getattr(args, "negative_prompt", None) is None:
        raise CliError(f"--true-cfg-scale {scale} runs true CFG only with a negative prompt: add --negative-prompt "
                       "TEXT (--negative-prompt '' for an empty one), or drop --true-cfg-scale.")


def _check_output_path(path: str) -> None:
    """Refuse an output name PIL cannot write before the model is loaded (not after the image is made)."""
    from PIL import Image

    extension = os.path.splitext(path)[1].lower()
    if extension != ".mp4" and extension not in Image.registered_extensions():  # .mp4: omni_accel.video_io
        shown = f"extension {extension!r}" if extension else "no extension"
        raise CliError(f"-o {path!r} has {shown}: the image format comes from it; use e.g. "
                       f"{os.path.splitext(path)[0] or 'out'}.png (or .jpg, .webp; .mp4 or .gif for a video).")
    if os.path.isdir(path):
        raise CliError(f"-o {path!r} is a folder; give a file path such as {os.path.join(path, 'out.png')}.")


def call_parameters(pipe) -> "dict[str, inspect.Parameter]":
    """The parameters of the stock pipeline's ``__call__`` (accelerate() swaps in a subclass)."""
    cls = getattr(type(pipe), "_omni_accel_original_class", type(pipe))
    return dict(inspect.signature(cls.__call__).parameters)


def _call_kwargs(pipe, args: argparse.Namespace, defaults: dict) -> dict:
    """The model's call defaults, overridden by the flags the user gave; keys the pipeline does not take are
    dropped (with a warning when the user asked for them)."""
    import torch

    given = {
        "prompt": args.prompt,
        "num_inference_steps": args.steps,
        "height": args.height,
        "width": args.width,
        "guidance_scale": args.guidance,
        "true_cfg_scale": args.true_cfg_scale,
        "negative_prompt": args.negative_prompt,
        "num_frames": args.frames if args.frames is not None else defaults.get("num_frames"),
    }
    given = {key: value for key, value in given.items() if value is not None}
    defaults = {k: v for k, v in defaults.items() if k not in OUTPUT_DEFAULTS}
    accepted = call_parameters(pipe)
    for key in given:
        if key not in accepted:
            logger.warning("%s does not take %s; ignoring it", type(pipe).__name__, key)
    kwargs = {k: v for k, v in {**defaults, **given}.items() if k in accepted}
    kwargs["generator"] = torch.Generator("cpu").manual_seed(args.seed)
    if "output_type" in accepted:
        kwargs["output_type"] = "pil"
    return kwargs


def _to_pil_list(images) -> list:
    import numpy as np
    from PIL import Image

    out = []
    for im in images:
        if isinstance(im, Image.Image):
            out.append(im)
            continue
        arr = np.asarray(im.detach().float().cpu() if hasattr(im, "detach") else im)
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
            arr = np.moveaxis(arr, 0, -1)
        if arr.dtype != np.uint8:
            arr = (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)
        out.append(Image.fromarray(arr.squeeze(-1) if arr.shape[-1] == 1 else arr))
    return out


def save_output(result, path: str, fps: int = DEFAULT_FPS) -> dict:
    """Save an image (``.images``) or video (``.frames``) result; returns what was written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    if getattr(result, "frames", None) is not None:
        frames = _to_pil_list(result.frames[0])
        if path.lower().endswith(".mp4"):
            from .video_io import encode_mp4

            with open(path, "wb") as fh:
                fh.write(encode_mp4(frames, fps))
            return {"path": path, "kind": "video", "frames": len(frames), "fps": fps, "size": list(frames[0].size)}
        if path.lower().endswith(".gif"):
            frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
            return {"path": path, "kind": "video", "frames": len(frames), "fps": fps, "size": list(frames[0].size)}
        frames[0].save(path)
        return {"path": path, "kind": "video (first frame)", "frames": len(frames), "size": list(frames[0].size)}
    image = _to_pil_list(result.images[:1])[0]
    image.save(path)
    return {"path": path, "kind": "image", "size": list(image.size)}


def format_report(report: dict, saved: dict, wall_s: float) -> str:
    applied = [p["pass"] + (f"({p['backend']})" if "backend" in p else "") for p in report.get("applied", [])]
    last = report.get("last_call") or {}
    times = last.get("time_s", {})
    rows = [
        ("family", report.get("family")),
        ("pipeline", report.get("pipeline")),
        ("device", report.get("device")),
        ("applied passes", ", ".join(dict.fromkeys(applied)) or "none"),
        ("transformer forwards", last.get("transformer_forwards")),
        ("text encoding s", times.get("text_encoding")),
        ("denoising s", times.get("denoising")),
        ("vae decode s", times.get("vae_decode")),
        ("total s", times.get("total")),
        ("peak GPU mem GiB", last.get("peak_gpu_mem_gib")),
        ("wall s (incl. load)", round(wall_s, 3)),
        ("saved", f"{saved['path']} ({saved['kind']}, {saved['size'][0]}x{saved['size'][1]}"
                  + (f", {saved['frames']} frames at {saved['fps']} fps" if "fps" in saved else "") + ")"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def under_torchrun(command: Callable[[], int]) -> int:
    """Run ``command`` inside the process group when launched by torchrun with more than one rank."""
    from . import distributed

    launched = distributed.torchrun_env() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched:  # before any .to("cuda"): init pins this rank to its own GPU (LOCAL_RANK)
        distributed.init()
    try:
        return command()
    finally:
        if launched:
            distributed.shutdown()


def run_generate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    return under_torchrun(lambda: _generate(args, t0))


def _generate(args: argparse.Namespace, t0: float) -> int:
    import torch

    import omni_accel
    from .distributed import is_main_process

    device = _resolve_device(args.device)
    dtype = _torch_dtype(args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32"))
    _check_sampling_args(args)
    if args.fps is not None and args.fps < 1:
        raise CliError(f"--fps {args.fps} is invalid: it must be a positive integer.")
    output = args.output or ("out.mp4" if args.video else "out.png")
    _check_output_path(output)
    config = _accel_config(args, device)  # AccelError on bad values, before any loading
    _check_attention_early(args.attention, device, dtype)
    cache_loaded = start_compile_cache(args)
    pipe, defaults, source = _load_pipeline(args, device, dtype)
    logger.info("loaded %s (%s) in %.1fs", source, type(pipe).__name__, time.perf_counter() - t0)
    kwargs = _call_kwargs(pipe, args, defaults)
    omni_accel.accelerate(pipe, config=config)
    logger.info("calling %s with %s", type(pipe).__name__, {k: v for k, v in kwargs.items() if k != "generator"})
    with torch.inference_mode():
        result = pipe(**kwargs)
    if not is_main_process():  # every rank holds the same images; only rank 0 writes and reports
        return EXIT_OK
    if args.compile_cache and not cache_loaded:
        written = omni_accel.save_compile_cache(args.compile_cache)
        logger.info("omni_accel: compile cache %s written (%d bytes)", args.compile_cache, written)
    saved = save_output(result, output, args.fps or defaults.get("fps", DEFAULT_FPS))
    report = pipe.omni_accel.report()
    if args.report == "json":
        print(json.dumps({"saved": saved, **report}, separators=(",", ":"), default=str))
    elif args.report == "table":
        print(format_report(report, saved, time.perf_counter() - t0))
    else:
        print(saved["path"])
    return EXIT_OK


# -------------------------------------------------------------------------------------------------- info
def _add_info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the information as JSON")


def collect_info() -> dict:
    import diffusers
    import torch
    import transformers

    import omni_accel

    from .kernels.attention import available_backends

    info: dict[str, Any] = {
        "versions": {"omni_accel": omni_accel.__version__, "torch": torch.__version__,
                     "diffusers": diffusers.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            mem = torch.cuda.get_device_properties(i).total_memory / 2**30
            gpus.append({"index": i, "name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}",
                         "memory_gib": round(mem, 1)})
    info["devices"] = gpus or "cpu only"
    info["attention_backends"] = {"cpu": available_backends("cpu"), "cuda": available_backends("cuda")}
    try:
        from .pipelines import supported_families

        info["families"] = supported_families()
    except Exception as exc:  # noqa: BLE001 -- a broken adapter must not break `info`
        info["families"] = f"unavailable ({exc!r})"
    return info


def run_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=1))
        return EXIT_OK
    print("versions:  " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    if isinstance(info["devices"], str):
        print("devices:   cpu only")
    else:
        for g in info["devices"]:
            print(f"devices:   cuda:{g['index']} {g['name']} (capability {g['capability']}, {g['memory_gib']} GiB)")
    print("attention: cpu: " + ", ".join(["auto"] + info["attention_backends"]["cpu"]))
    print("           cuda: " + ", ".join(["auto"] + info["attention_backends"]["cuda"]))
    fam = info["families"]
    print("families:  " + (", ".join(fam) if isinstance(fam, list) else fam))
    return EXIT_OK


# -------------------------------------------------------------------------------------------------- main
def _lazy_subcommand(module: str):
    """(add_arguments, run) of a subcommand module that defines both; its heavy imports (fastapi, gradio) happen
    only inside its run()."""
    import importlib

    return (lambda p: importlib.import_module(module).add_arguments(p),
            lambda a: importlib.import_module(module).run(a))


SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "generate": ("generate an image (or video) with an accelerated pipeline", _add_generate_arguments,
                 run_generate),
    "info": ("versions, devices, attention backends and supported model families", _add_info_arguments, run_info),
    "serve": ("serve an OpenAI-compatible image API (FastAPI + uvicorn; pip install 'omni-accel[serve]')",
              *_lazy_subcommand("omni_accel.serve.server")),
    "demo": ("a Gradio web demo: generate, toggle accelerations, compare plain vs accelerated "
             "(pip install 'omni-accel[demo]')", *_lazy_subcommand("omni_accel.demo.app")),
    "calibrate": ("fit a TeaCache profile (coefficients + threshold) that meets a PSNR target",
                  *_lazy_subcommand("omni_accel.cache.cli")),
    "bench": ("time the plain pipeline and the accelerated one side by side in one process: s/call, ms/step, "
              "TFLOP/s, peak memory, speed-up and the output difference", *_lazy_subcommand("omni_accel.bench")),
}


def _drop_torchvision_notes(record: logging.LogRecord) -> bool:
    return "torchvision" not in record.getMessage()


def _quiet_torchvision() -> None:
    """Silence the torchvision notes every command would print, about image processing omni_accel never does:
    transformers' "`CLIPImageProcessor` requires torchvision (not installed)" when diffusers imports a pipeline
    module, and a torchvision built for another torch warning about its image extension when it is installed."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torchvision(\.|$)")
    logging.getLogger("transformers.utils.import_utils").addFilter(_drop_torchvision_notes)


def _chosen_subcommand(argv: list[str] | None) -> str | None:
    """The subcommand named in ``argv`` (its first word that is one), or None."""
    return next((word for word in argv or () if word in SUBCOMMANDS), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given ``argv``, only the subcommand it names gets its arguments (the others' modules --
    fastapi, gradio, torch -- stay unimported, so ``omni-accel --help`` answers at once)."""
    parser = argparse.ArgumentParser(
        prog="omni-accel", description="Accelerate stock diffusers pipelines in place.", epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"omni-accel {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = _chosen_subcommand(argv) if argv is not None else None
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=ENV_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if argv is None or name == chosen:
            add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    _quiet_torchvision()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("omni_accel").setLevel(level)
    from .errors import AccelError

    try:
        return args._run(args)
    except (AccelError, CliError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
