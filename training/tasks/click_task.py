"""Click logs: rows of dense values and categorical ids, pooled towers, AUC.

The `Task` (`training.task`) of a Criteo-shaped dataset (`hybridrec preprocess` of a
click log): each row is one sample with a label; its ids are looked up and pooled per
feature, the tower (DLRM, DCNv2, MLP, DHEN, DMT's towers, or a user's "pooled" tower)
gives a logit; AUC, logloss, normalized entropy and calibration over the rows.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.common.progress import Progress
from hybridrec.embedding_store.remote.client import ServerSet
from hybridrec.model import (
    StreamingMetrics,
    device_tables,
    local_rows,
    make_eval_step,
    make_mesh,
    make_train_step,
)
from hybridrec.model.tower_parallel import (
    check_layout,
    make_tower_mesh,
    make_tower_parallel_eval_step,
    make_tower_parallel_train_step,
)
from hybridrec.pipeline import DatasetMetadata
from hybridrec.pipeline.id_map import read_id_map
from hybridrec.training.config import TrainConfig
from hybridrec.training.data.input import ParquetReader, default_read_threads
from hybridrec.training.defaults import check_batch_size, resolve_auto
from hybridrec.training.device.mapped_ids import plan_click_log_tables
from hybridrec.training.job import Job, check_tower_inputs, new_job
from hybridrec.training.layouts import FlatLayout, TowerLayout, feature_ids
from hybridrec.training.run_store import default_local_shards
from hybridrec.training.sources import StreamSource
from hybridrec.training.stopping import VALIDATION_SPLIT
from hybridrec.training.tables import TablePlan, resolve_tables
from hybridrec.training.task import Evaluation, Task


class ClickLogTask(Task):
    """Click-log rows through pooled towers (see the module)."""

    name: ClassVar[str] = "clicks"
    tower_kind: ClassVar[str] = "pooled"

    # ---- config and data ----------------------------------------------------------------

    def wrong_tower(self, tower: str, metadata: DatasetMetadata) -> str:
        return (
            f"model.tower = {tower!r} reads user histories, but {metadata.root} is a click-log "
            "dataset; preprocess an event log (a spec with kind = 'events') or pick a "
            "click-log tower"
        )

    def resolve_auto(
        self, config: TrainConfig, metadata: DatasetMetadata, divisor: int
    ) -> tuple[TrainConfig, tuple[str, ...]]:
        return resolve_auto(config, metadata, divisor)

    def prepare(
        self,
        config: TrainConfig,
        metadata: DatasetMetadata,
        *,
        servers: ServerSet | None,
        follow: bool,
    ) -> Job:
        process_count = jax.process_count()
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
        config, choices = self.resolve(config, metadata, math.lcm(mesh.devices.size, process_count))
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
        shards = config.embedding.num_shards
        tables, plan_lines = resolve_tables(
            config,
            metadata,
            shards if addresses else shards or default_local_shards(),
            id_map=id_map,
        )
        check_tower_inputs(config, metadata)
        devices = plan_click_log_tables(
            config,
            metadata,
            mesh,
            tables,
            shared_servers=bool(addresses) and process_count > 1,
            follow=follow,
        )
        return new_job(
            self,
            config,
            metadata,
            mesh,
            tables,
            servers=servers,
            addresses=addresses,
            choices=(*choices, *plan_lines, *devices.lines),
            id_map=id_map,
            devices=devices,
        )

    def tables(
        self, config: TrainConfig, metadata: DatasetMetadata, num_shards: int
    ) -> tuple[TablePlan, tuple[str, ...]]:
        embedding = config.embedding
        id_map = read_id_map(embedding.id_map, embedding.id_map_kind) if embedding.id_map else None
        tables, lines = resolve_tables(config, metadata, num_shards, id_map=id_map)
        return tables, tuple(lines)

    def reader(
        self, job: Job, split: str, *, batch_size: int, train: bool
    ) -> tuple[ParquetReader, slice]:
        """Normally each process reads its own share of the files in local batches (slice
        = all rows). Training with replicated in-process stores or `data.global_order`,
        or a split with fewer files than processes, reads the global batch stream on
        every process instead and the slice picks this process's rows."""
        metadata = job.metadata
        files = metadata.split_files(split)
        if not files:
            raise UserError(f"{job.config.data.path}: split {split!r} has no files")
        whole = (
            (train and (job.replicated_store or job.config.data.global_order))
            or job.tower_parallel  # a tower's devices take its features of every row
            or len(files) < job.process_count
        )
        local_size = batch_size // job.process_count
        rows = slice(None)
        if whole and job.process_count > 1:
            rows = slice(job.process_index * local_size, (job.process_index + 1) * local_size)
        reader = ParquetReader.of_dataset(
            metadata,
            files,
            batch_size=batch_size if whole else local_size,
            seed=job.config.seed,
            shuffle_buffer=job.config.data.shuffle_buffer if train else 0,
            shard_index=0 if whole else job.process_index,
            shard_count=1 if whole else job.process_count,
            pad_final=not train,
            id_map=job.id_map,
            read_threads=job.config.data.read_threads or default_read_threads(),
        )
        return reader, rows

    # ---- steps ----------------------------------------------------------------------------

    def layout(self, job: Job, batch_size: int, rows: slice) -> FlatLayout | TowerLayout:
        if job.tower_parallel:
            names = [feature.name for feature in job.metadata.categorical]
            return TowerLayout(job.mesh, job.config.model.towers, names, batch_size)
        return FlatLayout(job.mesh, rows)

    def loop_layout(
        self, job: Job, batch_size: int, rows: slice, device_tables: bool
    ) -> FlatLayout | TowerLayout:
        if device_tables:  # the host pools only the features whose tables it holds
            return FlatLayout(job.mesh, rows, job.devices.host_features)
        return self.layout(job, batch_size, rows)

    def train_step(self, job: Job) -> Any:
        if job.tower_parallel:
            return make_tower_parallel_train_step(job.mesh, job.config.model.towers)
        if job.device_tables:
            return device_tables.make_train_step(job.mesh, job.devices.layout)
        return make_train_step(job.mesh)

    def eval_step(self, job: Job) -> Any:
        """Probabilities [B]."""
        if job.tower_parallel:
            return make_tower_parallel_eval_step(job.mesh, job.config.model.towers)
        return make_eval_step(job.mesh)

    # ---- metrics ----------------------------------------------------------------------------

    def evaluate(
        self, job: Job, state: Any, store: Any, eval_step: Any, covering: Evaluation
    ) -> dict[str, float]:
        """AUC, logloss, NE and calibration: every process evaluates its own share of the
        files; predictions are gathered so every process returns the same numbers.
        Lookups neither admit ids nor count them."""
        config = job.config
        batch_size = config.data.eval_batch_size or config.data.batch_size
        reader, rows = job.reader(covering.split, batch_size=batch_size, train=False)
        num_batches = reader.batches_per_epoch
        if covering.max_batches:
            num_batches = min(num_batches, covering.max_batches)
        metrics = StreamingMetrics()
        name = covering.progress_name
        progress = Progress(name, total=num_batches, unit="batches") if name else None
        layout = job.layout(batch_size, rows)
        for batch in reader.batches(num_batches=num_batches):
            pooled = store.lookup_features(
                feature_ids(batch, layout.rows, layout.features),
                feature_tables=job.tables.feature_tables,
                pooling=config.embedding.pooling,
                train=False,
            ).result()
            out = eval_step(state, layout.device_batch(batch, pooled.embeddings))
            if job.tower_parallel:  # every process read the whole batch: in global order
                probabilities, labels, valid = job.global_rows(out), batch.labels, batch.valid
            else:
                probabilities, labels, valid = (
                    job.gather(local_rows(out)),
                    job.gather(batch.labels[rows]),
                    job.gather(batch.valid[rows]),
                )
            metrics.update(probabilities[valid], labels[valid])
            if progress:
                progress.update(1)
        if progress:
            progress.close()
        return {key: float(value) for key, value in metrics.result().items()}

    def metric_names(self, config: TrainConfig) -> set[str]:
        return {"auc", "logloss", "ne", "calibration"}

    def judged_by(self, config: TrainConfig) -> str:
        return "auc"

    def validation_split(self, config: TrainConfig) -> str:
        """ "valid", beside the "eval" split the run's figures are reported on."""
        return VALIDATION_SPLIT

    def no_validation(self, config: TrainConfig) -> str:
        return (
            f"train.patience = {config.train.patience}: {config.data.path} has no validation "
            f"split besides {config.data.eval_split!r}, the one its figures are reported on; "
            f"preprocess it with --valid-fraction F (a split {VALIDATION_SPLIT!r} before the "
            "eval rows), or set train.patience = 0"
        )

    # ---- streams ----------------------------------------------------------------------------

    def stream_source(self, job: Job, **timing: float) -> StreamSource:
        return StreamSource(job, **timing)
