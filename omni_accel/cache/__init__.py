"""Step caching: TeaCache (hooks at module boundaries), cache-dit (DBCache / FBCache / TaylorSeer / SCM), diffusers'
MagCache, and the calibration that fits TeaCache profiles. ``accelerate(pipe, cache="tea_cache" | "cache_dit" |
"fb_cache" | "mag_cache", cache_config={...})``; see docs/caching.md."""

from .base import CacheBackend, load_profile, shipped_profiles
from .cache_pass import BACKENDS, CachePass
from .calibrate import calibrate  # noqa: E402 -- binds the function over the same-named submodule attribute

__all__ = ["BACKENDS", "CacheBackend", "CachePass", "calibrate", "load_profile", "shipped_profiles"]
