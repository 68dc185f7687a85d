"""Model inputs with multi-valued (bag) features, and bag pooling as training pools.

A served model's ids come in one of two forms:

    ids [n, F] uint64                     every feature single-valued (one id per row)
    {feature: ids [n] uint64 | RaggedIds} features in spec order; a multi-valued feature's
                                          bag of row r is values[offsets[r]:offsets[r + 1]]

`pool_bags` is `embedding_store._pooling.pool` for one feature: the rows of a bag
summed in order (`np.add.reduceat`, float32), then divided by the bag's size (mean)
or its square root (sqrtn); an empty bag pools to zeros. The parser never makes an
empty bag (an empty field is a bag of one id, the feature's missing-value id), but
a client sending hashed bags may.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from hybridrec.embedding_store import RaggedIds

POOLINGS = ("sum", "mean", "sqrtn")

Ids = np.ndarray | dict[str, Any]


def num_rows(ids: Ids) -> int:
    """Rows of `ids` in either form."""
    if isinstance(ids, np.ndarray):
        return len(ids)
    first = next(iter(ids.values()))
    return len(first.offsets) - 1 if isinstance(first, RaggedIds) else len(first)


def slice_rows(ids: Ids, start: int, stop: int) -> Ids:
    """Rows [start, stop) of `ids` (either form, or one feature's ids)."""
    if isinstance(ids, dict):
        return {name: slice_rows(feature, start, stop) for name, feature in ids.items()}
    if isinstance(ids, RaggedIds):
        offsets = ids.offsets[start : stop + 1]
        return RaggedIds(values=ids.values[offsets[0] : offsets[-1]], offsets=offsets - offsets[0])
    return ids[start:stop]


def concatenate(parts: Sequence[Any]) -> Any:
    """The rows of every part, in order (parts of one form: [n, F] arrays, dicts of
    one model's features, one feature's [n] arrays or RaggedIds)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, dict):
        return {name: concatenate([part[name] for part in parts]) for name in first}
    if not isinstance(first, RaggedIds):
        return np.concatenate(parts)
    offsets, base = [np.zeros(1, np.int64)], 0
    for part in parts:
        offsets.append(part.offsets[1:] + base)
        base += int(part.offsets[-1])
    return RaggedIds(
        values=np.concatenate([part.values for part in parts]), offsets=np.concatenate(offsets)
    )


def pool_bags(rows: np.ndarray, offsets: np.ndarray, pooling: str) -> np.ndarray:
    """Pools each bag's rows as `lookup_features` does.

    Args:
        rows: [nnz, dim] float32, the rows of every bag's ids, bag after bag.
        offsets: [n + 1] int64, bag b holds rows[offsets[b]:offsets[b + 1]].
        pooling: sum, mean or sqrtn.

    Returns:
        [n, dim] float32; an empty bag is zeros.
    """
    counts = np.diff(offsets)
    out = np.zeros((len(counts), rows.shape[1]), np.float32)
    nonempty = counts > 0
    if len(rows):
        out[nonempty] = np.add.reduceat(rows, offsets[:-1][nonempty], axis=0)
    if pooling != "sum":
        scale = counts[nonempty].astype(np.float32)
        out[nonempty] /= (scale if pooling == "mean" else np.sqrt(scale))[:, None]
    return out


def bag_rows(offsets: np.ndarray) -> np.ndarray:
    """offsets [n + 1] -> [nnz] the row each bag value belongs to."""
    return np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))


def check_bag(name: str, values: np.ndarray, offsets: np.ndarray, rows: int) -> None:
    """Raises ValueError unless values [nnz] uint64 and offsets [rows + 1] form `rows` bags."""
    if values.dtype != np.uint64 or values.ndim != 1:
        raise ValueError(f"feature {name!r}: bag values must be a 1-D uint64 array")
    if offsets.ndim != 1 or len(offsets) != rows + 1:
        raise ValueError(f"feature {name!r}: offsets must have {rows + 1} entries (rows + 1)")
    if offsets[0] != 0 or offsets[-1] != len(values) or np.any(np.diff(offsets) < 0):
        raise ValueError(
            f"feature {name!r}: offsets must start at 0, never decrease and end at "
            f"len(values) = {len(values)}"
        )
