"""Exact top-K over a catalogue: every item scored, the best K kept per query.

The rows are held as one [C, D] float32 matrix, already in the form scores compare (an
int8 export's dequantized, L2-normalized for cosine similarity). Ties are ordered by
catalogue order, so the result is deterministic.

With the native kernel built (`serving/_scan.c`) and a CPU with AVX-512 VNNI, the rows are
also held as 8-bit codes with per-row bounds on their error, a quarter of the bytes a scan
reads. The scan has two stages: every item's score is bounded from its codes with integer
dot products (the queries rounded to int8, that rounding bounded too), on every core, and
only the items whose upper bound reaches the k-th best lower bound (a few hundred a query)
are scored from the float32 rows. The bounds are rigorous, so the result is the exact
top-K of the float32 rows, as the one-stage scan finds it.

Elsewhere a batch of queries is scored chunk by chunk with one BLAS call each
(`rows @ queries.T`); a chunk's items above a query's k-th best so far are merged into its
top-K.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hybridrec.serving.quantize import quantize_rows


def _load_native():
    """The compiled first stage (a C module that imports nothing of this package), or None
    in a source tree without the built extension (see setup.py) or with HYBRIDREC_NATIVE=0."""
    if os.environ.get("HYBRIDREC_NATIVE", "1") == "0":
        return None
    try:
        return importlib.import_module("hybridrec.serving._scan")
    except ImportError:
        return None


_scan = _load_native()

CHUNK = 1 << 17  # catalogue rows scored at once
FIRST_CHUNK = 4096  # the first chunk's rows: every query's top-k of them is sorted
CODE_CHUNK = 1 << 16  # rows quantized at once when the codes are built
_LEVELS = 255  # the codes' largest value
_CANDIDATE = np.dtype([("row", "<i8"), ("query", "<i4"), ("upper", "<f4")])
_THREADS = max(1, min(os.cpu_count() or 1, 8))
_pool: ThreadPoolExecutor | None = None


class ExactCatalogue:
    """The items [C] uint64 (ascending) and their rows [C, D] float32, as scores use them:
    given whole (`rows`), or read through a function of catalogue positions
    (`read_rows(index [m]) -> [m, D]`, with `dim`). The two-stage scan reads them in chunks
    at start-up to build its codes, then only its candidates' rows: it never holds the
    float32 matrix. The one-stage scan holds it."""

    def __init__(
        self,
        items: np.ndarray,
        rows: np.ndarray | None = None,
        *,
        read_rows: Callable[[np.ndarray], np.ndarray] | None = None,
        dim: int | None = None,
        native: bool | None = None,
    ):
        """`native`: the two-stage scan (None: where the kernel is built and the CPU has
        AVX-512 VNNI; its portable kernel is slower than the one-stage BLAS scan)."""
        if (rows is None) == (read_rows is None):
            raise ValueError("give the catalogue's rows or a read_rows function, not both")
        if rows is not None:
            if len(items) != len(rows):
                raise ValueError(f"{len(items)} items but {len(rows)} rows")
            rows = np.ascontiguousarray(rows, np.float32)
            read_rows, dim = rows.__getitem__, rows.shape[1]
        if native and _scan is None:
            raise RuntimeError("the native scan (hybridrec.serving._scan) is not built")
        if native is None:
            native = _scan is not None and _scan.kernel() == "avx512-vnni"
        self.items, self.read_rows, self.dim = items, read_rows, int(dim)
        self.codes = BoundedCodes(len(items), self.dim, read_rows) if native else None
        if not native and rows is None:
            rows = np.empty((len(items), self.dim), np.float32)
            for start in range(0, len(items), CODE_CHUNK):
                rows[start : start + CODE_CHUNK] = read_rows(np.arange(start, min(start + CODE_CHUNK, len(items))))  # fmt: skip
        self.rows = rows  # None for a two-stage scan given read_rows

    def __len__(self) -> int:
        return len(self.items)

    def top_k(
        self, queries: np.ndarray, k: int, exclude: list[np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(items [n, k] uint64, scores [n, k] float32): the best `k` catalogue items per
        query by score (ties: catalogue order), leaving out each row's `exclude` items (a
        row with fewer than k items left ends with scores of -inf).

        The two-stage scan bounds every score on a thread per core, then scores its
        candidates; the one-stage scan makes one BLAS call a chunk, which threads itself
        (chunks on threads of their own were slower on the 2-core VM, docs/benchmarks.md)."""
        queries = np.ascontiguousarray(queries, np.float32)
        if not len(queries):
            k = max(min(k, len(self.items)), 0)
            return np.zeros((0, k), np.uint64), np.zeros((0, k), np.float32)
        masked = _positions(self.items, exclude or [])
        if self.codes is not None and len(self.items) and k > 0:
            return self._two_stage(queries, min(k, len(self.items)), masked)
        return self._one_stage(queries, k, masked)

    def _two_stage(self, queries, k, masked):
        n, size = len(queries), len(self.items)
        rows, query = self.codes.candidates(queries, k, masked)
        scores = np.einsum("md,md->m", self.read_rows(rows), queries[query])
        order = np.lexsort((rows, -scores, query))
        rows, query, scores = rows[order], query[order], scores[order]
        rank = np.arange(len(query)) - np.searchsorted(query, query)
        kept = rank < k
        best_scores = np.full((n, k), -np.inf, np.float32)
        best_index = np.full((n, k), size, np.int64)
        best_scores[query[kept], rank[kept]] = scores[kept]
        best_index[query[kept], rank[kept]] = rows[kept]
        return self._items_of(best_index), best_scores

    def _items_of(self, best_index):
        found = best_index < len(self.items)
        return np.where(found, self.items[np.where(found, best_index, 0)], 0)

    def _one_stage(self, queries, k, masked):
        n = len(queries)
        size = len(self.items)
        k = min(k, size)
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
        return self._items_of(best_index), best_scores

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


