"""CachePass: the ``cache=`` knob. Picks the backend, validates cache_config, applies, records one undo."""

from __future__ import annotations

from ..deps import require
from ..errors import AccelError
from ..pass_base import AccelPass, PassContext
from .base import CacheBackend
from .cache_dit_backend import CacheDitBackend, FbCacheBackend
from .mag_cache import MagCacheBackend
from .tea_cache import TeaCacheBackend

BACKENDS: dict[str, CacheBackend] = {
    "tea_cache": TeaCacheBackend(),
    "cache_dit": CacheDitBackend(),
    "fb_cache": FbCacheBackend(),
    "mag_cache": MagCacheBackend(),
}


class CachePass(AccelPass):
    name = "cache"

    def wanted(self, config) -> bool:
        return config.cache is not None

    def _backend(self, ctx: PassContext) -> CacheBackend:
        backend = BACKENDS.get(ctx.config.cache)
        if backend is None:  # config.validate already refuses unknown names; keep the message if it ever drifts
            raise AccelError(f"cache={ctx.config.cache!r} is not known. Use one of: {', '.join(BACKENDS)}.")
        return backend

    def check(self, ctx: PassContext) -> None:
        backend = self._backend(ctx)
        if backend.requires:
            require(backend.requires, f"cache={backend.name!r}", "use cache='tea_cache', which is built in")
        if ctx.config.compile and ctx.config.cache != "tea_cache":
            # TeaCache's hooks stay outside the compiled block forwards (compiler._compile_block); cache-dit
            # swaps its own wrapper in for the block lists on every forward, untested under compile.
            raise AccelError(
                f"cache={ctx.config.cache!r} with compile={ctx.config.compile!r} is not supported together yet "
                "(cache-dit replaces the block lists with its own wrapper on every forward; not tested under "
                "torch.compile); use cache='tea_cache' with compile, or drop one of them."
            )
        opts = backend.resolve(ctx)
        backend.check(ctx, opts)

    def apply(self, ctx: PassContext) -> None:
        backend = self._backend(ctx)
        opts = backend.resolve(ctx)
        undo, details, controller = backend.apply(ctx, opts)
        ctx.state.cache_controller = controller  # TeaCache controller (tests, calibration); None for cache-dit
        ctx.state.record("cache", undo, **details)
