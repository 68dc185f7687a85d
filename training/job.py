"""What training and evaluation of a run share: its devices, data, tables and store.

Where the embedding store lives in a job of several processes:
* with `embedding.servers` (remote shards, the PERSIA layout) all processes share one
  store; each reads its own share of the files and pushes its own gradients;
* with in-process shards every process holds a full replica: each reads the whole
  global batch stream (deterministically), trains on its slice of it, and applies
  the all-gathered gradients of the global batch, so the replicas stay identical.
Sequence runs read the whole global batch on every process: with replicas each looks
up and updates all of its rows; with servers the chief alone does, for all of them
(`SequenceLayout`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from hybridrec.common import config as config_lib
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.embedding_store import EmbeddingStore
from hybridrec.embedding_store.remote import DEFAULT_RETRY_TIMEOUT, ServerSet
from hybridrec.model import (
    create_train_state,
    device_tables,
    make_eval_step,
    make_mesh,
    make_train_step,
    maybe_initialize_distributed,
)
from hybridrec.model.sequence_step import make_sequence_eval_step, make_sequence_train_step
from hybridrec.model.tower_parallel import (
    check_layout,
    make_tower_mesh,
    make_tower_parallel_eval_step,
    make_tower_parallel_train_step,
)
from hybridrec.model.towers import check_user_tower
from hybridrec.pipeline import DatasetMetadata, EventMetadata, read_dataset
from hybridrec.pipeline.id_map import read_id_map
from hybridrec.pipeline.metadata import ITEM_FEATURE
from hybridrec.training.checkpoint import CONFIG_FILE, RunCheckpoints
from hybridrec.training.config import PRESET_DIR, TrainConfig
from hybridrec.training.defaults import (
    check_batch_size,
    item_table_rows,
    resolve_auto,
    resolve_sequence_auto,
    side_prefixes,
)
from hybridrec.training.device_ids import DeviceIds, plan_click_log_tables
from hybridrec.training.device_plan import DevicePlan, plan_devices
from hybridrec.training.device_rows import DeviceRows
from hybridrec.training.hybrid import HybridLoop
from hybridrec.training.input import Batch, ParquetReader, default_read_threads
from hybridrec.training.layouts import FlatLayout, SequenceLayout, TowerLayout
from hybridrec.training.run_store import default_local_shards, open_store
from hybridrec.training.sequences import (
    Catalogue,
    Histories,
    SequenceReader,
    packed_reader,
)
from hybridrec.training.tables import TablePlan, plan_tables, resolve_tables
from jax.experimental import multihost_utils


@dataclasses.dataclass(frozen=True)
class Job:
    """One process's view of a run: config, data, devices and tables (see `prepare`)."""

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
    id_map: Any = None  # training.learned_hash.IdMap of embedding.id_map, or None
    devices: DevicePlan | None = None  # tables on the devices (training.device_plan)
    # sequence runs: the training split's histories and their items (training.sequences)
    histories: Histories | None = None
    catalogue: Catalogue | None = None

    @property
    def sequences(self) -> bool:
        """A run over user histories (an event-log dataset, a sequence tower)."""
        return self.metadata.kind == "events"

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
        """Sequence runs of several trainer processes sharing embedding servers: the chief
        looks up each batch's rows for all and applies their update (`SequenceLayout`)."""
        return self.sequences and self.shared_store and not self.device_tables

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

    def reader(self, split: str, *, batch_size: int, train: bool) -> tuple[ParquetReader, slice]:
        """A reader of `split` and the rows of each of its batches this process uses.

        Normally each process reads its own share of the files in local batches (slice
        = all rows). Training with replicated in-process stores or `data.global_order`,
        or a split with fewer files than processes, reads the global batch stream on
        every process instead and the slice picks this process's rows.
        """
        if self.sequences:
            return self.sequence_reader(split, train=train), slice(None)
        metadata = self.metadata
        files = metadata.split_files(split)
        if not files:
            raise UserError(f"{self.config.data.path}: split {split!r} has no files")
        whole = (
            (train and (self.replicated_store or self.config.data.global_order))
            or self.tower_parallel  # a tower's devices take its features of every row
            or len(files) < self.process_count
        )
        local_size = batch_size // self.process_count
        rows = slice(None)
        if whole and self.process_count > 1:
            rows = slice(self.process_index * local_size, (self.process_index + 1) * local_size)
        reader = ParquetReader.of_dataset(
            metadata,
            files,
            batch_size=batch_size if whole else local_size,
            seed=self.config.seed,
            shuffle_buffer=self.config.data.shuffle_buffer if train else 0,
            shard_index=0 if whole else self.process_index,
            shard_count=1 if whole else self.process_count,
            pad_final=not train,
            id_map=self.id_map,
            read_threads=self.config.data.read_threads or default_read_threads(),
        )
        return reader, rows

    def sequence_reader(self, split: str, *, train: bool) -> SequenceReader:
        """Packed batches of a split's histories (`training.sequences`)."""
        histories = self.histories if split == self.config.data.train_split else None
        return packed_reader(self.config, self.metadata, split, histories, self.catalogue, train)

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

    def layout(self, batch_size: int, rows: slice = slice(None)) -> FlatLayout | TowerLayout:
        """How a batch of `batch_size` (this process's `rows` of it) meets the devices."""
        if self.sequences:
            return SequenceLayout(
                self.mesh,
                ranking=self.config.model.sequence.ranking,
                from_chief=self.rows_from_chief,
                dim=self.config.embedding.dim,
                on_devices=self.device_tables,
                cached=self.device_tables and bool(self.devices.layout.caches),
            )
        if self.tower_parallel:
            names = [feature.name for feature in self.metadata.categorical]
            return TowerLayout(self.mesh, self.config.model.towers, names, batch_size)
        return FlatLayout(self.mesh, rows)

    def train_step(self) -> Any:
        """The jitted train step of the run's layout."""
        if self.sequences:
            return make_sequence_train_step(
                self.mesh,
                self.config.model.sequence,
                self.config.seed,
                rows_from_chief=self.rows_from_chief,
                tables=self.devices.layout if self.device_tables else None,
            )
        if self.tower_parallel:
            return make_tower_parallel_train_step(self.mesh, self.config.model.towers)
        if self.device_tables:
            return device_tables.make_train_step(self.mesh, self.devices.layout)
        return make_train_step(self.mesh)

    def eval_step(self) -> Any:
        """The jitted eval step of the run's layout: probabilities [B] (sequence runs:
        the tower's output at every position)."""
        if self.sequences:
            return make_sequence_eval_step(self.mesh, self.config.model.sequence)
        if self.tower_parallel:
            return make_tower_parallel_eval_step(self.mesh, self.config.model.towers)
        return make_eval_step(self.mesh)

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
        layout = self.layout(self.config.data.batch_size, rows)
        if device_rows is not None and not self.sequences:
            layout = FlatLayout(self.mesh, rows, self.devices.host_features)
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
            # a sequence step's row gradients are the whole batch's already (SequenceLayout)
            replicated=self.replicated_store and not self.sequences,
            gather=self.gather,
            # with k = 0 the step always waits for the host work: nothing to yield to
            nice=config.hybrid.background_nice if config.hybrid.staleness else 0,
        )

    def open_store(
        self, checkpoints: RunCheckpoints, step: int | None, *, remote: bool = True
    ) -> EmbeddingStore:
        """The run's embedding store, restored to `step` when given (`run_store.open_store`)."""
        return open_store(self, checkpoints, step, remote=remote)


