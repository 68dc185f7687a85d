"""From a dataset's categorical features and the embedding config to the store's tables.

The feature spec names a table per categorical feature (several features may share
one). With `embedding.fuse_tables` (the default) every spec table lives in one
physical table, `FUSED_TABLE`: the ids of different features never collide, since
each feature's ids carry its own prefix in their high bits (see `pipeline.hashing`),
and a row's initial value depends only on its id. A batch then costs one request per
shard instead of one per table and shard, which is what makes the store keep up with
the dense step (the table-batched embeddings of FBGEMM and TorchRec fuse tables for
the same reason). Capacity and the tiering RAM budget scale with the number of spec
tables, so the ceiling on rows held is the same; eviction picks its least recently
used rows across all features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import TableConfig
from hybridrec.embedding_store.columns import describe_plan, plan_column_shards
from hybridrec.pipeline import CategoricalFeature, DatasetMetadata
from hybridrec.pipeline.id_map import IdMap
from hybridrec.training.config import EmbeddingConfig, TrainConfig
from hybridrec.training.data.input import ParquetReader

FUSED_TABLE = "embeddings"  # the physical table's name when tables are fused


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """The store's tables and which of them each feature reads."""

    tables: tuple[TableConfig, ...]  # in a stable order (checkpoints and servers compare them)
    feature_tables: dict[str, str]  # feature name -> physical table name


def plan_tables(embedding: EmbeddingConfig, features: Sequence[CategoricalFeature]) -> TablePlan:
    """The tables of a run on a dataset whose categorical features are `features`.

    `embedding` must be resolved (`training.defaults.resolve_auto`): no auto dim or rate.
    """
    if not embedding.dim or not embedding.optimizer.learning_rate:
        raise ValueError(
            "embedding.dim / embedding.optimizer.learning_rate are still 0 (auto): resolve the "
            "config for its dataset first (training.defaults.resolve_auto)"
        )
    spec_tables = list(dict.fromkeys(feature.table for feature in features))
    if not embedding.fuse_tables:
        return TablePlan(
            tables=tuple(embedding.table(name) for name in spec_tables),
            feature_tables={feature.name: feature.table for feature in features},
        )
    fused = embedding.table(FUSED_TABLE)
    tiering = fused.tiering
    if tiering.ram_rows:
        tiering = dataclasses.replace(tiering, ram_rows=tiering.ram_rows * len(spec_tables))
    fused = dataclasses.replace(fused, capacity=fused.capacity * len(spec_tables), tiering=tiering)
    return TablePlan(
        tables=(fused,), feature_tables={feature.name: FUSED_TABLE for feature in features}
    )


PLAN_SAMPLE_BATCHES = 20  # embedding.column_shards = 0 plans from this many first batches


def plan_columns(
    plan: TablePlan, batches: Sequence[Mapping[str, Any]], num_shards: int
) -> tuple[TablePlan, str]:
    """The plan with each table's column split chosen for how `batches` access it.

    Args:
        plan: the tables (their `column_shards` are the starting point).
        batches: per batch, feature name -> ids ([batch] uint64, or ragged with `.values`).
        num_shards: the shards the tables are spread over.

    Returns:
        (the plan with `column_shards` set per table, the lines to print at start-up).
    """
    accesses: dict[str, list[np.ndarray]] = {table.name: [] for table in plan.tables}
    for batch in batches:
        per_table: dict[str, list[np.ndarray]] = {}
        for feature, ids in batch.items():
            values = np.asarray(getattr(ids, "values", ids), np.uint64)
            per_table.setdefault(plan.feature_tables[feature], []).append(values)
        for table, parts in per_table.items():
            accesses[table].append(np.concatenate(parts))
    columns = plan_column_shards(plan.tables, accesses, num_shards)
    planned = tuple(
        dataclasses.replace(table, column_shards=columns[table.name]) for table in plan.tables
    )
    description = describe_plan(plan.tables, columns, accesses, num_shards)
    return TablePlan(tables=planned, feature_tables=plan.feature_tables), description


def resolve_tables(
    config: TrainConfig,
    metadata: DatasetMetadata,
    num_shards: int | None,
    *,
    id_map: IdMap | None = None,
) -> tuple[TablePlan, tuple[str, ...]]:
    """The store's tables for a resolved config, and the lines describing a column plan.

    With `embedding.column_shards = 0` each table's column split is planned from the ids of
    the first PLAN_SAMPLE_BATCHES training batches (read in file order, unshuffled, so an
    embedding server resolving the same config and data plans the same tables).

    Args:
        num_shards: the shards the tables are spread over (None: not known, which a
            planned split refuses).
        id_map: `embedding.id_map` loaded: the sample's ids as training will see them.
    """
    plan = plan_tables(config.embedding, metadata.categorical)
    if config.embedding.column_shards:
        return plan, ()
    if num_shards is None:
        raise UserError(
            "embedding.column_shards = 0 (planned) with embedding servers needs "
            "embedding.num_shards: the servers' total shard count"
        )
    reader = ParquetReader.of_dataset(
        metadata,
        metadata.split_files(config.data.train_split),
        batch_size=config.data.batch_size,
        seed=config.seed,
        id_map=id_map,
    )
    sample = [batch.ids for batch in reader.batches(PLAN_SAMPLE_BATCHES)]
    planned, description = plan_columns(plan, sample, num_shards)
    header, *per_table, balance = description.splitlines()
    split = [
        line
        for line, table in zip(per_table, planned.tables, strict=True)
        if table.column_shards > 1
    ]
    if len(per_table) > 8:  # many tables: name the split ones only
        split.append(f"  {len(per_table) - len(split)} of {len(per_table)} tables keep whole rows")
        per_table = split
    return planned, (header, *per_table, balance)
