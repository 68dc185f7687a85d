"""The interface a kind of run implements: what the trainer, evaluation, export and the
commands ask of it instead of deciding the kind themselves.

hybridrec trains two kinds of run, one task each (`training.tasks`):

    ClickLogTask   "clicks": rows of dense values and categorical ids (a Criteo-shaped
                   log), pooled towers (DLRM, DCNv2, DHEN, DMT), AUC
    SequenceTask   "sequences": user histories packed into rows (an event log), sequence
                   towers (SASRec, HSTU), next-item HR@10 under full ranking and / or the
                   next action's AUC

The dataset's metadata picks the task (`training.tasks.task_of`); a user's tower names the
kind it reads by its `kind` ("pooled" or "sequence"), which must be the task's. `Task` is
an abstract class: what every kind shares (the tower check, the defaults below) is here,
the rest each task implements. `Job`,
`Trainer`, `evaluate`, `export` and the commands call the task; outside the task modules
nothing branches on the kind (`scripts/check_layers.py` counts such branches).

Everything else (the store, the hybrid loop, checkpoints, stopping, the run directory)
is shared. The serving runtime does not import this package: an export's manifest names
its task (`name`), and serving keeps one served model per name (`serving.load`).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from hybridrec.common.errors import UserError
from hybridrec.model.custom import tower_kind

if TYPE_CHECKING:  # for annotations only: the job holds its task
    from hybridrec.embedding_store.remote.client import ServerSet
    from hybridrec.pipeline import DatasetMetadata, EventMetadata
    from hybridrec.training.config import TrainConfig
    from hybridrec.training.job import Job
    from hybridrec.training.tables import TablePlan

    Metadata = DatasetMetadata | EventMetadata


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What an evaluation covers: a split, at most `max_batches` batches of it (0 = all),
    with a progress line under `progress_name` (None = quiet)."""

    split: str
    max_batches: int = 0
    progress_name: str | None = None


class Task(abc.ABC):
    """A kind of run: its data, its steps, its metrics and its stream."""

    name: ClassVar[str]  # "clicks" | "sequences": an export's manifest kind
    tower_kind: ClassVar[str]  # the towers it trains: "pooled" | "sequence"
    # every process reads the whole global batch and the row gradients are the whole
    # batch's already (sequence runs); else each process reads its own share
    whole_batch: ClassVar[bool] = False

    # ---- config and data ----------------------------------------------------------------

    def resolve(
        self, config: TrainConfig, metadata: Metadata, divisor: int
    ) -> tuple[TrainConfig, tuple[str, ...]]:
        """The config with every "auto" value chosen for the dataset, a line per choice
        (`divisor`: the global batch divides evenly by it; 1 where only tables matter);
        a UserError when the tower reads the other kind of data."""
        tower = config.model.tower
        if tower != "auto" and tower_kind(tower) != self.tower_kind:
            raise UserError(self.wrong_tower(tower, metadata))
        return self.resolve_auto(config, metadata, divisor)

    @abc.abstractmethod
    def wrong_tower(self, tower: str, metadata: Metadata) -> str:
        """The error for a tower of the other kind, with the fix."""

    @abc.abstractmethod
    def resolve_auto(
        self, config: TrainConfig, metadata: Metadata, divisor: int
    ) -> tuple[TrainConfig, tuple[str, ...]]:
        """`resolve` once the tower is known to fit (`training.defaults`)."""

    @abc.abstractmethod
    def tables(
        self, config: TrainConfig, metadata: Metadata, num_shards: int
    ) -> tuple[TablePlan, tuple[str, ...]]:
        """The embedding tables of a resolved config over `num_shards` shards, in the
        order training builds them, with a line per planning choice (what an embedding
        server resolves from a trainer's config)."""

    @abc.abstractmethod
    def prepare(
        self, config: TrainConfig, metadata: Metadata, *, servers: ServerSet | None, follow: bool
    ) -> Job:
        """The job of one process: the config resolved and checked against the data and
        devices, the mesh, the tables and where they live (`training.tasks.prepare`)."""

    @abc.abstractmethod
    def reader(self, job: Job, split: str, *, batch_size: int, train: bool) -> tuple[Any, slice]:
        """Batches of `split` and the rows of each batch this process uses."""

    def positions_per_row(self, config: TrainConfig) -> int:
        """Positions a training row holds (0: a row is one sample)."""
        return 0

    # ---- steps ----------------------------------------------------------------------------

    @abc.abstractmethod
    def layout(self, job: Job, batch_size: int, rows: slice) -> Any:
        """How a batch (this process's `rows` of it) meets the devices
        (`training.layouts`)."""

    def loop_layout(self, job: Job, batch_size: int, rows: slice, device_tables: bool) -> Any:
        """The layout the hybrid loop trains through (`device_tables`: some tables are
        trained in the step); by default `layout`'s."""
        return self.layout(job, batch_size, rows)

    @abc.abstractmethod
    def train_step(self, job: Job) -> Any:
        """The jitted train step."""

    @abc.abstractmethod
    def eval_step(self, job: Job) -> Any:
        """The jitted eval step."""

    # ---- metrics ----------------------------------------------------------------------------

    @abc.abstractmethod
    def evaluate(
        self, job: Job, state: Any, store: Any, eval_step: Any, covering: Evaluation
    ) -> dict[str, float]:
        """Metrics of `state` with `store`'s rows on what `covering` says, the same on every
        process; lookups neither admit ids nor count them."""

    @abc.abstractmethod
    def metric_names(self, config: TrainConfig) -> set[str]:
        """The metrics `evaluate` gives (what `checkpoint.keep_best` may name)."""

    @abc.abstractmethod
    def judged_by(self, config: TrainConfig) -> str:
        """The figure a run's best checkpoint is kept by."""

    @abc.abstractmethod
    def validation_split(self, config: TrainConfig) -> str:
        """The split a run tunes and stops on (never the one its figures are reported on)."""

    @abc.abstractmethod
    def no_validation(self, config: TrainConfig) -> str:
        """Why a patience cannot work on this dataset, and the fix (no validation split)."""

    # ---- streams ----------------------------------------------------------------------------

    @abc.abstractmethod
    def stream_source(self, job: Job, **timing: float) -> Any:
        """The source of `train --follow` (`training.sources.StreamSource`'s interface;
        `timing`: its flush_after, poll_interval and max_idle seconds)."""
