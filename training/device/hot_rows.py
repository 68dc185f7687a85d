"""Which rows a hot-row cache on the devices holds: admission by access frequency.

A cache (`model.device_tables.DeviceTable.cache`) holds up to `capacity` rows of a host
table. `HotRows` decides, batch by batch, which of the batch's ids not yet held come in
and which held rows leave for them (TinyLFU's rule):

- Every id's accesses are counted in a count-min sketch (`depth` rows of 2**`width_bits`
  counters; an estimate is the smallest of its counters, never below the true count).
  The counts halve every `period` accesses, so the cache follows a drifting hot set.
- While the cache has free rows, every id of a batch comes in.
- When it is full, a candidate comes in only if it has been seen more often than the
  least used held row not in this batch, which leaves for it: the most frequent
  candidates meet the least used rows first. A cache of `EXACT_BELOW` rows or more looks
  for its least used rows in a sample of them, drawn each batch, `SAMPLE` rows for each
  candidate that may come in (as HierarchicalKV evicts the lowest score of a key's
  bucket rather than of the whole table): finding them among all rows took a pass over
  the cache per batch, 0.84 s a batch at 4M rows (`scripts/bench_hot_rows.py`).
- An id evicted in the last `cooldown` batches is not admitted again: its value, written
  back to the host store after that batch's step, may not have landed yet when a later
  batch's rows are read (the staleness bound k).

Everything here is host numpy, run in step order on every process alike (the samples
from a generator of fixed seed), so every process of a job makes the same choices.
"""

from __future__ import annotations

import collections

import numpy as np
from hybridrec.embedding_store import SlotMap
from hybridrec.pipeline.hashing import splitmix64

DEPTH = 4
EXACT_BELOW = 1 << 16  # caches of fewer rows compare all of them for eviction
SAMPLE = 8  # larger caches: rows sampled per candidate that may come in
MIN_SAMPLE = 512  # candidates the first sample is drawn for
SAMPLE_SEED = 0x5A3E
SALTS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)


