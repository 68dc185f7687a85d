"""The Tower Partitioner on a finished run: `model.towers` for the next one.

`model.dmt.propose_towers` groups features by how strongly their learned embeddings
interact; this reads what it needs from a run directory (its newest embedding snapshot,
through the run's checkpoints and the store's snapshot API) and from the run's dataset.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import checkpoint as store_checkpoint
from hybridrec.model.dmt import interaction_strength, lookup_loads, pooled_from_rows, propose_towers
from hybridrec.pipeline import read_metadata
from hybridrec.training.checkpoint import RunCheckpoints


def propose_towers_from_run(
    run_dir: str | Path,
    data_dir: str | Path,
    num_towers: int,
    *,
    batch_size: int = 512,
    rows: int = 8192,
    tolerance: float = 0.25,
) -> tuple[list[list[int]], list[str]]:
    """The Tower Partitioner on a finished run: `model.towers` for a next run.

    The run's embedding checkpoint gives the learned embeddings of the first `rows`
    examples of the dataset's eval split (train if it has none), hence the interaction
    strengths; distinct ids per batch of `batch_size` give each feature's lookup load.

    Args:
        run_dir: a `hybridrec train` run directory with a committed checkpoint.
        data_dir: its preprocessed dataset (metadata.json and Parquet splits).
        num_towers: towers wanted.
        batch_size: examples per step, for the loads.
        rows: examples read.
        tolerance: allowed excess of a tower's load over the mean.

    Returns:
        (towers as lists of feature positions, the categorical feature names by position).

    Raises:
        UserError: no checkpoint, no data, or multi-valued features (not supported).
    """
    import pyarrow.parquet as pq

    metadata = read_metadata(data_dir)
    bags = [feature.name for feature in metadata.categorical if feature.multi_valued]
    if bags:
        raise UserError(f"the Tower Partitioner reads single-valued features; {bags} are bags")
    features = [feature.name for feature in metadata.categorical]
    url = RunCheckpoints(run_dir).embeddings_url
    step = store_checkpoint.latest_checkpoint_step(url)
    if step is None:
        raise UserError(f"{run_dir}: no committed embedding checkpoint")
    splits = metadata.raw.get("splits", {})
    files = [
        f for split in ("eval", "train") if split in splits for f in metadata.split_files(split)
    ]
    if not files:
        raise UserError(f"{metadata.root}: no Parquet shards in the eval or train split")
    table = pq.read_table(files[0], columns=features).slice(0, rows)
    feature_ids = np.stack([table[name].to_numpy() for name in features], axis=1)
    pooled = None
    # ids carry their feature's prefix, so no id is in two tables: the rows add up
    for name in sorted(store_checkpoint.read_manifest(url, step)["tables"]):
        ids, values = store_checkpoint.read_table_rows(url, step, name)
        found = pooled_from_rows(ids, values, feature_ids)
        pooled = found if pooled is None else pooled + found
    strength = interaction_strength(pooled)
    towers = propose_towers(
        strength, lookup_loads(feature_ids, batch_size), num_towers, tolerance=tolerance
    )
    return towers, features
