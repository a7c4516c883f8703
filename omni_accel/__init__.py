"""omni_accel: make stock diffusers pipelines fast, in place.

    pipe = omni_accel.accelerate(pipe, attention="auto", compile=True)
    image = pipe(prompt).images[0]
    print(pipe.omni_accel.report())
    omni_accel.restore(pipe)

``import omni_accel`` stays light (no torch, no diffusers): ``accelerate`` / ``restore`` and the submodules are
imported on first use, so the command line's ``--help`` and ``--version`` answer at once.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import AccelConfig
from .errors import AccelError, NotAvailableYet
from .sleep import is_sleeping, sleep, wake_up  # torch is imported inside them

__version__ = "0.1.0"

# public name -> module that defines it, imported on first access (PEP 562)
_LAZY = {"accelerate": ".api", "restore": ".api", "save_compile_cache": ".compiler",
         "load_compile_cache": ".compiler"}
_SUBMODULES = ("api", "ar_bridge", "bench", "builtin", "cache", "cli", "compiler", "config", "cuda_graphs", "demo",
               "distributed", "errors", "hooks", "kernels", "lora", "offload", "parallel", "pipelines", "serve", "state",
               "stats", "testing", "vae", "video_io")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'omni_accel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


def builtin_model_path() -> str:
    """Folder of the project's own small trained FLUX-compatible text-to-image model (shipped in the package)."""
    from .builtin import builtin_model_path as _path

    return _path()


__all__ = ["accelerate", "restore", "AccelConfig", "AccelError", "NotAvailableYet", "builtin_model_path",
           "sleep", "wake_up", "is_sleeping", "__version__"]
