"""Caption-adherence metric for the built-in model, needing no other model.

From an image (PIL or HxWx3 uint8 / float array) estimate
  * the background color: per-channel median of the border pixels -> nearest named color,
  * the shape pixels: pixels whose RGB distance from that median exceeds a threshold,
  * the shape color: per-channel median of the shape pixels farthest from the background -> nearest
    named color,
  * the position: centroid of the shape pixels -> 3x3 cell,
  * the size: shape area / reference area of the captioned shape -> small or large,
  * the shape: best IoU of the shape mask against the five rendered templates.
``score(image, caption)`` compares these with the caption and returns booleans; keys for
attributes the caption does not state (size, position) are left out.
"""
from __future__ import annotations

import numpy as np
import torch

try:
    from . import dataset as ds
except ImportError:  # imported as a plain module next to dataset.py (train.py run as a script)
    import dataset as ds  # type: ignore

_PAL = np.array([ds.COLORS[c] for c in ds.COLOR_NAMES], dtype=np.float32)
FG_THRESHOLD = 45.0  # RGB distance from the background estimate that marks a shape pixel
MIN_PIXELS_FRAC = 0.002  # fewer shape pixels than this fraction of the image -> "no shape"


def _to_array(image) -> np.ndarray:
    if hasattr(image, "convert"):  # PIL
        image = np.asarray(image.convert("RGB"))
    a = np.asarray(image)
    if a.ndim == 3 and a.shape[0] == 3 and a.shape[-1] != 3:
        a = a.transpose(1, 2, 0)
    if a.dtype != np.uint8:
        a = np.clip(a * 255 if a.max() <= 1.0 else a, 0, 255)
    return a.astype(np.float32)


def nearest_color(rgb) -> str:
    d = ((_PAL - np.asarray(rgb, dtype=np.float32)[None]) ** 2).sum(1)
    return ds.COLOR_NAMES[int(d.argmin())]


_REF_AREA: dict[str, float] = {}


def _templates(size: int, cx: float, cy: float, r) -> np.ndarray:
    """Masks of all shapes (n, size, size) centred at (cx, cy); r: one radius or one per shape."""
    n = len(ds.SHAPES)
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    py = (coords.view(1, size, 1) - cy).expand(n, size, size)
    px = (coords.view(1, 1, size) - cx).expand(n, size, size)
    rr = torch.as_tensor(r, dtype=torch.float32).reshape(-1, 1, 1).expand(n, 1, 1)
    with torch.no_grad():
        d = ds._sdf(torch.arange(n).view(n, 1, 1), px, py, rr)
    return ((0.5 - d * size).clamp(0, 1) > 0.5).numpy()


def ref_area(shape: str) -> float:
    """Area (fraction of the image) of `shape` at circumradius 1.0 (scaled: area ~ r^2)."""
    if not _REF_AREA:
        size, r = 256, 0.2
        t = _templates(size, 0.5, 0.5, r)
        for i, s in enumerate(ds.SHAPES):
            _REF_AREA[s] = float(t[i].mean()) / r**2
    return _REF_AREA[shape]


def analyze(image) -> dict:
    """Estimated attributes of one image: bg, color, position (or None), area, mask, centroid."""
    a = _to_array(image)
    h, w, _ = a.shape
    b = max(2, h // 40)
    border = np.concatenate([a[:b].reshape(-1, 3), a[-b:].reshape(-1, 3), a[:, :b].reshape(-1, 3), a[:, -b:].reshape(-1, 3)])
    bg_rgb = np.median(border, axis=0)
    dist = np.sqrt(((a - bg_rgb) ** 2).sum(-1))
    mask = dist > FG_THRESHOLD
    out = {"bg": nearest_color(bg_rgb), "bg_rgb": bg_rgb.tolist(), "mask": mask, "area": float(mask.mean())}
    if mask.sum() < MIN_PIXELS_FRAC * h * w:
        out.update(color=None, position=None, centroid=None)
        return out
    # shape color from the quarter of the shape pixels farthest from the background: drops anti-aliased
    # edges and, in blurry generated images, the halo where shape and background colors mix
    core = mask & (dist >= float(np.percentile(dist[mask], 75)))
    out["color"] = nearest_color(np.median(a[core], axis=0))
    ys, xs = np.nonzero(mask)
    cx, cy = (xs.mean() + 0.5) / w, (ys.mean() + 0.5) / h
    out["centroid"] = (float(cx), float(cy))
    out["position"] = ds.POSITIONS[3 * min(2, int(cy * 3)) + min(2, int(cx * 3))]
    return out


def classify_shape(info: dict) -> str | None:
    mask = info["mask"]
    if info.get("centroid") is None:
        return None
    h = mask.shape[0]
    cx, cy = info["centroid"]
    best, best_iou = None, -1.0
    radii = [float(np.sqrt(info["area"] / ref_area(s))) for s in ds.SHAPES]
    temps = _templates(h, cx, cy, radii)
    for i, s in enumerate(ds.SHAPES):
        t = temps[i]
        iou = float((t & mask).sum() / max(1, (t | mask).sum()))
        if iou > best_iou:
            best, best_iou = s, iou
    return best


def estimate_size(info: dict, shape: str) -> str | None:
    if info.get("centroid") is None:
        return None
    r = np.sqrt(info["area"] / ref_area(shape))
    mid = (ds.SIZE_RADIUS["small"] + ds.SIZE_RADIUS["large"]) / 2
    return "large" if r > mid else "small"


def score(image, caption: str) -> dict:
    """Booleans: bg_color, color, shape, and size / position where the caption states them."""
    want = ds.parse_caption(caption)
    info = analyze(image)
    res = {"bg_color": info["bg"] == want["bg"], "color": info["color"] == want["color"],
           "shape": classify_shape(info) == want["shape"]}
    if want["size"] is not None:
        res["size"] = estimate_size(info, want["shape"]) == want["size"]
    if want["position"] is not None:
        res["position"] = info["position"] == want["position"]
    return res
