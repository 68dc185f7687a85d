"""XLA's compiled programs kept on disk between runs of the commands that compile them.

A run compiles its parameter initializer, train step and eval step before the first
step; on a CPU host that is seconds of a short run (docs/benchmarks.md). With JAX's
persistent compilation cache, a second run of the same shapes (the next epoch's run,
an evaluation, a resumed job) loads them instead. The cache is keyed by the program,
the JAX/XLA version and the devices, so a stale entry is never used.

`$HYBRIDREC_COMPILATION_CACHE` names the directory; `off` (or an empty value) turns it
off. Default: `$XDG_CACHE_HOME/hybridrec/jax`, else `~/.cache/hybridrec/jax`.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HYBRIDREC_COMPILATION_CACHE"
# Programs that compile faster than this are not worth a disk round trip.
MIN_COMPILE_SECONDS = 0.2


def cache_directory() -> Path | None:
    """The cache directory this process uses, or None when it is turned off."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "0", "none") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridrec" / "jax"


def use_compilation_cache() -> Path | None:
    """Points JAX's persistent compilation cache at `cache_directory()`; returns it.

    A directory that cannot be created turns the cache off rather than failing the run.
    """
    directory = cache_directory()
    if directory is None:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # the user's wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
