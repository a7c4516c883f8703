"""MP4 encoding for video outputs: H.264 / yuv420p that decodes back to the same frames (within H.264's loss)."""

import io

import numpy as np
import pytest
from PIL import Image

from omni_accel.errors import AccelError
from omni_accel.video_io import decode_mp4, encode_mp4, first_frame_png


def moving_square(frames=9, height=48, width=64):
    """A white square moving right over a dark blue background: smooth content H.264 keeps closely."""
    clip = np.zeros((frames, height, width, 3), np.uint8)
    clip[..., 2] = 120
    for index in range(frames):
        left = 4 + 4 * index
        clip[index, 16:32, left:left + 16] = 255
    return clip


def test_mp4_round_trip_keeps_frames_size_and_rate():
    clip = moving_square()
    data = encode_mp4(clip, fps=8)
    assert data[4:8] == b"ftyp"
    assert data.find(b"moov") < data.find(b"mdat")  # faststart: a browser can play while downloading
    frames, fps = decode_mp4(data)
    assert frames.shape == clip.shape and fps == 8
    assert np.abs(frames.astype(int) - clip.astype(int)).mean() < 3


def test_mp4_is_h264_yuv420p():
    import av

    with av.open(io.BytesIO(encode_mp4(moving_square(), fps=16))) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.codec_context.pix_fmt == "yuv420p"


def test_pil_frames_and_odd_sizes_are_cropped_to_even():
    clip = moving_square(frames=3, height=33, width=47)
    frames, _ = decode_mp4(encode_mp4([Image.fromarray(frame) for frame in clip], fps=4))
    assert frames.shape == (3, 32, 46, 3)


def test_float_frames_in_unit_range_are_accepted():
    clip = moving_square(frames=2)
    frames, _ = decode_mp4(encode_mp4(clip.astype(np.float32) / 255.0, fps=2))
    assert np.abs(frames.astype(int) - clip.astype(int)).mean() < 3


def test_first_frame_png():
    clip = moving_square(frames=2)
    image = Image.open(io.BytesIO(first_frame_png(clip)))
    assert image.format == "PNG" and np.array_equal(np.asarray(image), clip[0])
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(first_frame_png([Image.fromarray(clip[1])])))), clip[1])


@pytest.mark.parametrize(
    "frames, fps, message",
    [
        (np.zeros((0, 8, 8, 3), np.uint8), 8, "No frames to encode"),
        (np.zeros((2, 8, 8), np.uint8), 8, "expected F x H x W x 3"),
        (np.zeros((2, 8, 8, 3), np.int64), 8, "pass uint8 in [0, 255] or float in [0, 1]"),
        (np.zeros((2, 8, 8, 3), np.uint8), 0, "fps=0 is not a positive whole number"),
        (np.zeros((2, 8, 8, 3), np.uint8), 7.5, "fps=7.5 is not a positive whole number"),
        (np.zeros((2, 1, 8, 3), np.uint8), 8, "too small for H.264"),
    ],
)
def test_bad_input_is_refused(frames, fps, message):
    with pytest.raises(AccelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        encode_mp4(frames, fps)
