"""Safe decoding of uploaded images: size limit, format allow-list, dimension check before the pixels are decoded."""

from __future__ import annotations

import io

from .errors import ApiError, bad_request

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")


def decode_upload(data: bytes, *, max_bytes: int, max_pixels: int, param: str = "image"):
    """Bytes of an upload -> RGB PIL image, or ApiError 400/413. ``Image.open`` reads only the header, so the
    dimensions are checked before any pixel is decompressed (a 100-kB PNG can hold gigapixels)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > max_bytes:
        raise ApiError(413, f"{param}: the upload is {len(data)} bytes, larger than the limit of {max_bytes} bytes "
                            "(omni-accel serve --max-upload-mb)", param=param, code="upload_too_large")
    if not data:
        raise bad_request(f"{param}: the upload is empty; send a PNG, JPEG or WebP image", param, "invalid_image")
    try:
        im = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as exc:  # PIL's own guard (> 2 x Image.MAX_IMAGE_PIXELS)
        raise bad_request(f"{param}: {exc}", param, "image_too_large")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise bad_request(f"{param}: not a PNG, JPEG or WebP image", param, "invalid_image")
    w, h = im.size
    if w < 1 or h < 1 or w * h > max_pixels:
        raise bad_request(f"{param}: {w}x{h} = {w * h} pixels is more than the limit of {max_pixels} "
                          "(omni-accel serve --max-input-pixels)", param, "image_too_large")
    try:
        im.load()
        return im.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise bad_request(f"{param}: the image could not be decoded ({exc.__class__.__name__}: {exc})", param,
                          "invalid_image")


def fit_area(image, width: int, height: int):
    """Downscale a reference image (keeping its aspect ratio) to at most width*height pixels."""
    from PIL import Image

    w, h = image.size
    if w * h <= width * height:
        return image
    scale = (width * height / (w * h)) ** 0.5
    return image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)
