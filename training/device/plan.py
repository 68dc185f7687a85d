"""Where each embedding table lives: on the devices, or in the host store.

TorchRec keeps tables in device memory; PERSIA keeps them on embedding servers. A run
here does both: `plan_devices` puts the spec tables that fit `embedding.device_budget`
(bytes per device, optimizer state included) on the devices, smallest first, and leaves
the rest to the host store and the hybrid loop. A table's rows come from the dataset's
statistics (the distinct ids of its features, with 10% headroom), or from the config.

    small tables (<= REPLICATE_BYTES)   one replica on every device; their gradient is
                                        reduced over the devices like the dense one
    larger tables                       rows split over all devices
    the rest                            the host store (async, staleness k), each with a
                                        hot-row cache on the devices in what is left of
                                        the budget (`training.device.hot_rows`), if that holds
                                        at least MIN_CACHE_ROWS rows

When not every table fits, the budget goes where it serves the most lookups per byte:
the pipeline counts how many ids of each feature were seen at least 1, 2, 5, 10, 100 and
1000 times, which tells how many lookups the hottest N ids of a table take. Bands of ids
of every table, densest first, get rows until the budget is spent; a table that gets all
its rows is placed whole, one that gets part of them a cache of that many rows. A
dataset without those counts places whole tables smallest first and the caches of the
others share what is left equally.

With `embedding.fuse_tables` the tables of each kind share one device table (their ids
never collide: each feature's ids carry its prefix), so a step gathers and updates
rows with two operations, not one per table (FBGEMM's table-batched embeddings); the
caches of each layout share one cache too, with the sum of their rows.
`embedding.placement.<table>` overrides the choice per table; the plan is printed at
start-up. Where device tables cannot go (several trainer processes sharing embedding
servers, the tower-parallel layout, a followed stream) the auto plan keeps everything on
the host and says why; a sequence run's item table goes to the devices (whole, or as a
cache) only where placed there (`training.job`). One trainer process in front of
embedding servers may use them: rows move between its devices and the servers over the
wire (`take_rows`, `write_rows`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from hybridrec.common.errors import ConfigError
from hybridrec.embedding_store import TableConfig
from hybridrec.model.device_tables import DeviceTable, DeviceTableLayout, SparseRule
from hybridrec.pipeline import DatasetMetadata
from hybridrec.training.config import TrainConfig, parse_placement
from hybridrec.training.device.budget import (
    lookup_bands,
    merge_bands,
    plan_by_lookups,
    plan_caches,
    size_text,
    split_layout,
)
from hybridrec.training.tables import TablePlan
from jax.experimental import multihost_utils


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Which spec tables live on the devices, and how (`training.device.plan.plan_devices`)."""

    layout: DeviceTableLayout  # what the step sees
    features: dict[str, tuple[str, ...]]  # device table -> its features, in position order
    store_tables: dict[str, str]  # device table -> the store table its rows are written to
    prefixes: dict[str, tuple[int, ...]]  # device table -> its features' id prefixes
    prefix_bits: int
    lines: tuple[str, ...] = ()  # the plan, as printed at start-up
    all_features: tuple[str, ...] = ()  # every categorical feature, in position order

    @property
    def host_features(self) -> list[str] | None:
        """Features the host store looks up, in position order (None: every feature)."""
        if not self.layout.tables:
            return None
        on_devices = {name for t in self.layout.whole for name in self.features[t.name]}
        return [f for f in self.all_features if f not in on_devices]


AUTO_FRACTION = 0.25  # of a device's free memory, when embedding.device_budget = -1
HEADROOM = 1.1  # rows planned per distinct id seen in the training split


def free_bytes_per_device(mesh: Any) -> tuple[int, str]:
    """(free bytes of one of this process's devices, where the number comes from); the
    smallest over the processes of a multi-process job, so that all plan alike."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    stats = memory_stats(device)
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        where = f"{device.device_kind} memory"
    else:
        local = len([d for d in mesh.devices.flat if d.process_index == device.process_index])
        free = available_host_memory() // local
        where = f"host memory shared by {local} {device.platform} devices"
    if jax.process_count() > 1:  # in MiB: JAX gathers 32-bit integers unless x64 is on
        mib = np.asarray(max(free, 0) >> 20, np.int32)
        free = int(np.min(multihost_utils.process_allgather(mib))) << 20
        where += ", the smallest of the processes'"
    return free, where


def memory_stats(device: Any) -> dict[str, Any] | None:
    """The device's allocator statistics; None where the backend keeps none (CPU)."""
    try:
        return device.memory_stats() or None
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _rule(table: TableConfig) -> SparseRule:
    opt = table.optimizer
    return SparseRule(
        name=opt.name,
        learning_rate=opt.learning_rate,
        eps=opt.eps,
        beta1=opt.beta1,
        beta2=opt.beta2,
        initial_accumulator=opt.initial_accumulator,
    )


