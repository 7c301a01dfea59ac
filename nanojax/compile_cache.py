"""jax's persistent compilation cache under the nanojax cache dir, so a second
`nanojax generate` / `serve` / `bench` loads its compiled programs instead of compiling.

Where (first that is set): `--compile-cache-dir`, $NANOJAX_COMPILE_CACHE, jax's own
$JAX_COMPILATION_CACHE_DIR, `<nanojax cache dir>/jax` (the cache dir is `--cache-dir`,
$NANOJAX_CACHE or ~/.cache/nanojax). `--no-compile-cache` turns it off.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "NANOJAX_COMPILE_CACHE"
# every program is worth keeping: a CPU start compiles dozens of sub-second ones
MIN_COMPILE_TIME_S = 0.0


def cache_path(override: str | os.PathLike | None = None,
               model_cache_dir: str | os.PathLike | None = None) -> Path:
    if override:
        return Path(override)
    for env in (ENV, "JAX_COMPILATION_CACHE_DIR"):
        if os.environ.get(env):
            return Path(os.environ[env])
    from nanojax.paths import cache_dir
    return cache_dir(model_cache_dir) / "jax"


def enable(path: str | os.PathLike) -> Path:
    """Turns the cache on at path; call before the first compile."""
    import jax
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    return path


def disable() -> None:
    import jax
    jax.config.update("jax_enable_compilation_cache", False)


def configure(args) -> Path | None:
    """From the CLI flags (see add_args); returns the directory in use, None when off."""
    if args.no_compile_cache:
        disable()
        return None
    return enable(cache_path(args.compile_cache_dir, getattr(args, "cache_dir", None)))


def add_args(p) -> None:
    p.add_argument("--compile-cache-dir", default=None,
                   help="jax's persistent compilation cache (env NANOJAX_COMPILE_CACHE; "
                        "default: <cache dir>/jax)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile everything afresh and keep nothing")
