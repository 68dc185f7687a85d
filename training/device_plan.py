"""Where each embedding table lives: on the devices, or in the host store.

TorchRec keeps tables in device memory; PERSIA keeps them on embedding servers. A run
here does both: `plan_devices` puts the spec tables that fit `embedding.device_budget`
(bytes per device, optimizer state included) on the devices, smallest first, and leaves
the rest to the host store and the hybrid loop. A table's rows come from the dataset's
statistics (the distinct ids of its features, with 10% headroom), or from the config.

    small tables (<= REPLICATE_BYTES)   one replica on every device; their gradient is
                                        reduced over the devices like the dense one
    larger tables                       rows split over all devices
    the rest                            the host store (async, staleness k)

With `embedding.fuse_tables` the tables of each kind share one device table (their ids
never collide: each feature's ids carry its prefix), so a step gathers and updates
rows with two operations, not one per table (FBGEMM's table-batched embeddings).
`embedding.placement.<table>` overrides the choice per table; the plan is printed at
start-up. Where device tables cannot go (embedding servers, the tower-parallel layout,
a followed stream) the auto plan keeps everything on the host and says why.
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
    distinct = {
        name: int(stats.get("distinct_estimate", 0))
        for name, stats in ((metadata.raw.get("stats") or {}).get("categorical") or {}).items()
    }
    store = {t.name: t for t in tables.tables}
    candidates = []  # (bytes per device, spec table, rows, sharded, store table)
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
        if forced_rows:
            rows = forced_rows
        elif seen:
            rows = min(math.ceil(seen * HEADROOM) + 64, embedding.capacity)
        elif place == "device":
            raise ConfigError(
                f"embedding.placement.{spec_table} = {where!r}: the dataset has no distinct-id "
                f'count for its features; give its rows: "device:ROWS"'
            )
        else:
            continue  # unknown size: the host store grows as needed
        width = embedding.dim + config_of.optimizer.state_width(embedding.dim)
        total = (rows + 1) * width * 4
        sharded = forced_layout == "sharded" or (
            not forced_layout and total > REPLICATE_BYTES and devices > 1
        )
        per_device = math.ceil(total / devices) if sharded else total
        candidates.append((per_device, spec_table, rows, sharded, store_name, where != "auto"))
    chosen, used = [], 0
    for per_device, spec_table, rows, sharded, store_name, is_forced in sorted(
        candidates, key=lambda c: (not c[5], c[0])
    ):
        if used + per_device > budget:
            if is_forced:
                raise ConfigError(
                    f"embedding.device_budget = {budget:,} bytes per device ({budget_note}) is "
                    f"too small for table {spec_table!r} forced onto the devices by "
                    f"embedding.placement ({_size(per_device)} per device, {_size(used)} taken)"
                )
            continue
        used += per_device
        chosen.append((spec_table, rows, sharded, store_name))
    if not chosen:
        return _with_lines(
            empty, [f"device tables: none fit {_size(budget)} per device ({budget_note})"]
        )
    groups: dict[tuple[Any, ...], list[tuple[str, int]]] = {}
    for spec_table, rows, sharded, store_name in chosen:
        key = (
            ("sharded" if sharded else "replicated", store_name)
            if embedding.fuse_tables
            else (
                spec_table,
                store_name,
            )
        )
        groups.setdefault((*key, sharded), []).append((spec_table, rows))
    device: list[DeviceTable] = []
    member_features: dict[str, tuple[str, ...]] = {}
    store_tables: dict[str, str] = {}
    prefixes: dict[str, tuple[int, ...]] = {}
    for (name, store_name, sharded), members in groups.items():
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


def _describe(
    plan: DevicePlan,
    chosen: Sequence[tuple[str, int, bool, str]],
    spec_tables: Sequence[str],
    budget: int,
    budget_note: str,
    used: int,
) -> list[str]:
    on = len(chosen)
    replicated = sum(1 for _, _, sharded, _ in chosen if not sharded)
    lines = [
        f"device tables: {on} of {len(spec_tables)} tables on the devices "
        f"({replicated} replicated, {on - replicated} split by rows), {_size(used)} of "
        f"{_size(budget)} per device ({budget_note}); "
        f"{len(spec_tables) - on} in the host store"
    ]
    shown = chosen if len(chosen) <= 8 else sorted(chosen, key=lambda c: -c[1])[:4]
    for spec_table, rows, sharded, _ in shown:
        lines.append(
            f"  {spec_table}: {rows:,} rows, {'split by rows' if sharded else 'replicated'}"
        )
    if len(shown) < len(chosen):
        lines.append(f"  ... and {len(chosen) - len(shown)} smaller tables")
    return lines


def _with_lines(plan: DevicePlan, lines: Sequence[str]) -> DevicePlan:
    return dataclasses.replace(plan, lines=tuple(lines))


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