def _unplaceable(table: TableConfig) -> str | None:
    """Why a store table's rows cannot move to the devices, or None."""
    if table.column_shards > 1:
        return "its rows are split by columns (embedding.column_shards)"
    if not table.admission.admits_all:
        return "it admits ids by count or probability (embedding.admission)"
    if table.eviction.ttl_steps:
        return "its rows expire (embedding.eviction.ttl_steps)"
    if table.storage_dtype != "float32":
        return f"it stores {table.storage_dtype} rows (embedding.storage_dtype)"
    return None


def plan_devices(
    config: TrainConfig,
    metadata: DatasetMetadata,
    mesh: Any,
    tables: TablePlan,
    *,
    host_only: str | None = None,
    no_caches: str | None = None,
    stats: dict[str, dict] | None = None,
    row_overhead: int = 0,
) -> DevicePlan:
    """The run's device tables.

    Args:
        host_only: why this run keeps every table on the host (None: it need not); a
            table forced onto the devices then is a ConfigError.
        no_caches: why this run can have whole tables on the devices but no hot-row
            caches (None: it can); a forced cache then is a ConfigError.
        stats: per feature its statistics (`distinct_estimate`, ...), where the dataset
            keeps them elsewhere than a click log's metadata (None: the metadata's).
        row_overhead: bytes a row of a whole table costs on every device besides its
            values and state, split by rows or not (the hash table of ids mapped in the
            step: `model.device_ids.ROW_BYTES`).
    """
    embedding = config.embedding
    features = metadata.categorical
    names = [f.name for f in features]
    spec_tables = list(dict.fromkeys(f.table for f in features))
    for table in embedding.placement:
        if table not in spec_tables:
            raise ConfigError(
                f"embedding.placement.{table}: no table {table!r} in the dataset "
                f"(tables: {', '.join(spec_tables)})"
            )
    forced = [t for t, where in embedding.placement.items() if where != "host"]
    prefix_bits = int(metadata.raw.get("hash_scheme", {}).get("prefix_bits", 8))
    empty = DevicePlan(
        DeviceTableLayout((), len(features)), {}, {}, {}, prefix_bits, all_features=tuple(names)
    )
    if host_only or embedding.device_budget == 0:
        why = host_only or "embedding.device_budget = 0"
        if forced:
            raise ConfigError(
                f"embedding.placement.{forced[0]} = {embedding.placement[forced[0]]!r}, but {why}"
            )
        return _with_lines(empty, [f"device tables: none ({why})"])
    devices = mesh.devices.size
    budget, budget_note = _budget(embedding.device_budget, mesh)
    if stats is None:
        stats = (metadata.raw.get("stats") or {}).get("categorical") or {}
    candidates, cached, weighed = _classify(
        config, metadata, tables, spec_tables, stats, devices, no_caches, row_overhead
    )
    chosen, used = _choose_whole(candidates, cached, budget, budget_note, no_caches)
    given = [c for c in cached if c[1]]
    used = plan_caches(given, chosen, budget, budget_note, used, devices)
    # the others by lookups per byte: whole where a table's rows all earn their place
    used = plan_by_lookups(
        weighed,
        chosen,
        budget,
        budget_note,
        used,
        devices,
        caches=not no_caches,
        row_overhead=row_overhead,
    )
    # no statistics: what is left, shared equally
    rest = [c for c in cached if not c[1] and not no_caches]
    used = plan_caches(rest, chosen, budget, budget_note, used, devices)
    if not chosen:
        return _with_lines(
            empty, [f"device tables: none fit {size_text(budget)} per device ({budget_note})"]
        )
    plan = _grouped(chosen, features, embedding, {t.name: t for t in tables.tables}, prefix_bits)
    lines = _describe(plan, chosen, spec_tables, budget, budget_note, used)
    if no_caches:
        lines.append(f"  no hot-row caches: {no_caches}")
    return _with_lines(plan, lines)


def _budget(device_budget: int, mesh: Any) -> tuple[int, str]:
    """(bytes per device the tables may take, where the figure comes from)."""
    if device_budget > 0:
        return device_budget, "embedding.device_budget"
    free, where = free_bytes_per_device(mesh)
    return int(free * AUTO_FRACTION), f"auto: {AUTO_FRACTION:.0%} of {size_text(free)} free {where}"


