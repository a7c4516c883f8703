"""Per-request LoRA adapters for ``omni-accel serve``: the registry, the LRU of loaded adapters, path safety, and
the switch of the pipeline's one adapter slot.

The pipeline carries one peft adapter, the *slot*: created before ``accelerate()`` from the first adapter (with
``enable_lora_hotswap(target_rank=--max-lora-rank)``, so every later adapter of rank <= that swaps in without a
recompile), and switched per batch by ``load_lora_weights(..., hotswap=True)``. A request without an adapter runs
the slot at scale 0, which is the base model exactly. Adapters are held in host memory as state dicts (at most
``--max-loras``, least recently used first out; those named with ``--lora`` are pinned), with their alpha / rank
scaling folded into ``lora_B`` so that every adapter loads at scaling 1 from a dict.
"""

from __future__ import annotations

import collections
import fnmatch
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AccelError

logger = logging.getLogger("omni_accel.serve")

SLOT = "omni_accel_lora"
WEIGHT_FILE = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes


class LoraRequestError(ValueError):
    """A request named an adapter it cannot have: ``status`` is the HTTP status (400 or 404), ``param`` the field."""

    def __init__(self, message: str, param: str = "lora", status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class LoraChoice:
    """The adapter one request runs with (plain data: batch keys, the distributed spec)."""

    name: str
    path: str  # absolute, resolved folder or file
    scale: float

    @property
    def key(self) -> tuple:
        return (self.path, self.scale)

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "scale": self.scale}


def parse_lora_flags(values: list[str], flag: str = "--lora") -> dict[str, str]:
    """``--lora NAME=PATH`` values -> {name: absolute path}; AccelError naming the bad value."""
    out: dict[str, str] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise AccelError(f"{flag} {value!r} is not NAME=PATH; e.g. {flag} swap={_example_path()}")
        if name in out:
            raise AccelError(f"{flag} {name}=... is given twice; give each adapter one name.")
        if not os.path.exists(path):
            raise AccelError(f"{flag} {value!r}: {path!r} does not exist; pass a folder written by "
                             "save_lora_weights (or its .safetensors file).")
        out[name] = os.path.realpath(path)
    return out


def _example_path() -> str:
    from ..builtin import builtin_lora_path

    return builtin_lora_path()


def fold_scaling(state_dict: dict[str, torch.Tensor], metadata: dict | None) -> dict[str, torch.Tensor]:
    """The adapter's alpha / rank scaling (per module with alpha_pattern / rank_pattern; rsLoRA's sqrt) multiplied
    into its ``lora_B`` matrices: a dict loads with scaling 1 (diffusers reads alpha only from a file's metadata)."""
    meta = {k.split(".", 1)[1]: v for k, v in (metadata or {}).items() if "." in k}
    if meta.get("use_dora"):
        raise LoraRequestError("DoRA adapters cannot be hot-swapped; serve a plain LoRA adapter.")
    alpha, alpha_pattern = meta.get("lora_alpha"), meta.get("alpha_pattern") or {}
    rslora = bool(meta.get("use_rslora"))
    out = {}
    for key, tensor in state_dict.items():
        if ".lora_B." in key and alpha is not None:
            module = key.split(".lora_B.")[0]
            rank = tensor.shape[1]
            a = next((v for p, v in alpha_pattern.items() if fnmatch.fnmatchcase(module, f"*{p}")), alpha)
            scale = a / (math.sqrt(rank) if rslora else rank)
            tensor = tensor * scale if scale != 1 else tensor
        out[key] = tensor.detach().to("cpu").contiguous()
    return out


def adapter_rank(state_dict: dict[str, torch.Tensor]) -> int:
    return max((t.shape[0] for k, t in state_dict.items() if ".lora_A." in k), default=0)


