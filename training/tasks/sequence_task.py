"""User histories: an event log's histories packed into rows, sequence towers, next-item
retrieval under full ranking and / or the next action's AUC.

The `Task` (`training.task`) of an event-log dataset (`hybridrec preprocess` of a spec with
kind = "events"): histories are packed into rows of `model.sequence.max_length`
positions (`training.sequences.batches`), the tower (SASRec, HSTU or a user's "sequence" tower)
gives an output at every position, scored against the next item and sampled negatives;
evaluation ranks every item of the catalogue for each user's held-out event
(`training.sequences.ranking`). Every process reads the whole global batch (see
`training.job`); a stream of histories is evaluated window by window before it is trained
(`training.sequences.event_stream`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import numpy as np
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.embedding_store.remote.client import ServerSet
from hybridrec.model import make_mesh
from hybridrec.model.sequence_step import make_sequence_eval_step, make_sequence_train_step
from hybridrec.pipeline import EventMetadata
from hybridrec.pipeline.metadata import ITEM_FEATURE
from hybridrec.training.config import TrainConfig
from hybridrec.training.defaults import (
    check_batch_size,
    item_table_rows,
    resolve_sequence_auto,
    side_prefixes,
)
from hybridrec.training.device.plan import plan_devices
from hybridrec.training.job import Job, check_tower_inputs, new_job
from hybridrec.training.layouts import SequenceLayout
from hybridrec.training.sequences.baselines import ranking_metrics
from hybridrec.training.sequences.batches import Catalogue, Histories, SequenceReader, packed_reader
from hybridrec.training.sequences.event_stream import SequenceStreamSource
from hybridrec.training.sequences.ranking import evaluate_sequences
from hybridrec.training.tables import TablePlan, plan_tables
from hybridrec.training.task import Evaluation, Task


class SequenceTask(Task):
    """User histories through sequence towers (see the module)."""

    name: ClassVar[str] = "sequences"
    tower_kind: ClassVar[str] = "sequence"
    whole_batch: ClassVar[bool] = True

    # ---- config and data ----------------------------------------------------------------

    def wrong_tower(self, tower: str, metadata: EventMetadata) -> str:
        return (
            f"model.tower = {tower!r} reads click-log features, but {metadata.root} holds "
            "user histories (kind 'events'): use model.tower = 'sasrec' or 'hstu' "
            "(--config sasrec)"
        )

    def resolve_auto(
        self, config: TrainConfig, metadata: EventMetadata, divisor: int
    ) -> tuple[TrainConfig, tuple[str, ...]]:
        return resolve_sequence_auto(config, metadata, divisor)

    def prepare(
        self,
        config: TrainConfig,
        metadata: EventMetadata,
        *,
        servers: ServerSet | None,
        follow: bool,
    ) -> Job:
        """A stream of histories (`follow`) starts from its reference's catalogue."""
        streamed = "stream" in metadata.raw
        if streamed != follow:
            fix = "train it with `train --follow`" if streamed else "not a stream (`preprocess --follow --stats` makes one of it)"  # fmt: skip
            raise UserError(f"{metadata.root} {'is a stream of' if streamed else 'holds'} user histories: {fix}")  # fmt: skip
        process_count = jax.process_count()
        addresses = tuple(servers.addresses if servers else config.embedding.servers)
        if config.model.layout == "towers":
            raise ConfigError(
                "model.layout = 'towers' is DMT's, for click logs, not sequence towers"
            )
        if config.embedding.map_ids == "devices":
            raise ConfigError(
                "embedding.map_ids = 'devices' is for click logs: a packed batch of histories "
                "holds its items once already (use 'auto' or 'host')"
            )
        mesh = make_mesh(config.mesh)
        config, choices = self.resolve(config, metadata, math.lcm(mesh.devices.size, process_count))
        check_batch_size(
            "data.eval_batch_size", config.data.eval_batch_size or config.data.batch_size, mesh
        )
        check_tower_inputs(config, metadata)
        sequence = config.model.sequence
        histories = None
        if not streamed:
            histories = Histories.read(
                metadata, config.data.train_split, times=sequence.reads_times,
                sides=sequence.side_features,
            )  # fmt: skip
        catalogue = Catalogue.of(histories) if histories is not None else Catalogue.of_run(metadata, config.data.train_split, 0)  # fmt: skip
        tables, _ = self.tables(config, metadata, config.embedding.num_shards)
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
        return new_job(
            self,
            config,
            metadata,
            mesh,
            tables,
            servers=servers,
            addresses=addresses,
            choices=(
                *choices,
                f"items: {len(catalogue):,} in the training split"
                + (" of the reference" * streamed),  # fmt: skip
                *devices.lines,
            ),
            devices=devices,
            histories=histories,
            catalogue=catalogue,
        )

    def tables(
        self, config: TrainConfig, metadata: EventMetadata, num_shards: int
    ) -> tuple[TablePlan, tuple[str, ...]]:
        """The item table (and the side features' tables it holds)."""
        return plan_tables(config.embedding, metadata.categorical), ()

    def reader(
        self, job: Job, split: str, *, batch_size: int, train: bool
    ) -> tuple[SequenceReader, slice]:
        """Packed batches of a split's histories, the whole global batch on every process
        (the training split's histories are the job's, read once)."""
        config = job.config
        histories = job.histories if split == config.data.train_split else None
        reader = packed_reader(config, job.metadata, split, histories, job.catalogue, train)
        return reader, slice(None)

    def positions_per_row(self, config: TrainConfig) -> int:
        return config.model.sequence.max_length

    # ---- steps ----------------------------------------------------------------------------

    def layout(self, job: Job, batch_size: int, rows: slice) -> SequenceLayout:
        return SequenceLayout(
            job.mesh,
            ranking=job.config.model.sequence.ranking,
            from_chief=job.rows_from_chief,
            dim=job.config.embedding.dim,
            on_devices=job.device_tables,
            cached=job.device_tables and bool(job.devices.layout.caches),
        )

    def train_step(self, job: Job) -> Any:
        return make_sequence_train_step(
            job.mesh,
            job.config.model.sequence,
            job.config.seed,
            rows_from_chief=job.rows_from_chief,
            tables=job.devices.layout if job.device_tables else None,
        )

    def eval_step(self, job: Job) -> Any:
        """The tower's output at every position."""
        return make_sequence_eval_step(job.mesh, job.config.model.sequence)

    # ---- metrics ----------------------------------------------------------------------------

    def evaluate(
        self, job: Job, state: Any, store: Any, eval_step: Any, covering: Evaluation
    ) -> dict[str, float]:
        """Full-ranking HR, NDCG and MRR of each history's held-out event (with and
        without its history's items), and / or the next action's AUC."""
        return evaluate_sequences(
            job,
            state,
            store,
            eval_step,
            job.catalogue,
            split=covering.split,
            max_batches=covering.max_batches,
            progress_name=covering.progress_name,
        )

    def metric_names(self, config: TrainConfig) -> set[str]:
        sequence = config.model.sequence
        names = set()
        if sequence.retrieval:
            base = ranking_metrics(np.zeros(1))
            names |= {
                f"{k}{suffix}"
                for k in base
                for suffix in ("", "_history_kept", "_history_excluded")
            }
        if sequence.ranking:
            names |= {"auc", "ne"}
        return names

    def judged_by(self, config: TrainConfig) -> str:
        """HR@10 for next-item retrieval, else the next action's AUC."""
        return "hr@10" if config.model.sequence.retrieval else "auc"

    def validation_split(self, config: TrainConfig) -> str:
        """The eval split, "valid" of a leave-one-out split (the figures are test's)."""
        return config.data.eval_split

    def no_validation(self, config: TrainConfig) -> str:
        return (
            f"train.patience = {config.train.patience}: {config.data.path} has no validation "
            "split to stop on (preprocess it with a leave-one-out split, which writes one)"
        )

    # ---- streams ----------------------------------------------------------------------------

    def stream_source(self, job: Job, **timing: float) -> SequenceStreamSource:
        """Each shard is evaluated as a window before it is trained."""
        return SequenceStreamSource(job, **timing)
