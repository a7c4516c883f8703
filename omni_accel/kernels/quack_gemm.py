"""16-bit GEMMs of the ``quack-kernels`` package (CuTe DSL, Hopper and newer) on a named tile configuration.

Why: cuBLAS picks its kernel by a model of the GPU at full clocks; at a power cap another kernel design may do the
same arithmetic in less time. quack's GEMMs (the CuTe DSL kernels FlashAttention-4 is built beside) take the same
epilogues the graph pass uses -- bias, tanh-GELU + bias, accumulation into the output -- on a tile, warp-group
schedule (pingpong or cooperative) and cluster that the caller names. ``gemm_tuning`` times them beside torch's call
and cuBLASLt's candidates when its ``QUACK_CONFIGS`` lists names; this module only runs a named one.

A name reads ``<tile_m>x<tile_n>_<pp|coop>_c<cluster_m>x<cluster_n>`` (``256x192_coop_c2x1``), or ``default`` for
quack's own default tile. Each (name, epilogue) compiles once per process, on its first call (a few seconds).
"""

from __future__ import annotations

import re

import torch

from ..deps import installed
from ..errors import AccelError

_NAME = re.compile(r"^(\d+)x(\d+)_(pp|coop)_c(\d+)x(\d+)$")


def available(device: torch.device) -> str | None:
    """None where quack's Hopper GEMMs can run on ``device``, else why not (with the fix)."""
    if device.type != "cuda":
        return f"quack's GEMMs need a CUDA GPU, not {device.type}"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "quack's GEMMs need a Hopper or newer GPU (compute capability 9.0+)"
    if not installed("quack"):
        return "quack-kernels is not installed; pip install quack-kernels"
    return None


def check_name(name: str) -> None:
    """Raise AccelError unless ``name`` is ``default`` or ``<tile_m>x<tile_n>_<pp|coop>_c<m>x<n>``."""
    if name != "default" and not _NAME.match(name):
        raise AccelError(f"quack GEMM config {name!r} is not a config name: use 'default' or "
                         "'<tile_m>x<tile_n>_<pp|coop>_c<cluster_m>x<cluster_n>', e.g. '256x192_coop_c2x1'")


def config(name: str, device: torch.device | None = None):
    """quack's ``GemmConfig`` for ``name`` (its default config for ``default``)."""
    check_name(name)
    from quack.gemm_config import GemmConfig, default_config

    if name == "default":
        return default_config(device)
    tile_m, tile_n, kind, cluster_m, cluster_n = _NAME.match(name).groups()
    capability = torch.cuda.get_device_capability(device)[0] if device is not None else 9
    return GemmConfig(tile_m=int(tile_m), tile_n=int(tile_n), pingpong=kind == "pp", cluster_m=int(cluster_m),
                      cluster_n=int(cluster_n), is_dynamic_persistent=False, device_capacity=capability)


def linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, epilogue: str, out: torch.Tensor | None,
           gemm_config) -> torch.Tensor:
    """``x @ w_t`` with ``epilogue`` (``gemm_tuning.linear``'s meaning) on quack's kernel for ``gemm_config``:
    a new tensor, or ``out`` itself for "accumulate"."""
    from quack.gemm_interface import gemm_act, gemm_tuned

    if epilogue == "accumulate":
        gemm_tuned.fn(x, w_t, out, None, add_to_output=True, config=gemm_config)
        return out
    target = torch.empty(x.shape[0], w_t.shape[1], device=x.device, dtype=x.dtype)
    if epilogue == "gelu_bias":
        gemm_act(x, w_t, bias=bias, activation="gelu_tanh_approx", store_preact=False, postact_out=target,
                 config=gemm_config, tuned=False)
        return target
    gemm_tuned.fn(x, w_t, target, None, bias=bias if epilogue == "bias" else None, config=gemm_config)
    return target
