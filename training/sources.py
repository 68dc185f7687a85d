"""Where a run's batches come from: epochs of a dataset, or a followed stream.

The trainer (`training.trainer.Trainer`) asks its source for segments: runs of batches it
trains through one `HybridLoop`. A source also owns its position, the counters that go
with it, and what a checkpoint saves of them, so a run resumes exactly where it stopped.

    EpochSource    `hybridrec train`: `data.epochs` (or `data.max_steps`) of the train
                   split, one segment; the last step is known, so there is an ETA
    StreamSource   `hybridrec train --follow`: the committed shards of a stream dataset,
                   one segment per burst of new rows; idle (yields None) between bursts
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.training.data.input import Batch, Columns, DataPosition
from hybridrec.training.data.stream_reader import StreamPosition, StreamReader, batch_sizes
from hybridrec.training.hybrid import StepResult
from hybridrec.training.job import Job


@dataclasses.dataclass(frozen=True)
class Segment:
    """Batches the trainer runs through one HybridLoop."""

    batches: Iterator[Batch]
    size: int  # batches in it
    rows: slice = dataclasses.field(
        default_factory=lambda: slice(None)
    )  # this process's rows of each batch
    windows: tuple[int, ...] = ()  # shards to evaluate before training it (event streams)


class EpochSource:
    """Epochs of a dataset's train split (or `data.max_steps` batches of it)."""

    kind = "epochs"
    windows = False

    def __init__(self, job: Job):
        config = job.config
        # a dataset preprocessed with --eval-fraction 0 trains without evaluation
        self.evaluates = bool(job.metadata.split_files(config.data.eval_split))
        self.batch_size = config.data.batch_size
        self.reader, self.rows = job.reader(
            config.data.train_split, batch_size=self.batch_size, train=True
        )
        self.steps_per_epoch = self.reader.batches_per_epoch
        self.last_step = config.data.max_steps or config.data.epochs * self.steps_per_epoch
        self.position = DataPosition()
        self.samples = 0
        # sequence runs: positions trained, of the rows' max_length each
        self.tokens = 0
        self.row_length = job.task.positions_per_row(config)

    def restore(self, saved: dict[str, Any] | None) -> float:
        """Takes the position of a checkpoint's record; returns its training seconds."""
        if saved is None:
            return 0.0
        if "position" not in saved:
            raise UserError("the checkpoint is of a --follow run; resume it with --follow")
        self.position = DataPosition.from_dict(saved["position"])
        if "processes" in saved:  # written by a job of another process count
            self.position = self.reader.position_after(self.position.batches)
        self.samples = int(saved["samples"])
        self.tokens = int(saved.get("tokens", 0))
        return float(saved["seconds"])

    def segments(self, step: int, stop: threading.Event) -> Iterator[Segment | None]:
        if step < self.last_step and not stop.is_set():
            batches = self.reader.batches(num_batches=self.last_step, position=self.position)
            yield Segment(batches, self.last_step - step, self.rows)

    def advance(self, result: StepResult) -> int:
        """Moves past a trained step; returns its rows."""
        self.position = result.position
        self.samples += self.batch_size
        self.tokens += result.tokens
        return self.batch_size

    def trained(self) -> int:
        """Rows trained since the run's start."""
        return self.samples

    def record(self) -> dict[str, Any]:
        """What a checkpoint saves of the position (with the run's training seconds)."""
        return {"position": self.position.to_dict(), "samples": self.samples, "tokens": self.tokens}

    def fields(self) -> dict[str, Any]:
        return {"samples": self.samples, **self._tokens()}

    def summary(self) -> dict[str, Any]:
        return {"samples": self.samples, **self._tokens()}

    def _tokens(self) -> dict[str, Any]:
        """Sequence runs: positions trained and the share of the rows left as padding."""
        if not self.row_length:
            return {}
        padding = 1.0 - self.tokens / max(self.samples * self.row_length, 1)
        return {"tokens": self.tokens, "padding_fraction": round(padding, 4)}

    def published(self) -> dict[str, Any]:
        """What a published export's line records of the position."""
        return {"samples": self.samples, "position": self.position.to_dict()}


