"""Image quality against the uncached output: PSNR and SSIM per image (torch, no extra dependency).

Images are float tensors in [0, 1], (N, C, H, W) (or (N, C, F, H, W) video: frames are folded into the batch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _nchw(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().float().cpu()
    if x.ndim == 3:
        x = x[None]
    if x.ndim == 5:  # N, C, F, H, W -> N*F, C, H, W
        x = x.permute(0, 2, 1, 3, 4).reshape(-1, x.shape[1], x.shape[3], x.shape[4])
    if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):  # NHWC
        x = x.permute(0, 3, 1, 2)
    return x


def psnr(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """PSNR in dB per image (data range 1); identical images give inf."""
    a, b = _nchw(a), _nchw(b)
    mse = ((a - b) ** 2).flatten(1).mean(1)
    return [float("inf") if m == 0 else float(10 * torch.log10(1.0 / m)) for m in mse]


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> list[float]:
    """SSIM per image (Wang et al. 2004: Gaussian window 11 / sigma 1.5, K1 0.01, K2 0.03, data range 1),
    averaged over channels and valid window positions."""
    a, b = _nchw(a), _nchw(b)
    c = a.shape[1]
    g = torch.exp(-((torch.arange(window) - window // 2) ** 2) / (2 * sigma**2))
    g = (g / g.sum()).float()
    k = (g[:, None] * g[None, :]).expand(c, 1, window, window).contiguous()
    conv = lambda x: F.conv2d(x, k, groups=c)  # noqa: E731 -- valid positions only
    mu_a, mu_b = conv(a), conv(b)
    saa = conv(a * a) - mu_a**2
    sbb = conv(b * b) - mu_b**2
    sab = conv(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_a * mu_b + c1) * (2 * sab + c2)) / ((mu_a**2 + mu_b**2 + c1) * (saa + sbb + c2))
    return [float(v) for v in s.flatten(1).mean(1)]
