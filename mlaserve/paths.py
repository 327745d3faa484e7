"""Where mlaserve keeps files it makes once and reuses: the embedded default model, converted tokenizers."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """$MLASERVE_CACHE, else $XDG_CACHE_HOME/mlaserve (default ~/.cache/mlaserve)."""
    return os.environ.get("MLASERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mlaserve"
    )
