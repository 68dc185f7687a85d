"""The host's side of embedding tables held on the devices (`model.device_tables`).

A table on the devices is trained inside the jitted step, synchronously (staleness 0):
the host only maps each batch's ids to rows. `DeviceRows` keeps, per device table, an id
-> row map (`embedding_store.SlotMap`), gives a new id the next free row and its initial
values (the store's initializer, so the same id starts from the same vector wherever it
lives; its optimizer state starts in the step from the same initial state as the
store's), and turns a global batch into the arrays the step reads.

The store stays the table of record for checkpoints, evaluation and export: when the
loop quiesces, `write_back` copies every row a step changed since the last write-back,
optimizer state included, into the host store (`EmbeddingStore.write_rows`), so a
checkpoint, `evaluate` or `export` sees each row's latest value, and a checkpoint
restores into a host-only run (or another device count) unchanged. `load` reads a
restored store's rows of the device tables back onto the devices.

A hot-row cache (a device table with `cache`) holds some rows of a host table; the host
store keeps them all. Per batch, `prepare` counts the table's ids, admits the frequent
ones it does not hold (`training.device.hot_rows`), reads the admitted rows with their
optimizer state from the store (`EmbeddingStore.take_rows`), and hands the host lookup
the ids the cache does not hold. The rows it evicts leave the step as outputs and are
written back to the store with that step's update (`write_evicted`), before any lookup
that may read them (the staleness gate). A cached row is trained on the devices at
staleness 0; the others in the store, at staleness k.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import (
    SlotMap,
    TableConfig,
    initial_rows,
)
from hybridrec.model import make_global_batch
from hybridrec.model.device_tables import NEW_ROWS, PER_EXAMPLE, array_key
from hybridrec.model.distributed import replicated_array
from hybridrec.model.sharding import replicated
from hybridrec.pipeline.metadata import ITEM_FEATURE
from hybridrec.training.data.input import Batch
from hybridrec.training.device.batch_shapes import PaddedSizes
from hybridrec.training.device.hot_rows import HotRows
from hybridrec.training.device.id_bags import as_bags, bag_arrays, distinct_ids, host_part
from hybridrec.training.device.plan import DevicePlan
from hybridrec.training.sequences.batches import SequenceBatch

MIN_ROWS = 256  # a batch's distinct rows per table are padded to a power of two, at least this


@dataclasses.dataclass
class Prepared:
    """One global batch's device-table arrays (host numpy), made by `DeviceRows.prepare`."""

    arrays: dict[str, np.ndarray]
    touched: dict[str, np.ndarray]  # table -> rows the batch's step changes
    placed: dict[str, tuple[np.ndarray, np.ndarray]]  # table -> (rows, ids) new in them
    host_ids: dict[str, Any] = dataclasses.field(default_factory=dict)  # cached feature ->
    # the ids the host looks up (those its cache does not hold)
    evicted: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # cache -> ids
    # ([N, dim], [(table, first row, its ids or a cache's read values)]): the new rows,
    # until `DeviceRows.host_arrays` fills them
    new_rows: tuple | None = None
    # a sequence batch with a cache: the positions among its distinct items of those the
    # host looks up (their rows come from the host, their gradients go to it)
    host_at: np.ndarray | None = None
    # the first batch of a smaller new-rows size: the step's compile for it, started ahead
    # (`DeviceRows.compile_ahead`); the trainer waits for it before the step
    compiled: Future | None = None

    def host_batch(self, batch: Batch) -> Batch:
        """`batch` with the cached features' ids the host store looks up."""
        if not self.host_ids:
            return batch
        return dataclasses.replace(batch, ids={**batch.ids, **self.host_ids})


@dataclasses.dataclass
class Deduped:
    """A global batch's device-table ids, deduplicated (`DeviceRows.dedupe`)."""

    tables: dict[str, tuple]  # table -> (columns, distinct ids, inverse, bags or None)


