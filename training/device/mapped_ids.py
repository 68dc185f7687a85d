"""The host's side of device tables whose ids the step maps itself (`embedding.map_ids`).

With `training.device.held_rows` the host deduplicates each batch's ids, maps them to rows and
builds the index arrays; on an accelerator that host work bounds the loop. Here the host
hands the batch's raw ids to the step (`model.device_ids` maps them in a hash table on
the devices) and keeps only what the store needs at quiesce points:

- `write_back` reads each table's row ids and the clock stamp of the step that last
  trained each row, and copies the rows trained since the last write-back into the store
  (values and optimizer state), so checkpoints, `evaluate` and `export` see them, as
  with host-mapped tables;
- `load` fills the tables and their hash tables from a restored store.

`maps_on_devices` and `map_on_devices` decide at start-up: the step maps the ids of a
click log's device tables on an accelerator ("auto") or wherever asked ("devices"), where
every device table is held whole (no hot-row cache: a cache's admissions are the host's;
the planner then plans none) and every feature of them is single-valued.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.embedding_store import TableConfig, initializer_salts
from hybridrec.model import device_ids, make_global_batch
from hybridrec.model.device_tables import array_key, replicated_table
from hybridrec.model.sharding import replicated
from hybridrec.pipeline import DatasetMetadata
from hybridrec.training.config import TrainConfig
from hybridrec.training.data.input import Batch
from hybridrec.training.device.held_rows import Prepared, filled_table, restored_rows, take_rows
from hybridrec.training.device.plan import DevicePlan, plan_devices
from hybridrec.training.tables import TablePlan


def new_rows_of(table: TableConfig) -> device_ids.NewRows:
    """The store table's initializer as the step computes it (`model.device_ids`)."""
    init = table.initializer
    uniform = init.kind == "uniform"
    row_salt, column_salt = initializer_salts(init)
    return device_ids.NewRows(
        kind=init.kind,
        row_salt=row_salt,
        column_salt=column_salt,
        first_column=table.first_column,
        a=float(init.low if uniform else init.mean),
        b=float(init.high if uniform else init.stddev),
    )


def plan_click_log_tables(
    config: TrainConfig,
    metadata: DatasetMetadata,
    mesh: Any,
    tables: TablePlan,
    *,
    shared_servers: bool,
    follow: bool,
) -> DevicePlan:
    """A click-log run's device tables (`training.device.plan.plan_devices`) and who maps
    their ids (`map_on_devices`).

    Args:
        shared_servers: several trainer processes in front of the same embedding servers.
        follow: the run trains a followed stream.
    """
    host_only = no_caches = None
    if shared_servers and not config.data.global_order:
        # each process reads its own rows of the files, so its device tables would take
        # other ids than the others'; one trainer process in front of servers may use them
        host_only = (
            "the trainer processes share embedding servers and each reads its own rows "
            "(data.global_order = true lets them keep tables on the devices)"
        )
    elif shared_servers:
        # every process sees the global batch, but a row admitted into a cache would be
        # read from the servers by each process at its own time: the replicas could differ
        no_caches = "several trainer processes share the embedding servers"
    elif config.model.layout == "towers":
        host_only = "model.layout = 'towers' places each tower's tables itself"
    elif follow:
        host_only = "a followed stream brings new ids without end"
    mode, platform = config.embedding.map_ids, mesh.devices.flat[0].platform
    multi_valued = {f.name: f.multi_valued for f in metadata.categorical}
    auto_on_host = mode == "auto" and any(multi_valued.values())
    if auto_on_host:
        mode = "host"  # a bag's ids are the host's to map; the run keeps its caches
    overhead = 0
    if not host_only and maps_on_devices(mode, platform):
        no_caches = (
            no_caches or f"ids are mapped to rows in the step (embedding.map_ids = {mode!r})"
        )
        overhead = device_ids.ROW_BYTES  # the hash table's, on every device
    plan = plan_devices(
        config,
        metadata,
        mesh,
        tables,
        host_only=host_only,
        no_caches=no_caches,
        row_overhead=overhead,
    )
    mapped = map_on_devices(
        plan,
        mode,
        {table.name: table for table in tables.tables},
        platform=platform,
        multi_valued=multi_valued,
    )
    if auto_on_host and plan.layout.tables:
        line = (
            "  ids mapped to rows on the host (multi-valued features; embedding.map_ids = 'auto')"
        )
        mapped = dataclasses.replace(mapped, lines=(*mapped.lines, line))
    return mapped


