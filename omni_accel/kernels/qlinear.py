"""What every quantized drop-in for ``nn.Linear`` shares (``Fp8Linear`` in kernels/fp8.py, ``Int8Linear`` in
kernels/int8.py): the shape, the bias, flattening the leading dimensions around the 2-D product, and the one-time
output-error measurement behind ``quant_config={"measure_error": True}``. Subclasses implement ``_product``. Also
the device check both formats make before anything is patched."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class QuantizedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        # Set by the quant pass when the user asked for a measured output error: the layer's original weight
        # (host copy on GPUs) is used once, on the first forward, then dropped.
        self.reference_weight: torch.Tensor | None = None
        self.output_rel_err: float | None = None
        self.weight_rel_err: float = 0.0  # set by the subclass once its weight is quantized

    def _product(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 @ W^T`` for a 2-D ``x2`` (tokens, in_features), in ``x2``'s dtype, without the bias."""
        raise NotImplementedError

    def _biased_product(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 @ W^T + bias``; a subclass whose GEMM adds the bias in its epilogue overrides this."""
        y = self._product(x2)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self._biased_product(x2)
        if self.reference_weight is not None:
            self._measure(x2, y)
        return y.reshape(*lead, self.out_features)

    @torch.compiler.disable  # a one-time measurement must not enter compiled graphs
    def _measure(self, x2: torch.Tensor, y: torch.Tensor) -> None:
        ref_w = self.reference_weight.to(device=x2.device, dtype=x2.dtype)
        ref = F.linear(x2, ref_w, None if self.bias is None else self.bias.to(x2.dtype))
        self.output_rel_err = rel_err(y.float(), ref.float())
        self.reference_weight = None


def matmul_support(device: torch.device, kind: str, capability: tuple[int, int], cpu_op: str, cpu_works: bool,
                   cpu_missing: str) -> tuple[bool, str]:
    """(supported, reason) for ``kind`` ("FP8", "int8") GEMMs on ``device``: GPUs from compute ``capability`` on;
    the CPU where this torch build has ``cpu_op`` (``cpu_works``; ``cpu_missing`` says what it lacks otherwise)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA GPU"
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if (major, minor) < capability:
            return False, (f"{name} has compute capability {major}.{minor}; {kind} tensor cores need "
                           f"{capability[0]}.{capability[1]} or newer")
        return True, f"{name} (compute capability {major}.{minor})"
    if device.type == "cpu":
        if cpu_works:
            return True, f"CPU {cpu_op} (correct but not fast: use it to test, not to serve)"
        return False, f"this torch build ({torch.__version__}) has no CPU {cpu_missing}"
    return False, f"device type {device.type!r} has no {kind} GEMM support in omni_accel"


def rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp(min=1e-30))
