"""Video files for users: H.264 MP4 in (for tests) and out (for `generate --video`, the server and the demo).

PyAV carries FFmpeg and libx264 in its wheels, so encoding needs nothing from the system. Output is what every
browser plays: H.264, yuv420p (the only chroma layout browsers decode), even width and height (yuv420p halves both),
and `+faststart` so a browser can start playing before the whole file has arrived.
"""

from __future__ import annotations

import io
import os
import tempfile
from fractions import Fraction
from typing import Sequence, Union

import numpy as np
from PIL import Image

from omni_accel.errors import AccelError

Frames = Union[Sequence[Image.Image], np.ndarray]

# A constant rate factor of 18 is visually lossless for most content; "medium" balances size and encode time.
H264_CRF = "18"
H264_PRESET = "medium"


def _import_av():
    try:
        import av
    except ImportError as err:  # pragma: no cover - av is in the serve and video extras
        raise AccelError("Writing MP4 needs PyAV: pip install 'omni-accel[video]' (or pip install av).") from err
    return av


def frames_to_array(frames: Frames) -> np.ndarray:
    """Frames as one uint8 array F x H x W x 3, from PIL images or an array (uint8, or float in [0, 1])."""
    if isinstance(frames, np.ndarray):
        array = frames
    else:
        frames = list(frames)
        if not frames:
            raise AccelError("No frames to encode: pass at least one frame.")
        array = np.stack([np.asarray(frame.convert("RGB")) for frame in frames])
    if array.ndim != 4 or array.shape[-1] != 3:
        raise AccelError(f"Frames have shape {tuple(array.shape)}; expected F x H x W x 3 (RGB).")
    if array.shape[0] == 0:
        raise AccelError("No frames to encode: pass at least one frame.")
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.floating):
            raise AccelError(f"Frames have dtype {array.dtype}; pass uint8 in [0, 255] or float in [0, 1].")
        array = (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return array


def _even(frames: np.ndarray) -> np.ndarray:
    """Crop one row / column if needed: yuv420p stores chroma at half resolution, so both sides must be even."""
    height, width = frames.shape[1] & ~1, frames.shape[2] & ~1
    if height == 0 or width == 0:
        raise AccelError(f"Frames of {frames.shape[2]}x{frames.shape[1]} px are too small for H.264; need >= 2x2.")
    return frames[:, :height, :width]


def encode_mp4(frames: Frames, fps: int) -> bytes:
    """The frames as a browser-playable H.264 MP4 (yuv420p, even size, moov atom first)."""
    if not isinstance(fps, (int, np.integer)) or isinstance(fps, bool) or fps < 1:
        raise AccelError(f"fps={fps!r} is not a positive whole number of frames per second; pass e.g. fps=16.")
    array = np.ascontiguousarray(_even(frames_to_array(frames)))
    av = _import_av()
    # +faststart rewrites the file to move the index to the front, which FFmpeg can only do on a real file.
    with tempfile.TemporaryDirectory(prefix="omni_accel_mp4_") as folder:
        path = os.path.join(folder, "clip.mp4")
        _write_h264(av, array, int(fps), path)
        with open(path, "rb") as file:
            return file.read()


def _write_h264(av, array: np.ndarray, fps: int, path: str) -> None:
    with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps, 1))
        stream.width, stream.height = array.shape[2], array.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": H264_CRF, "preset": H264_PRESET}
        for frame in array:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            container.mux(packet)


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame of an MP4 as uint8 F x H x W x 3, and its frame rate."""
    av = _import_av()
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        fps = float(stream.average_rate or stream.guessed_rate)
    return frames, fps


def first_frame_png(frames: Frames) -> bytes:
    """The first frame as PNG bytes (a video's thumbnail)."""
    array = frames_to_array(frames[:1] if isinstance(frames, np.ndarray) else list(frames)[:1])
    buffer = io.BytesIO()
    Image.fromarray(array[0]).save(buffer, format="PNG")
    return buffer.getvalue()
