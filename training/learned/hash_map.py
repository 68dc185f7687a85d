"""Learning an id -> bucket map from a trained run ("learning to collide").

A table too small for every id must let ids share rows. The hashing trick picks the
sharing at random (`bucket = hash(id) % buckets`), so a frequent id may share its row
with anything. A learned mapping chooses it from a previous run: per feature, the most
frequent ids keep rows of their own, and the long tail is grouped by where the previous
run's training put their embeddings (their two principal components), so that ids
sharing a row are ids the model already treated alike. Ids the previous run never saw
are hashed into the tail's buckets.

Per feature with n distinct ids in the previous run's training split and a budget of
`buckets = ceil(fraction * n)` rows:
  * the `ceil(exclusive_share * buckets)` most frequent ids get one bucket each;
  * the other ids are sorted into the remaining buckets on a grid over their
    embeddings' first two principal components, with cells of equal access mass
    (strips along the first component, then cells along the second within a strip).

A mapped id keeps its feature's prefix in the high bits (so fused tables stay
collision-free across features) and carries `bucket + 1` below it.

    hybridrec learn-hash --run runs/criteo --out runs/criteo_map --fraction 0.25
    hybridrec train ... --set embedding.id_map='"runs/criteo_map"'          # learned
    hybridrec train ... --set embedding.id_map='"runs/criteo_map"' \\
        --set embedding.id_map_kind='"hashing_trick"'                        # same budget
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import checkpoint as store_checkpoint
from hybridrec.pipeline import read_metadata
from hybridrec.pipeline.id_counts import count_ids
from hybridrec.pipeline.id_map import FeatureMap, find_sorted, write_id_map
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.config import load_config
from hybridrec.training.run_dir import require_run_dir
from hybridrec.training.tables import plan_tables


def _tail_buckets(vectors: np.ndarray, counts: np.ndarray, num_buckets: int) -> np.ndarray:
    """[n] buckets in [0, num_buckets) grouping rows of similar `vectors` ([n, dim]),
    cells of about equal total `counts`, on a grid over the first two principal components."""
    n = len(vectors)
    if n == 0:
        return np.zeros(0, np.int64)
    if num_buckets >= n:
        return np.arange(n, dtype=np.int64)
    centered = vectors - vectors.mean(axis=0)
    if np.any(centered):
        _, _, components = np.linalg.svd(centered, full_matrices=False)
        coordinates = centered @ components[:2].T
    else:
        coordinates = np.zeros((n, 2))
    if coordinates.shape[1] < 2:
        coordinates = np.pad(coordinates, ((0, 0), (0, 2 - coordinates.shape[1])))
    strips = max(1, min(num_buckets, math.ceil(math.sqrt(num_buckets))))  # PC1 first
    cells = np.full(strips, num_buckets // strips)
    cells[: num_buckets % strips] += 1
    first = np.cumsum(cells) - cells  # first bucket of each strip
    weights = counts.astype(np.float64)
    buckets = np.empty(n, np.int64)
    order = np.lexsort((np.arange(n), coordinates[:, 0]))
    mass = np.cumsum(weights[order]) - weights[order] / 2
    strip_of = np.minimum((mass / weights.sum() * strips).astype(np.int64), strips - 1)
    for strip in range(strips):
        members = order[strip_of == strip]
        if not len(members):
            continue
        inner = members[np.lexsort((members, coordinates[members, 1]))]
        inner_mass = np.cumsum(weights[inner]) - weights[inner] / 2
        cell = (inner_mass / weights[inner].sum() * cells[strip]).astype(np.int64)
        buckets[inner] = first[strip] + np.minimum(cell, cells[strip] - 1)
    return buckets


def build_feature_map(
    ids: np.ndarray,
    counts: np.ndarray,
    vectors: np.ndarray,
    *,
    fraction: float,
    exclusive_share: float = 0.5,
) -> FeatureMap:
    """One feature's learned mapping.

    Args:
        ids: [n] uint64 ids seen in the previous run's training split, most frequent first.
        counts: [n] their occurrence counts.
        vectors: [n, dim] float32 the previous run's embeddings of them (zeros where the run
            holds no row for an id).
        fraction: bucket budget as a fraction of n.
        exclusive_share: share of the budget given one frequent id per bucket.
    """
    n = len(ids)
    num_buckets = max(1, math.ceil(fraction * n))
    if num_buckets >= n:  # no collisions needed: every id its own bucket
        buckets = np.arange(n, dtype=np.int64)
        exclusive = n
        num_buckets = max(n, 1)
    else:
        exclusive = min(math.ceil(exclusive_share * num_buckets), num_buckets - 1)
        buckets = np.empty(n, np.int64)
        buckets[:exclusive] = np.arange(exclusive)
        buckets[exclusive:] = exclusive + _tail_buckets(
            vectors[exclusive:], counts[exclusive:], num_buckets - exclusive
        )
    order = np.argsort(ids, kind="stable")
    return FeatureMap(
        ids=ids[order].astype(np.uint64),
        buckets=buckets[order],
        num_buckets=num_buckets,
        exclusive=exclusive,
    )


def learn_id_map(
    run_dir: str | Path,
    out: str | Path,
    *,
    fraction: float,
    exclusive_share: float = 0.5,
    step: int | None = None,
) -> dict[str, Any]:
    """Learns the id -> bucket mapping of every feature from a trained run and writes it.

    Access counts come from a Beam pass over the run's training split
    (`pipeline.id_counts`), embeddings from the run's checkpoint at `step` (default: the
    newest complete one).

    Returns:
        A summary: the output directory, ids seen, total buckets, per-feature budgets.
    """
    if not 0 < fraction <= 1:
        raise UserError(f"--fraction must be in (0, 1], got {fraction}")
    if not 0 <= exclusive_share < 1:
        raise UserError(f"--exclusive-share must be in [0, 1), got {exclusive_share}")
    run_dir = Path(run_dir)
    require_run_dir(run_dir)
    config = load_config(None, [], run_dir)
    if config.embedding.id_map:
        raise UserError(f"{run_dir} trained with an id map already; learn from a run without one")
    if config.embedding.column_shards != 1:
        raise UserError(f"{run_dir}: learning from a run with column-split tables is not supported")
    metadata = read_metadata(config.data.path)
    checkpoints = RunCheckpoints(run_dir, keep=config.checkpoint.keep)
    step = checkpoints.resolve_step(step, "learn embeddings from")
    counts = count_ids(metadata, config.data.train_split)
    plan = plan_tables(config.embedding, metadata.categorical)
    rows = {
        table.name: store_checkpoint.read_table_rows(checkpoints.embeddings_url, step, table.name)
        for table in plan.tables
    }
    features = {}
    for feature in metadata.categorical:
        ids, feature_counts = counts[feature.name]
        table_ids, table_values = rows[plan.feature_tables[feature.name]]
        position, held = find_sorted(table_ids, ids)
        vectors = np.zeros((len(ids), config.embedding.dim), np.float32)
        vectors[held] = table_values[position[held]]
        features[feature.name] = build_feature_map(
            ids, feature_counts, vectors, fraction=fraction, exclusive_share=exclusive_share
        )
    prefix_bits = int(metadata.raw["hash_scheme"]["prefix_bits"])
    source = {
        "run": str(run_dir),
        "step": step,
        "fraction": fraction,
        "exclusive_share": exclusive_share,
    }
    write_id_map(out, features, prefix_bits=prefix_bits, source=source)
    seen = sum(len(feature.ids) for feature in features.values())
    buckets = sum(feature.num_buckets for feature in features.values())
    return {
        "out": str(out),
        "step": step,
        "ids": seen,
        "buckets": buckets,
        "features": len(features),
    }
