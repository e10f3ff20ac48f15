"""Where pagedserve keeps what it makes once and reuses: converted models and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PAGEDSERVE_CACHE, or pagedserve/ under $XDG_CACHE_HOME (~/.cache)."""
    if os.environ.get("PAGEDSERVE_CACHE"):
        return Path(os.environ["PAGEDSERVE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"