def maps_on_devices(mode: str, platform: str) -> bool:
    """Whether a click-log run with `embedding.map_ids = mode` on `platform` has the step
    map its tables' ids (the planner then plans no hot-row caches)."""
    return mode == "devices" or (mode == "auto" and platform != "cpu")


def map_on_devices(
    plan: DevicePlan,
    mode: str,
    tables: Mapping[str, TableConfig],
    *,
    platform: str,
    multi_valued: Mapping[str, bool],
) -> DevicePlan:
    """`plan` with the step mapping its tables' ids where `mode` ("auto", "host",
    "devices": `embedding.map_ids`) and the run allow, and a line of the plan saying so.

    Args:
        tables: the store's tables by name (the new rows' initializer).
        platform: the devices' platform ("auto" maps on the devices off the CPU).
        multi_valued: per feature, whether a row may hold several ids.
    """
    if mode == "host" or not plan.layout.tables:
        return plan
    bags = [f for t in plan.layout.tables for f in plan.features[t.name] if multi_valued.get(f)]
    why_not = (
        "hot-row caches admit rows on the host"
        if plan.layout.caches
        else f"feature {bags[0]!r} is multi-valued"
        if bags
        else None
    )
    if why_not and mode == "devices":
        raise ConfigError(f"embedding.map_ids = 'devices': {why_not}; use 'host' or 'auto'")
    if why_not or not maps_on_devices(mode, platform):
        why = why_not or "on the CPU the host maps them beside the step"
        line = f"  ids mapped to rows on the host ({why}; embedding.map_ids = {mode!r})"
        return dataclasses.replace(plan, lines=(*plan.lines, line))
    mapped = tuple(
        dataclasses.replace(t, new_rows=new_rows_of(tables[plan.store_tables[t.name]]))
        for t in plan.layout.tables
    )
    line = f"  ids mapped to rows on the devices, in the step (embedding.map_ids = {mode!r})"
    layout = dataclasses.replace(plan.layout, tables=mapped)
    return dataclasses.replace(plan, layout=layout, lines=(*plan.lines, line))


