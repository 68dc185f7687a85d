"""Deterministic initial rows: value[i, c] is a pure function of (seed, id[i], c).

The native kernel (`init_rows`) and the numpy version compute the same float64
expressions in the same order: uniform rows are the same bits; a normal row can differ in
a rare last float32 bit where libm's log or cos and numpy's round differently.
"""

from __future__ import annotations

import numpy as np
from hybridrec.common import splitmix
from hybridrec.embedding_store._arrays import native
from hybridrec.embedding_store._hashing import SALT_INIT, mix64, salt_offset, unit_float
from hybridrec.embedding_store._pools import NATIVE_THREADS, ForkSafePool
from hybridrec.embedding_store.config import InitializerConfig

_COLUMN = np.uint64(splitmix.COLUMN_STEP)  # a column's step between counters
PART_VALUES = 1 << 19  # a native initialization this large or more is split over threads

# the threads that share a large native initialization (the kernel holds no GIL)
_threads = ForkSafePool(NATIVE_THREADS, "embedding-init")


def initial_rows(
    config: InitializerConfig,
    ids: np.ndarray,
    dim: int,
    first_column: int = 0,
    *,
    out: np.ndarray | None = None,
    at: np.ndarray | None = None,
) -> np.ndarray:
    """ids: [n] uint64 -> [n, dim] float32 initial values of columns [first_column,
    first_column + dim), identical on any shard and run (and for any column slicing).

    With `out` (a C-contiguous float32 [m, dim] array) and `at` ([n] row positions in
    it), the rows are written to out[at] instead, and `out` is returned.
    """
    ids = np.ascontiguousarray(ids, np.uint64)
    if out is not None:
        at = np.ascontiguousarray(at, np.int64)
        if out.ndim != 2 or out.shape[1] != dim or len(at) != len(ids):
            raise ValueError(
                f"initial_rows: out {out.shape} must be [rows, {dim}] and at {at.shape} "
                f"one position per id ({len(ids)})"
            )
        if config.kind == "zeros" or not len(ids):
            out[at] = 0.0
        elif native is not None and out.flags.c_contiguous and out.dtype == np.float32:
            _native_rows(config, ids, dim, first_column, out, at)
        else:
            out[at] = initial_rows(config, ids, dim, first_column)
        return out
    if config.kind == "zeros" or not len(ids):
        return np.zeros((len(ids), dim), np.float32)
    if native is not None:
        rows = np.empty((len(ids), dim), np.float32)
        return _native_rows(config, ids, dim, first_column, rows, np.arange(len(ids)))
    row_key = mix64(ids, SALT_INIT + config.seed)
    columns = np.arange(first_column, first_column + dim, dtype=np.uint64)
    counters = row_key[:, None] + columns[None, :] * _COLUMN
    bits = mix64(counters, SALT_INIT)
    if config.kind == "uniform":
        values = config.low + (config.high - config.low) * unit_float(bits)
    else:  # normal, Box-Muller on the two 32-bit halves
        low = (bits & np.uint64(0xFFFFFFFF)).astype(np.float64)
        high = (bits >> np.uint64(32)).astype(np.float64)
        u1 = (low + 1.0) * (1.0 / 4294967296.0)  # (0, 1]: log is finite
        u2 = high * (1.0 / 4294967296.0)
        values = config.mean + config.stddev * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return values.astype(np.float32)


def initializer_salts(config: InitializerConfig) -> tuple[int, int]:
    """(what an id gets added before mixing into its row's key, what each column's counter
    gets added before mixing): the two offsets of `config`'s initial rows, for a
    computation of them elsewhere (the step's new rows: `model.device_ids`)."""
    return salt_offset(SALT_INIT + config.seed), salt_offset(SALT_INIT)


def _native_rows(config, ids, dim, first_column, out, at) -> np.ndarray:
    """The kernel over `ids`: on one thread, or in parts over the pool's when large."""
    uniform = config.kind == "uniform"
    rest = (
        dim,
        salt_offset(SALT_INIT + config.seed),
        salt_offset(SALT_INIT),
        first_column,
        0 if uniform else 1,
        float(config.low if uniform else config.mean),
        float(config.high if uniform else config.stddev),
    )
    parts = max(1, min(NATIVE_THREADS, len(ids) * dim // PART_VALUES))
    _threads.in_parts(
        len(ids), parts, lambda lo, hi: native.init_rows(out, at[lo:hi], ids[lo:hi], *rest)
    )
    return out
