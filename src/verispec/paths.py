"""Where verispec keeps what it makes for itself: step-time profiles, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(name: str) -> Path:
    """`$VERISPEC_CACHE/name`, by default `~/.cache/verispec/name` (not created here)."""
    root = os.environ.get("VERISPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "verispec")
    return Path(root) / name
