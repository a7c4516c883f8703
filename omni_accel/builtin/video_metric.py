"""Caption-adherence metric for the built-in video model, needing no other model.

Each frame goes through the image model's per-image analysis (``metric.analyze``: background = median of the border,
shape pixels = far from it, shape colour = median of the shape's core, centroid). Over the clip:
  * background colour and shape colour: the most common per-frame answer;
  * direction: a least-squares line through the centroid track (x and y against the frame index). The clip moves in
    the direction of the larger of the two slopes, provided the shape travels at least ``MIN_TRAVEL`` of the side
    over the clip and the line explains at least ``MIN_R2`` of the track's variance along that axis. Without the
    last two conditions a still or jittering shape (or frames in random order) would still "move" somewhere;
    with them, such clips get no direction and score 0 -- below the 25 % of a four-way guess.
``score(frames, caption)`` returns booleans ``bg_color``, ``color``, ``direction`` (the targets) and ``shape``
(the middle frame's shape class, not a target).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

try:
    from . import metric as M
    from . import video_dataset as vds
except ImportError:  # next to the other modules (train_video.py run as a script)
    import metric as M  # type: ignore
    import video_dataset as vds  # type: ignore

MIN_TRAVEL = 0.2  # fraction of the side the fitted line must cover over the clip (rendered clips travel >= 0.44)
MIN_R2 = 0.5  # share of the centroid's variance along the motion the straight line must explain
MIN_TRACKED = 0.5  # share of frames in which a shape must be found


def _vote(values: list) -> object:
    values = [v for v in values if v is not None]
    return Counter(values).most_common(1)[0][0] if values else None


def direction_of(track: np.ndarray, frames: int) -> str | None:
    """The direction of a centroid track (frame index, cx, cy rows; NaN where no shape was found), or None."""
    found = ~np.isnan(track[:, 1])
    if found.sum() < max(2, MIN_TRACKED * frames):
        return None
    t, xy = track[found, 0], track[found, 1:]
    t_centred = t - t.mean()
    slopes = (t_centred[:, None] * (xy - xy.mean(0))).sum(0) / max(float((t_centred ** 2).sum()), 1e-12)
    axis = int(np.argmax(np.abs(slopes)))
    travel = slopes[axis] * (frames - 1)
    residual = xy[:, axis] - xy[:, axis].mean() - slopes[axis] * t_centred
    variance = float(((xy[:, axis] - xy[:, axis].mean()) ** 2).sum())
    r2 = 1 - float((residual ** 2).sum()) / variance if variance > 0 else 0.0
    if abs(travel) < MIN_TRAVEL or r2 < MIN_R2:
        return None
    vector = (int(np.sign(travel)), 0) if axis == 0 else (0, int(np.sign(travel)))
    return next(name for name, v in vds.DIRECTION_VECTORS.items() if v == vector)


def analyze_clip(frames) -> dict:
    """Estimated attributes of one clip (F x H x W x 3, uint8 or float in [0, 1]): bg, color, direction, shape,
    and the centroid track (F x 3: frame index, cx, cy)."""
    frames = np.asarray(frames)
    infos = [M.analyze(frame) for frame in frames]
    track = np.array([[i, *(info["centroid"] or (np.nan, np.nan))] for i, info in enumerate(infos)], dtype=float)
    middle = infos[len(infos) // 2]
    return {"bg": _vote([i["bg"] for i in infos]), "color": _vote([i["color"] for i in infos]),
            "direction": direction_of(track, len(frames)), "shape": M.classify_shape(middle), "track": track}


def score(frames, caption: str) -> dict:
    """Booleans: bg_color, color, direction (targets) and shape."""
    want = vds.parse_caption(caption)
    info = analyze_clip(frames)
    return {"bg_color": info["bg"] == want["bg"], "color": info["color"] == want["color"],
            "direction": info["direction"] == want["direction"], "shape": info["shape"] == want["shape"]}
