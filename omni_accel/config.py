"""AccelConfig: every knob of accelerate(), validated before anything is patched.

Only checks that need nothing but the values live here; checks that need the pipeline (does it have true CFG,
how many heads, which device) run in each pass's ``check`` -- still before the first patch (see api.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import AccelError

CACHE_BACKENDS = ("tea_cache", "cache_dit", "fb_cache", "mag_cache")
OFFLOAD_MODES = ("model", "block")
QUANT_MODES = ("fp8", "fp8_weight_only", "int8")
TEXT_ENCODER_ENGINES = ("vllm", "transformers")
# compile= accepts the command line's words too: one vocabulary for Python and the CLI
COMPILE_MODES = {False: False, True: True, "off": False, "on": True, "max": "max"}


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AccelError(f"{name}={value!r} is invalid: {name} must be a positive integer (1 turns it off).")


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise AccelError(f"{name}={value!r} is not known. Use one of: {shown}.")


@dataclass
class AccelConfig:
    """All acceleration settings. Field names match the keyword arguments of ``omni_accel.accelerate``."""

    sp: int = 1
    ulysses: int | None = None
    ring: int | None = None
    cfg_parallel: int = 1
    tp: int = 1
    vae_parallel: int = 1
    cache: str | None = None
    cache_config: dict | None = None
    offload: str | None = None
    quant: str | None = None
    quant_config: dict | None = None
    attention: str = "auto"
    compile: bool | str = False
    text_encoder: str | None = None
    kernels: bool = False
    fuse_qkv: bool = False
    vae_tiling: bool = False
    vae_slicing: bool = False
    device: str | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def validate(self) -> "AccelConfig":
        """Check every value on its own and the degrees against each other; raise AccelError naming the fix."""
        for name in ("sp", "cfg_parallel", "tp", "vae_parallel"):
            _positive_int(name, getattr(self, name))
        for name in ("ulysses", "ring"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        self.ulysses_degree, self.ring_degree  # noqa: B018 -- raises on inconsistent degrees
        if self.cache is not None:
            _one_of("cache", self.cache, CACHE_BACKENDS)
        if self.cache_config is not None:
            if not isinstance(self.cache_config, dict):
                raise AccelError(f"cache_config={self.cache_config!r} must be a dict of cache options.")
            if self.cache is None:
                raise AccelError("cache_config was given without cache=...; pick a backend, e.g. cache='tea_cache'.")
        if self.offload is not None:
            _one_of("offload", self.offload, OFFLOAD_MODES)
        if self.quant is not None:
            _one_of("quant", self.quant, QUANT_MODES)
        if self.quant_config is not None:
            if not isinstance(self.quant_config, dict):
                raise AccelError(f"quant_config={self.quant_config!r} must be a dict, e.g. {{'skip': ['*.ff.*']}}.")
            if self.quant is None:
                raise AccelError(
                    "quant_config was given without quant=...; add quant='fp8', 'fp8_weight_only' or 'int8'.")
        if not isinstance(self.attention, str) or not self.attention:
            raise AccelError(f"attention={self.attention!r} must be a backend name such as 'auto'.")
        if not isinstance(self.compile, (bool, str)) or self.compile not in COMPILE_MODES:
            raise AccelError(f"compile={self.compile!r} is not known. Use False / 'off', True / 'on' (regional) "
                             "or 'max'.")
        self.compile = COMPILE_MODES[self.compile]
        if self.text_encoder is not None:
            _one_of("text_encoder", self.text_encoder, TEXT_ENCODER_ENGINES)
        for name in ("kernels", "fuse_qkv", "vae_tiling", "vae_slicing"):
            if not isinstance(getattr(self, name), bool):
                raise AccelError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.device is not None and not isinstance(self.device, str):
            raise AccelError(f"device={self.device!r} must be a device string such as 'cuda' or 'cuda:1'.")
        if self.offload is not None and self.world_size > 1:
            raise AccelError(
                f"offload={self.offload!r} cannot be combined with parallelism (world size {self.world_size}): "
                "parallel runs split the model over GPUs already; drop offload or the parallel degrees."
            )
        return self

    @property
    def ulysses_degree(self) -> int:
        return self._sequence_degrees()[0]

    @property
    def ring_degree(self) -> int:
        return self._sequence_degrees()[1]

    @property
    def sequence_degree(self) -> int:
        u, r = self._sequence_degrees()
        return u * r

    @property
    def world_size(self) -> int:
        """Processes the parallel mesh needs: cfg x ring x ulysses x tp."""
        return self.cfg_parallel * self.sequence_degree * self.tp

    def _sequence_degrees(self) -> tuple[int, int]:
        u, r, sp = self.ulysses, self.ring, self.sp
        if u is None and r is None:
            return sp, 1
        if u is not None and r is not None:
            if sp not in (1, u * r):
                raise AccelError(
                    f"ulysses={u} x ring={r} = {u * r} does not match sp={sp}; set sp={u * r} or leave sp out."
                )
            return u, r
        given, name = (u, "ulysses") if u is not None else (r, "ring")
        if sp == 1:
            return (given, 1) if name == "ulysses" else (1, given)
        if sp % given:
            raise AccelError(f"{name}={given} does not divide sp={sp}; choose {name} among the divisors of sp.")
        return (given, sp // given) if name == "ulysses" else (sp // given, given)

    def replace(self, **changes: Any) -> "AccelConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
