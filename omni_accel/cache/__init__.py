"""Step caching: TeaCache (hooks at module boundaries), cache-dit (DBCache / FBCache / TaylorSeer / SCM) and the
calibration that fits TeaCache profiles. ``accelerate(pipe, cache="tea_cache" | "cache_dit" | "fb_cache",
cache_config={...})``; see docs/caching.md."""

from .base import CacheBackend, load_profile, shipped_profiles
from .cache_pass import BACKENDS, CachePass


def calibrate(*args, **kwargs):
    """Fit a TeaCache profile for a pipeline; see omni_accel.cache.calibrate_impl.calibrate."""
    from .calibrate import calibrate as _calibrate

    return _calibrate(*args, **kwargs)


__all__ = ["BACKENDS", "CacheBackend", "CachePass", "calibrate", "load_profile", "shipped_profiles"]
