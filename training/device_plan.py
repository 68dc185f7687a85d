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
                                        the budget (`training.hot_rows`), if that holds
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
the host and says why. One trainer process in front of embedding servers may use them:
rows move between its devices and the servers over the wire (`take_rows`, `write_rows`).
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
from hybridrec.training.device_rows import DevicePlan
from hybridrec.training.tables import TablePlan
from jax.experimental import multihost_utils

AUTO_FRACTION = 0.25  # of a device's free memory, when embedding.device_budget = -1
REPLICATE_BYTES = 4 << 20  # tables up to this size get a replica on every device
MIN_CACHE_ROWS = 4096  # a smaller cache than this is not planned
# a cache's host work for each lookup of its table, in host-store lookups and updates
CACHE_LOOKUP_COST = 0.5
HEADROOM = 1.1  # rows planned per distinct id seen in the training split


def free_bytes_per_device(mesh: Any) -> tuple[int, str]:
    """(free bytes of one of this process's devices, where the number comes from); the
    smallest over the processes of a multi-process job, so that all plan alike."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        where = f"{device.device_kind} memory"
    else:
        local = len([d for d in mesh.devices.flat if d.process_index == device.process_index])
        free = _available_host_memory() // local
        where = f"host memory shared by {local} {device.platform} devices"
    if jax.process_count() > 1:
        free = int(np.min(multihost_utils.process_allgather(np.asarray(free, np.int64))))
        where += ", the smallest of the processes'"
    return free, where


def _available_host_memory() -> int:
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
) -> DevicePlan:
    """The run's device tables.

    Args:
        host_only: why this run keeps every table on the host (None: it need not); a
            table forced onto the devices then is a ConfigError.
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
    if embedding.device_budget > 0:
        budget, budget_note = embedding.device_budget, "embedding.device_budget"
    else:
        free, where = free_bytes_per_device(mesh)
        budget = int(free * AUTO_FRACTION)
        budget_note = f"auto: {AUTO_FRACTION:.0%} of {_size(free)} free {where}"
    stats = (metadata.raw.get("stats") or {}).get("categorical") or {}
    distinct = {name: int(s.get("distinct_estimate", 0)) for name, s in stats.items()}
    lookups = {name: _lookups(s, metadata) for name, s in stats.items()}
    store = {t.name: t for t in tables.tables}
    candidates = []  # (bytes per device, spec table, rows, sharded, store table, forced, row bytes)
    # (spec table, rows (0: planned), layout, store table, row bytes, forced, most rows)
    cached = []
    # sized by their lookups: (spec table, layout, store table, row bytes, forced cache,
    # most rows, [(rows, lookups)] hottest first)
    weighed = []
    for spec_table in spec_tables:
        members = [f for f in features if f.table == spec_table]
        store_name = tables.feature_tables[members[0].name]
        config_of = store[store_name]
        where = embedding.placement.get(spec_table, "auto")
        place, forced_rows, forced_layout = (
            parse_placement(spec_table, where) if where != "auto" else ("auto", 0, "")
        )
        if place == "host":
            continue
        reason = _unplaceable(config_of)
        if reason is not None:
            if where != "auto":
                raise ConfigError(
                    f"embedding.placement.{spec_table} = {where!r}: table {spec_table!r} cannot "
                    f"be trained on the devices: {reason}"
                )
            continue
        seen = sum(distinct.get(f.name, 0) for f in members)
        row_bytes = 4 * (embedding.dim + config_of.optimizer.state_width(embedding.dim))
        most = min(
            math.ceil(seen * HEADROOM) + 64 if seen else embedding.capacity, embedding.capacity
        )
        curve = _merge([lookups[f.name] for f in members if lookups.get(f.name)])
        if curve and not forced_rows and place in ("cache", "auto"):
            weighed.append(
                (spec_table, forced_layout, store_name, row_bytes, place == "cache", most, curve)
            )
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
        sharded, per_device = _split(forced_layout, (rows + 1) * row_bytes, devices)
        candidates.append(
            (per_device, spec_table, rows, sharded, store_name, where != "auto", row_bytes)
        )
    chosen, used = [], 0
    # tables forced onto the devices first; then the caches given their rows
    for per_device, spec_table, rows, sharded, store_name, is_forced, row_bytes in sorted(
        candidates, key=lambda c: (not c[5], c[0])
    ):
        if used + per_device > budget:
            if is_forced:
                raise ConfigError(
                    f"embedding.device_budget = {budget:,} bytes per device ({budget_note}) is "
                    f"too small for table {spec_table!r} forced onto the devices by "
                    f"embedding.placement ({_size(per_device)} per device, {_size(used)} taken)"
                )
            # left on the host: a cache of it where what is left of the budget allows
            cached.append((spec_table, 0, "", store_name, row_bytes, False, rows))
            continue
        used += per_device
        chosen.append((spec_table, rows, sharded, store_name, False))
    given = [c for c in cached if c[1]]
    used = _plan_caches(given, chosen, budget, budget_note, used, devices)
    # the others by lookups per byte: whole where a table's rows all earn their place
    used = _plan_by_lookups(weighed, chosen, budget, budget_note, used, devices)
    rest = [c for c in cached if not c[1]]  # no statistics: what is left, shared equally
    used = _plan_caches(rest, chosen, budget, budget_note, used, devices)
    if not chosen:
        return _with_lines(
            empty, [f"device tables: none fit {_size(budget)} per device ({budget_note})"]
        )
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
    plan = DevicePlan(
        DeviceTableLayout(tuple(device), len(features)),
        member_features,
        store_tables,
        prefixes,
        prefix_bits,
        all_features=tuple(names),
    )
    return _with_lines(plan, _describe(plan, chosen, spec_tables, budget, budget_note, used))


