"""A collisionless, growable id -> slot map: open addressing, linear probing, numpy-vectorized.

Every operation probes all its ids at once, one vectorized round per probe step
(at load <= 0.5 nearly all ids finish in the first two rounds); there is no per-id
Python loop. Keys and slots sit side by side in one [capacity, 2] uint64 array so a
probe touches one cache line. Slots are stored plus one, so that an all-zero entry
(np.zeros: lazily backed, no initial write) is EMPTY and ends a probe chain;
TOMBSTONE marks a removed entry (skipped by lookups, dropped on the next rebuild).

Growing (doubling at 60% load) rehashes every id, which is too slow for the call
that crosses the threshold once the map holds millions of ids. So at 40% load the next
table is built on a background thread from the live entries while this one keeps
serving; inserts and removals made meanwhile are journaled, the build replays them as
it catches up, and the map switches to the new table at its first call after the build
is done, replaying only the changes made since. The build reads entries the owner may be
writing: a write fills an EMPTY entry (key, then slot) or sets a slot to TOMBSTONE, so a
torn read sees (key, EMPTY) or (0, slot). Both come from journaled ids, except that the
second could pose as id 0, which is why id 0 is never taken from the build but from
this table.

The probes run in native kernels (`embedding_store._native`, one C loop per call with
the GIL released, so a background build truly runs beside the owner) when the package
was installed with its extension; the numpy kernels below probe the same positions and
serve a source tree used without installing (or HYBRIDREC_NATIVE=0).
"""

from __future__ import annotations

import numpy as np
from hybridrec.embedding_store._arrays import native
from hybridrec.embedding_store._growth import Ahead
from hybridrec.embedding_store._hashing import SALT_SLOT, mix64, salt_offset
from hybridrec.embedding_store._pools import NATIVE_THREADS, ForkSafePool

EMPTY = np.uint64(0)
TOMBSTONE = np.uint64(0xFFFFFFFFFFFFFFFF)
_ONE = np.uint64(1)
_LIVE_LIMIT = np.uint64(0xFFFFFFFFFFFFFFFE)  # stored - 1 < this  <=>  live entry
BUILD_AT = 0.4  # load (entries used) at which the next table starts building
FIND_PART = 1 << 15  # a native lookup of at least twice this many ids is split over threads

_threads = ForkSafePool(NATIVE_THREADS, "slot-find")


