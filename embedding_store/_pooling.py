"""Pooled lookups: per-table id dedupe across features, bag pooling and its backward pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from hybridrec.embedding_store._arrays import sum_by_inverse, take_rows, unique_inverse
from hybridrec.embedding_store.errors import InvalidInputError

Pooling = Literal["sum", "mean", "sqrtn"]


@dataclasses.dataclass(frozen=True)
class RaggedIds:
    """A multi-valued feature: bag b holds `values[offsets[b]:offsets[b + 1]]`."""

    values: np.ndarray  # [nnz] uint64
    offsets: np.ndarray  # [batch + 1] int64, offsets[0] == 0, non-decreasing, offsets[-1] == nnz


FeatureIds = np.ndarray | RaggedIds


@dataclasses.dataclass
class _TableIds:
    """All ids one call sends to one table, deduplicated."""

    unique: np.ndarray  # [u] uint64 distinct ids
    inverse: np.ndarray  # [total] int64: occurrence -> index in `unique`
    # {stored table (the table or a column slice): (order [u] unique ids grouped by shard,
    # bounds [num_shards + 1])}, set by the store's routing
    routes: dict | None = None


@dataclasses.dataclass
class _Feature:
    name: str
    table: str
    start: int  # this feature's occurrences within its table's concatenated ids
    stop: int
    counts: np.ndarray | None  # [batch] bag sizes (None: single-valued)
    offsets: np.ndarray | None


@dataclasses.dataclass
class PooledLookup:
    """Result of `EmbeddingStore.lookup_features`, kept for `apply_pooled_gradients`."""

    embeddings: np.ndarray  # [batch, features, dim] float32, features in call order
    features: tuple[str, ...]
    pooling: Pooling
    _features: list[_Feature] = dataclasses.field(repr=False, default_factory=list)
    _tables: dict[str, _TableIds] = dataclasses.field(repr=False, default_factory=dict)


def _check_ids(name: str, ids: object) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        described = (
            f"{ids.dtype} array of shape {ids.shape}"
            if isinstance(ids, np.ndarray)
            else type(ids).__name__
        )
        raise InvalidInputError(f"{name}: ids must be a 1-D uint64 numpy array, got {described}")
    return ids


def _check_feature(name: str, ids: FeatureIds) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Returns (values [nnz], offsets [B+1] or None, batch)."""
    if isinstance(ids, RaggedIds):
        values = _check_ids(f"feature {name!r} values", ids.values)
        offsets = ids.offsets
        if (
            not isinstance(offsets, np.ndarray)
            or offsets.ndim != 1
            or offsets.dtype.kind not in "iu"
            or len(offsets) < 1
        ):
            raise InvalidInputError(
                f"feature {name!r}: offsets must be a 1-D integer numpy array of length batch + 1"
            )
        offsets = offsets.astype(np.int64, copy=False)
        if offsets[0] != 0 or offsets[-1] != len(values) or np.any(np.diff(offsets) < 0):
            raise InvalidInputError(
                f"feature {name!r}: offsets must start at 0, never decrease and end at "
                f"len(values) = {len(values)} (got first {offsets[0]}, last {offsets[-1]})"
            )
        return values, offsets, len(offsets) - 1
    values = _check_ids(f"feature {name!r}", ids)
    return values, None, len(values)


def dedupe(ids: np.ndarray) -> _TableIds:
    """Distinct ids with everything the backward pass needs."""
    unique, inverse = unique_inverse(ids)
    return _TableIds(unique, inverse)


def plan(
    features: Mapping[str, FeatureIds],
    feature_tables: Mapping[str, str],
    dims: Mapping[str, int],
    pooling: str,
) -> tuple[list[_Feature], dict[str, _TableIds], int, int]:
    """Validates a batch and dedupes its ids per table. Returns (features, tables, batch, dim)."""
    if pooling not in ("sum", "mean", "sqrtn"):
        raise InvalidInputError(f"pooling must be sum, mean or sqrtn, got {pooling!r}")
    if not features:
        raise InvalidInputError("lookup_features needs at least one feature")
    per_table: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, int] = {}
    planned, batch, dim = [], None, None
    for name, ids in features.items():
        if name not in feature_tables:
            raise InvalidInputError(f"feature {name!r} has no entry in feature_tables")
        table = feature_tables[name]
        if table not in dims:
            from hybridrec.embedding_store.errors import UnknownTableError

            raise UnknownTableError(
                f"feature {name!r} maps to unknown table {table!r}; tables: {', '.join(dims)}"
            )
        values, offsets, rows = _check_feature(name, ids)
        if batch is None:
            batch, dim = rows, dims[table]
        if rows != batch:
            raise InvalidInputError(f"feature {name!r} has batch {rows}, earlier features {batch}")
        if dims[table] != dim:
            raise InvalidInputError(
                f"feature {name!r}: table {table!r} has dim {dims[table]}, earlier features' "
                f"tables {dim}; one lookup_features call needs a single dim"
            )
        start = sizes.get(table, 0)
        sizes[table] = start + len(values)
        per_table.setdefault(table, []).append(values)
        counts = np.diff(offsets) if offsets is not None else None
        planned.append(_Feature(name, table, start, start + len(values), counts, offsets))
    tables = {
        table: dedupe(np.concatenate(parts) if len(parts) > 1 else parts[0])
        for table, parts in per_table.items()
    }
    return planned, tables, batch, dim