class LoraManager:
    """The adapters a server offers and the one its pipeline runs. ``resolve`` (HTTP thread) validates a request;
    ``activate`` (worker thread, every rank) puts its adapter into the slot."""

    def __init__(self, pipe: Any, adapters: dict[str, str] | None = None, *, max_loras: int = 4,
                 lora_dir: str | None = None, max_rank: int = 64, parent: str = ""):
        if max_loras < 1:
            raise AccelError(f"--max-loras {max_loras} must be at least 1.")
        if max_rank < 1:
            raise AccelError(f"--max-lora-rank {max_rank} must be at least 1.")
        if lora_dir is not None and not os.path.isdir(lora_dir):
            raise AccelError(f"--lora-dir {lora_dir!r} is not a folder.")
        if not hasattr(pipe, "load_lora_weights"):
            raise AccelError(f"{type(pipe).__name__} cannot load LoRA adapters (diffusers gives it no "
                             "load_lora_weights); serve it without --lora / --lora-dir.")
        self.pipe = pipe
        self.named = dict(adapters or {})
        self.max_loras = max(max_loras, len(self.named))
        self.lora_dir = os.path.realpath(lora_dir) if lora_dir else None
        self.max_rank = max_rank
        self.parent = parent
        self._cache: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.active: tuple | None = None  # (path, scale) in the slot now
        self.slot_path: str | None = None
        self.switches = 0
        self.switch_seconds: list[float] = []

    def catalog(self) -> "LoraManager":
        """The same adapters without the pipeline (its class reads and checks adapter files): what an ingress holds
        while its replicas run the pipeline (serve/ray_app.py). It resolves and checks requests; it never runs."""
        return LoraManager(type(self.pipe), self.named, max_loras=self.max_loras,
                           lora_dir=self.lora_dir, max_rank=self.max_rank, parent=self.parent)

    def __getstate__(self) -> dict:  # a catalog crosses processes: without its lock and cached weights
        state = dict(self.__dict__)
        state.pop("_lock")
        state["_cache"] = collections.OrderedDict()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.named) or self.lora_dir is not None

    # -- start-up (before accelerate) ------------------------------------------------------------------------
    def prepare(self) -> None:
        """Load every named adapter into the cache and the first into the slot, at scale 0, before the pipeline is
        accelerated: the compiled graphs then include the LoRA layers, and later adapters swap in place."""
        for name, path in self.named.items():
            try:
                self._state(name, path, param="--lora")
            except LoraRequestError as exc:  # a start-up flag: the command line's error
                raise AccelError(str(exc)) from None
        if self.named:
            first = next(iter(self.named.values()))
            self._create_slot(first)
            self._set_scale(0.0)
            self.active = (None, 0.0)

    # -- requests (HTTP thread) ----------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return list(self.named)

    def resolve(self, model: str | None, lora: dict | None) -> LoraChoice | None:
        """The adapter a request asks for, through ``model: NAME`` or ``"lora": {"name" | "path", "scale"}``."""
        if lora is None:
            if model is not None and model in self.named:
                return LoraChoice(model, self.named[model], 1.0)
            return None
        if not isinstance(lora, dict):
            raise LoraRequestError(f"lora must be an object like {{\"name\": \"...\", \"scale\": 1.0}}; got {lora!r}")
        unknown = sorted(set(lora) - {"name", "path", "scale"})
        if unknown:
            raise LoraRequestError(f"lora has unknown fields {unknown}; use name or path, and scale.")
        scale = lora.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not -8.0 <= scale <= 8.0:
            raise LoraRequestError(f"lora.scale={scale!r} must be a number in [-8, 8].", "lora.scale")
        name, path = lora.get("name"), lora.get("path")
        if (name is None) == (path is None):
            raise LoraRequestError("lora needs exactly one of name (an adapter the server was started with) or "
                                   "path (a folder under the server's --lora-dir).")
        if name is not None:
            if name not in self.named:
                raise LoraRequestError(f"lora.name={name!r} is not an adapter of this server; known: "
                                       f"{sorted(self.named)}.", "lora.name", 404)
            return LoraChoice(name, self.named[name], float(scale))
        return LoraChoice(str(path), self.resolve_path(path), float(scale))

    def resolve_path(self, path: Any) -> str:
        """``path`` under ``--lora-dir``, symlinks resolved; anything outside the root is refused (no file reads
        outside it)."""
        if self.lora_dir is None:
            raise LoraRequestError("lora.path needs a server started with --lora-dir ROOT; name an adapter instead.",
                                   "lora.path")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise LoraRequestError(f"lora.path={path!r} must be a folder name under the server's adapter root.",
                                   "lora.path")
        full = os.path.realpath(os.path.join(self.lora_dir, path))
        if os.path.commonpath([full, self.lora_dir]) != self.lora_dir or full == self.lora_dir:
            raise LoraRequestError(f"lora.path={path!r} resolves outside the server's adapter root; give a folder "
                                   "under it.", "lora.path")
        if not os.path.exists(full):
            raise LoraRequestError(f"lora.path={path!r} does not exist under the server's adapter root.",
                                   "lora.path", 404)
        return full

    def check(self, choice: LoraChoice) -> None:
        """Read and check ``choice``'s adapter now (cached): a bad adapter is the request's 400, not a failed call."""
        self._state(choice.name, choice.path)

    # -- the worker (every rank) ------------------------------------------------------------------------------
    def activate(self, choice: dict | None) -> float:
        """Put ``choice`` (a ``LoraChoice.as_dict()``, or None = the base model) into the pipeline; returns the
        seconds spent (0 when it was already there)."""
        want = (choice["path"], float(choice["scale"])) if choice else (None, 0.0)
        if want == self.active or (choice is None and self.slot_path is None):
            return 0.0
        t0 = time.perf_counter()
        if choice is None:
            self._set_scale(0.0)
        else:
            path = choice["path"]
            if path != self.slot_path:
                state = self._state(choice["name"], path)
                if self.slot_path is None:
                    self._create_slot(path)
                else:
                    self._swap(path, state)
            self._set_scale(float(choice["scale"]))
        self.active = want
        seconds = time.perf_counter() - t0
        self.switches += 1
        self.switch_seconds.append(seconds)
        del self.switch_seconds[:-100]
        return seconds

    def _swap(self, path: str, state: dict) -> None:
        try:
            self.pipe.load_lora_weights(dict(state), adapter_name=SLOT, hotswap=True)
        except RuntimeError as exc:  # peft checks before it copies: the slot is unchanged
            # an adapter on modules the slot lacks: new layers (a compiled pipeline compiles again once)
            logger.warning("omni_accel.serve: LoRA %s cannot swap into the slot (%s); re-creating it", path,
                           str(exc)[:200])
            self.pipe.delete_adapters(SLOT)
            self._create_slot(path)
            return
        self.slot_path = path

    def _create_slot(self, path: str) -> None:
        """The first adapter: peft layers created (padded to max_rank, scalings as tensors). On an accelerated
        pipeline omni_accel re-applies its passes around this load (a compiled pipeline compiles again once)."""
        self.pipe.enable_lora_hotswap(target_rank=self.max_rank)
        # copies: peft may adopt the given tensors as the slot's parameters, which later swaps overwrite in place
        self.pipe.load_lora_weights({k: v.clone() for k, v in self._cache[path].items()}, adapter_name=SLOT)
        self.slot_path = path

    def _set_scale(self, scale: float) -> None:
        from ..lora import set_lora_scale

        set_lora_scale(self.pipe, SLOT, scale)

    def _state(self, name: str, path: str, param: str = "lora") -> dict:
        """The adapter's state dict from the LRU, read (and checked) on a miss."""
        with self._lock:
            if path in self._cache:
                self._cache.move_to_end(path)
                return self._cache[path]
        state = self._read(name, path, param)
        with self._lock:
            self._cache[path] = state
            pinned = set(self.named.values())
            while len(self._cache) > self.max_loras:
                victim = next((p for p in self._cache if p not in pinned and p != path), None)
                if victim is None:
                    break
                del self._cache[victim]
                logger.info("omni_accel.serve: LoRA %s left the cache (--max-loras %d)", victim, self.max_loras)
        return state

    def _read(self, name: str, path: str, param: str) -> dict:
        folder, weight_name = (os.path.dirname(path), os.path.basename(path)) if os.path.isfile(path) else (path, None)
        try:
            state, metadata = self.pipe.lora_state_dict(folder, weight_name=weight_name, return_lora_metadata=True)
        except Exception as exc:  # noqa: BLE001 -- any unreadable adapter is the request's problem, named
            raise LoraRequestError(f"{param} {name!r}: {path!r} is not a LoRA adapter diffusers can read "
                                   f"({type(exc).__name__}: {str(exc)[:200]}).", param) from None
        if not state:
            raise LoraRequestError(f"{param} {name!r}: {path!r} holds no LoRA weights.", param)
        rank = adapter_rank(state)
        if rank > self.max_rank:
            raise LoraRequestError(f"{param} {name!r} has rank {rank}, above this server's --max-lora-rank "
                                   f"{self.max_rank}; restart it with --max-lora-rank {rank} or more.", param)
        return fold_scaling(state, metadata)

    def stats(self) -> dict:
        return {"cached": list(self._cache), "slot": self.slot_path, "active": self.active,
                "switches": self.switches}


def request_lora(manager: LoraManager | None, model: str | None, lora: dict | None, *, flags: str,
                 what: str = "") -> LoraChoice | None:
    """The adapter a request asks for (``model: NAME`` or the ``lora`` field), read and checked now -- file reads:
    call it off the event loop -- with OpenAI errors: 400 / 404 naming the field, 400 when the server has none."""
    from .errors import ApiError, bad_request

    if manager is None:
        if lora is not None:
            raise bad_request(f"this server offers no LoRA adapters{what}; start it with {flags}", "lora",
                              "lora_not_supported")
        return None
    try:
        choice = manager.resolve(model, lora)
        if choice is not None:
            manager.check(choice)
    except LoraRequestError as exc:
        raise ApiError(exc.status, str(exc), param=exc.param,
                       code="lora_not_found" if exc.status == 404 else "invalid_lora")
    return choice
