"""Deterministic initial rows: value[i, c] is a pure function of (seed, id[i], c)."""

from __future__ import annotations

import numpy as np
from hybridrec.embedding_store._hashing import SALT_INIT, mix64, unit_float
from hybridrec.embedding_store.config import InitializerConfig


def initial_rows(
    config: InitializerConfig, ids: np.ndarray, dim: int, first_column: int = 0
) -> np.ndarray:
    """ids: [n] uint64 -> [n, dim] float32 initial values of columns [first_column,
    first_column + dim), identical on any shard and run (and for any column slicing)."""
    if config.kind == "zeros" or not len(ids):
        return np.zeros((len(ids), dim), np.float32)
    row_key = mix64(ids, SALT_INIT + config.seed)
    columns = np.arange(first_column, first_column + dim, dtype=np.uint64)
    counters = row_key[:, None] + columns[None, :] * np.uint64(0xD1B54A32D192ED03)
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
