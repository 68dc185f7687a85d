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
from collections.abc import Sequence

from embedding_store import TableConfig
from pipeline import CategoricalFeature
from training.config import EmbeddingConfig

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
