"""VAE patch parallelism: each rank decodes one horizontal band of the latent; the bands are all-gathered.

Exact, not tiled: a 3x3 convolution reads the neighbouring rows of its band from the ranks above and below
(halo exchange; zeros at the image border, as the convolution's own padding), every GroupNorm reduces its
statistics over all bands (all_reduce of sums, two passes), and the attention of the mid block runs on the
gathered feature map. So the decode equals single-process decode up to float rounding (tested <= 1e-4, fp32).
Supported: 2-D decoders made of Conv2d / GroupNorm / attention / nearest upsampling (AutoencoderKL: FLUX.1,
FLUX.2, SD3, Z-Image). Video VAEs (Wan, Qwen-Image: causal 3-D convolutions with a frame cache) are refused.

Why our own: diffusers' VAE tiling blends overlapping tiles (approximate, one process); nothing in diffusers
splits one decode over ranks.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.hooks import ModelHook

from ..errors import AccelError
from ..hooks import add_hook, wrap_method
from ..pass_base import AccelPass, PassContext
from .mesh import gather_uneven, init, split_sizes, world_size


class _Band:
    def __init__(self, group, ranks, me):
        self.group, self.ranks, self.me = group, ranks, me
        self.active = False

    @property
    def n(self) -> int:
        return len(self.ranks)


class _ConvHook(ModelHook):
    def __init__(self, band: _Band):
        super().__init__()
        self.band = band

    def new_forward(self, module, x):
        b = self.band
        if not b.active:
            return self.fn_ref.original_forward(x)
        p = module.padding[0]
        edges = torch.cat([x[:, :, :p], x[:, :, -p:]], dim=2).contiguous()
        bufs = [torch.empty_like(edges) for _ in range(b.n)]
        dist.all_gather(bufs, edges, group=b.group)
        zeros = torch.zeros_like(edges[:, :, :p])
        above = bufs[b.me - 1][:, :, p:] if b.me > 0 else zeros  # last rows of the band above
        below = bufs[b.me + 1][:, :, :p] if b.me < b.n - 1 else zeros  # first rows of the band below
        x = torch.cat([above, x, below], dim=2)
        return F.conv2d(x, module.weight, module.bias, module.stride, (0, module.padding[1]), module.dilation,
                        module.groups)


class _GroupNormHook(ModelHook):
    def __init__(self, band: _Band):
        super().__init__()
        self.band = band

    def new_forward(self, module, x):
        b = self.band
        if not b.active:
            return self.fn_ref.original_forward(x)
        n, c = x.shape[:2]
        g = module.num_groups
        xg = x.reshape(n, g, -1).float()
        stats = torch.stack([xg.sum(-1), torch.full_like(xg[..., 0], xg.shape[-1])])
        dist.all_reduce(stats, group=b.group)
        mean = (stats[0] / stats[1])[..., None]
        sq = ((xg - mean) ** 2).sum(-1)
        dist.all_reduce(sq, group=b.group)
        var = (sq / stats[1])[..., None]
        y = ((xg - mean) / torch.sqrt(var + module.eps)).reshape(x.shape).to(x.dtype)
        if module.affine:
            shape = (1, c) + (1,) * (x.ndim - 2)
            y = y * module.weight.reshape(shape) + module.bias.reshape(shape)
        return y


class _GatherHook(ModelHook):
    """Runs a spatially global module (attention) on the gathered feature map, then keeps this rank's band."""

    def __init__(self, band: _Band):
        super().__init__()
        self.band = band

    def new_forward(self, module, x, *args, **kwargs):
        b = self.band
        if not b.active:
            return self.fn_ref.original_forward(x, *args, **kwargs)
        h = x.shape[2]
        t = torch.tensor([h], device=x.device)
        sizes = [torch.empty_like(t) for _ in range(b.n)]
        dist.all_gather(sizes, t, group=b.group)
        sizes = [int(s.item()) for s in sizes]
        full = gather_uneven(x, 2, sizes, b.group)
        b.active = False
        try:
            out = self.fn_ref.original_forward(full, *args, **kwargs)
        finally:
            b.active = True
        return out.narrow(2, sum(sizes[: b.me]), sizes[b.me])


