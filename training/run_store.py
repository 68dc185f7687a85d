"""A run's embedding store: in-process shards, or the embedding servers' remote ones,
restored to a checkpoint's step when given."""

from __future__ import annotations

import os
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSFiles
from hybridrec.embedding_store import EmbeddingStore
from hybridrec.embedding_store.remote.client import connect
from hybridrec.training.checkpoint import RunCheckpoints


def default_local_shards() -> int:
    """In-process shards when embedding.num_shards is not set: one per two cores, 1 to 4.

    A shard is a worker thread; in a process whose cores also run the dense step, more
    shards than that cost more in hand-offs than they gain (docs/benchmarks.md).
    """
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def open_store(
    job: Any, checkpoints: RunCheckpoints, step: int | None, *, remote: bool = True
) -> EmbeddingStore:
    """The run's embedding store (of `job`, a `training.job.Job`), restored to `step` when
    given.

    Remote shards are shared by every process, so only process 0 loads a checkpoint
    onto them and the others attach after it is done. With `remote=False` (evaluating
    a checkpoint) the rows are restored into in-process shards even when servers are
    configured, so the servers' live rows are never rolled back.
    """
    embedding = job.config.embedding
    tables = list(job.tables.tables)
    if not (remote and job.servers):
        num_shards = embedding.num_shards or default_local_shards()
        if step is None:
            return EmbeddingStore(tables, num_shards=num_shards)
        return EmbeddingStore.restore(
            checkpoints.embeddings_url, tables, step=step, num_shards=num_shards
        )
    shards = connect(
        list(job.servers),
        tables,
        token=job.server_token,
        tls=TLSFiles.from_config(embedding.tls, "embedding.tls"),
        retry_timeout=job.retry_timeout,
        wire_dtype=embedding.wire_dtype,
    )
    if embedding.num_shards is not None and embedding.num_shards != len(shards):
        raise UserError(
            f"embedding.num_shards = {embedding.num_shards}, but the servers "
            f"{', '.join(job.servers)} host {len(shards)} shards; leave "
            "embedding.num_shards unset with servers"
        )
    if step is None or not job.is_chief:
        job.barrier(f"restore-embeddings-{step}")
        return EmbeddingStore(tables, num_shards=len(shards), shards=shards)
    store = EmbeddingStore.restore(
        checkpoints.embeddings_url, tables, step=step, num_shards=len(shards), shards=shards
    )
    job.barrier(f"restore-embeddings-{step}")
    return store
