"""omni_accel: make stock diffusers pipelines fast, in place.

    pipe = omni_accel.accelerate(pipe, attention="auto", compile=True)
    image = pipe(prompt).images[0]
    print(pipe.omni_accel.report())
    omni_accel.restore(pipe)
"""

from .api import accelerate, restore
from .config import AccelConfig
from .errors import AccelError, NotAvailableYet
from .sleep import is_sleeping, sleep, wake_up

__version__ = "0.1.0"


def builtin_model_path() -> str:
    """Folder of the project's own small trained FLUX-compatible text-to-image model (shipped in the package)."""
    from .builtin import builtin_model_path as _path

    return _path()


__all__ = ["accelerate", "restore", "AccelConfig", "AccelError", "NotAvailableYet", "builtin_model_path",
           "sleep", "wake_up", "is_sleeping", "__version__"]