def prepare(
    config: TrainConfig,
    *,
    distributed: dict[str, Any] | None = None,
    servers: ServerSet | None = None,
    follow: bool = False,
) -> Job:
    """Joins the multi-process job (if any) and checks the config against the data and devices.

    Args:
        config: the run's configuration.
        distributed: coordinator / num_processes / process_id of a multi-process job.
        servers: the remote shard servers as the command resolved them; None:
            `embedding.servers`, no token.
        follow: the run trains a followed stream (no tables on the devices: new ids
            arrive without end).
    """
    maybe_initialize_distributed(**(distributed or {}))
    if not config.data.path:
        raise UserError(
            "no data: pass --data DIR (a `hybridrec preprocess` output) or set data.path"
        )
    metadata = read_dataset(config.data.path)
    process_count = jax.process_count()
    if metadata.kind == "events":
        return _prepare_sequences(config, metadata, servers=servers, follow=follow)
    addresses = tuple(servers.addresses if servers else config.embedding.servers)
    towers = config.model.towers
    if config.model.layout == "towers":
        if process_count > 1 and not addresses:
            raise ConfigError(
                "model.layout = 'towers' in a multi-process job needs embedding servers "
                "(embedding.servers): a tower's processes update only its tables"
            )
        mesh = make_tower_mesh(len(towers))
    else:
        mesh = make_mesh(config.mesh)
    # the "auto" values become concrete here and are saved so in the run's config.json
    config, choices = resolve_auto(config, metadata, math.lcm(mesh.devices.size, process_count))
    for name, size in (
        ("data.batch_size", config.data.batch_size),
        ("data.eval_batch_size", config.data.eval_batch_size or config.data.batch_size),
    ):
        check_batch_size(name, size, mesh)
        if config.model.layout == "towers":
            check_layout(mesh, towers, size)
    id_map = None
    if config.embedding.id_map:
        id_map = read_id_map(config.embedding.id_map, config.embedding.id_map_kind)
        choices = (
            *choices,
            f"id map: {config.embedding.id_map_kind} mapping of {config.embedding.id_map} "
            f"({id_map.total_buckets():,} rows for {len(id_map.features)} features)",
        )
    tables, plan_lines = resolve_tables(
        config,
        metadata,
        config.embedding.num_shards
        if addresses
        else config.embedding.num_shards or default_local_shards(),
        id_map=id_map,
    )
    _check_tower(config, metadata)
    devices = plan_click_log_tables(
        config,
        metadata,
        mesh,
        tables,
        shared_servers=bool(addresses) and process_count > 1,
        follow=follow,
    )
    return Job(
        config=config,
        metadata=metadata,
        mesh=mesh,
        process_index=jax.process_index(),
        process_count=process_count,
        tables=tables,
        **_server_fields(addresses, servers),
        choices=(*choices, *plan_lines, *devices.lines),
        id_map=id_map,
        devices=devices,
    )