class BoundedCodes:
    """A catalogue's rows [C, D] as 8-bit codes in blocks for the native scan, with the
    terms that bound each score computed from them (serving/_scan.c): row i is about
    `scale[i] * codes + offset[i]`, within `error[i]` of each value; `rounding[i]` covers
    float rounding in either stage, `spread[i]` the rounding of the queries to int8.

    `portable`: the portable integer kernel even where AVX-512 VNNI is there (the same
    integers, slower)."""

    def __init__(
        self,
        size: int,
        dim: int,
        read_rows: Callable[[np.ndarray], np.ndarray],
        *,
        portable: bool = False,
    ):
        """The codes of rows [size, dim] read chunk by chunk through `read_rows`."""
        block, group = _scan.BLOCK, _scan.GROUP
        self.size, self.dim, self.portable = size, dim, portable
        self.blocks, self.groups = -(-size // block), -(-dim // group)
        padded = self.blocks * block
        codes = np.zeros((padded, self.groups * group), np.uint8)
        self.terms = np.zeros((5, padded), np.float32)  # scale, offset, error, rounding, spread
        rounding = (dim + 8) * 2.0**-23  # a D-term float32 dot product's, with room to spare
        for start in range(0, size, CODE_CHUNK):
            stop = min(start + CODE_CHUNK, size)
            part = np.asarray(read_rows(np.arange(start, stop)), np.float32)
            level, scale_offset = quantize_rows(part, np.float32)
            codes[start:stop, :dim] = level
            scale, offset = scale_offset[:, 0], scale_offset[:, 1]
            part, level = part.astype(np.float64), level.astype(np.float64)
            approx = level * scale.astype(np.float64)[:, None] + offset.astype(np.float64)[:, None]
            error = np.abs(part - approx).max(axis=1)  # measured: the bound holds as coded
            largest = np.abs(part).max(axis=1)
            magnitude = rounding * (_LEVELS * scale + np.abs(offset) + largest)
            spread = scale * np.abs(level - 128).sum(axis=1)
            terms = np.stack([scale, offset, *_up([error, magnitude, spread])])
            self.terms[:, start:stop] = terms
        # [blocks, groups, block, group]: a row's four dimensions side by side
        shape = (self.blocks, block, self.groups, group)
        self.codes = np.ascontiguousarray(codes.reshape(shape).transpose(0, 2, 1, 3))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.terms.nbytes

    def _queries(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes [n, groups * 4], terms [n, 7]): each query as `step * codes + rho`."""
        q = queries.astype(np.float64)
        step = (np.abs(q).max(axis=1) / 127).astype(np.float32)
        step[step == 0] = 1.0
        step64 = step.astype(np.float64)[:, None]
        levels = np.clip(np.rint(q / step64), -127, 127)
        rho = q - levels * step64  # exact: a float32 times a small integer, in float64
        codes = np.zeros((len(q), self.groups * _scan.GROUP), np.int8)
        codes[:, : self.dim] = levels
        absolute = np.abs(q).sum(axis=1)
        magnitude = step64[:, 0] * np.abs(levels).sum(axis=1) + 128 * np.abs(rho.sum(axis=1))
        terms = np.stack(
            [
                step,
                128 * rho.sum(axis=1),
                q.sum(axis=1),
                *_up([absolute, magnitude + absolute, np.abs(rho).max(axis=1)]),
                np.zeros(len(q)),
            ],
            axis=1,
        )
        return codes, np.ascontiguousarray(terms, np.float32)

    def candidates(self, queries, k, masked) -> tuple[np.ndarray, np.ndarray]:
        """(row [m], query [m]): every (row, query) whose upper bound reaches the query's
        k-th best lower bound, the excluded left out (in no particular order); the row
        ranges of the catalogue scanned on threads of their own."""
        n = len(queries)
        codes, terms = self._queries(queries)
        query_of, position = masked
        order = np.lexsort((position, query_of))
        excluded = np.ascontiguousarray(position[order], np.int64)
        starts = np.searchsorted(query_of[order], np.arange(n + 1)).astype(np.int64)
        parts = max(1, min(_THREADS, self.blocks // 16))
        bounds = np.linspace(0, self.blocks, parts + 1).astype(int)
        heaps = [np.full((n, k), -np.inf, np.float32) for _ in range(parts)]

        def scan(part: int) -> bytes:
            return _scan.scan(
                self.codes, self.terms, codes, terms, heaps[part], excluded, starts,
                self.groups, k, int(bounds[part]), int(bounds[part + 1]), self.size,
                self.portable,
            )  # fmt: skip

        found = list(_threads().map(scan, range(parts))) if parts > 1 else [scan(0)]
        records = np.frombuffer(b"".join(found), _CANDIDATE)
        lowers = np.concatenate(heaps, axis=1)
        threshold = np.partition(lowers, lowers.shape[1] - k, axis=1)[:, -k]
        kept = records[records["upper"] >= threshold[records["query"]]]
        return kept["row"].astype(np.int64), kept["query"].astype(np.int64)


def _up(values: list[np.ndarray]) -> list[np.ndarray]:
    """Non-negative float64 terms as float32, rounded up with room to spare."""
    return [(np.asarray(v, np.float64) * (1 + 2.0**-20)).astype(np.float32) for v in values]


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="catalogue-scan")
    return _pool
