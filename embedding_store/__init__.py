"""Sharded embedding store: huge tables off the accelerators, async lookups and updates.

Public surface:
    TableConfig (+ InitializerConfig, SparseOptimizerConfig, AdmissionConfig,
        EvictionConfig, TieringConfig): what a table is.
    EmbeddingStore: the client (lookup, apply_gradients, lookup_features,
        apply_pooled_gradients, set_step, flush, stats, checkpoint, restore, close).
    RaggedIds, PooledLookup: multi-valued feature input and pooled lookup results.
    Shard, LocalShard: the shard backend protocol and the in-process shard.
    RemoteShard (+ RemoteShardError, ServerUnavailableError): a shard hosted by a
        `hybridrec serve-embeddings` server; `embedding_store.remote.client.connect` builds them.
    route_hash, shard_of: how ids map to shards.
    SlotMap, initial_rows, initial_optimizer_state: an id -> row map, and the values and
        optimizer state a new row starts from (for rows held outside the store, on devices).
    latest_checkpoint_step: newest committed checkpoint under a URL.
    load_tables: TableConfigs from a TOML/JSON file.
    Errors: EmbeddingStoreError and its kinds (invalid input, unknown table, checkpoints).

Modules for remote shards: `server` (ShardServer, the Flight transport), `remote`
(connect, the client side), `processes` (start servers as subprocesses), `wire`
(the request format and wire dtypes; `wire_rows` whole rows with their optimizer
state). `checkpoint` holds the on-disk format of
snapshots (fp32, fp16, int8 or int4 rows: `EmbeddingStore.checkpoint(precision=...)`).
`columns` holds column-wise sharding (`TableConfig.column_shards`) and its planner.
"""

from hybridrec.common.sparse_rules import initial_state as initial_optimizer_state
from hybridrec.embedding_store._arrays import unique_inverse
from hybridrec.embedding_store._initializers import initial_rows, initializer_salts
from hybridrec.embedding_store._pooling import FeatureIds, PooledLookup, RaggedIds
from hybridrec.embedding_store._slot_map import SlotMap
from hybridrec.embedding_store.checkpoint import latest_checkpoint_step
from hybridrec.embedding_store.config import (
    AdmissionConfig,
    EvictionConfig,
    InitializerConfig,
    SparseOptimizerConfig,
    TableConfig,
    TieringConfig,
    load_tables,
)
from hybridrec.embedding_store.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
    EmbeddingStoreError,
    IncompatibleCheckpointError,
    InvalidInputError,
    UnknownTableError,
)
from hybridrec.embedding_store.remote.client import (
    RemoteShard,
    RemoteShardError,
    ServerUnavailableError,
)
from hybridrec.embedding_store.routing import route_hash, shard_of
from hybridrec.embedding_store.shard import LocalShard, Shard
from hybridrec.embedding_store.store import EmbeddingStore

__all__ = [
    "AdmissionConfig",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "EmbeddingStore",
    "EmbeddingStoreError",
    "EvictionConfig",
    "FeatureIds",
    "IncompatibleCheckpointError",
    "InitializerConfig",
    "InvalidInputError",
    "LocalShard",
    "PooledLookup",
    "RaggedIds",
    "RemoteShard",
    "RemoteShardError",
    "ServerUnavailableError",
    "Shard",
    "SlotMap",
    "SparseOptimizerConfig",
    "TableConfig",
    "TieringConfig",
    "UnknownTableError",
    "initial_optimizer_state",
    "initial_rows",
    "initializer_salts",
    "latest_checkpoint_step",
    "load_tables",
    "route_hash",
    "shard_of",
    "unique_inverse",
]
