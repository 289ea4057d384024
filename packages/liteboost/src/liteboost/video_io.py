"""Write generated frames to disk atomically: GIF or MP4, plus a PNG contact sheet."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from npu_core.files import atomic_path


def _atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Run ``write(tmp_path)`` on a temporary name in ``path``'s folder, then rename it."""
    with atomic_path(path) as tmp:
        write(tmp)
    return path


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """[T, H, W, 3] floats in [0, 1] -> uint8."""
    return (np.clip(frames, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def write_video(frames: np.ndarray, path: Path, fps: int = 8) -> Path:
    """Write [T, H, W, 3] uint8 frames as a GIF or MP4 (chosen by ``path``'s suffix)."""
    import imageio.v3 as iio

    suffix = path.suffix.lower()
    if suffix not in (".gif", ".mp4"):
        raise ValueError(f"video path {path} must end in .gif or .mp4")
    if suffix == ".gif":
        return _atomic(path, lambda tmp: iio.imwrite(tmp, frames, duration=1000 / fps, loop=0))
    # libx264 needs even sizes and a macro-block multiple to avoid rescaling; pad, never resize.
    return _atomic(
        path, lambda tmp: iio.imwrite(tmp, frames, fps=fps, codec="libx264", macro_block_size=1)
    )


def write_contact_sheet(frames: np.ndarray, path: Path, columns: int | None = None) -> Path:
    """Write every frame of [T, H, W, 3] uint8 into one PNG grid."""
    count, height, width, _ = frames.shape
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    sheet = np.zeros((rows * height, columns * width, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        r, c = divmod(i, columns)
        sheet[r * height : (r + 1) * height, c * width : (c + 1) * width] = frame
    return _atomic(path, lambda tmp: Image.fromarray(sheet).save(tmp, format="PNG"))
