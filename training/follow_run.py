"""What a follow run (`hybridrec train --follow`) adds to the trainer: its options, its
source (click-log rows or user histories), and the checkpoint it may start from."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.pipeline.metadata import read_dataset
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.config import load_config
from hybridrec.training.job import Job
from hybridrec.training.run_dir import require_run_dir


@dataclasses.dataclass(frozen=True)
class FollowOptions:
    """`hybridrec train --follow`: train a stream dataset's shards as they arrive."""

    checkpoint_every: float = 30.0  # seconds between checkpoints (while there is training)
    publish_every: float = 0.0  # seconds between published exports (0: only at the end)
    flush_after: float = 1.0  # seconds without a new shard before a partial batch is trained
    poll_interval: float = 0.5  # seconds between looks at the manifest when idle
    max_idle: float = 0.0  # also stop after this many seconds without a new shard (0: never)
    # a fresh run starts from this run's checkpoint (dense state and embeddings), e.g. a
    # batch run on the stream's reference dataset; None: from a new model
    init_from: Path | None = None
    init_step: int | str | None = None  # its step (None: the newest, "best": the kept best)


def stream_source(job: Job, follow: FollowOptions) -> Any:
    """The source of a follow run (the task's: an event stream's histories, or click-log
    rows; `training.sources.StreamSource`'s interface)."""
    return job.task.stream_source(
        job,
        flush_after=follow.flush_after,
        poll_interval=follow.poll_interval,
        max_idle=follow.max_idle,
    )


class InitialModel:
    """The checkpoint a fresh follow run starts from (`--init-from RUN_DIR`), checked
    against the stream: the same spec and hash scheme, so its rows' ids are the stream's."""

    def __init__(self, job: Job, run_dir: Path, step: int | str | None):
        require_run_dir(run_dir)
        self.run_dir = run_dir
        self.checkpoints = RunCheckpoints(run_dir)
        self.step = self.checkpoints.resolve_step(step, "start from")
        theirs = read_dataset(load_config(None, [], run_dir).data.path).raw
        for key in ("spec", "hash_scheme"):
            if theirs.get(key) != job.metadata.raw.get(key):
                raise UserError(
                    f"--init-from {run_dir}: it trained on data of another "
                    f"{key.replace('_', ' ')} than {job.metadata.root} (start from a run on "
                    "the stream's reference dataset)"
                )

    def restore_dense(self, state: Any) -> Any:
        try:
            return self.checkpoints.restore_dense(self.step, state)
        except (ValueError, KeyError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise UserError(
                f"--init-from {self.run_dir}: its step {self.step} does not fit this run's "
                f"model ({first[:200]}); give this run the --config and --set values it was "
                "trained with"
            ) from None

    def open_store(self, job: Job) -> Any:
        """Its embeddings (the run's first checkpoint of them is then a full one)."""
        return job.open_store(self.checkpoints, self.step)