class HotRows:
    """Admission and eviction for one cache.

    Args:
        capacity: rows the cache holds.
        cooldown: batches an evicted id waits before it may come back (the staleness k).
        width_bits: log2 of the sketch's counters per row (default: room for ~8x the
            capacity, at least 2**16).
        period: accesses between two halvings of every count (default: 10x the capacity).
        exact_below: caches of fewer rows compare every row for eviction; larger ones a
            sample (default `EXACT_BELOW`; 0: always a sample).
    """

    def __init__(
        self,
        capacity: int,
        *,
        cooldown: int = 0,
        width_bits: int = 0,
        period: int = 0,
        exact_below: int | None = None,
    ):
        self.capacity = capacity
        self.cooldown = cooldown
        bits = width_bits or max(16, int(8 * capacity - 1).bit_length())
        self._mask = np.uint64((1 << bits) - 1)
        self._sketch = np.zeros((DEPTH, 1 << bits), np.uint32)
        self._period = period or 10 * capacity
        self._since_halving = 0
        self.counts = np.zeros(capacity, np.float64)  # per held row: its estimate when last seen
        self.used = 0  # rows [0, used) have been given out; rows are never returned
        self._exact_below = EXACT_BELOW if exact_below is None else exact_below
        self._rng = np.random.default_rng(SAMPLE_SEED)  # the same draws on every process
        self._busy = np.zeros(capacity, bool)  # rows of the batch being chosen for
        self._recent: collections.deque = collections.deque()  # the last batches' evictions
        self._cooling = SlotMap(1 << 10)  # ... and a map of their ids (any row: a set)

    def seen(self, ids: np.ndarray, occurrences: np.ndarray) -> np.ndarray:
        """Counts one batch's distinct `ids` (each `occurrences` times); their estimates."""
        columns = [
            (splitmix64(ids ^ np.uint64(salt)) & self._mask).astype(np.int64) for salt in SALTS
        ]
        for row, column in enumerate(columns):
            np.add.at(self._sketch[row], column, occurrences.astype(np.uint32))
        estimate = np.min([self._sketch[row][c] for row, c in enumerate(columns)], axis=0)
        self._since_halving += int(occurrences.sum())
        if self._since_halving >= self._period:
            self._sketch >>= 1
            self.counts /= 2
            self._since_halving = 0
        return estimate.astype(np.float64)

    def choose(
        self, ids: np.ndarray, estimate: np.ndarray, slots: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(positions in `ids` of those admitted, the rows they take), for a batch's
        distinct `ids` with their estimates and held rows (`slots`, -1: not held).

        The rows taken are free ones first, then rows evicted for them; the caller reads
        the evicted rows' ids before it reuses them.
        """
        held = slots >= 0
        self.counts[slots[held]] = estimate[held]
        candidates = np.flatnonzero(~held)
        if len(self._cooling) and len(candidates):
            candidates = candidates[self._cooling.find(ids[candidates]) < 0]
        free = min(self.capacity - self.used, len(candidates))
        if free:  # the most frequent take the free rows
            candidates = candidates[np.argsort(-estimate[candidates], kind="stable")]
        rows = np.arange(self.used, self.used + free, dtype=np.int64)
        self.used += free
        victims = rest = np.zeros(0, np.int64)
        if len(candidates) > free:  # full: the others compete for rows held before
            busy = np.concatenate([slots[held], rows])  # the batch's rows stay
            victims, rest = self._evict(estimate, candidates[free:], busy)
        admitted = np.concatenate([candidates[:free], rest])
        taken = np.concatenate([rows, victims])
        self.counts[taken] = estimate[admitted]
        return admitted, taken

    def _evict(
        self, estimate: np.ndarray, candidates: np.ndarray, busy: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rows evicted, the candidates admitted into them, in that order) of a full
        cache: the most frequent candidates meet the least used rows not `busy` (this
        batch's) first, each coming in while it was seen more often than its row.

        A cache of fewer than `exact_below` rows compares every row (ties: the lower row
        leaves first). A larger one looks for its least used rows in a sample, `SAMPLE`
        rows per contender (a candidate seen more often than the least used row of a
        first, small sample), drawn anew each batch: its cost follows the batch, not the
        cache."""
        self._busy[busy] = True
        try:
            look, every_row = self._rows_to_compare(SAMPLE * MIN_SAMPLE)
            if not every_row:
                lowest = self.counts[look].min(initial=np.inf)
                contenders = np.count_nonzero(estimate[candidates] > lowest)
                if not contenders:  # none beats even the least used row sampled
                    return np.zeros(0, np.int64), np.zeros(0, np.int64)
                look, _ = self._rows_to_compare(SAMPLE * contenders)
            counts = self.counts[look]
            order = np.argsort(counts, kind="stable")
            look, counts = look[order], counts[order]
            # only a candidate seen more often than some row it could take competes
            lowest = counts[0] if len(counts) else np.inf
            contenders = candidates[estimate[candidates] > lowest]
            contenders = contenders[np.argsort(-estimate[contenders], kind="stable")]
            pairs = min(len(contenders), len(look))
            wins = estimate[contenders[:pairs]] > counts[:pairs]
            n = int(np.argmin(wins)) if not wins.all() else pairs
            return look[:n], contenders[:n]
        finally:
            self._busy[busy] = False

    def _rows_to_compare(self, size: int) -> tuple[np.ndarray, bool]:
        """(rows not busy, ascending, whether they are all of them): every row in a cache
        of fewer than `exact_below` rows or where `size` draws would be half as many
        (sorting the draws would cost more than every row's counts), else those of a
        sample of `size` draws."""
        every_row = self.capacity < self._exact_below or 2 * size >= self.capacity
        if every_row:
            look = np.arange(self.capacity)
        else:
            look = np.unique(self._rng.integers(0, self.capacity, max(size, 1)))
        return look[~self._busy[look]], every_row

    def evicted(self, ids: np.ndarray) -> None:
        """Records the ids the last `choose` evicted (kept out for `cooldown` batches)."""
        if not self.cooldown:
            return
        if len(self._recent) == self.cooldown:  # the oldest batch's wait is over
            self._cooling.remove(self._recent.popleft())
        ids = np.asarray(ids, np.uint64)
        self._recent.append(ids)
        self._cooling.insert(ids, np.zeros(len(ids), np.int64))
