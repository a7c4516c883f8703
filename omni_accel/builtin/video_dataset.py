"""Procedural, seeded clips for the built-in text-to-video model: one coloured shape moving across a plain background.

Every clip is one shape (circle, square, triangle, star, ring) of a named colour moving in a straight line, at a
steady speed, from one side of the frame to the other, on a background of a *different* named colour:

    a red circle moving from left to right on a blue background
    a white star moving from bottom to top on a purple background

The shapes, colours and the signed-distance rasteriser are the image model's (``dataset.py``): a clip is rendered
as F images in one batched call, so a batch of 64 clips x 17 frames is a few milliseconds on a GPU. Start and end
points, the position across the motion, the size and the colours are jittered; all of it comes from a torch
generator, so ``sample_params(n, generator)`` + ``render_clips`` is deterministic.
"""
from __future__ import annotations

import re

import torch

try:
    from . import dataset as ds
except ImportError:  # imported as a plain module next to dataset.py (train_video.py run as a script)
    import dataset as ds  # type: ignore

DIRECTIONS = ["left to right", "right to left", "top to bottom", "bottom to top"]
# unit vector of each direction in image coordinates (x right, y down)
DIRECTION_VECTORS = {"left to right": (1, 0), "right to left": (-1, 0), "top to bottom": (0, 1), "bottom to top": (0, -1)}
RADIUS = 0.13  # circumradius, fraction of the side (about 8 px at 64 px)
RADIUS_JITTER = 0.1  # relative
START = (0.2, 0.28)  # distance of the start point from the edge the shape starts at (fraction of the side)
END = (0.72, 0.8)  # distance of the end point from that same edge
ACROSS = (0.3, 0.7)  # position across the motion (y for horizontal motion, x for vertical)

# (colour, shape, background) triples never shown in training: the image model's ten plus five more, so the
# adherence benchmark has 15 x 4 directions = 60 distinct held-out captions.
HELDOUT_TRIPLES: list[tuple[str, str, str]] = ds.HELDOUT_TRIPLES + [
    ("green", "circle", "purple"),
    ("yellow", "ring", "blue"),
    ("white", "triangle", "red"),
    ("black", "star", "yellow"),
    ("purple", "square", "white"),
]
_HELD = torch.tensor([(ds.COLOR_NAMES.index(c), ds.SHAPES.index(s), ds.COLOR_NAMES.index(b))
                      for c, s, b in HELDOUT_TRIPLES])

VOCAB_WORDS = sorted(set("a moving from to on background".split()) | set(ds.COLOR_NAMES) | set(ds.SHAPES)
                     | {w for d in DIRECTIONS for w in d.split()})

_CAPTION_RE = re.compile(r"^\s*a\s+(\w+)\s+(\w+)\s+moving\s+from\s+(\w+\s+to\s+\w+)\s+on\s+an?\s+(\w+)\s+background\s*\.?\s*$")


def make_caption(color: str, shape: str, direction: str, bg: str) -> str:
    return f"a {color} {shape} moving from {direction} on a {bg} background"


def parse_caption(caption: str) -> dict:
    """Inverse of make_caption: dict with color, shape, direction, bg; ValueError naming the bad part."""
    m = _CAPTION_RE.match(caption.lower())
    if not m:
        raise ValueError(f"caption {caption!r} is not of the form 'a <color> <shape> moving from <left to right|"
                         "right to left|top to bottom|bottom to top> on a <color> background'")
    color, shape, direction, bg = m.groups()
    direction = " ".join(direction.split())
    for value, allowed, what in ((color, ds.COLOR_NAMES, "color"), (bg, ds.COLOR_NAMES, "background color"),
                                 (shape, ds.SHAPES, "shape"), (direction, DIRECTIONS, "direction")):
        if value not in allowed:
            raise ValueError(f"unknown {what} {value!r} in caption {caption!r}; known: {allowed}")
    return {"color": color, "shape": shape, "direction": direction, "bg": bg}


def _is_heldout(color: torch.Tensor, shape: torch.Tensor, bg: torch.Tensor) -> torch.Tensor:
    triple = torch.stack([color, shape, bg], dim=1)
    return (triple[:, None, :] == _HELD[None]).all(-1).any(-1)