class DeviceRows:
    """Id -> row maps of the device tables of one run, and their batches.

    Args:
        plan: the device tables.
        tables: the store's tables by name (initializer and optimizer of new rows).
        mesh: the step's mesh.
        pooling: how multi-valued features pool their rows ("sum", "mean", "sqrtn").
        store: the embedding store (caches read the rows they admit from it).
        staleness: the run's bound k (an id a cache evicts stays out for k batches).
        writes: whether this process writes the rows back to the store (of trainer
            processes sharing embedding servers, the chief alone does).
        written: called by every process after a write-back (a barrier where the store
            is shared: no process reads the rows before they are written).
    """

    def __init__(
        self,
        plan: DevicePlan,
        tables: Mapping[str, TableConfig],
        mesh: Any,
        pooling: str,
        *,
        store: Any = None,
        staleness: int = 0,
        writes: bool = True,
        written: Callable[[], None] | None = None,
    ):
        self.plan = plan
        self._writes = writes
        self._written = written
        self.mesh = mesh
        self.pooling = pooling
        self.store = store
        self._staleness = staleness
        self._configs = {t.name: tables[plan.store_tables[t.name]] for t in plan.layout.tables}
        # the sizes batches are padded to: a table's distinct rows and its bags' width only
        # grow, so tables hovering about a power of two do not compile every mix
        self.sizes = PaddedSizes()
        self._reset()
        self.lookups = 0  # ids looked up on the devices (each occurrence)
        self._cache_counts = {
            t.name: dict.fromkeys(("lookups", "hits", "admitted", "evicted"), 0)
            for t in plan.layout.caches
        }

    def _reset(self) -> None:
        tables = self.plan.layout.tables
        self._maps = {t.name: SlotMap(min(t.rows, 1 << 16)) for t in tables}
        self._ids = {t.name: np.zeros(t.rows, np.uint64) for t in tables}  # as prepared
        self._resident = {t.name: np.zeros(t.rows, np.uint64) for t in tables}  # as trained
        self._used = {t.name: 0 for t in tables}
        self._touched = {t.name: np.zeros(t.rows, bool) for t in tables}
        self._hot = {
            t.name: HotRows(t.rows, cooldown=self._staleness) for t in self.plan.layout.caches
        }

    @property
    def tables(self):
        return self.plan.layout.tables

    @property
    def caches(self) -> bool:
        """Whether some device tables are hot-row caches of host tables."""
        return bool(self.plan.layout.caches)

    def compile_ahead(self, hook: Callable[[dict], Future | None]) -> None:
        """`hook({array key: shape})` compiles the step for a smaller new-rows size, which
        `prepare` takes `SHRINK_DELAY` batches later (`PaddedSizes`), its first batch
        carrying the compile (`Prepared.compiled`)."""
        self.sizes.ahead = lambda key, size: hook({key: (size, self.tables[0].dim)})

    def rows_of(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The rows of device table `table` holding `ids` (-1 for ids it does not hold)."""
        return self._maps[table].find(np.asarray(ids, np.uint64))

    def summary(self) -> dict[str, Any]:
        """Rows held per device table, the ids looked up on the devices so far, and per
        cache its lookups, hits (ids it held), admissions, evictions and hit rate, with
        the hit rate of all caches together (`cache_hit_rate`)."""
        out: dict[str, Any] = {"rows": dict(self._used), "lookups": self.lookups}
        if self._cache_counts:
            counts = self._cache_counts.values()
            out["caches"] = {
                name: {**c, "hit_rate": _ratio(c["hits"], c["lookups"])}
                for name, c in self._cache_counts.items()
            }
            out["cache_hit_rate"] = _ratio(
                sum(c["hits"] for c in counts), sum(c["lookups"] for c in counts)
            )
        return out

    # ---- per batch (the lookup thread, in step order) -----------------------------------

    def dedupe(self, batch: Batch | SequenceBatch) -> Deduped:
        """What `prepare` needs of a global batch that depends on the batch alone: per
        table its distinct ids and each occurrence's index among them, and a whole table's
        bags. The input thread makes it ahead of the step order (batches in input order:
        a bag width only grows, as it did in `prepare`)."""
        deduped = Deduped({})
        for table in self.tables:
            if isinstance(batch, SequenceBatch):  # its items are distinct, and the step
                # indexes their rows itself (no bags)
                deduped.tables[table.name] = ((), batch.ids[ITEM_FEATURE.name], None, None)
                continue
            columns = [as_bags(batch.ids[name]) for name in self.plan.features[table.name]]
            # distinct ids in order of first occurrence, the same on every process
            unique, inverse = distinct_ids(
                [c[0] for c in columns], self.plan.prefixes[table.name], self.plan.prefix_bits
            )
            # a whole table holds every id of the batch once `prepare` gave the new ones
            # rows; a cache's bags wait for what it admits
            bags = None if table.cache else self._bags(table.name, columns, inverse, batch.size)
            deduped.tables[table.name] = (columns, unique, inverse, bags)
        return deduped

    def prepare(self, batch: Batch, deduped: Deduped | None = None) -> Prepared:
        """The device-table arrays of a global batch (`deduped`: its `dedupe`, made here
        when None); new ids get rows here, in step order, and caches admit and evict
        theirs. The new rows' initial values are filled by `host_arrays`, on the thread
        that copies the batch to the devices."""
        if deduped is None:
            deduped = self.dedupe(batch)
        prepared = Prepared({}, {}, {})
        arriving = []  # (table, positions among its distinct rows, ids or read values)
        for table in self.tables:
            columns, unique, inverse, bags = deduped.tables[table.name]
            slots = self.rows_of(table.name, unique)
            # padded to a power of two, never less than before: few compiles. A cache pads
            # to the ids' count (the most distinct rows there can be): with single-valued
            # features every batch has the same shapes, whatever its admissions and evictions
            need = len(inverse) if table.cache and inverse is not None else len(unique)
            size = self.sizes.grow(table.name, max(need, MIN_ROWS))
            if table.cache:
                fresh, slots = self._admit(table, unique, inverse, slots, columns, prepared, size)
                at = np.flatnonzero(fresh)
                new_state = np.zeros((size, table.rule.state_width(table.dim)), np.float32)
                admitted = np.zeros((0, table.dim), np.float32)  # their values, from the store
                if len(at):
                    store_table = self.plan.store_tables[table.name]
                    admitted, new_state[at] = self.store.take_rows(store_table, unique[at]).result()
                prepared.arrays[array_key(table.name, "state")] = new_state
                arriving.append((table, at, size, admitted))
            else:
                fresh = slots < 0
                slots = self._assign(table, unique, slots)
                arriving.append((table, np.flatnonzero(fresh), size, unique[fresh]))
            # a whole table now holds every id of the batch, a cache those it admitted
            held = slice(None) if not table.cache else slots >= 0
            padded = np.full(size, table.scratch, np.int32)
            padded[: len(unique)][held] = slots[held]
            prepared.touched[table.name] = slots[held]
            prepared.placed[table.name] = (slots[fresh], unique[fresh])
            prepared.arrays[array_key(table.name, "slots")] = padded
            if inverse is None:  # a sequence batch's distinct items
                self.lookups += len(unique)
                continue
            if bags is None:  # a cache's: its lookups are the ids it holds
                held_at = held[inverse]
                bags = self._bags(table.name, columns, inverse, batch.size, held_at)
                self.lookups += int(np.count_nonzero(held_at))
            else:
                self.lookups += len(inverse)
            index, weights = bags
            key = table.name
            prepared.arrays.update(
                {array_key(key, "inverse"): index, array_key(key, "weights"): weights}
            )
        if arriving:
            self._new_rows(arriving, prepared)
        return prepared

    def _new_rows(self, arriving, prepared: Prepared) -> None:
        """The batch's new rows, every table's in one [N, dim] array, and per table where
        its distinct rows find theirs (-1: held). N is a power of two that grows at once and
        shrinks as the tables fill only once its padding has cost more than a compile
        (`PaddedSizes.fit`): following every batch's count compiled at each power of two on
        the way down, 13 compiles and 3.4 s of one epoch of `criteo_dlrm` at batch 512."""
        total = sum(len(at) for _, at, _, _ in arriving)
        dim = arriving[0][0].dim  # the tower concatenates the features: one dim for all
        shape = (self.sizes.fit(NEW_ROWS, max(total, MIN_ROWS), dim * 4), dim)
        prepared.compiled = self.sizes.compiled(NEW_ROWS)
        offset, fills = 0, []
        for table, at, size, incoming in arriving:
            new = np.full(size, -1, np.int32)
            new[at] = np.arange(offset, offset + len(at))
            prepared.arrays[array_key(table.name, "new")] = new
            if len(at):
                fills.append((table, offset, incoming))
            offset += len(at)
        prepared.new_rows = (shape, fills)

    def _fill_new_rows(self, prepared: Prepared) -> None:
        """The batch's [N, dim] new rows: a whole table's from the store's initializer (their
        optimizer state is set in the step, the rule's initial), a cache's admitted values
        read from the store."""
        if prepared.new_rows is None:
            return
        (shape, fills), prepared.new_rows = prepared.new_rows, None
        rows = np.zeros(shape, np.float32)
        for table, offset, incoming in fills:
            if table.cache:
                rows[offset : offset + len(incoming)] = incoming
            else:
                config = self._configs[table.name]
                places = np.arange(offset, offset + len(incoming), dtype=np.int64)
                initial_rows(
                    config.initializer, incoming, shape[1], config.first_column, out=rows, at=places
                )
        prepared.arrays[NEW_ROWS] = rows

    def _admit(self, table, unique, inverse, slots, columns, prepared: Prepared, size: int):
        """A cache's admissions and evictions for one batch: (admitted [U] bool, rows [U]
        with -1 for the ids left to the host); fills `prepared`'s evict and host arrays."""
        name, hot = table.name, self._hot[table.name]
        if inverse is None:  # a sequence batch: each distinct item once
            occurrences = np.ones(len(unique), np.int64)
        else:
            occurrences = np.bincount(inverse, minlength=len(unique))
        counts = self._cache_counts[name]
        counts["lookups"] += int(occurrences.sum())
        counts["hits"] += int(occurrences[slots >= 0].sum())
        admitted, rows = hot.choose(unique, hot.seen(unique, occurrences), slots)
        leaving = rows[rows < self._used[name]]  # rows given out before: evicted
        evicted = self._ids[name][leaving]
        hot.evicted(evicted)
        if len(leaving):
            self._maps[name].remove(evicted)
        self._maps[name].insert(unique[admitted], rows)
        self._ids[name][rows] = unique[admitted]
        self._used[name] = hot.used
        counts["admitted"] += len(admitted)
        counts["evicted"] += len(leaving)
        # as long as the batch's rows (it evicts at most as many): no shape of its own to compile
        evict = np.full(size, table.scratch, np.int32)
        evict[: len(leaving)] = leaving
        prepared.arrays[array_key(name, "evict")] = evict
        prepared.evicted[name] = evicted
        fresh = np.zeros(len(unique), bool)
        fresh[admitted] = True
        slots = slots.copy()
        slots[admitted] = rows
        if inverse is None:  # a sequence batch: the host looks up the items not held
            prepared.host_at = np.flatnonzero(slots < 0)
            prepared.host_ids[ITEM_FEATURE.name] = unique[prepared.host_at]
            return fresh, slots
        features = self.plan.features[table.name]
        host_ids, scale = host_part(features, columns, slots >= 0, inverse, self.pooling)
        prepared.host_ids.update(host_ids)
        prepared.arrays[array_key(name, "host_scale")] = scale
        return fresh, slots

    def _assign(self, table, unique: np.ndarray, slots: np.ndarray) -> np.ndarray:
        new = slots < 0
        count = int(np.count_nonzero(new))
        if not count:
            return slots
        start = self._used[table.name]
        if start + count > table.rows:
            features = self.plan.features[table.name]
            shown = ", ".join(features[:4]) + (", ..." if len(features) > 4 else "")
            raise UserError(
                f"embedding table {table.name!r} on the devices (features {shown}) is full: "
                f"{table.rows:,} rows hold {start:,} ids and this batch brings {count:,} new "
                "ones; its rows are at most embedding.capacity and the ids the dataset's "
                "statistics count: give its tables more rows (embedding.placement.TABLE = "
                '"device:ROWS", or a larger embedding.capacity), a cache ("cache") or the '
                'host ("host")'
            )
        fresh = np.arange(start, start + count, dtype=np.int64)
        self._maps[table.name].insert(unique[new], fresh)
        self._ids[table.name][fresh] = unique[new]
        self._used[table.name] = start + count
        slots = slots.copy()
        slots[new] = fresh
        return slots

    def _bags(self, name, columns, inverse, rows: int, held=None) -> tuple[np.ndarray, np.ndarray]:
        """`bag_arrays` of a table's features, L a power of two never less than before."""
        longest = [1 if counts is None else int(counts.max(initial=1)) for _, counts in columns]
        width = self.sizes.grow(f"{name}/width", max(longest, default=1))
        return bag_arrays(columns, inverse, rows, width, self.pooling, held)

    def host_arrays(self, prepared: Prepared, rows: slice) -> tuple[dict, dict]:
        """(per-example arrays of this process's `rows`, arrays the same on every process)
        of a prepared batch, on the host: `make_global_batch` copies them with the batch."""
        self._fill_new_rows(prepared)
        whole, per_example = {}, {}
        if prepared.host_at is not None:  # for the layout, not the step (SequenceLayout)
            whole["host_at"] = prepared.host_at
        for key, array in prepared.arrays.items():
            if key.rsplit("/", 1)[-1] in PER_EXAMPLE:
                per_example[key] = array[rows]
            else:
                whole[key] = array
        return per_example, whole

    def device_arrays(self, prepared: Prepared, rows: slice) -> dict[str, jax.Array]:
        """The batch's arrays on the devices: per-example ones from this process's `rows`."""
        per_example, whole = self.host_arrays(prepared, rows)
        return make_global_batch(per_example, self.mesh, replicated=whole)

    def trained(self, prepared: Prepared) -> None:
        """Marks the rows a dispatched step changed (written back at the next quiesce)."""
        for name, slots in prepared.touched.items():
            self._touched[name][slots] = True
        for name, (slots, ids) in prepared.placed.items():
            self._resident[name][slots] = ids

    def write_evicted(self, prepared: Prepared, evicted: Mapping[str, Any], store: Any) -> list:
        """Hands the rows a step's caches evicted (its `evicted` output) to `store`;
        returns the store's futures."""
        futures = []
        for name, ids in prepared.evicted.items():
            if not len(ids):
                continue
            values, state = (np.asarray(part.addressable_data(0)) for part in evicted[name])
            futures.append(
                store.write_rows(
                    self.plan.store_tables[name], ids, values[: len(ids)], state[: len(ids)]
                )
            )
        return futures

    # ---- at quiesce points (the caller's thread, every process) ---------------------------

    def write_back(self, state: Any, store: Any) -> int:
        """Copies the rows changed since the last write-back into `store`; returns how many.

        Every process calls it at the same step (a replicated store takes every row on
        each process; a gather of a table split over processes is a collective; a shared
        store takes the rows from one of them).
        """
        written = 0
        for table in self.tables:
            slots = np.flatnonzero(self._touched[table.name])
            if not len(slots):
                continue
            values, opt_state = take_rows(state.tables[table.name], slots, self.mesh)
            ids = self._resident[table.name][slots]
            if self._writes:
                write = store.write_rows(self.plan.store_tables[table.name], ids, values, opt_state)
                write.result()
            self._touched[table.name][:] = False
            written += len(slots)
        if self._written is not None:
            self._written()
        return written

    def load(self, state: Any, store: Any) -> Any:
        """The state with the device tables filled from `store`'s rows of their features
        (after a restore); the id -> row maps start over from them, and caches empty."""
        tables = dict(state.tables)
        self._reset()
        for table in self.plan.layout.whole:
            ids, values, opt_state = restored_rows(self.plan, table, store)
            self._maps[table.name].insert(ids, np.arange(len(ids), dtype=np.int64))
            self._ids[table.name][: len(ids)] = self._resident[table.name][: len(ids)] = ids
            self._used[table.name] = len(ids)
            tables[table.name] = filled_table(state.tables[table.name], values, opt_state)
        return state.replace(tables=tables)


