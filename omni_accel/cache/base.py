"""The one interface every step-cache backend implements, and the option checking they share."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import AccelError
from ..pass_base import PassContext


class CacheBackend:
    """A step cache. ``options`` lists every cache_config key the backend accepts, with its default.

    ``check`` may only look (it raises AccelError); ``apply`` patches and returns ``(undo, details)``.
    """

    name: str = "cache"
    options: dict[str, Any] = {}
    requires: str | None = None  # the optional package it runs on (checked by CachePass before anything else)

    def resolve(self, ctx: PassContext) -> dict:
        """The options of this run: defaults overlaid with ``cache_config``; unknown keys are refused."""
        given = dict(ctx.config.cache_config or {})
        unknown = sorted(k for k in given if k not in self.options)
        if unknown:
            valid = ", ".join(sorted(self.options))
            raise AccelError(
                f"cache_config key(s) {', '.join(repr(k) for k in unknown)} not known to cache={self.name!r}. "
                f"Valid keys: {valid}."
            )
        return {**self.options, **given}

    def check(self, ctx: PassContext, options: dict) -> None:
        pass

    def apply(self, ctx: PassContext, options: dict):
        raise NotImplementedError


def load_profile(profile: Any) -> dict:
    """A profile dict from a dict, a JSON path, or the name of a profile shipped in omni_accel/cache/profiles."""
    if isinstance(profile, dict):
        data = dict(profile)
    elif isinstance(profile, (str, os.PathLike)):
        path = os.fspath(profile)
        if not os.path.exists(path):
            shipped = os.path.join(os.path.dirname(__file__), "profiles", f"{path}.json")
            if os.path.exists(shipped):
                path = shipped
            else:
                raise AccelError(
                    f"cache_config profile={profile!r} is neither a file nor a shipped profile "
                    f"(shipped: {', '.join(shipped_profiles()) or 'none'}); make one with omni_accel.cache.calibrate "
                    "or `omni-accel calibrate`."
                )
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise AccelError(f"cache_config profile={profile!r} could not be read as JSON: {exc}")
    else:
        raise AccelError(f"cache_config profile={profile!r} must be a path to a profile JSON or a dict.")
    if "coefficients" not in data or "threshold" not in data:
        raise AccelError(f"cache_config profile={profile!r} lacks 'coefficients' or 'threshold'.")
    return data


def shipped_profiles() -> list[str]:
    d = os.path.join(os.path.dirname(__file__), "profiles")
    return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".json")) if os.path.isdir(d) else []


def resolve_module(root, dotted: str):
    """``root.a.0.b`` by a dotted path (list indices allowed); AccelError naming the missing part."""
    module = root
    for part in dotted.split("."):
        nxt = getattr(module, part, None) if not part.isdigit() else None
        if nxt is None and part.isdigit():
            try:
                nxt = module[int(part)]
            except (IndexError, TypeError, KeyError):
                nxt = None
        if nxt is None:
            raise AccelError(f"{type(root).__name__} has no submodule {dotted!r} (missing {part!r}).")
        module = nxt
    return module
