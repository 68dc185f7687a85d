"""What training and evaluation of a run share: its devices, data, tables and store.

Where the embedding store lives in a job of several processes:
* with `embedding.servers` (remote shards, the PERSIA layout) all processes share one
  store; each reads its own share of the files and pushes its own gradients;
* with in-process shards every process holds a full replica: each reads the whole
  global batch stream (deterministically), trains on its slice of it, and applies
  the all-gathered gradients of the global batch, so the replicas stay identical.
Sequence runs read the whole global batch on every process (`Task.whole_batch`): with
replicas each looks up and updates all of its rows; with servers the chief alone does, for
all of them (`SequenceLayout`).

What depends on the kind of run (its data, steps, metrics and stream) the job asks its
task (`training.task`); `training.tasks.prepare` makes the job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from hybridrec.embedding_store import EmbeddingStore
from hybridrec.embedding_store.remote.client import DEFAULT_RETRY_TIMEOUT, ServerSet
from hybridrec.model import create_train_state, device_tables
from hybridrec.model.towers import check_user_tower
from hybridrec.pipeline import DatasetMetadata, EventMetadata
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.config import TrainConfig
from hybridrec.training.data.input import Batch
from hybridrec.training.device.held_rows import DeviceRows
from hybridrec.training.device.mapped_ids import DeviceIds
from hybridrec.training.device.plan import DevicePlan
from hybridrec.training.hybrid import HybridLoop
from hybridrec.training.run_store import open_store
from hybridrec.training.sequences.batches import Catalogue, Histories
from hybridrec.training.tables import TablePlan
from hybridrec.training.task import Task
from jax.experimental import multihost_utils


@dataclasses.dataclass(frozen=True)
class Job:
    """One process's view of a run: its task, config, data, devices and tables
    (`training.tasks.prepare` makes it)."""

    task: Task  # the kind of run: click logs or user histories (`training.tasks`)
    config: TrainConfig
    metadata: DatasetMetadata | EventMetadata
    mesh: jax.sharding.Mesh
    process_index: int
    process_count: int
    tables: TablePlan
    servers: tuple[str, ...] = ()  # remote shard servers; empty: in-process shards
    server_token: str | None = None  # the servers' shared secret
    retry_timeout: float = DEFAULT_RETRY_TIMEOUT  # seconds to retry an unreachable server
    choices: tuple[str, ...] = ()  # what each "auto" config value became and why, a line each
    id_map: Any = None  # pipeline.id_map.IdMap of embedding.id_map, or None
    devices: DevicePlan | None = None  # tables on the devices (training.device.plan)
    # sequence runs: the training split's histories and their items (training.sequences.batches)
    histories: Histories | None = None
    catalogue: Catalogue | None = None

    @property
    def device_tables(self) -> bool:
        """Whether some tables are trained on the devices."""
        return bool(self.devices and self.devices.layout.tables)

    def device_rows(self, store: Any) -> DeviceRows | DeviceIds | None:
        """The host side of the device tables (id -> row maps) in front of `store`, None
        without any."""
        if not self.device_tables:
            return None
        shared = self.shared_store
        # trainers sharing servers: the chief writes the rows, the others wait for it
        writes = {
            "writes": self.is_chief or not shared,
            "written": (lambda: self.barrier("device-rows-written")) if shared else None,
        }
        if self.devices.layout.tables[0].new_rows is not None:  # the step maps the ids
            return DeviceIds(self.devices, self.mesh, **writes)
        tables = {table.name: table for table in self.tables.tables}
        pooling, staleness = self.config.embedding.pooling, self.config.hybrid.staleness
        return DeviceRows(
            self.devices, tables, self.mesh, pooling, store=store, staleness=staleness, **writes
        )

    @property
    def is_chief(self) -> bool:
        """Process 0 writes what is written once (logs, summaries, shared checkpoints)."""
        return self.process_index == 0

    @property
    def rows_from_chief(self) -> bool:
        """Runs reading the whole global batch on each of several trainer processes sharing
        embedding servers: the chief looks up each batch's rows for all and applies their
        update (`SequenceLayout`)."""
        return self.task.whole_batch and self.shared_store and not self.device_tables

    @property
    def shared_store(self) -> bool:
        """Several trainer processes in front of the same embedding servers."""
        return bool(self.servers) and self.process_count > 1

    @property
    def replicated_store(self) -> bool:
        """In-process shards in a multi-process job: every process holds a replica."""
        return self.process_count > 1 and not self.servers

    @property
    def tower_parallel(self) -> bool:
        """DMT's Tower Modules each on their own devices (`model.layout = "towers"`)."""
        return self.config.model.layout == "towers"

    @property
    def num_features(self) -> int:
        return len(self.tables.feature_tables)

    def reader(self, split: str, *, batch_size: int, train: bool) -> tuple[Any, slice]:
        """A reader of `split` and the rows of each of its batches this process uses (the
        task's `reader`)."""
        return self.task.reader(self, split, batch_size=batch_size, train=train)

    def gather(self, array: np.ndarray) -> np.ndarray:
        """Concatenates every process's rows in process order (a collective when multi-process)."""
        if self.process_count == 1:
            return array
        gathered = multihost_utils.process_allgather(array)
        return gathered.reshape(-1, *array.shape[1:])

    def global_rows(self, array: jax.Array) -> np.ndarray:
        """A global array's rows in global order, on every process (a collective)."""
        if self.process_count == 1:
            return np.asarray(array)
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    def barrier(self, name: str) -> None:
        """Waits for every process (no-op in a single-process job)."""
        if self.process_count > 1:
            multihost_utils.sync_global_devices(name)

    def new_state(self) -> Any:
        """A freshly initialized dense train state, laid out on the mesh."""
        config = self.config
        state = create_train_state(
            config.model,
            config.optimizer,
            self.mesh,
            jax.random.key(config.seed),
            num_dense=len(self.metadata.dense_columns),
            num_features=self.num_features,
            embedding_dim=config.embedding.dim,
        )
        if self.device_tables:
            state = state.replace(tables=device_tables.init_tables(self.devices.layout, self.mesh))
        return state

    def layout(self, batch_size: int, rows: slice = slice(None)) -> Any:
        """How a batch of `batch_size` (this process's `rows` of it) meets the devices."""
        return self.task.layout(self, batch_size, rows)

    def train_step(self) -> Any:
        """The jitted train step of the run's task and layout."""
        return self.task.train_step(self)

    def eval_step(self) -> Any:
        """The jitted eval step of the run's task and layout."""
        return self.task.eval_step(self)

    def hybrid_loop(
        self,
        batches: Iterator[Batch],
        *,
        state: Any,
        train_step: Any,
        store: Any,
        first_step: int,
        rows: slice = slice(None),
        device_rows: DeviceRows | None = None,
    ) -> HybridLoop:
        """The hybrid loop over `batches` with the run's settings (`hybrid.*`,
        `data.prefetch`, `embedding.pooling`), this job's mesh, tables and processes;
        `device_rows` (from `device_rows(store)`) when some tables are on the devices."""
        config = self.config
        layout = self.task.loop_layout(
            self, config.data.batch_size, rows, device_tables=device_rows is not None
        )
        return HybridLoop(
            batches,
            state=state,
            train_step=train_step,
            store=store,
            layout=layout,
            device_rows=device_rows,
            looks_up=self.is_chief or not self.rows_from_chief,
            feature_tables=self.tables.feature_tables,
            pooling=config.embedding.pooling,
            staleness=config.hybrid.staleness,
            lookahead=config.hybrid.lookahead,
            steps_ahead=config.hybrid.steps_ahead,
            first_step=first_step,
            prefetch=config.data.prefetch,
            # a step over the whole global batch has the whole batch's row gradients already
            replicated=self.replicated_store and not self.task.whole_batch,
            gather=self.gather,
            # with k = 0 the step always waits for the host work: nothing to yield to
            nice=config.hybrid.background_nice if config.hybrid.staleness else 0,
        )

    def open_store(
        self, checkpoints: RunCheckpoints, step: int | None, *, remote: bool = True
    ) -> EmbeddingStore:
        """The run's embedding store, restored to `step` when given (`run_store.open_store`)."""
        return open_store(self, checkpoints, step, remote=remote)


def new_job(
    task: Task,
    config: TrainConfig,
    metadata: DatasetMetadata | EventMetadata,
    mesh: jax.sharding.Mesh,
    tables: TablePlan,
    *,
    servers: ServerSet | None,
    addresses: tuple[str, ...],
    **fields: Any,
) -> Job:
    """A task's job of this process: its embedding-server fields from `servers` (as the
    command resolved them) and `addresses`, the other fields as given."""
    return Job(
        task=task,
        config=config,
        metadata=metadata,
        mesh=mesh,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        tables=tables,
        servers=addresses,
        server_token=servers.token if servers else None,
        retry_timeout=servers.retry_timeout if servers else DEFAULT_RETRY_TIMEOUT,
        **fields,
    )


def check_tower_inputs(config: TrainConfig, metadata: DatasetMetadata | EventMetadata) -> None:
    """A user's tower against the contract, with the dataset's inputs (model/custom.py)."""
    check_user_tower(
        config.model,
        num_dense=len(metadata.dense_columns),
        num_features=len(metadata.categorical),
        embedding_dim=config.embedding.dim,
    )