def restored_rows(plan: DevicePlan, table: Any, store: Any) -> tuple[np.ndarray, ...]:
    """(ids, values, optimizer state) of device table `table`'s rows in a restored
    `store`; a UserError if they are more than the table's rows."""
    ids, values, state = store.read_rows(
        plan.store_tables[table.name], plan.prefixes[table.name], plan.prefix_bits
    )
    if len(ids) > table.rows:
        raise UserError(
            f"the checkpoint holds {len(ids):,} rows of embedding table {table.name!r}, "
            f"more than the {table.rows:,} planned on the devices; set "
            f'embedding.placement.{table.name} = "device:ROWS" with more rows, or "host"'
        )
    return ids, values, state


def _ratio(part: int, whole: int) -> float:
    return round(part / max(whole, 1), 4)


def take_rows(table: Mapping[str, jax.Array], slots: np.ndarray, mesh: Any):
    """(values, state) host copies of a device table's `slots` (on every process)."""
    index = replicated_array(slots.astype(np.int32), mesh)
    values, state = _taker(mesh)(dict(table), index)
    return np.asarray(values.addressable_data(0)), np.asarray(state.addressable_data(0))


@functools.cache
def _taker(mesh: Any):
    return jax.jit(lambda t, i: (t["values"][i], t["state"][i]), out_shardings=replicated(mesh))


def filled_table(table: Mapping[str, jax.Array], values: np.ndarray, state: np.ndarray) -> dict:
    """The device table with rows [0, n) set to `values` / `state`, the rest zeros."""
    out = {}
    for key, rows in (("values", values), ("state", state)):
        array = table[key]
        full = np.zeros(array.shape, np.float32)
        full[: len(rows)] = rows
        out[key] = jax.make_array_from_callback(array.shape, array.sharding, lambda i, f=full: f[i])
    return out