def _classify(config, metadata, tables, spec_tables, stats, devices, no_caches, overhead=0):
    """Each spec table the devices may hold, by how it is to be placed: (candidates, cached,
    weighed).

    candidates: whole tables of known rows, (bytes per device, spec table, rows, sharded,
        store table, forced, row bytes);
    cached: caches of given rows (or 0: planned), (spec table, rows, layout, store table,
        row bytes, forced, most rows);
    weighed: sized by their lookups, (spec table, layout, store table, row bytes, forced
        cache, most rows, [(rows, lookups)] hottest first, may go whole).
    """
    embedding, features = config.embedding, metadata.categorical
    distinct = {name: int(s.get("distinct_estimate", 0)) for name, s in stats.items()}
    lookups = {name: lookup_bands(s, metadata) for name, s in stats.items()}
    store = {t.name: t for t in tables.tables}
    candidates, cached, weighed = [], [], []
    for spec_table in spec_tables:
        members = [f for f in features if f.table == spec_table]
        store_name = tables.feature_tables[members[0].name]
        config_of = store[store_name]
        where = embedding.placement.get(spec_table, "auto")
        placement = _placement(spec_table, where, config_of, no_caches)
        if placement is None:
            continue
        place, forced_rows, forced_layout = placement
        seen = sum(distinct.get(f.name, 0) for f in members)
        row_bytes = 4 * (embedding.dim + config_of.optimizer.state_width(embedding.dim))
        most = min(
            math.ceil(seen * HEADROOM) + 64 if seen else embedding.capacity, embedding.capacity
        )
        # more ids than embedding.capacity rows: the host store evicts the least recently
        # used, a table on the devices cannot; such a table goes there as a cache only
        outgrows = bool(seen) and math.ceil(seen * HEADROOM) + 64 > embedding.capacity
        if outgrows and place == "device" and not forced_rows:
            raise ConfigError(
                f"embedding.placement.{spec_table} = {where!r}: its features' {seen:,} "
                f"distinct ids need {math.ceil(seen * HEADROOM) + 64:,} rows with headroom, "
                f"more than embedding.capacity ({embedding.capacity:,}), and a table on the "
                "devices cannot evict rows as the host store does; raise embedding.capacity "
                'or place it as a cache ("cache")'
            )
        if outgrows and place == "auto" and no_caches:
            continue
        curve = merge_bands([lookups[f.name] for f in members if lookups.get(f.name)])
        if curve and not forced_rows and place in ("cache", "auto"):
            weighed.append(
                (
                    *(spec_table, forced_layout, store_name, row_bytes, place == "cache"),
                    *(most, curve, not outgrows),
                )
            )
            continue
        if outgrows and place == "auto":  # no lookup counts: a cache shares what is left
            cached.append((spec_table, 0, "", store_name, row_bytes, False, most))
            continue
        if place == "cache":
            cached.append(
                (spec_table, forced_rows, forced_layout, store_name, row_bytes, True, most)
            )
            continue
        if forced_rows:
            rows = forced_rows
        elif seen:
            rows = most
        elif place == "device":
            raise ConfigError(
                f"embedding.placement.{spec_table} = {where!r}: the dataset has no distinct-id "
                f'count for its features; give its rows: "device:ROWS"'
            )
        else:
            cached.append((spec_table, 0, "", store_name, row_bytes, False, most))  # unknown size
            continue
        sharded, per_device = split_layout(forced_layout, (rows + 1) * row_bytes, devices)
        per_device += (rows + 1) * overhead
        candidates.append(
            (per_device, spec_table, rows, sharded, store_name, where != "auto", row_bytes)
        )
    return candidates, cached, weighed


def _placement(spec_table: str, where: str, config_of: TableConfig, no_caches):
    """(place, rows, layout) that `embedding.placement` asks of a table ("auto", 0, "" when
    it does not); None where the table stays on the host."""
    place, forced_rows, forced_layout = (
        parse_placement(spec_table, where) if where != "auto" else ("auto", 0, "")
    )
    if place == "host":
        return None
    if place == "cache" and no_caches:
        raise ConfigError(
            f"embedding.placement.{spec_table} = {where!r}, but {no_caches}: hot-row "
            'caches cannot be used here ("device" or "host")'
        )
    reason = _unplaceable(config_of)
    if reason is None:
        return place, forced_rows, forced_layout
    if where != "auto":
        raise ConfigError(
            f"embedding.placement.{spec_table} = {where!r}: table {spec_table!r} cannot "
            f"be trained on the devices: {reason}"
        )
    return None


