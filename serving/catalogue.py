"""Exact top-K over a catalogue: every item scored, the best K kept per query.

The rows are held as one [C, D] float32 matrix, already in the form scores compare (an
int8 export's dequantized, L2-normalized for cosine similarity). A batch of queries is
scored chunk by chunk with one BLAS call each (`rows @ queries.T`, the layout BLAS is
fastest at for a few queries); a chunk's items above a query's k-th best so far are
merged into its top-K, so after a first small chunk only a few items a chunk are sorted.
Ties are ordered by catalogue order, so the result is deterministic.
"""

from __future__ import annotations

import numpy as np

CHUNK = 1 << 17  # catalogue rows scored at once
FIRST_CHUNK = 4096  # the first chunk's rows: every query's top-k of them is sorted


class ExactCatalogue:
    """The items [C] uint64 (ascending) and their rows [C, D] float32, as scores use them."""

    def __init__(self, items: np.ndarray, rows: np.ndarray):
        if len(items) != len(rows):
            raise ValueError(f"{len(items)} items but {len(rows)} rows")
        self.items = items
        self.rows = rows

    def __len__(self) -> int:
        return len(self.items)

    def top_k(
        self, queries: np.ndarray, k: int, exclude: list[np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(items [n, k] uint64, scores [n, k] float32): the best `k` catalogue items per
        query by score (ties: catalogue order), leaving out each row's `exclude` items (a
        row with fewer than k items left ends with scores of -inf).

        One BLAS call a chunk, which threads itself (chunks on threads of their own were
        slower on the 2-core VM, docs/benchmarks.md)."""
        n = len(queries)
        size = len(self.items)
        k = min(k, size)
        masked = _positions(self.items, exclude or [])
        best_scores = np.full((n, k), -np.inf, np.float32)
        best_index = np.full((n, k), size, np.int64)  # after every item: no item yet
        transposed = np.ascontiguousarray(queries.T, np.float32)  # items @ queries.T
        first = min(max(FIRST_CHUNK, k), size)
        threshold = np.full(n, -np.inf, np.float32)
        _merge(best_scores, best_index, *self._candidates(0, first, transposed, threshold, masked))
        bounds = [*range(first, size, CHUNK), size]
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            threshold = best_scores[:, -1]
            found = self._candidates(start, stop, transposed, threshold, masked)
            _merge(best_scores, best_index, *found)
        found = best_index < size
        items = self.items[np.where(found, best_index, 0)]
        return np.where(found, items, 0), best_scores

    def _candidates(self, start, stop, transposed, threshold, masked):
        """(catalogue index, row, score) of the items of [start, stop) above their row's
        threshold: the lowest threshold first (one contiguous comparison), then each row's."""
        n = transposed.shape[1]
        scores = self.rows[start:stop] @ transposed  # [items, rows]
        rows, at = masked
        inside = (at >= start) & (at < stop)
        scores[at[inside] - start, rows[inside]] = -np.inf
        flat = scores.reshape(-1)
        above = np.flatnonzero(flat > threshold.min())
        above = above[flat[above] > threshold[above % n]]
        item, row = np.divmod(above, n)
        return item + start, row, flat[above]


def _merge(best_scores, best_index, items, rows, scores) -> None:
    """Merges candidates (catalogue index, row, score) into each row's top-k (sorted by
    score, then catalogue order)."""
    if not len(rows):
        return
    k = best_scores.shape[1]
    by_row = np.argsort(rows, kind="stable")
    items, rows, scores = items[by_row], rows[by_row], scores[by_row]
    for part in np.split(np.arange(len(rows)), np.flatnonzero(np.diff(rows)) + 1):
        row = rows[part[0]]
        merged = np.concatenate([best_scores[row], scores[part]])
        index = np.concatenate([best_index[row], items[part]])
        order = np.lexsort((index, -merged))[:k]
        best_scores[row], best_index[row] = merged[order], index[order]


def _positions(catalogue: np.ndarray, exclude: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(row, catalogue position) of every excluded item that is in the catalogue."""
    if not exclude:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows = np.repeat(np.arange(len(exclude)), [len(e) for e in exclude])
    items = np.concatenate(exclude).astype(np.uint64) if len(rows) else np.zeros(0, np.uint64)
    position = np.minimum(np.searchsorted(catalogue, items), max(len(catalogue) - 1, 0))
    hit = catalogue[position] == items if len(catalogue) else np.zeros(len(items), bool)
    return rows[hit], position[hit]
