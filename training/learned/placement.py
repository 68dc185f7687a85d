"""DMT placement: each tower's tables on its own server group, its Tower Module next to them.

`hybridrec train` runs a DMT model (`model.towers`) data-parallel: every process looks up
every feature of its rows from whichever servers hold them. Here the processes are split
into T groups (a group is a host, or a few): group t reads tower t's features for the
whole global batch, looks them up in tower t's tables on its own server group (local),
runs Tower Module t and exchanges only the compressed outputs with the other groups
(`model/tower_parallel.py`). The flat data-parallel layout of the same loop is the
baseline it is measured against (`scripts/bench_dmt.py`, `hybridrec.cli.placement_run`): same
batches, same model, same updates.

Both layouts train synchronously (lookup, step, update, in turn): this loop measures what
crosses the network per step and checks that the placed run learns what the flat one
does; it has no checkpoints (the hybrid trainer's asynchronous pipeline and checkpoints
are for the flat layout).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from hybridrec.common.errors import ConfigError
from hybridrec.common.progress import Progress
from hybridrec.embedding_store import EmbeddingStore
from hybridrec.embedding_store.remote.client import parse_addresses
from hybridrec.model import (
    StreamingMetrics,
    fetch_metrics,
)
from hybridrec.model.collectives import collective_bytes
from hybridrec.model.dmt import check_towers
from hybridrec.pipeline import CategoricalFeature
from hybridrec.training.config import EmbeddingConfig
from hybridrec.training.data.input import Batch
from hybridrec.training.layouts import feature_ids
from hybridrec.training.tables import TablePlan, plan_tables
from jax.experimental import multihost_utils

WARMUP_STEPS = 20  # steps left out of the steady rate and the bytes per step


def tower_of_process(process_index: int, process_count: int, num_towers: int) -> int:
    """The tower a process serves: processes split into `num_towers` contiguous groups."""
    if process_count % num_towers:
        raise ConfigError(
            f"model.towers: {num_towers} towers need a process count that divides by "
            f"{num_towers}, got {process_count} processes"
        )
    return process_index * num_towers // process_count


def tower_table_plans(
    embedding: EmbeddingConfig,
    features: Sequence[CategoricalFeature],
    towers: Sequence[Sequence[int]],
) -> list[TablePlan]:
    """Per tower, its features' tables; fused tables are named `tower_<t>`.

    A spec table shared by features of two towers cannot be placed with both.
    """
    check_towers(towers, len(features))
    owners: dict[str, int] = {}
    for index, tower in enumerate(towers):
        for position in tower:
            table = features[position].table
            if owners.setdefault(table, index) != index:
                raise ConfigError(
                    f"model.towers: table {table!r} is read by features of towers "
                    f"{owners[table]} and {index}; a table is placed with one tower"
                )
    plans = []
    for index, tower in enumerate(towers):
        plan = plan_tables(embedding, [features[position] for position in tower])
        if embedding.fuse_tables:
            (table,) = plan.tables
            renamed = dataclasses.replace(table, name=f"tower_{index}")
            plan = TablePlan(
                tables=(renamed,),
                feature_tables={name: renamed.name for name in plan.feature_tables},
            )
        plans.append(plan)
    return plans


def _lookup(store: EmbeddingStore, layout, batch: Batch, feature_tables, *, train: bool):
    ids = feature_ids(batch, layout.rows, layout.features)
    return store.lookup_features(ids, feature_tables=feature_tables, train=train).result()


def wire_bytes(
    store: EmbeddingStore, local: Iterable[str], group: Iterable[str] = ()
) -> dict[str, int]:
    """This process's store payload bytes so far, by where the server is.

    Returns:
        {"local": this host's servers, "group": the other servers of its tower group,
        "remote": every other server}.
    """
    local = set(parse_addresses(list(local))) if local else set()
    group = set(parse_addresses(list(group))) - local if group else set()
    out = {"local": 0, "group": 0, "remote": 0}
    for shard in store.shards:
        counted = getattr(shard, "wire_bytes", None)
        if counted is not None:
            where = (
                "local"
                if shard.address in local
                else "group"
                if shard.address in group
                else "remote"
            )
            out[where] += sum(counted.values())
    return out


def train(
    batches: Iterable[Batch],
    *,
    layout,
    state: Any,
    train_step,
    store: EmbeddingStore,
    feature_tables: Mapping[str, str],
    local_servers: Sequence[str] = (),
    group_servers: Sequence[str] = (),
    steps: int,
    warmup: int = WARMUP_STEPS,
) -> tuple[Any, dict[str, Any]]:
    """Trains `steps` global batches synchronously; returns the state and what was measured.

    Args:
        batches: the global batches (every process reads all rows; each uses its share).
        layout: `FlatLayout` or `TowerLayout` on the step's mesh.
        state: the dense train state on that mesh.
        train_step: the layout's jitted step (`make_train_step` or
            `make_tower_parallel_train_step`).
        store: this process's store (for a tower, its tower's tables only).
        feature_tables: feature -> table of that store.
        local_servers: addresses of the servers on this process's host.
        group_servers: addresses of its tower group's servers (tower-parallel).
        steps: batches to train.
        warmup: steps left out of the steady rate and the bytes per step.

    Returns:
        (state, {"losses": [...], "steady_samples_per_s", "store_bytes_per_step":
        {"local", "group", "remote"}, "collective_bytes_per_step": {...}}).
    """
    progress = Progress(f"train ({type(layout).__name__})", total=steps, unit="steps")
    losses, batch_size = [], None
    start_bytes = start_time = None
    collectives = None
    for index, batch in enumerate(batches):
        if index == steps:
            break
        if index == warmup:
            jax.block_until_ready(state)
            start_bytes, start_time = (
                wire_bytes(store, local_servers, group_servers),
                time.perf_counter(),
            )
        batch_size = batch.size
        lookup = _lookup(store, layout, batch, feature_tables, train=True)
        device_batch = layout.device_batch(batch, lookup.embeddings, train=True)
        if collectives is None:
            text = train_step.lower(state, device_batch).compile().as_text()
            collectives = collective_bytes(text, layout.mesh.devices.size)
        state, metrics, grads = train_step(state, device_batch)
        store.apply_pooled_gradients(lookup, layout.gradients(grads)).result()
        losses.append(fetch_metrics(metrics, index + 1)["loss"])  # raises if not finite
        progress.update(1)
    jax.block_until_ready(state)
    progress.close()
    measured = len(losses) - warmup
    record: dict[str, Any] = {"losses": losses}
    if measured > 0:
        elapsed = time.perf_counter() - start_time
        end_bytes = wire_bytes(store, local_servers, group_servers)
        record["steady_samples_per_s"] = measured * batch_size / elapsed
        record["store_bytes_per_step"] = {
            key: (end_bytes[key] - start_bytes[key]) / measured for key in end_bytes
        }
    record["collective_bytes_per_step"] = {
        key: value for key, value in (collectives or {}).items() if key != "ops"
    }
    return state, record


def evaluate(
    batches: Iterable[Batch],
    *,
    layout,
    state: Any,
    eval_step,
    store: EmbeddingStore,
    feature_tables: Mapping[str, str],
) -> dict[str, float]:
    """AUC and logloss over `batches` (global batches; padding rows left out)."""
    metrics = StreamingMetrics()
    for batch in batches:
        lookup = _lookup(store, layout, batch, feature_tables, train=False)
        probabilities = eval_step(state, layout.device_batch(batch, lookup.embeddings, train=False))
        if jax.process_count() > 1:
            probabilities = multihost_utils.process_allgather(probabilities, tiled=True)
        probabilities = np.asarray(probabilities)
        metrics.update(probabilities[batch.valid], batch.labels[batch.valid])
    return metrics.result()