class SlotMap:
    """Maps uint64 ids to int64 slots; not thread-safe (the owning table locks)."""

    def __init__(self, initial_capacity: int = 1024, max_load: float = 0.6):
        capacity = 1 << max(4, int(initial_capacity - 1).bit_length())
        self._max_load = max_load
        self._set_entries(np.zeros((capacity, 2), np.uint64))
        self._live = 0
        self._used = 0  # live + tombstones
        self._next: Ahead | None = None  # the next table, being built in the background
        self._journal: list[tuple[np.ndarray, np.ndarray | None]] = []

    def __len__(self) -> int:
        return self._live

    def _set_entries(self, entries: np.ndarray) -> None:
        self._entries = entries
        self._pairs = _pairs(entries)

    @property
    def nbytes(self) -> int:
        return self._entries.nbytes

    @staticmethod
    def bytes_for(rows: int) -> int:
        """The most bytes a map holding up to `rows` ids takes (the ceiling of `nbytes`)."""
        return 16 * _entries_for(rows, 16)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """ids: [n] uint64 -> [n] int64 slots, -1 where absent."""
        if native is not None:
            keys, result = _keys(ids), np.empty(len(ids), np.int64)
            # a large lookup in parts over threads (the kernel holds no GIL)
            _threads.in_parts(
                len(keys),
                max(1, min(NATIVE_THREADS, len(keys) // FIND_PART)),
                lambda lo, hi: native.slot_find(self._entries, keys[lo:hi], result[lo:hi], _OFFSET),
            )
            return result
        mask = np.uint64(len(self._entries) - 1)
        result = np.full(len(ids), -1, np.int64)
        position = (mix64(ids, SALT_SLOT) & mask).astype(np.intp)
        pending = np.arange(len(ids))
        keys = ids
        while len(pending):
            probe = _probe(self._pairs, position)
            slots = probe[:, 1] - _ONE  # EMPTY wraps to the maximum, TOMBSTONE to max - 1
            hit = (probe[:, 0] == keys) & (slots < _LIVE_LIMIT)
            if hit.any():
                result[pending[hit]] = slots[hit].astype(np.int64)
            go_on = ~hit & (probe[:, 1] != EMPTY)
            pending, keys = pending[go_on], keys[go_on]
            position = (position[go_on] + 1) & int(mask)
        return result

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Adds ids (unique and absent from the map) with their slots: [n] uint64, [n] int64."""
        if not len(ids):
            return
        if self._next is not None and self._next.done():
            self._take_over()
        if self._used + len(ids) > self._max_load * len(self._entries):
            if self._next is not None:
                self._take_over()  # waits for the build, unless it has not started
            if self._used + len(ids) > self._max_load * len(self._entries):
                self._rebuild(self._live + len(ids))
        elif self._next is None and self._used + len(ids) > BUILD_AT * len(self._entries):
            self._journal = []
            capacity = _entries_for(self._live + len(ids), len(self._entries))
            self._next = Ahead(_build, self._entries, capacity, self._journal)
        stored = slots.astype(np.uint64) + _ONE
        if self._next is not None:
            self._journal.append((ids.copy(), stored))
        _place(self._pairs, ids, stored)
        self._live += len(ids)
        self._used += len(ids)

    def remove(self, ids: np.ndarray) -> None:
        """Removes present ids: [n] uint64 (absent ones are ignored)."""
        if self._next is not None and self._next.done():
            self._take_over()
        if self._next is not None:
            self._journal.append((ids.copy(), None))
        self._live -= _remove(self._entries, self._pairs, ids)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All live (ids [n] uint64, slots [n] int64)."""
        live = self._entries[:, 1] - _ONE < _LIVE_LIMIT
        return self._entries[live, 0].copy(), (self._entries[live, 1] - _ONE).astype(np.int64)

    def _rebuild(self, live_needed: int) -> None:
        """Rehashes every live id into a table large enough for `live_needed` ids."""
        capacity = len(self._entries)
        while live_needed > self._max_load * capacity * 0.8:
            capacity *= 2
        ids, slots = self.items()
        self._set_entries(np.zeros((capacity, 2), np.uint64))
        self._used = self._live = len(ids)
        _place(self._pairs, ids, slots.astype(np.uint64) + _ONE)

    def _take_over(self) -> None:
        """Switches to the table built in the background (waiting for it if it is under
        way), replaying the changes it has not seen yet; drops it if it never started."""
        ahead, journal = self._next, self._journal
        self._next, self._journal = None, []
        built = ahead.take()
        if built is None:
            return
        entries, used, replayed = built
        zero = self.find(np.zeros(1, np.uint64))  # id 0 comes from here (see the module doc)
        self._set_entries(entries)
        self._used = used
        for change in [*journal[replayed:], (np.zeros(1, np.uint64), None)]:
            self._used += _replay(self._entries, self._pairs, change)
        if zero[0] >= 0:
            _place(self._pairs, np.zeros(1, np.uint64), zero.astype(np.uint64) + _ONE)
            self._used += 1


def _entries_for(live: int, size: int) -> int:
    """The size of the next table for `live` ids (at least `size`): load <= BUILD_AT / 1.25,
    so that ids keep arriving for a while before the next build starts."""
    while 1.25 * live > BUILD_AT * size:
        size *= 2
    return size


def _pairs(entries: np.ndarray) -> np.ndarray:
    # One 16-byte item per entry: gathering (key, slot) pairs this way is ~10x faster
    # than entries[position] on the 2-D array.
    return entries.view(np.dtype((np.void, 16))).reshape(-1)


def _probe(pairs: np.ndarray, position: np.ndarray) -> np.ndarray:
    return pairs[position].view(np.uint64).reshape(-1, 2)


_OFFSET = salt_offset(SALT_SLOT)


def _keys(ids: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ids, dtype=np.uint64)


def _place(pairs: np.ndarray, ids: np.ndarray, slots: np.ndarray) -> None:
    """ids [n] (unique, absent) with their stored slot values (slot + 1) [n] uint64."""
    if native is not None:
        native.slot_place(pairs, _keys(ids), _keys(slots), _OFFSET)
        return
    mask = len(pairs) - 1
    position = (mix64(ids, SALT_SLOT) & np.uint64(mask)).astype(np.intp)
    while len(ids):
        free = _probe(pairs, position)[:, 1] == EMPTY
        where = position[free]
        # Several ids may race for one empty entry: the last write wins, the rest probe on.
        written = np.stack([ids[free], slots[free]], axis=1)
        pairs[where] = written.view(pairs.dtype).reshape(-1)
        placed = np.zeros(len(ids), bool)
        placed[np.flatnonzero(free)[_probe(pairs, where)[:, 1] == slots[free]]] = True
        keep = ~placed
        ids, slots = ids[keep], slots[keep]
        position = (position[keep] + 1) & mask


def _remove(entries: np.ndarray, pairs: np.ndarray, ids: np.ndarray) -> int:
    """Tombstones the first live entry of each of `ids` [n] uint64; how many there were."""
    if native is not None:
        return native.slot_remove(entries, _keys(ids), _OFFSET)
    mask = len(entries) - 1
    position = (mix64(ids, SALT_SLOT) & np.uint64(mask)).astype(np.intp)
    keys = ids
    removed = 0
    while len(keys):
        probe = _probe(pairs, position)
        hit = (probe[:, 0] == keys) & (probe[:, 1] - _ONE < _LIVE_LIMIT)
        if hit.any():
            entries[position[hit], 1] = TOMBSTONE
            removed += int(hit.sum())
        go_on = ~hit & (probe[:, 1] != EMPTY)
        keys, position = keys[go_on], (position[go_on] + 1) & mask
    return removed


def _replay(entries: np.ndarray, pairs: np.ndarray, change) -> int:
    """Applies one journaled change (ids, stored slots or None for a removal); entries used."""
    ids, stored = change
    while _remove(entries, pairs, ids):  # a torn read may have added an id twice
        pass
    if stored is None:
        return 0
    _place(pairs, ids, stored)
    return len(ids)


def _build(entries: np.ndarray, capacity: int, journal: list) -> tuple[np.ndarray, int, int]:
    """A table of `capacity` entries with the live entries of `entries` (but id 0), then
    the changes of `journal` made since: (table, entries used, changes replayed).

    Runs on the background thread while the owner writes `entries` and appends to `journal`.
    """
    live = entries[entries[:, 1] - _ONE < _LIVE_LIMIT]
    live = live[(live[:, 0] != 0) & (live[:, 1] - _ONE < _LIVE_LIMIT)]  # torn reads
    table = np.zeros((capacity, 2), np.uint64)
    table[:] = 0  # page the whole table in here, not on the owner's thread
    pairs = _pairs(table)
    _place(pairs, live[:, 0].copy(), live[:, 1].copy())
    used, replayed = len(live), 0
    while replayed < len(journal):  # catch up, so that the owner replays only the last few
        used += _replay(table, pairs, journal[replayed])
        replayed += 1
    return table, used, replayed