class DeviceIds:
    """The device tables of one run whose ids the step maps (`model.device_ids`): the
    `DeviceRows` interface the hybrid loop and the trainer use, with the per-batch work
    reduced to handing over the ids.

    Args:
        plan: the device tables (each with `new_rows`).
        mesh: the step's mesh.
        writes: whether this process writes the rows back to the store (of trainer
            processes sharing embedding servers, the chief alone does).
        written: called by every process after a write-back (a barrier where the store
            is shared).
    """

    caches = False

    def __init__(
        self,
        plan: DevicePlan,
        mesh: Any,
        *,
        writes: bool = True,
        written: Callable[[], None] | None = None,
    ):
        self.plan = plan
        self.mesh = mesh
        self._writes = writes
        self._written = written
        self._written_at = 0  # the clock at the last write-back
        self._used = {t.name: 0 for t in self.tables}
        self.lookups = 0

    @property
    def tables(self):
        return self.plan.layout.tables

    def compile_ahead(self, hook: Callable) -> None:
        """Nothing to compile ahead: a batch's shapes are its ids', the same every batch."""

    def summary(self) -> dict[str, Any]:
        """Rows held per device table (as of the last write-back) and the ids looked up."""
        return {"rows": dict(self._used), "lookups": self.lookups, "mapped_on_devices": True}

    # ---- per batch ---------------------------------------------------------------------

    def dedupe(self, batch: Batch) -> None:
        """Nothing: the step finds the distinct ids."""
        return None

    def prepare(self, batch: Batch, deduped: Any = None) -> Prepared:
        """The batch's ids of each table, [F, B, 2] uint32 halves, a feature a row (the
        reader's columns stacked: no transposition on the host, `host_arrays`)."""
        arrays = {}
        for table in self.tables:
            names = self.plan.features[table.name]
            columns = []
            for name in names:
                ids = batch.ids[name]
                if hasattr(ids, "offsets"):
                    raise UserError(
                        f"feature {name!r} came with several ids a row, but its table's ids "
                        "are mapped on the devices for single-valued features; set "
                        "embedding.map_ids = 'host'"
                    )
                columns.append(np.asarray(ids, np.uint64))
            arrays[array_key(table.name, "ids")] = device_ids.split_ids(np.stack(columns))
            self.lookups += batch.size * len(names)
        return Prepared(arrays, {}, {})

    def host_arrays(self, prepared: Prepared, rows: slice) -> tuple[dict, dict]:
        """(this process's `rows` of the ids, feature by feature in its block of the batch
        (`model.device_ids.batch_major`), nothing the same on every process)."""
        arrays = prepared.arrays.items()
        return {key: device_ids.feature_major(ids[:, rows]) for key, ids in arrays}, {}

    def device_arrays(self, prepared: Prepared, rows: slice) -> dict[str, jax.Array]:
        """The batch's ids on the devices, this process's `rows` of them."""
        per_example, whole = self.host_arrays(prepared, rows)
        return make_global_batch(per_example, self.mesh, replicated=whole)

    def trained(self, prepared: Prepared) -> None:
        """Nothing: the step stamps the rows it trains."""

    # ---- at quiesce points (the caller's thread, every process) -------------------------

    def write_back(self, state: Any, store: Any) -> int:
        """Copies the rows trained since the last write-back into `store`; returns how many.
        Raises if a table ran out of rows since (its new ids trained the scratch row)."""
        written, clock = 0, self._written_at
        for table in self.tables:
            held = state.tables[table.name]
            counters = {k: int(_host(held[k])) for k in device_ids.COUNTERS}
            clock = counters["clock"]
            self._used[table.name] = used = counters["used"]
            if counters["full"]:
                features = self.plan.features[table.name]
                raise UserError(
                    f"embedding table {table.name!r} on the devices (features "
                    f"{', '.join(features[:4])}{', ...' if len(features) > 4 else ''}) is "
                    f"full: its {table.rows:,} rows hold {used:,} ids and the batches since the "
                    "last write-back brought more new ones; give its tables more rows "
                    '(embedding.placement.TABLE = "device:ROWS", or a larger '
                    'embedding.capacity) or the host ("host")'
                )
            slots = np.flatnonzero(_host(held["trained_at"])[:used] > self._written_at)
            if not len(slots):
                continue
            ids = device_ids.joined_ids(_host(held["row_hi"])[slots], _host(held["row_lo"])[slots])
            values, opt_state = take_rows(held, slots, self.mesh)
            if self._writes:
                store_table = self.plan.store_tables[table.name]
                store.write_rows(store_table, ids, values, opt_state).result()
            written += len(slots)
        self._written_at = clock
        if self._written is not None:
            self._written()
        return written

    def load(self, state: Any, store: Any) -> Any:
        """The state with the device tables and their hash tables filled from `store`'s
        rows of their features (after a restore)."""
        tables = dict(state.tables)
        for table in self.tables:
            ids, values, opt_state = restored_rows(self.plan, table, store)
            empty = device_ids.empty_table(table.rows)
            empty["clock"][...] = self._written_at
            hashed = replicated_table(empty, self.mesh)
            halves = device_ids.split_ids(np.asarray(ids, np.uint64))
            held = replicated_table({"high": halves[:, 1], "low": halves[:, 0]}, self.mesh)
            hashed = _filler(self.mesh)(hashed, held["high"], held["low"])
            filled = filled_table(state.tables[table.name], values, opt_state)
            tables[table.name] = {**filled, **hashed}
            self._used[table.name] = len(ids)
        return state.replace(tables=tables)


def _host(array: jax.Array) -> np.ndarray:
    """A replicated array's value on this process."""
    return np.asarray(array.addressable_data(0))


@functools.cache
def _filler(mesh: Any):
    return jax.jit(device_ids.filled, out_shardings=replicated(mesh))