def _server_fields(addresses: tuple[str, ...], servers: ServerSet | None) -> dict[str, Any]:
    """A Job's embedding-server fields: the addresses, the token, the retry timeout."""
    return {
        "servers": addresses,
        "server_token": servers.token if servers else None,
        "retry_timeout": servers.retry_timeout if servers else DEFAULT_RETRY_TIMEOUT,
    }


def _check_tower(config: TrainConfig, metadata: DatasetMetadata | EventMetadata) -> None:
    """A user's tower against the contract, with the dataset's inputs (model/custom.py)."""
    check_user_tower(
        config.model,
        num_dense=len(metadata.dense_columns),
        num_features=len(metadata.categorical),
        embedding_dim=config.embedding.dim,
    )


def _prepare_sequences(
    config: TrainConfig, metadata: EventMetadata, *, servers: ServerSet | None, follow: bool
) -> Job:
    """`prepare` for a dataset of user histories (a sequence tower over packed rows); a
    stream of them (`follow`) starts from its reference's catalogue."""
    streamed = "stream" in metadata.raw
    if streamed != follow:
        fix = "train it with `train --follow`" if streamed else "not a stream (`preprocess --follow --stats` makes one of it)"  # fmt: skip
        raise UserError(f"{metadata.root} {'is a stream of' if streamed else 'holds'} user histories: {fix}")  # fmt: skip
    process_count = jax.process_count()
    addresses = tuple(servers.addresses if servers else config.embedding.servers)
    if config.model.layout == "towers":
        raise ConfigError("model.layout = 'towers' is DMT's, for click logs, not sequence towers")
    if config.embedding.map_ids == "devices":
        raise ConfigError(
            "embedding.map_ids = 'devices' is for click logs: a packed batch of histories "
            "holds its items once already (use 'auto' or 'host')"
        )
    mesh = make_mesh(config.mesh)
    config, choices = resolve_sequence_auto(
        config, metadata, math.lcm(mesh.devices.size, process_count)
    )
    check_batch_size(
        "data.eval_batch_size", config.data.eval_batch_size or config.data.batch_size, mesh
    )
    _check_tower(config, metadata)
    sequence = config.model.sequence
    histories = None
    if not streamed:
        histories = Histories.read(
            metadata, config.data.train_split, times=sequence.reads_times,
            sides=sequence.side_features,
        )  # fmt: skip
    catalogue = Catalogue.of(histories) if histories is not None else Catalogue.of_run(metadata, config.data.train_split, 0)  # fmt: skip
    tables = plan_tables(config.embedding, metadata.categorical)
    # the item table goes to the devices (whole, or a cache of it) where placed there (it
    # grows with the catalogue: the host store stays the default)
    placed = config.embedding.placement.get(ITEM_FEATURE.table, "auto") not in ("auto", "host")
    devices = plan_devices(
        config, metadata, mesh, tables,
        host_only=None if placed else 'the item rows stay in the host store unless embedding.placement.item = "device"',
        no_caches="several trainer processes share the embedding servers" if addresses and process_count > 1 else None,
        stats={ITEM_FEATURE.name: {"distinct_estimate": item_table_rows(metadata, sequence)}},
    )  # fmt: skip
    if sequence.side_features:  # the item table holds the side features' rows too
        extra = side_prefixes(metadata, sequence.side_features)
        prefixes = {name: (*own, *extra) for name, own in devices.prefixes.items()}
        devices = dataclasses.replace(devices, prefixes=prefixes)
    return Job(
        config=config,
        metadata=metadata,
        mesh=mesh,
        process_index=jax.process_index(),
        process_count=process_count,
        tables=tables,
        **_server_fields(addresses, servers),
        choices=(
            *choices,
            f"items: {len(catalogue):,} in the training split" + (" of the reference" * streamed),
            *devices.lines,
        ),
        devices=devices,
        histories=histories,
        catalogue=catalogue,
    )


def load_config(
    preset: str | None, overrides: list[str], run_dir: Path | None = None
) -> TrainConfig:
    """The preset (or, without one, the config saved in run_dir) plus overrides."""
    if preset is None and run_dir is not None and (run_dir / CONFIG_FILE).exists():
        saved = json.loads((run_dir / CONFIG_FILE).read_text())
        try:
            return config_lib.from_dict(TrainConfig, config_lib.apply_overrides(saved, overrides))
        except UserError as error:
            raise UserError(f"{run_dir / CONFIG_FILE}: {error}") from None
    return config_lib.load(TrainConfig, preset, overrides, preset_dir=PRESET_DIR)