def _choose_whole(candidates, cached, budget: int, budget_note: str, no_caches):
    """(chosen, bytes per device used): the whole tables within the budget, those forced
    onto the devices first, then the smallest; a table left out goes to `cached` (a cache
    of it where the budget allows)."""
    chosen, used = [], 0
    for per_device, spec_table, rows, sharded, store_name, is_forced, row_bytes in sorted(
        candidates, key=lambda c: (not c[5], c[0])
    ):
        if used + per_device > budget:
            if is_forced:
                raise ConfigError(
                    f"embedding.device_budget = {budget:,} bytes per device ({budget_note}) is "
                    f"too small for table {spec_table!r} forced onto the devices by "
                    f"embedding.placement ({size_text(per_device)} per device, {size_text(used)} taken)"
                )
            if not no_caches:  # left on the host: a cache of it where the budget allows
                cached.append((spec_table, 0, "", store_name, row_bytes, False, rows))
            continue
        used += per_device
        chosen.append((spec_table, rows, sharded, store_name, False))
    return chosen, used


def _grouped(chosen, features, embedding, store, prefix_bits: int) -> DevicePlan:
    """The chosen tables as device tables: with `embedding.fuse_tables` those of each
    layout in one (and the caches of each layout in one), else one per spec table."""
    names = [f.name for f in features]
    groups: dict[tuple[Any, ...], list[tuple[str, int]]] = {}
    for spec_table, rows, sharded, store_name, cache in chosen:
        if cache:  # fused caches share one capacity: the hottest rows of any of them stay
            layout = "sharded" if sharded else "replicated"
            name = f"cache.{layout}" if embedding.fuse_tables else f"{spec_table}.cache"
            key: tuple[Any, ...] = (name, store_name)
        elif embedding.fuse_tables:
            key = ("sharded" if sharded else "replicated", store_name)
        else:
            key = (spec_table, store_name)
        groups.setdefault((*key, sharded, cache), []).append((spec_table, rows))
    device: list[DeviceTable] = []
    member_features: dict[str, tuple[str, ...]] = {}
    store_tables: dict[str, str] = {}
    prefixes: dict[str, tuple[int, ...]] = {}
    for (name, store_name, sharded, cache), members in groups.items():
        held = {t for t, _ in members}
        positions = tuple(i for i, f in enumerate(features) if f.table in held)
        device.append(
            DeviceTable(
                name=str(name),
                positions=positions,
                rows=sum(rows for _, rows in members),
                dim=embedding.dim,
                rule=_rule(store[store_name]),
                sharded=sharded,
                cache=cache,
            )
        )
        member_features[str(name)] = tuple(names[p] for p in positions)
        store_tables[str(name)] = store_name
        prefixes[str(name)] = tuple(p + 1 for p in positions)
    return DevicePlan(
        DeviceTableLayout(tuple(device), len(features)),
        member_features,
        store_tables,
        prefixes,
        prefix_bits,
        all_features=tuple(names),
    )


def _describe(
    plan: DevicePlan,
    chosen: Sequence[tuple[str, int, bool, str, bool]],
    spec_tables: Sequence[str],
    budget: int,
    budget_note: str,
    used: int,
) -> list[str]:
    whole = [c for c in chosen if not c[4]]
    caches = [c for c in chosen if c[4]]
    on = len(whole)
    replicated = sum(1 for c in whole if not c[2])
    lines = [
        f"device tables: {on} of {len(spec_tables)} tables on the devices "
        f"({replicated} replicated, {on - replicated} split by rows), {size_text(used)} of "
        f"{size_text(budget)} per device ({budget_note}); "
        f"{len(spec_tables) - on} in the host store"
        + (f", {len(caches)} of them with a hot-row cache on the devices" if caches else "")
    ]
    shown = whole if len(whole) <= 8 else sorted(whole, key=lambda c: -c[1])[:4]
    for spec_table, rows, sharded, _, _ in shown:
        lines.append(
            f"  {spec_table}: {rows:,} rows, {'split by rows' if sharded else 'replicated'}"
        )
    if len(shown) < len(whole):
        lines.append(f"  ... and {len(whole) - len(shown)} smaller tables")
    for spec_table, rows, sharded, _, _ in caches:
        lines.append(
            f"  {spec_table}: host store, hot-row cache of {rows:,} rows, "
            f"{'split by rows' if sharded else 'replicated'}"
        )
    return lines


def _with_lines(plan: DevicePlan, lines: Sequence[str]) -> DevicePlan:
    return dataclasses.replace(plan, lines=tuple(lines))