class StreamSource:
    """The committed shards of a stream dataset (`hybridrec preprocess --follow`), from a
    position on, until stopped.

    Batches have `data.batch_size` while rows keep coming; after `flush_after` seconds
    without a new shard, the rows short of a batch are trained in decreasing powers of
    two times the device count (each shape compiles once), so a file's last rows do not
    wait for the next file.

    Args:
        job: the run's job (`data.path` is the stream dataset; one process).
        flush_after: seconds without a new shard before a partial batch is trained.
        poll_interval: seconds between looks at the manifest when idle.
        max_idle: also end after this many seconds without a new shard (0: never).
    """

    kind = "stream"
    evaluates = False  # a stream has no eval split: exports are evaluated by serving
    windows = False  # nor windows (an event stream's are: training.sequences.event_stream)
    last_step = None

    def __init__(
        self,
        job: Job,
        *,
        flush_after: float = 1.0,
        poll_interval: float = 0.5,
        max_idle: float = 0.0,
    ):
        metadata = job.metadata
        if job.process_count > 1:
            raise UserError("train --follow runs in one process (use remote embedding servers to scale the store)")  # fmt: skip
        if job.tower_parallel:
            raise UserError("train --follow runs the flat layout; set model.layout = 'flat'")
        if "stream" not in metadata.raw:
            raise UserError(f"{metadata.root}: not a stream dataset (write one with `hybridrec preprocess --follow`)")  # fmt: skip
        self.batch_size = job.config.data.batch_size
        self.divisor = int(job.mesh.devices.size)
        self.flush_after, self.poll_interval, self.max_idle = flush_after, poll_interval, max_idle
        self.reader = StreamReader(
            metadata.root,
            Columns.of_dataset(metadata),
        )
        self.position = StreamPosition()
        self.rows = 0
        self.rows_by_shard: dict[str, int] = {}

    def restore(self, saved: dict[str, Any] | None) -> float:
        if saved is not None:
            if "stream" not in saved:
                raise UserError("the checkpoint is of a batch run, not a --follow run")
            self.position = StreamPosition.from_dict(saved["stream"])
            self.rows, self.rows_by_shard = int(saved["rows"]), dict(saved["rows_by_shard"])
        if self.reader.refresh() < self.position.shard + (self.position.offset > 0):
            raise UserError(
                f"the checkpoint is at shard {self.position.shard} of {self.reader.root}, "
                f"which has {len(self.reader.shards)} committed shards; a run follows one "
                "stream (start a new --run-dir for another)"
            )
        return float(saved["seconds"]) if saved else 0.0

    def segments(self, step: int, stop: threading.Event) -> Iterator[Segment | None]:
        """Bursts of the rows committed so far; None while idle (`poll_interval` apart)."""
        known, last_new = len(self.reader.shards), time.monotonic()
        while True:
            if self.reader.refresh() > known:  # new shards: flush partial batches later
                known, last_new = len(self.reader.shards), time.monotonic()
            idle = time.monotonic() - last_new
            available = self.reader.available(self.position)
            # stopping for --max-idle trains the rows short of a batch first
            flush = idle >= self.flush_after or bool(self.max_idle and idle >= self.max_idle)
            sizes = batch_sizes(available, self.batch_size, self.divisor, flush=flush)
            if sizes and not stop.is_set():
                yield Segment(self.reader.batches(self.position, sizes), len(sizes))
                continue
            if stop.is_set() or (self.max_idle and idle >= self.max_idle):
                return
            yield None
            stop.wait(self.poll_interval)

    def advance(self, result: StepResult) -> int:
        """Moves past a trained step (counting its rows per shard); returns its rows."""
        self.position = result.position
        rows = 0
        for shard, count in result.position.pieces:
            self.rows_by_shard[str(shard)] = self.rows_by_shard.get(str(shard), 0) + count
            rows += count
        self.rows += rows
        return rows

    def trained(self) -> int:
        return self.rows

    def record(self) -> dict[str, Any]:
        return {"stream": self.position.to_dict(), "rows": self.rows, "rows_by_shard": self.rows_by_shard}  # fmt: skip

    def fields(self) -> dict[str, Any]:
        return {
            "rows_trained": self.rows,
            "shard": self.position.shard,
            "shards_seen": len(self.reader.shards),
        }

    def published(self) -> dict[str, Any]:
        return {
            "rows_trained": self.rows,
            "position": self.position.to_dict(),
            "shards_complete": self.position.shard,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "rows_trained": self.rows,
            "rows_by_shard": dict(self.rows_by_shard),
            "position": self.position.to_dict(),
            "shards_seen": len(self.reader.shards),
        }