def _decoder_modules(vae):
    decoder = getattr(vae, "decoder", None)
    if decoder is None:
        return None
    convs, norms, attns, bad = [], [], [], []
    for name, m in decoder.named_modules():
        if isinstance(m, (torch.nn.Conv3d, torch.nn.Conv1d)) or "Causal" in type(m).__name__:
            bad.append(f"{name} ({type(m).__name__})")
        elif isinstance(m, torch.nn.Conv2d):
            k = m.kernel_size
            if k[0] == 1 and k[1] == 1:
                continue
            if m.stride != (1, 1) or m.dilation != (1, 1) or m.padding_mode != "zeros" or \
                    m.padding[0] != (k[0] - 1) // 2 or k[0] % 2 == 0:
                bad.append(f"{name} (Conv2d {k} stride {m.stride} padding {m.padding})")
            else:
                convs.append(m)
        elif isinstance(m, torch.nn.GroupNorm):
            norms.append((name, m))
        elif hasattr(m, "processor") and hasattr(m, "to_q"):
            attns.append((name, m))
    # the GroupNorm inside an attention module runs on the gathered map, unsplit
    inner = {n for a, _ in attns for n, _ in norms if n.startswith(a + ".")}
    return convs, [m for n, m in norms if n not in inner], [m for _, m in attns], bad


class VaeParallelPass(AccelPass):
    name = "vae_parallel"

    def wanted(self, config) -> bool:
        return config.vae_parallel > 1

    def check(self, ctx: PassContext) -> None:
        n = ctx.config.vae_parallel
        vae = getattr(ctx.pipe, ctx.adapter.vae_name, None)
        found = _decoder_modules(vae) if vae is not None else None
        if found is None:
            raise AccelError(f"vae_parallel={n}: this pipeline has no VAE with a decoder to split.")
        if found[3]:
            raise AccelError(
                f"vae_parallel={n}: {type(vae).__name__} is not a 2-D convolutional decoder that can be split "
                f"exactly into bands ({', '.join(found[3][:3])}); video VAEs are not supported -- drop vae_parallel "
                "(or use vae_tiling=True on one process)."
            )
        if ctx.config.vae_tiling:
            raise AccelError("vae_parallel and vae_tiling both split the decode; pick one.")
        others = ctx.config.world_size
        if n > 1:
            init()
        ws = world_size()
        total = others if others > 1 else n
        if ws != total or total % n:
            raise AccelError(
                f"vae_parallel={n} must divide the world size and the world size must be "
                f"{total} (cfg x sp x tp, or vae_parallel alone); torchrun started {ws} processes."
            )

    def apply(self, ctx: PassContext) -> None:
        n = ctx.config.vae_parallel
        rank, ws = dist.get_rank(), dist.get_world_size()
        band = None
        for start in range(0, ws, n):  # every rank creates every group, in the same order
            ranks = list(range(start, start + n))
            group = dist.new_group(ranks)
            if rank in ranks:
                band = _Band(group, ranks, ranks.index(rank))
        vae = getattr(ctx.pipe, ctx.adapter.vae_name)
        convs, norms, attns, _ = _decoder_modules(vae)
        for i, m in enumerate(convs):
            ctx.state.record("vae_parallel", add_hook(m, "vae_parallel.conv", _ConvHook(band)), hidden=True)
        for m in norms:
            ctx.state.record("vae_parallel", add_hook(m, "vae_parallel.norm", _GroupNormHook(band)), hidden=True)
        for m in attns:
            ctx.state.record("vae_parallel", add_hook(m, "vae_parallel.attn", _GatherHook(band)), hidden=True)

        def make(original):
            @functools.wraps(original)
            def decode(z, *args, **kwargs):
                if not isinstance(z, torch.Tensor) or z.ndim != 4 or z.shape[2] < band.n or band.active:
                    return original(z, *args, **kwargs)
                sizes = split_sizes(z.shape[2], band.n)
                local = z.narrow(2, sum(sizes[: band.me]), sizes[band.me])
                band.active = True
                try:
                    out = original(local, *args, **kwargs)
                finally:
                    band.active = False
                sample = out.sample if hasattr(out, "sample") else out[0]
                factor = sample.shape[2] // local.shape[2]
                full = gather_uneven(sample.contiguous(), 2, [s * factor for s in sizes], band.group)
                if hasattr(out, "sample"):
                    out.sample = full
                    return out
                return (full,) + tuple(out[1:])

            return decode

        ctx.state.record("vae_parallel", wrap_method(vae, "decode", make), degree=n, convs=len(convs),
                         norms=len(norms), attentions=len(attns))
