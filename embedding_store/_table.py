"""One table's rows on one shard: slot map, row storage, admission, eviction, optimizer.

All mutations happen under the table's lock; the numpy work inside releases the GIL
for large arrays, so other tables and shards proceed in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import tensorstore as ts
from hybridrec.common import sparse_rules
from hybridrec.embedding_store import _optimizers
from hybridrec.embedding_store._arrays import sum_duplicates, unique_counts
from hybridrec.embedding_store._growth import PREPARE_AT, Spare
from hybridrec.embedding_store._hashing import SALT_ADMIT, mix64, unit_float
from hybridrec.embedding_store._initializers import initial_rows
from hybridrec.embedding_store._slot_map import SlotMap
from hybridrec.embedding_store._storage import RamRows, TieredRows
from hybridrec.embedding_store.checkpoint import RowBlock
from hybridrec.embedding_store.config import TableConfig
from hybridrec.embedding_store.errors import EmbeddingStoreError, InvalidInputError


class _Counters:
    """Sightings of not-yet-admitted ids (growable, vectorized)."""

    def __init__(self):
        self._map = SlotMap(1024)
        self._counts = np.zeros(1024, np.int64)
        self._ids = np.zeros(1024, np.uint64)
        self._next = 0
        self._free = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self._map)

    def add(self, ids: np.ndarray, increments: np.ndarray) -> np.ndarray:
        """ids: [u] unique uint64; returns their total sightings [u] int64."""
        index = self._map.find(ids)
        new = index < 0
        if new.any():
            index[new] = self._allocate(int(new.sum()))
            self._map.insert(ids[new], index[new])
            self._ids[index[new]] = ids[new]
            self._counts[index[new]] = 0
        self._counts[index] += increments
        return self._counts[index]

    def remove(self, ids: np.ndarray) -> None:
        index = self._map.find(ids)
        index = index[index >= 0]
        self._map.remove(self._ids[index])
        self._free = np.concatenate([self._free, index])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        ids, index = self._map.items()
        return ids, self._counts[index]

    def _allocate(self, count: int) -> np.ndarray:
        reuse = self._free[:count]
        self._free = self._free[count:]
        fresh = np.arange(self._next, self._next + count - len(reuse), dtype=np.int64)
        self._next += len(fresh)
        if self._next > len(self._counts):
            size = max(self._next, 2 * len(self._counts))
            self._counts = np.resize(self._counts, size)
            self._ids = np.resize(self._ids, size)
        return np.concatenate([reuse, fresh])

    @property
    def nbytes(self) -> int:
        return self._map.nbytes + self._counts.nbytes + self._ids.nbytes


# Slots a table starts with; its arrays and slot map then double as rows arrive, up to
# capacity, so memory follows the rows held (each doubling copies once: amortized O(1)).
INITIAL_SLOTS = 1024
# Bytes of per-slot metadata: id (8), live flag (1), last access step (4), last change (8).
_METADATA_BYTES = 21
_SLOT_ARRAYS = ("_slot_ids", "_live", "_last_step", "_modified")


class ShardTable:
    """Rows of `config` owned by one shard (at most `config.shard_capacity(num_shards)`)."""

    def __init__(
        self,
        config: TableConfig,
        *,
        shard_index: int,
        num_shards: int,
        context: ts.Context,
    ):
        self.config = config
        self.capacity = config.shard_capacity(num_shards)
        self._state_width = config.optimizer.state_width(config.dim)
        self._lock = threading.RLock()
        initial = min(self.capacity, INITIAL_SLOTS)
        self._map = SlotMap(initial)
        if config.tiering.enabled:
            location = config.tiering.path
            if location:
                location = f"{location.rstrip('/')}/{config.name}/shard-{shard_index:05d}"
            self._rows = TieredRows(
                config.dim,
                self._state_width,
                config.storage_dtype,
                ram_rows=config.shard_ram_rows(num_shards),
                max_slots=self.capacity,
                location=location,
                chunk_rows=config.tiering.chunk_rows,
                evict_fraction=config.tiering.evict_fraction,
                context=context,
            )
        else:
            self._rows = RamRows(config.dim, self._state_width, config.storage_dtype, initial)
        self._rows.reserve(initial)
        self._slot_ids = np.zeros(initial, np.uint64)
        self._live = np.zeros(initial, bool)
        self._last_step = np.zeros(initial, np.int32)  # training step of the last access
        self._modified = np.zeros(initial, np.int64)  # sequence number of the last change
        self._spares = {name: Spare() for name in _SLOT_ARRAYS}
        self._high_water = 0
        self._free = np.zeros(0, np.int64)
        self._counters = _Counters()
        self._step = 0
        self._last_sweep = 0
        self._sequence = 1
        self._committed = 0  # rows modified after this sequence are not in the last checkpoint
        self._deleted: list[tuple[int, np.ndarray]] = []
        self._stats = dict.fromkeys(
            (
                "lookups",
                "hits",
                "misses",
                "admitted",
                "rejected",
                "capacity_rejected",
                "evicted_lru",
                "evicted_ttl",
                "updates",
                "updates_unadmitted",
                "nonfinite_skipped",
            ),
            0,
        )

    # ----------------------------------------------------------------- reads / writes

    def lookup(self, ids: np.ndarray, *, train: bool = True) -> np.ndarray:
        """ids: [n] uint64 -> [n, dim] float32; unadmitted ids read as zeros."""
        config = self.config
        with self._lock:
            slots = self._map.find(ids)
            missing = slots < 0
            if missing.any() and train:
                slots[missing] = self._admit(ids[missing], protect=slots[~missing])
            hit = slots >= 0
            stats = self._stats
            stats["lookups"] += len(ids)
            hits = int(np.count_nonzero(~missing))
            stats["hits"] += hits
            stats["misses"] += len(ids) - hits
            if hit.all():
                return self._rows.gather(slots)
            stats["rejected"] += int(np.count_nonzero(~hit)) if train else 0
            out = np.zeros((len(ids), config.dim), np.float32)
            present = slots[hit]
            out[hit] = self._rows.gather(present)
            if not train and config.admission.admits_all:
                # Evaluation never creates rows; an id training would admit reads its initial value.
                out[~hit] = initial_rows(
                    config.initializer, ids[~hit], config.dim, config.first_column
                )
            return out

    def apply_gradients(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """ids: [n] uint64, grads: [n, dim] float32; duplicates summed; non-finite rows skipped.

        Gradients of a repeated id are summed in call order, so the result is the same
        bits however the ids were spread over shards.
        """
        with self._lock:
            slots = self._map.find(ids)
            missing = slots < 0
            if missing.any():
                if self.config.admission.admits_all:
                    # The row was evicted (or never looked up); admit it as a lookup would.
                    slots[missing] = self._admit(ids[missing], protect=slots[~missing])
                present = slots >= 0
                if not present.all():
                    unadmitted = np.unique(ids[~present])
                    self._stats["updates_unadmitted"] += len(unadmitted)
                    slots, grads = slots[present], grads[present]
            slots, grads = sum_duplicates(slots, grads)
            lines = self._rows.lines(slots)
            skipped = _optimizers.apply_in_place(
                self.config.optimizer, self._rows.values, self._rows.state, lines, grads
            )
            self._stats["nonfinite_skipped"] += skipped
            self._rows.mark_dirty(lines)  # (a skipped row is written back unchanged)
            self._modified[slots] = self._sequence
            self._last_step[slots] = self._step
            self._stats["updates"] += len(slots) - skipped

    def write_rows(self, ids: np.ndarray, values: np.ndarray, state: np.ndarray) -> None:
        """Sets rows (unique ids [n], values [n, dim], optimizer state [n, width]), creating
        the ids not held; they count as changed (the next incremental snapshot has them).

        Rows held elsewhere (a device table, `training.device.held_rows`) come back this way.
        """
        with self._lock:
            slots = self._map.find(ids)
            new = slots < 0
            if new.any():
                fresh = self._allocate(int(new.sum()), slots[~new])
                if len(fresh) < int(new.sum()):
                    raise EmbeddingStoreError(
                        f"table {self.config.name!r}: no room for {int(new.sum())} rows written "
                        f"back ({len(self._map):,} of {self.capacity:,} held); raise its capacity"
                    )
                self._map.insert(ids[new], fresh)
                self._slot_ids[fresh] = ids[new]
                self._live[fresh] = True
                slots[new] = fresh
            self._rows.write_rows(slots, values, state)
            self._last_step[slots] = self._step
            self._modified[slots] = self._sequence

    def take_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values [n, dim], state [n, width]) of unique ids [n], creating those not held
        as a training lookup would: rows a device cache takes over (`training.device.held_rows`)."""
        with self._lock:
            slots = self._map.find(ids)
            missing = slots < 0
            if missing.any():
                slots[missing] = self._admit(ids[missing], protect=slots[~missing])
                if (slots < 0).any():
                    raise EmbeddingStoreError(
                        f"table {self.config.name!r}: no room for {int(missing.sum())} rows "
                        f"({len(self._map):,} of {self.capacity:,} held); raise its capacity"
                    )
            values, state = self._rows.read_rows(slots)
            self._last_step[slots] = self._step
            return values.astype(np.float32, copy=False), state

    def read_rows(
        self, prefixes: Sequence[int] | None = None, prefix_bits: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, values, state) of the held rows: all, or with `prefixes` those whose id's
        top `prefix_bits` bits (1 to 63) are one of them."""
        if prefixes is not None and not 0 < prefix_bits < 64:
            raise InvalidInputError(f"prefix_bits must be in [1, 63], got {prefix_bits}")
        with self._lock:
            slots = np.flatnonzero(self._live[: self._high_water])
            ids = self._slot_ids[slots]
            if prefixes is not None:
                wanted = np.asarray(prefixes, np.uint64)
                picked = np.isin(ids >> np.uint64(64 - prefix_bits), wanted)
                slots, ids = slots[picked], ids[picked]
            ids = ids.copy()
            values, state = self._rows.read_rows(slots)
            return ids, values.astype(np.float32, copy=False), state

    # ----------------------------------------------------------------- admission / eviction

    def _admit(self, ids: np.ndarray, protect: np.ndarray) -> np.ndarray:
        """Missing ids [n] (may repeat) -> slots [n], -1 where not admitted."""
        unique, counts = unique_counts(ids)
        admission = self.config.admission
        if admission.admits_all:
            chosen = np.ones(len(unique), bool)
        else:
            totals = self._counters.add(unique, counts)
            chosen = totals >= admission.min_count
            if admission.probability < 1.0:
                draw = mix64(unique ^ totals.astype(np.uint64), SALT_ADMIT + admission.seed)
                chosen &= unit_float(draw) < admission.probability
        admitted = np.flatnonzero(chosen)
        new_slots = self._allocate(len(admitted), protect)
        admitted = admitted[: len(new_slots)]
        self._stats["capacity_rejected"] += int(np.count_nonzero(chosen)) - len(admitted)
        if not len(admitted):
            return np.full(len(ids), -1, np.int64)
        new_ids = unique[admitted]
        self._create_rows(new_ids, new_slots)
        if not admission.admits_all:
            self._counters.remove(new_ids)
        self._stats["admitted"] += len(admitted)
        return self._map.find(ids)

    def _create_rows(self, ids: np.ndarray, slots: np.ndarray) -> None:
        config = self.config
        self._map.insert(ids, slots)
        self._slot_ids[slots] = ids
        self._live[slots] = True
        self._last_step[slots] = self._step
        self._modified[slots] = self._sequence
        self._rows.write_rows(
            slots,
            initial_rows(config.initializer, ids, config.dim, config.first_column),
            sparse_rules.initial_state(config.optimizer, len(ids), config.dim),
        )

    def _allocate(self, count: int, protect: np.ndarray) -> np.ndarray:
        """Up to `count` free slots, evicting least-recently-used rows when the shard is full."""
        room = self.capacity - len(self._map)
        if room < count and self.config.eviction.policy == "lru":
            batch = int(self.capacity * self.config.eviction.lru_batch_fraction)
            self._evict_lru(max(count - room, batch), protect)
            room = self.capacity - len(self._map)
        count = max(0, min(count, room))
        reuse = self._free[:count]
        self._free = self._free[count:]
        fresh = np.arange(self._high_water, self._high_water + count - len(reuse), dtype=np.int64)
        self._high_water += len(fresh)
        size = len(self._slot_ids)
        if self._high_water > size:
            self._grow(max(self._high_water, min(2 * size, self.capacity)))
        elif self._high_water >= PREPARE_AT * size and size < self.capacity:
            self._prepare(min(2 * size, self.capacity))
        return np.concatenate([reuse, fresh])

    def _prepare(self, size: int) -> None:
        """Starts allocating the slot arrays' next size in the background."""
        for name in _SLOT_ARRAYS:
            self._spares[name].prepare(getattr(self, name), size)
        self._rows.prepare(size)

    def _grow(self, size: int) -> None:
        """Grows the slot arrays to `size` slots, keeping their contents."""
        for name in _SLOT_ARRAYS:
            setattr(self, name, self._spares[name].grow(getattr(self, name), size))
        self._rows.reserve(size)

    def _evict_lru(self, count: int, protect: np.ndarray) -> None:
        live = np.flatnonzero(self._live[: self._high_water])
        age = self._last_step[live].astype(np.int64)
        protected = np.isin(live, protect)
        age[protected] = np.iinfo(np.int64).max
        count = min(count, len(live) - int(protected.sum()))
        if count <= 0:
            return
        victims = live[np.argpartition(age, count - 1)[:count]]
        self._drop(victims)
        self._stats["evicted_lru"] += len(victims)

    def _drop(self, slots: np.ndarray) -> None:
        ids = self._slot_ids[slots]
        self._map.remove(ids)
        self._rows.release(slots)
        self._live[slots] = False
        self._free = np.concatenate([self._free, slots])
        self._deleted.append((self._sequence, ids))

    def set_step(self, step: int) -> None:
        with self._lock:
            self._step = step
            ttl = self.config.eviction.ttl_steps
            if ttl and step - self._last_sweep >= self.config.eviction.sweep_interval:
                self._last_sweep = step
                live = np.flatnonzero(self._live[: self._high_water])
                expired = live[step - self._last_step[live] > ttl]
                if len(expired):
                    self._drop(expired)
                    self._stats["evicted_ttl"] += len(expired)

    # ----------------------------------------------------------------- snapshots

    def snapshot(self, *, full: bool) -> tuple[RowBlock, int]:
        """Rows changed since the last committed snapshot (all rows if `full`) + capture mark."""
        with self._lock:
            live = self._live[: self._high_water]
            if not full:
                live = live & (self._modified[: self._high_water] > self._committed)
            slots = np.flatnonzero(live)
            values, state = self._rows.read_rows(slots)
            deleted = [ids for sequence, ids in self._deleted if sequence > self._committed]
            counter_ids, counter_counts = self._counters.items()
            block = RowBlock(
                ids=self._slot_ids[slots].copy(),
                values=values,
                state=state,
                last_step=self._last_step[slots].astype(np.int64),
                deleted=np.concatenate(deleted) if deleted and not full else np.zeros(0, np.uint64),
                counter_ids=counter_ids,
                counter_counts=counter_counts,
            )
            capture = self._sequence
            self._sequence += 1
            return block, capture

    def commit_snapshot(self, capture: int) -> None:
        """Marks everything up to `capture` as saved: the next delta starts after it."""
        with self._lock:
            self._committed = max(self._committed, capture)
            self._deleted = [(s, ids) for s, ids in self._deleted if s > self._committed]

    def load(self, block: RowBlock, keep: np.ndarray | None = None) -> None:
        """Applies a snapshot part: deletions, then rows (upsert), then admission counters.

        `keep` is an optional [n] bool mask of the rows (and counters) this shard owns.
        Loaded rows count as saved (not dirty).
        """
        with self._lock:
            if len(block.deleted):
                slots = self._map.find(block.deleted)
                slots = slots[slots >= 0]
                if len(slots):
                    self._map.remove(self._slot_ids[slots])
                    self._rows.release(slots)
                    self._live[slots] = False
                    self._free = np.concatenate([self._free, slots])
            ids, rows = block.ids, slice(None)
            if keep is not None:
                rows = np.flatnonzero(keep)
                ids = ids[rows]
            slots = self._map.find(ids)
            new = slots < 0
            if new.any():
                saved_capacity, self.capacity = (
                    self.capacity,
                    max(self.capacity, len(self._map) + int(new.sum())),
                )
                slots[new] = self._allocate(int(new.sum()), np.zeros(0, np.int64))
                self.capacity = saved_capacity
                self._map.insert(ids[new], slots[new])
                self._slot_ids[slots[new]] = ids[new]
                self._live[slots[new]] = True
            self._rows.write_rows(slots, block.values[rows], block.state[rows])
            self._last_step[slots] = block.last_step[rows]
            self._modified[slots] = 0

    def load_counters(self, ids: np.ndarray, counts: np.ndarray) -> None:
        with self._lock:
            self._counters = _Counters()
            if len(ids):
                self._counters.add(ids, counts.astype(np.int64))

    def stats(self) -> dict[str, int]:
        """Counters, rows held, and memory: `bytes_held` (allocated now) and
        `bytes_at_capacity` (the same arrays grown to `capacity` rows, the ceiling)."""
        with self._lock:
            storage = self._rows.stats()
            metadata = sum(
                a.nbytes for a in (self._slot_ids, self._live, self._last_step, self._modified)
            )
            counters = self._counters.nbytes
            at_capacity = (
                self._rows.bytes_at(self.capacity)
                + SlotMap.bytes_for(self.capacity)
                + _METADATA_BYTES * self.capacity
            )
            return {
                "rows": len(self._map),
                "capacity": self.capacity,
                **self._stats,
                **storage,
                "bytes_held": storage["bytes_held"] + self._map.nbytes + metadata + counters,
                "bytes_at_capacity": at_capacity + counters,
                "pending_admission": len(self._counters),
            }

    def close(self) -> None:
        with self._lock:
            self._rows.close()
