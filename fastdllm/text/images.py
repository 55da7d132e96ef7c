"""Images as users give them: a `PIL.Image`, a file's path, its bytes, or a `data:` URL (what an
OpenAI-style request's `image_url` part carries). The server takes data URLs only: it reads no
file and fetches nothing for a request."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path

# an image's pixels at most (PIL's own guard against decompression bombs warns at 89M)
MAX_PIXELS = 64_000_000


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 `data:image/...;base64,` URL."""
    head, sep, body = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError("image_url: expected a data:image/<type>;base64,<data> URL (this server fetches nothing)")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url: its base64 data does not decode") from None


def open_image(source):
    """An RGB `PIL.Image` of `source`, transparency composited onto white (as transformers'
    image processors convert it)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, str) and source.startswith("data:"):
            source = data_url_bytes(source)
        elif isinstance(source, str) and source.split(":", 1)[0] in ("http", "https", "ftp"):
            raise ValueError("images: URLs are not fetched; give the file, its bytes or a data: URL")
        if isinstance(source, (bytes, bytearray)):
            stream = io.BytesIO(source)
        elif isinstance(source, (str, Path)):
            if not Path(source).is_file():
                raise ValueError(f"images: {source}: no such file")
            stream = str(source)
        else:
            raise ValueError(f"images: expected a PIL image, a path, bytes or a data URL, got {type(source).__name__}")
        try:
            image = Image.open(stream)
            if image.width * image.height > MAX_PIXELS:
                raise ValueError(f"images: {image.width}x{image.height} pixels is more than {MAX_PIXELS}")
            image.load()
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise ValueError(f"images: not an image this reader knows ({e})") from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def split_images(messages: list[dict]) -> tuple[list[dict], list]:
    """A conversation's images taken out of its messages' content parts, in order, each part left
    as a chat template reads one (`{"type": "image"}`): transformers' parts (`{"type": "image",
    "image" | "url" | "path": ...}`) and OpenAI's (`{"type": "image_url", "image_url": {"url":
    ...}}`)."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    source = next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)
                    if source is None:
                        raise ValueError("messages: an image part needs its image (image, url or path)")
                    images.append(source)
                    part = {"type": "image"}
                elif kind == "image_url":
                    url = part.get("image_url")
                    images.append(url.get("url") if isinstance(url, dict) else url)
                    part = {"type": "image"}
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out, images
