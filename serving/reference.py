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
import pyarrow.compute as pc
import pyarrow.parquet as pq
from hybridrec.embedding_store import EmbeddingStore, RaggedIds
from hybridrec.model import (
    create_train_state,
    local_rows,
    make_eval_step,
    make_global_batch,
    make_mesh,
)
from hybridrec.pipeline import read_metadata
from hybridrec.serving.bags import concatenate, slice_rows
from hybridrec.training import RunCheckpoints, load_config, plan_tables


def evaluate_rows(run_dir: str | Path, data_dir: str | Path | None = None, split: str = "eval"):
    """Per-row probabilities of `split` computed the way `hybridrec evaluate` computes them.

    The checkpoint's embeddings restored into an in-process store, pooled lookups without
    admission, the restored dense state, and `model.make_eval_step` on the run's mesh over this process's devices.

    Returns:
        ids, dense [n, d] float32, labels [n] float32, probabilities [n] float32. ids is
        [n, F] uint64 when every feature is single-valued, else {feature: [n] uint64 |
        RaggedIds} in spec order (the form `ServedModel.predict` takes).
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
    features = {feature.name: _feature_ids(table, feature) for feature in metadata.categorical}
    dense = np.stack(
        [table.column(n).to_numpy().astype(np.float32) for n in metadata.dense_columns], axis=1
    )
    labels = table.column(metadata.label_column).to_numpy().astype(np.float32)
    batch = config.data.eval_batch_size or config.data.batch_size  # as evaluate batches
    probabilities = []
    with EmbeddingStore.restore(
        checkpoints.embeddings_url, plan.tables, step=step, num_shards=4
    ) as store:
        for start in range(0, len(dense), batch):
            stop = min(start + batch, len(dense))
            count = stop - start
            pad = batch - count  # evaluate pads its final batch to the full size: same shapes
            batch_ids = {
                name: _pad(slice_rows(ids, start, stop), pad) for name, ids in features.items()
            }
            batch_dense = np.concatenate(
                [dense[start:stop], np.repeat(dense[start:stop][:1], pad, 0)]
            )
            pooled = store.lookup_features(
                batch_ids,
                feature_tables=plan.feature_tables,
                pooling=config.embedding.pooling,
                train=False,
            ).result()
            global_batch = make_global_batch(
                {"embeddings": pooled.embeddings, "dense": batch_dense}, mesh
            )
            probabilities.append(local_rows(eval_step(state, global_batch))[:count])
    if not any(feature.multi_valued for feature in metadata.categorical):
        features = np.stack(list(features.values()), axis=1)
    return features, dense, labels, np.concatenate(probabilities)


def _feature_ids(table, feature) -> np.ndarray | RaggedIds:
    """One categorical column: ids [n] uint64, or a RaggedIds of a list column."""
    column = table.column(feature.name)
    if not feature.multi_valued:
        return column.to_numpy().astype(np.uint64)
    column = column.combine_chunks()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return RaggedIds(values=column.flatten().to_numpy().astype(np.uint64), offsets=offsets)


def _pad(ids: np.ndarray | RaggedIds, rows: int) -> np.ndarray | RaggedIds:
    """`ids` with its first row repeated `rows` more times."""
    if not rows:
        return ids
    return concatenate([ids, *[slice_rows(ids, 0, 1)] * rows])
