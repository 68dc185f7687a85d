"""Per-row predictions of a checkpoint the way `hybridrec evaluate` computes them.

`evaluate` reports AUC and logloss only; checking serving against it needs each row's
probability. This recomputes them with the same pieces: the checkpoint's embeddings
restored into an in-process store, pooled lookups without admission, the restored
dense state and `model.make_eval_step` over the run's mesh.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pyarrow.parquet as pq

from embedding_store import EmbeddingStore
from model import create_train_state, local_rows, make_eval_step, make_global_batch, make_mesh
from pipeline import read_metadata
from training.checkpoint import RunCheckpoints
from training.job import load_config
from training.tables import plan_tables


def evaluate_rows(run_dir: str | Path, data_dir: str | Path | None = None, split: str = "eval"):
    """Per-row probabilities of `split` computed the way `hybridrec evaluate` computes them.

    The checkpoint's embeddings restored into an in-process store, pooled lookups without
    admission, the restored dense state, and `model.make_eval_step` on the run's mesh over this process's devices.

    Returns:
        ids [n, F] uint64, dense [n, d] float32, labels [n] float32, probabilities [n] float32.
    """
    run_dir = Path(run_dir)
    config = load_config(None, [], run_dir)
    metadata = read_metadata(data_dir or config.data.path)
    plan = plan_tables(config.embedding, metadata.categorical)
    checkpoints = RunCheckpoints(run_dir)
    step = checkpoints.latest_step()
    mesh = make_mesh(config.mesh)
    state = create_train_state(
        config.model,
        config.optimizer,
        mesh,
        jax.random.key(config.seed),
        num_dense=len(metadata.dense_columns),
        num_features=len(metadata.categorical),
        embedding_dim=config.embedding.dim,
    )
    state = checkpoints.restore_dense(step, state)
    checkpoints.close()
    eval_step = make_eval_step(mesh)
    table = pq.read_table(metadata.split_files(split))
    names = [feature.name for feature in metadata.categorical]
    ids = np.stack([table.column(n).to_numpy().astype(np.uint64) for n in names], axis=1)
    dense = np.stack(
        [table.column(n).to_numpy().astype(np.float32) for n in metadata.dense_columns], axis=1
    )
    labels = table.column(metadata.label_column).to_numpy().astype(np.float32)
    batch = config.data.eval_batch_size or config.data.batch_size  # as evaluate batches
    probabilities = []
    with EmbeddingStore.restore(
        checkpoints.embeddings_url, plan.tables, step=step, num_shards=4
    ) as store:
        for start in range(0, len(ids), batch):
            rows = slice(start, min(start + batch, len(ids)))
            count = rows.stop - rows.start
            pad = batch - count  # evaluate pads its final batch to the full size: same shapes
            batch_ids = np.concatenate([ids[rows], np.repeat(ids[rows][:1], pad, 0)])
            batch_dense = np.concatenate([dense[rows], np.repeat(dense[rows][:1], pad, 0)])
            pooled = store.lookup_features(
                {name: batch_ids[:, column] for column, name in enumerate(names)},
                feature_tables=plan.feature_tables,
                pooling=config.embedding.pooling,
                train=False,
            ).result()
            global_batch = make_global_batch(
                {"embeddings": pooled.embeddings, "dense": batch_dense}, mesh
            )
            probabilities.append(local_rows(eval_step(state, global_batch))[:count])
    return ids, dense, labels, np.concatenate(probabilities)
