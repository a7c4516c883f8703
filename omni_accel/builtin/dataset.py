"""Procedural, seeded captioned-shapes dataset for the built-in text-to-image model.

Every image is one shape (circle, square, triangle, star, ring) of a named color, size
(small / large) and position (3x3 grid) on a background of a *different* named color.
Images are rasterised on the fly from signed distance functions (no files), in torch so
the same code renders a 256-image batch on a GPU in a millisecond or a single image on a
CPU; ``CaptionedShapes[i]`` returns a PIL image + caption, seeded by ``(seed, i)``.

Captions: ``a [small|large] <color> <shape> [in the <position>] on a <color> background``.
The bracketed parts are dropped at random (``p_omit_size`` / ``p_omit_position``); the
attribute is still drawn at random, so a caption without them is a valid description.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 225),
    "yellow": (250, 225, 25),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "orange": (255, 135, 0),
    "purple": (140, 40, 180),
}
COLOR_NAMES = list(COLORS)
SHAPES = ["circle", "square", "triangle", "star", "ring"]
SIZES = ["small", "large"]
# 3x3 grid, row-major: index = 3 * row + col
POSITIONS = ["top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right"]
SIZE_RADIUS = {"small": 0.075, "large": 0.13}  # circumradius as a fraction of the image side
POS_JITTER = 0.025  # max centre offset from the cell centre, fraction of image side
RADIUS_JITTER = 0.08  # relative
COLOR_JITTER = 10  # per channel, uint8 units

# (shape color, shape, background color) triples never shown in training; the adherence
# benchmark samples part of its prompts from them.
HELDOUT_TRIPLES: list[tuple[str, str, str]] = [
    ("red", "circle", "blue"),
    ("green", "star", "white"),
    ("blue", "square", "yellow"),
    ("yellow", "triangle", "black"),
    ("white", "ring", "purple"),
    ("black", "circle", "orange"),
    ("orange", "square", "green"),
    ("purple", "star", "red"),
    ("red", "ring", "white"),
    ("blue", "triangle", "orange"),
]
_HELD = {(COLOR_NAMES.index(c), SHAPES.index(s), COLOR_NAMES.index(b)) for c, s, b in HELDOUT_TRIPLES}

VOCAB_WORDS = sorted(
    set("a in the on background".split())
    | set(COLOR_NAMES)
    | set(SHAPES)
    | set(SIZES)
    | {w for p in POSITIONS for w in p.split()}
)

_CAPTION_RE = re.compile(
    r"^\s*a\s+(?:(small|large)\s+)?(\w+)\s+(\w+)(?:\s+in\s+the\s+([a-z ]+?))?\s+on\s+a\s+(\w+)\s+background\s*\.?\s*$"
)


@dataclass
class Spec:
    color: int
    shape: int
    bg: int
    size: int
    pos: int
    show_size: bool = True
    show_pos: bool = True
    dx: float = 0.0
    dy: float = 0.0
    rscale: float = 1.0
    cj: tuple = (0, 0, 0)
    bj: tuple = (0, 0, 0)

    @property
    def caption(self) -> str:
        return make_caption(
            COLOR_NAMES[self.color], SHAPES[self.shape], COLOR_NAMES[self.bg],
            SIZES[self.size] if self.show_size else None,
            POSITIONS[self.pos] if self.show_pos else None,
        )


def make_caption(color: str, shape: str, bg: str, size: str | None = None, position: str | None = None) -> str:
    s = "a "
    if size:
        s += size + " "
    s += f"{color} {shape}"
    if position:
        s += f" in the {position}"
    return s + f" on a {bg} background"


def parse_caption(caption: str) -> dict:
    """Inverse of make_caption: dict with color, shape, bg, size (or None), position (or None)."""
    m = _CAPTION_RE.match(caption.lower())
    if not m:
        raise ValueError(f"caption {caption!r} is not of the form 'a [small|large] <color> <shape> "
                         "[in the <position>] on a <color> background'")
    size, color, shape, pos, bg = m.groups()
    for val, allowed, what in ((color, COLOR_NAMES, "color"), (bg, COLOR_NAMES, "background color"),
                               (shape, SHAPES, "shape")):
        if val not in allowed:
            raise ValueError(f"unknown {what} {val!r} in caption {caption!r}; known: {allowed}")
    if pos is not None and pos not in POSITIONS:
        raise ValueError(f"unknown position {pos!r} in caption {caption!r}; known: {POSITIONS}")
    return {"color": color, "shape": shape, "bg": bg, "size": size, "position": pos}


# ----------------------------------------------------------------------------- sampling
def sample_params(n: int, generator: torch.Generator, *, exclude_heldout: bool = True,
                  only_heldout: bool = False, p_omit_size: float = 0.3, p_omit_position: float = 0.3,
                  device="cpu") -> dict[str, torch.Tensor]:
    """Random attribute tensors (on `device`) for n images, drawn from `generator` (a CPU generator)."""
    g = generator
    nc, ns = len(COLOR_NAMES), len(SHAPES)
    if only_heldout:
        idx = torch.randint(len(HELDOUT_TRIPLES), (n,), generator=g)
        trip = torch.tensor(sorted(_HELD))[idx]
        color, shape, bg = trip[:, 0], trip[:, 1], trip[:, 2]
    else:
        color = torch.randint(nc, (n,), generator=g)
        shape = torch.randint(ns, (n,), generator=g)
        bg = (color + torch.randint(1, nc, (n,), generator=g)) % nc  # always different from color
        if exclude_heldout and _HELD:
            held = torch.zeros(n, dtype=torch.bool)
            for c, s, b in _HELD:
                held |= (color == c) & (shape == s) & (bg == b)
            # re-draw the background of held-out triples (never equal to the shape color, never held)
            while held.any():
                k = int(held.sum())
                bg[held] = (color[held] + torch.randint(1, nc, (k,), generator=g)) % nc
                held = torch.zeros(n, dtype=torch.bool)
                for c, s, b in _HELD:
                    held |= (color == c) & (shape == s) & (bg == b)
    p = {
        "color": color, "shape": shape, "bg": bg,
        "size": torch.randint(2, (n,), generator=g),
        "pos": torch.randint(9, (n,), generator=g),
        "show_size": torch.rand(n, generator=g) >= p_omit_size,
        "show_pos": torch.rand(n, generator=g) >= p_omit_position,
        "dx": (torch.rand(n, generator=g) * 2 - 1) * POS_JITTER,
        "dy": (torch.rand(n, generator=g) * 2 - 1) * POS_JITTER,
        "rscale": 1 + (torch.rand(n, generator=g) * 2 - 1) * RADIUS_JITTER,
        "cj": torch.randint(-COLOR_JITTER, COLOR_JITTER + 1, (n, 3), generator=g),
        "bj": torch.randint(-COLOR_JITTER, COLOR_JITTER + 1, (n, 3), generator=g),
    }
    return {k: v.to(device) for k, v in p.items()}


def captions_of(p: dict[str, torch.Tensor]) -> list[str]:
    out = []
    cols = {k: v.tolist() for k, v in p.items() if k in ("color", "shape", "bg", "size", "pos", "show_size", "show_pos")}
    for i in range(len(cols["color"])):
        out.append(make_caption(
            COLOR_NAMES[cols["color"][i]], SHAPES[cols["shape"][i]], COLOR_NAMES[cols["bg"][i]],
            SIZES[cols["size"][i]] if cols["show_size"][i] else None,
            POSITIONS[cols["pos"][i]] if cols["show_pos"][i] else None))
    return out


# ----------------------------------------------------------------------------- rendering
def _sdf(shape: torch.Tensor, px: torch.Tensor, py: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Signed distance (in units of the image side) of points (px, py) relative to the shape centre,
    y pointing DOWN (image rows). shape/r: (n,1,1); px/py: (n,H,W)."""
    d = torch.full_like(px, 1e3)
    q = torch.sqrt(px * px + py * py)
    # circle
    d = torch.where(shape == 0, q - r, d)
    # square (half side 0.8 r)
    h = 0.8 * r
    ax, ay = px.abs() - h, py.abs() - h
    box = torch.sqrt(ax.clamp(min=0) ** 2 + ay.clamp(min=0) ** 2) + torch.minimum(torch.maximum(ax, ay), torch.zeros_like(ax))
    d = torch.where(shape == 1, box, d)
    # triangle: equilateral, pointing up, circumradius r (centroid at the centre)
    k = math.sqrt(3.0)
    tx = px.abs()
    ty = -py  # y up
    # iq's sdEquilateralTriangle with side length r*sqrt(3) -> half side a
    a = r * k / 2
    tx2 = tx - a
    ty2 = ty + a / k
    cond = (tx2 + k * ty2) > 0
    nx = torch.where(cond, (tx2 - k * ty2) / 2, tx2)
    ny = torch.where(cond, (-k * tx2 - ty2) / 2, ty2)
    nx = nx - torch.maximum(torch.minimum(nx, torch.zeros_like(nx)), -2 * a)
    tri = -torch.sqrt(nx * nx + ny * ny) * torch.sign(ny)
    d = torch.where(shape == 2, tri, d)
    # star: 5 points, outer radius r, inner 0.45 r (polar approximation of the distance)
    ang = torch.atan2(px, -py)  # 0 = up
    seg = 2 * math.pi / 5
    f = torch.remainder(ang, seg) / seg  # 0..1 within one point-to-point sector
    tri_wave = (f - 0.5).abs() * 2  # 1 at points, 0 between
    rr = r * (0.45 + 0.55 * tri_wave)
    d = torch.where(shape == 3, (q - rr) * 0.7, d)
    # ring: outer radius r, thickness 0.42 r
    d = torch.where(shape == 4, (q - 0.79 * r).abs() - 0.21 * r, d)
    return d