def sample_params(n: int, generator: torch.Generator, *, exclude_heldout: bool = True, only_heldout: bool = False,
                  device="cpu") -> dict[str, torch.Tensor]:
    """Random clip attributes for n clips (on `device`), drawn from `generator` (a CPU generator)."""
    g, nc = generator, len(ds.COLOR_NAMES)
    if only_heldout:
        triple = _HELD[torch.randint(len(_HELD), (n,), generator=g)]
        color, shape, bg = triple[:, 0], triple[:, 1], triple[:, 2]
    else:
        color = torch.randint(nc, (n,), generator=g)
        shape = torch.randint(len(ds.SHAPES), (n,), generator=g)
        bg = (color + torch.randint(1, nc, (n,), generator=g)) % nc  # never the shape's colour
        held = _is_heldout(color, shape, bg) if exclude_heldout else torch.zeros(n, dtype=torch.bool)
        while held.any():  # re-draw the background of held-out triples
            bg[held] = (color[held] + torch.randint(1, nc, (int(held.sum()),), generator=g)) % nc
            held = _is_heldout(color, shape, bg)
    uniform = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=g)  # noqa: E731
    p = {
        "color": color, "shape": shape, "bg": bg,
        "direction": torch.randint(len(DIRECTIONS), (n,), generator=g),
        "start": uniform(*START), "end": uniform(*END), "across": uniform(*ACROSS),
        "rscale": uniform(1 - RADIUS_JITTER, 1 + RADIUS_JITTER),
        "cj": torch.randint(-ds.COLOR_JITTER, ds.COLOR_JITTER + 1, (n, 3), generator=g),
        "bj": torch.randint(-ds.COLOR_JITTER, ds.COLOR_JITTER + 1, (n, 3), generator=g),
    }
    return {k: v.to(device) for k, v in p.items()}


def params_for_captions(captions: list[str], generator: torch.Generator, device="cpu") -> dict[str, torch.Tensor]:
    """Random clip attributes that match the given captions (ground-truth clips for the metric's own test)."""
    p = sample_params(len(captions), generator, exclude_heldout=False, device=device)
    parsed = [parse_caption(c) for c in captions]
    for key, names in (("color", ds.COLOR_NAMES), ("shape", ds.SHAPES), ("bg", ds.COLOR_NAMES),
                       ("direction", DIRECTIONS)):
        p[key] = torch.tensor([names.index(c[key]) for c in parsed], device=device)
    return p


def captions_of(p: dict[str, torch.Tensor]) -> list[str]:
    cols = {k: p[k].tolist() for k in ("color", "shape", "direction", "bg")}
    return [make_caption(ds.COLOR_NAMES[c], ds.SHAPES[s], DIRECTIONS[d], ds.COLOR_NAMES[b])
            for c, s, d, b in zip(cols["color"], cols["shape"], cols["direction"], cols["bg"])]


def centres(p: dict[str, torch.Tensor], frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shape's centre (cx, cy) in every frame, each (n, frames), fractions of the side."""
    t = torch.linspace(0, 1, frames, device=p["start"].device).view(1, frames)
    along = p["start"].view(-1, 1) + (p["end"] - p["start"]).view(-1, 1) * t  # from the start edge
    d = p["direction"].view(-1, 1)
    forward = (d == 0) | (d == 2)  # left to right, top to bottom: coordinate grows
    coord = torch.where(forward, along, 1 - along)
    across = p["across"].view(-1, 1).expand_as(coord)
    horizontal = d < 2
    return torch.where(horizontal, coord, across), torch.where(horizontal, across, coord)


def render_clips(p: dict[str, torch.Tensor], frames: int = 17, size: int = 64, return_alpha: bool = False):
    """Clips in [0, 1] as (n, 3, frames, size, size) -- the layout of diffusers' video VAEs -- on p's device; with
    return_alpha also the shapes' coverage (n, 1, frames, size, size)."""
    n = p["color"].shape[0]
    cx, cy = centres(p, frames)
    each = lambda v: v.repeat_interleave(frames, dim=0)  # noqa: E731 -- per clip -> per frame
    r = RADIUS * p["rscale"]
    img, alpha = ds.draw(each(p["shape"]), cx.reshape(-1), cy.reshape(-1), each(r),
                         each(ds.jittered_rgb(p["color"], p["cj"])), each(ds.jittered_rgb(p["bg"], p["bj"])), size)
    img = img.view(n, frames, 3, size, size).transpose(1, 2)
    alpha = alpha.view(n, frames, 1, size, size).transpose(1, 2)
    return (img, alpha) if return_alpha else img


def to_uint8_frames(clips: torch.Tensor) -> torch.Tensor:
    """(n, 3, F, H, W) in [0, 1] -> (n, F, H, W, 3) uint8 (what the metric and the MP4 encoder take)."""
    return (clips.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()
