"""Learning an id -> bucket mapping from a trained run (the mapping itself: training.learned_hash)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import checkpoint as store_checkpoint
from hybridrec.pipeline import read_metadata
from hybridrec.pipeline.id_counts import count_ids
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.job import load_config, require_run_dir
from hybridrec.training.learned_hash import build_feature_map, find_sorted, write_id_map
from hybridrec.training.tables import plan_tables


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
    step = step if step is not None else checkpoints.latest_step()
    if step is None:
        raise UserError(f"{run_dir}: no complete checkpoint to learn embeddings from")
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
