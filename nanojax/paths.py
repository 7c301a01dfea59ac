"""Where nanojax keeps what it downloads, imports and compiles."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """`override` (--cache-dir), else $NANOJAX_CACHE, else ~/.cache/nanojax (or under
    $XDG_CACHE_HOME)."""
    if override:
        return Path(override)
    if os.environ.get("NANOJAX_CACHE"):
        return Path(os.environ["NANOJAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nanojax"
