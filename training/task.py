"""The interface a kind of run implements: what the trainer, evaluation, export and the
commands ask of it instead of deciding the kind themselves.

hybridrec trains two kinds of run, one task each (`training.tasks`):

    ClickLogTask   "clicks": rows of dense values and categorical ids (a Criteo-shaped
                   log), pooled towers (DLRM, DCNv2, DHEN, DMT), AUC
    SequenceTask   "sequences": user histories packed into rows (an event log), sequence
                   towers (SASRec, HSTU), next-item HR@10 under full ranking and / or the
                   next action's AUC

The dataset's metadata picks the task (`training.tasks.task_of`); a user's tower names the
kind it reads by its `kind` ("pooled" or "sequence"), which must be the task's. `Job`,
`Trainer`, `evaluate`, `export` and the commands call the task; outside the task modules
nothing branches on the kind (`scripts/check_layers.py` counts such branches).

Everything else (the store, the hybrid loop, checkpoints, stopping, the run directory)
is shared. The serving runtime does not import this package: an export's manifest names
its task (`name`), and serving keeps one served model per name (`serving.load`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:  # for annotations only: the job holds its task
    from hybridrec.embedding_store.remote import ServerSet
    from hybridrec.pipeline import DatasetMetadata, EventMetadata
    from hybridrec.training.config import TrainConfig
    from hybridrec.training.job import Job
    from hybridrec.training.tables import TablePlan


class Task(Protocol):
    """A kind of run: its data, its steps, its metrics and its export."""

    name: ClassVar[str]  # "clicks" | "sequences": an export's manifest kind
    tower_kind: ClassVar[str]  # the towers it trains: "pooled" | "sequence"
    # every process reads the whole global batch and the row gradients are the whole
    # batch's already (sequence runs); else each process reads its own share
    whole_batch: ClassVar[bool]

    # ---- config and data ----------------------------------------------------------------

    def resolve(
        self, config: TrainConfig, metadata: DatasetMetadata | EventMetadata, divisor: int
    ) -> tuple[TrainConfig, tuple[str, ...]]:
        """The config with every "auto" value chosen for the dataset, a line per choice
        (`divisor`: the global batch divides evenly by it; 1 where only tables matter)."""

    def prepare(
        self,
        config: TrainConfig,
        metadata: DatasetMetadata | EventMetadata,
        *,
        servers: ServerSet | None,
        follow: bool,
    ) -> Job:
        """The job of one process: the config resolved and checked against the data and
        devices, the mesh, the tables and where they live (`training.tasks.prepare`)."""

    def tables(
        self, config: TrainConfig, metadata: DatasetMetadata | EventMetadata, num_shards: int
    ) -> tuple[TablePlan, tuple[str, ...]]:
        """The embedding tables of a resolved config over `num_shards` shards, in the
        order training builds them, with a line per planning choice (what an embedding
        server resolves from a trainer's config)."""

    def reader(self, job: Job, split: str, *, batch_size: int, train: bool) -> tuple[Any, slice]:
        """Batches of `split` and the rows of each batch this process uses."""

    def positions_per_row(self, config: TrainConfig) -> int:
        """Positions a training row holds (0: a row is one sample)."""

    # ---- steps ----------------------------------------------------------------------------

    def layout(self, job: Job, batch_size: int, rows: slice) -> Any:
        """How a batch (this process's `rows` of it) meets the devices
        (`training.layouts`)."""

    def loop_layout(self, job: Job, batch_size: int, rows: slice, device_tables: bool) -> Any:
        """The layout the hybrid loop trains through (`device_tables`: some tables are
        trained in the step)."""

    def train_step(self, job: Job) -> Any:
        """The jitted train step."""

    def eval_step(self, job: Job) -> Any:
        """The jitted eval step."""

    # ---- metrics ----------------------------------------------------------------------------

    def evaluate(
        self,
        job: Job,
        state: Any,
        store: Any,
        eval_step: Any,
        *,
        split: str,
        max_batches: int,
        progress_name: str | None,
    ) -> dict[str, float]:
        """Metrics of `state` with `store`'s rows on `split`, the same on every process."""

    def metric_names(self, config: TrainConfig) -> set[str]:
        """The metrics `evaluate` gives (what `checkpoint.keep_best` may name)."""

    def judged_by(self, config: TrainConfig) -> str:
        """The figure a run's best checkpoint is kept by."""

    def validation_split(self, config: TrainConfig) -> str:
        """The split a run tunes and stops on (never the one its figures are reported on)."""

    def no_validation(self, config: TrainConfig) -> str:
        """Why a patience cannot work on this dataset, and the fix (no validation split)."""

    # ---- streams ----------------------------------------------------------------------------

    def stream_source(
        self, job: Job, *, flush_after: float, poll_interval: float, max_idle: float
    ) -> Any:
        """The source of `train --follow` (`training.sources.StreamSource`'s interface)."""