def pool(
    features: list[_Feature],
    tables: Mapping[str, _TableIds],
    rows: Mapping[str, np.ndarray],
    batch: int,
    dim: int,
    pooling: str,
) -> np.ndarray:
    """Unique rows per table -> [batch, features, dim] float32 pooled embeddings."""
    if _one_table_of_single_values(features, batch):
        # [batch, features] row indices: one gather writes the result in place
        index = tables[features[0].table].inverse.reshape(len(features), batch).T
        taken = take_rows(rows[features[0].table], index.reshape(-1))
        return taken.reshape(batch, len(features), dim)  # (a batch of 0 rows too)
    out = np.zeros((batch, len(features), dim), np.float32)
    for index, feature in enumerate(features):
        occurrences = tables[feature.table].inverse[feature.start : feature.stop]
        gathered = take_rows(rows[feature.table], occurrences)
        if feature.counts is None:
            out[:, index] = gathered
            continue
        nonempty = feature.counts > 0
        if len(gathered):
            out[nonempty, index] = np.add.reduceat(gathered, feature.offsets[:-1][nonempty], axis=0)
        if pooling != "sum":
            out[nonempty, index] /= _scale(feature.counts[nonempty], pooling)[:, None]
    return out


def _one_table_of_single_values(features: list[_Feature], batch: int) -> bool:
    """Whether every feature is single-valued and they fill one table's ids in order."""
    table = features[0].table
    return all(
        f.counts is None and f.table == table and f.start == i * batch
        for i, f in enumerate(features)
    )


def _scale(counts: np.ndarray, pooling: str) -> np.ndarray:
    counts = counts.astype(np.float32)
    return counts if pooling == "mean" else np.sqrt(counts)


def unpool(lookup: PooledLookup, grads: np.ndarray) -> dict[str, np.ndarray]:
    """dL/d(pooled) [batch, features, dim] -> {table: per-unique-id gradient [u, dim]}."""
    features = lookup._features
    if _one_table_of_single_values(features, len(grads)):
        ids = lookup._tables[features[0].table]
        occurrences = grads.transpose(1, 0, 2).reshape(-1, grads.shape[2])  # feature-major
        return {features[0].table: sum_by_inverse(occurrences, ids.inverse, len(ids.unique))}
    per_table: dict[str, list[np.ndarray]] = {}
    for index, feature in enumerate(lookup._features):
        g = grads[:, index]
        if feature.counts is not None:
            if lookup.pooling != "sum":
                g = g / np.maximum(_scale(feature.counts, lookup.pooling), 1)[:, None]
            g = np.repeat(g, feature.counts, axis=0)
        per_table.setdefault(feature.table, []).append(g)
    result = {}
    for table, parts in per_table.items():
        ids = lookup._tables[table]
        occurrences = np.concatenate(parts) if len(parts) > 1 else parts[0]
        result[table] = sum_by_inverse(occurrences, ids.inverse, len(ids.unique))
    return result


def check_rows(table: Any, grads: object, rows: int) -> np.ndarray:
    """`grads` as a float32 [rows, table.dim] array, or an InvalidInputError naming the table."""
    if not isinstance(grads, np.ndarray) or grads.dtype.kind != "f":
        described = (
            f"{grads.dtype} array" if isinstance(grads, np.ndarray) else type(grads).__name__
        )
        raise InvalidInputError(
            f"table {table.name!r}: gradients must be a float numpy array, got {described}"
        )
    if grads.shape != (rows, table.dim):
        raise InvalidInputError(
            f"table {table.name!r}: gradients must have shape [{rows}, {table.dim}] "
            f"(one row per id), got {list(grads.shape)}"
        )
    return grads.astype(np.float32, copy=False)
