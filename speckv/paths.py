"""Where speckv keeps files it builds at run time (converted models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$SPECKV_CACHE`` or ~/.cache/speckv."""
    return Path(os.environ.get("SPECKV_CACHE", Path.home() / ".cache" / "speckv"))