def _lookups(stats: dict, metadata: DatasetMetadata) -> list[tuple[float, float]]:
    """[(ids, lookups)] of a feature, hottest ids first: how many of its lookups the
    hottest ids take, estimated from the pipeline's counts of ids seen at least k times
    (`ids_with_count_at_least`); an id seen k to k' times counts sqrt(k * k') lookups
    (k for exactly k), and the hottest band takes what the others leave of the feature's
    rows. Empty without those counts."""
    at_least = {int(k): float(v) for k, v in (stats.get("ids_with_count_at_least") or {}).items()}
    if not at_least or at_least.get(1, 0) <= 0:
        return []
    rows = sum(split.get("rows", 0) for split in (metadata.raw.get("splits") or {}).values())
    total = rows * (1.0 - float(stats.get("missing_rate", 0.0)))
    thresholds = sorted(at_least, reverse=True)  # e.g. 1000, 100, 10, 5, 2, 1
    bands = []  # (ids, lookups) of each band, hottest first
    for i, low in enumerate(thresholds):
        ids = at_least[low] - (at_least[thresholds[i - 1]] if i else 0)
        high = thresholds[i - 1] if i else None
        each = low if high == low + 1 else math.sqrt(low * high) if high else low
        bands.append((max(ids, 0.0), max(ids, 0.0) * each))
    top_ids, top_floor = bands[0]
    rest = sum(count for _, count in bands[1:])
    bands[0] = (top_ids, max(total - rest, top_floor))
    return [band for band in bands if band[0] > 0]


