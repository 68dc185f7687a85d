"""Fast row gathers/scatters, unique and grouping for the hot paths.

numpy's `a[index]` on a 2-D array copies row by row through the generic
fancy-indexing machinery; viewing each row as one opaque item (np.void) turns the
same gather or scatter into a 1-D copy loop that is 3-5x faster. np.unique and
np.argsort on uint64 are many times slower than np.sort (SIMD), so grouping packs
(small key, position) into one int64 and sorts that instead.

With the native kernels built (`embedding_store._native`), dedupe is one hash pass and
summing rows by group one loop, both without the GIL; results are the same bits, only
the order of the distinct values differs (first occurrence instead of sorted).
"""

from __future__ import annotations

import importlib
import os

import numpy as np


def _load_native():
    """The compiled kernels (a C module that imports nothing of this package), or None in
    a source tree without the built extension (see setup.py) or with HYBRIDREC_NATIVE=0."""
    if os.environ.get("HYBRIDREC_NATIVE", "1") == "0":
        return None
    try:
        return importlib.import_module("hybridrec.embedding_store._native")
    except ImportError:
        return None


native = _load_native()


def _row_view(array: np.ndarray) -> np.ndarray | None:
    if array.ndim != 2 or not array.flags.c_contiguous or array.shape[1] == 0:
        return None
    return array.view(np.dtype((np.void, array.shape[1] * array.itemsize))).reshape(-1)


def take_rows(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """array[index] for a 2-D array: [len(index), width]."""
    return np.take(array, index, axis=0)


def put_rows(array: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
    """array[index] = rows for a 2-D array (index without duplicates)."""
    view = _row_view(array)
    if view is None:
        array[index] = rows
        return
    rows = np.ascontiguousarray(rows, dtype=array.dtype)
    view[index] = rows.view(view.dtype).reshape(-1)


def unique_counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values [u] and how often each occurs [u] int64."""
    ordered = np.sort(values)
    first = np.empty(len(values), bool)
    if len(values):
        first[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return ordered[starts], np.diff(np.append(starts, len(values)))


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct uint64 values [u] and, for each input, its index among them [n] int64.

    The distinct values come in order of first occurrence (native kernels) or sorted.
    """
    if native is not None:
        values = np.ascontiguousarray(values, dtype=np.uint64)
        unique = np.empty(len(values), np.uint64)
        inverse = np.empty(len(values), np.int64)
        scratch = np.zeros(1 << max(4, (2 * len(values) - 1).bit_length()), np.int64)
        count = native.dedupe(values, unique, inverse, scratch)
        return unique[:count], inverse
    order = np.argsort(values)  # searchsorted of n random needles is far slower for large n
    ordered = values[order]
    first = np.empty(len(values), bool)
    if len(values):
        first[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(len(values), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


def group(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups equal non-negative int64 keys, keeping input order inside each group.

    Returns:
        unique: [g] sorted distinct keys.
        order: [n] input positions, group by group, ascending within a group.
        bounds: [g + 1] group k is `order[bounds[k]:bounds[k + 1]]`.
    """
    n = len(keys)
    bits = max(1, int(n - 1).bit_length())
    if n and int(keys.max()) < (1 << (63 - bits)):
        packed = np.sort((keys.astype(np.int64) << bits) | np.arange(n, dtype=np.int64))
        order = packed & ((1 << bits) - 1)
        ordered = packed >> bits
    else:
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
    first = np.empty(n, bool)
    if n:
        first[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return ordered[starts], order, np.append(starts, n)


def segment_sum(rows: np.ndarray, order: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Sums the rows of each group (see `group`) in input order: [g, width] float32.

    A sparse 0/1 matrix product: each output row accumulates its inputs one after
    another in position order, so the result does not depend on how a batch was split.
    """
    import scipy.sparse  # only here: the native kernels need no scipy (0.1 s of imports)

    groups = len(bounds) - 1
    if groups == len(order):
        return take_rows(rows, order)
    matrix = scipy.sparse.csr_matrix(
        (np.ones(len(order), rows.dtype), order, bounds), shape=(groups, len(rows))
    )
    return np.asarray(matrix @ rows, dtype=rows.dtype)


def sum_by_inverse(rows: np.ndarray, inverse: np.ndarray, groups: int) -> np.ndarray:
    """[groups, width] float32: row g sums the rows i with inverse[i] == g, in input order."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if native is not None and rows.ndim == 2 and rows.shape[1]:
        out = np.zeros((groups, rows.shape[1]), np.float32)
        native.segment_sum(rows, np.ascontiguousarray(inverse, np.int64), out, rows.shape[1])
        return out
    _, order, bounds = group(inverse)
    return segment_sum(rows, order, bounds)


def sum_duplicates(keys: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys [u] and the float32 sum of each key's rows [u, width], in input order."""
    if native is not None:
        unique, inverse = unique_inverse(keys)
        if len(unique) == len(keys):
            return keys, rows
        return unique.astype(keys.dtype), sum_by_inverse(rows, inverse, len(unique))
    unique, order, bounds = group(keys)
    return unique.astype(keys.dtype, copy=False), segment_sum(rows, order, bounds)