def render(p: dict[str, torch.Tensor], size: int = 128, return_alpha: bool = False):
    """Render attribute tensors to float images in [0, 1], shape (n, 3, size, size), on p's device.

    With return_alpha=True also returns the shape's coverage (n, 1, size, size) in [0, 1] (the VAE
    loss uses it to weight the few shape pixels)."""
    dev = p["color"].device
    row = torch.div(p["pos"], 3, rounding_mode="floor").float()
    col = (p["pos"] % 3).float()
    cx = (col * 2 + 1) / 6 + p["dx"]
    cy = (row * 2 + 1) / 6 + p["dy"]
    r = torch.tensor([SIZE_RADIUS[s] for s in SIZES], device=dev)[p["size"]] * p["rscale"]
    img, alpha = draw(p["shape"], cx, cy, r, jittered_rgb(p["color"], p["cj"]), jittered_rgb(p["bg"], p["bj"]), size)
    return (img, alpha) if return_alpha else img


def jittered_rgb(color: torch.Tensor, jitter: torch.Tensor) -> torch.Tensor:
    """Named colour indices (n,) plus per-channel jitter (n, 3) in uint8 units -> RGB floats in [0, 1], (n, 3)."""
    pal = torch.tensor([COLORS[c] for c in COLOR_NAMES], dtype=torch.float32, device=color.device)
    return (pal[color] + jitter.float()).clamp(0, 255) / 255