def _merge(curves: Sequence[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """One table's bands from its features' (their ids never collide): densest first."""
    bands = [band for curve in curves for band in curve]
    return sorted(bands, key=lambda band: -band[1] / band[0])


def _plan_by_lookups(
    weighed: Sequence[tuple], chosen: list, budget: int, budget_note: str, used: int, devices: int
) -> int:
    """Gives the tables in `weighed` rows on the devices by the lookups each byte serves
    (their bands of ids, densest first over all tables, until the budget is spent);
    appends the whole tables and caches to `chosen`; returns the budget used.

    A table that gets all its planned rows goes onto the devices whole; one that gets
    fewer gets a hot-row cache of them when that is at least MIN_CACHE_ROWS (a forced
    cache that gets fewer is a ConfigError); the rest stay on the host only. A table's
    first rows (`_segments`) are granted whole or not at all, so no grant falls below the
    smallest cache.
    """
    segments = []  # (value per byte, table index, rows, bytes per row, whole or nothing)
    per_row = []  # bytes per device of one row, and its layout
    for index, (_, layout, _, row_bytes, forced, most, bands) in enumerate(weighed):
        sharded, _ = _split(layout, (most + 1) * row_bytes, devices)
        cost = row_bytes / devices if sharded else row_bytes
        per_row.append((cost, "sharded" if sharded else "replicated"))
        for rows, value, atomic in _values(_segments(bands, most), forced):
            segments.append((value / rows / cost, index, rows, cost, atomic))
    rows = [0.0] * len(weighed)
    stopped = [False] * len(weighed)  # a piece did not fit: the table takes no more
    # 2 rows of each table in reserve: a device table holds one row more than planned
    spare = budget - used - 2 * sum(cost for cost, _ in per_row)
    for density, index, ids, cost, atomic in sorted(segments, key=lambda s: -s[0]):
        if density <= 0 or stopped[index]:
            continue
        if atomic and ids * cost > spare:
            stopped[index] = True
            continue
        take = min(ids, max(spare, 0.0) / cost)
        rows[index] += take
        spare -= take * cost
    for index, (spec_table, _, store_name, row_bytes, forced, most, _) in enumerate(weighed):
        planned, layout = min(round(rows[index]), most), per_row[index][1]
        whole = planned >= most and not forced
        if not whole and planned < min(MIN_CACHE_ROWS, most):
            if forced:
                raise ConfigError(
                    f"embedding.device_budget = {budget:,} bytes per device ({budget_note}) "
                    f"leaves {_size(max(budget - used, 0))} for the cache of table "
                    f"{spec_table!r} (embedding.placement), under {MIN_CACHE_ROWS:,} rows; "
                    'give it rows ("cache:ROWS") or a larger budget'
                )
            continue
        sharded, per_device = _split(layout, (planned + 1) * row_bytes, devices)
        used += per_device
        chosen.append((spec_table, planned, sharded, store_name, not whole))
    return used


def _segments(bands: Sequence[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    """A table's (rows, lookups) in the order they come onto the devices, summing `most`
    rows: the first takes its densest bands up to the smallest cache (MIN_CACHE_ROWS, or
    the whole table when it is smaller), each further band one more, and the last the
    planned rows' headroom too (ids not seen yet)."""
    first = min(MIN_CACHE_ROWS, most)
    segments: list[list[float]] = []  # [rows, lookups]
    left = float(most)
    for ids, count in bands:
        take = min(ids, left)
        left -= take
        if segments and segments[0][0] < first:  # the first is not yet a whole cache
            part = min(take, first - segments[0][0])
            segments[0][0] += part
            segments[0][1] += count * part / ids
            take -= part
        if take > 0:
            segments.append([take, count * take / ids])
    if segments:
        segments[-1][0] += left
    return [(rows, count) for rows, count in segments]


def _values(
    segments: Sequence[tuple[float, float]], forced_cache: bool
) -> list[tuple[float, float, bool]]:
    """(rows, value, whole or nothing) of a table's pieces, in the order they come onto the
    devices; a piece's value is the lookups it serves less what a cache costs the host.

    A cache's bookkeeping on the host (its id map, admission counts and the split of each
    bag) costs about CACHE_LOOKUP_COST of a host-store lookup and update for every lookup
    of the table, held or not; a whole table costs none. So the first piece of a table
    pays for the cache, and the last piece, which makes the table whole, earns that back
    (it is ordered by that value, but may be taken in part: a larger cache). Pieces whose
    value per row rises are merged, so a table's values per row only fall; the first
    piece comes whole or not at all.
    """
    total = sum(count for _, count in segments)
    pieces = [[rows, count, position == 0] for position, (rows, count) in enumerate(segments)]
    if not forced_cache and pieces:
        pieces[0][1] -= CACHE_LOOKUP_COST * total
        pieces[-1][1] += CACHE_LOOKUP_COST * total
    merged: list[list] = []
    for piece in pieces:
        merged.append(piece)
        while len(merged) > 1 and merged[-1][1] / merged[-1][0] > merged[-2][1] / merged[-2][0]:
            rows, value, atomic = merged.pop()
            merged[-1][0] += rows
            merged[-1][1] += value
            merged[-1][2] = merged[-1][2] or atomic
    return [(rows, value, atomic) for rows, value, atomic in merged]


def _split(layout: str, total: int, devices: int) -> tuple[bool, int]:
    """(split by rows, bytes per device) of a table of `total` bytes: split when its layout
    says "sharded", or, with none given, when larger than REPLICATE_BYTES."""
    sharded = layout == "sharded" or (not layout and total > REPLICATE_BYTES and devices > 1)
    return sharded, math.ceil(total / devices) if sharded else total


def _plan_caches(
    cached: Sequence[tuple], chosen: list, budget: int, budget_note: str, used: int, devices: int
) -> int:
    """Appends to `chosen` the caches of the tables in `cached` that get one; returns the
    budget used.

    A forced cache with its rows gets them (a ConfigError if they do not fit); the others
    share what is left equally (up to the rows their table is planned to hold), forced
    ones first; an auto one that would hold fewer than MIN_CACHE_ROWS rows is not
    planned, a forced one is a ConfigError.
    """
    ordered = sorted(cached, key=lambda c: (not c[5], not c[1]))
    for index, entry in enumerate(ordered):
        spec_table, rows, layout, store_name, row_bytes, forced, most = entry
        left = budget - used
        if not rows:
            share = left // (len(ordered) - index)
            sharded, _ = _split(layout, share, devices)
            rows = min(share * (devices if sharded else 1) // row_bytes - 1, most)
            if rows < min(MIN_CACHE_ROWS, most):
                if forced:
                    raise ConfigError(
                        f"embedding.device_budget = {budget:,} bytes per device ({budget_note}) "
                        f"leaves {_size(max(left, 0))} for the cache of table {spec_table!r} "
                        f"(embedding.placement), under {MIN_CACHE_ROWS:,} rows; give it rows "
                        '("cache:ROWS") or a larger budget'
                    )
                continue
        sharded, per_device = _split(layout, (rows + 1) * row_bytes, devices)
        if used + per_device > budget:
            raise ConfigError(
                f"embedding.device_budget = {budget:,} bytes per device ({budget_note}) is too "
                f"small for the cache of table {spec_table!r} forced by embedding.placement "
                f"({_size(per_device)} per device, {_size(used)} taken)"
            )
        used += per_device
        chosen.append((spec_table, rows, sharded, store_name, True))
    return used


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
        f"({replicated} replicated, {on - replicated} split by rows), {_size(used)} of "
        f"{_size(budget)} per device ({budget_note}); "
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


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