def draw(shape: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor, fg: torch.Tensor, bg: torch.Tensor,
         size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n shapes (index, centre, circumradius as fractions of the side; fg / bg RGB (n, 3) in [0, 1]) rasterised with
    a 1-pixel anti-aliased edge: images (n, 3, size, size) and the shapes' coverage (n, 1, size, size)."""
    n = shape.shape[0]
    coords = (torch.arange(size, device=shape.device, dtype=torch.float32) + 0.5) / size
    py = (coords.view(1, size, 1) - cy.view(n, 1, 1)).expand(n, size, size)
    px = (coords.view(1, 1, size) - cx.view(n, 1, 1)).expand(n, size, size)
    d = _sdf(shape.view(n, 1, 1), px, py, r.view(n, 1, 1))
    alpha = (0.5 - d * size).clamp(0, 1).unsqueeze(1)
    img = bg.view(n, 3, 1, 1) * (1 - alpha) + fg.view(n, 3, 1, 1) * alpha
    return img, alpha


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(n,3,H,W) float [0,1] -> (n,H,W,3) uint8."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


class CaptionedShapes:
    """Deterministic, indexable dataset: item i is derived from (seed, i) alone."""

    def __init__(self, seed: int = 0, length: int = 10_000, size: int = 128, **sample_kwargs):
        self.seed, self.length, self.size, self.kw = seed, length, size, sample_kwargs

    def __len__(self) -> int:
        return self.length

    def params(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return sample_params(1, g, **self.kw)

    def __getitem__(self, i: int):
        from PIL import Image

        if not 0 <= i < self.length:
            raise IndexError(i)
        p = self.params(i)
        img = to_uint8(render(p, self.size))[0]
        return Image.fromarray(img), captions_of(p)[0]

    def batch(self, start: int, n: int) -> tuple[np.ndarray, list[str]]:
        imgs, caps = [], []
        for i in range(start, start + n):
            p = self.params(i)
            imgs.append(to_uint8(render(p, self.size))[0])
            caps.append(captions_of(p)[0])
        return np.stack(imgs), caps
