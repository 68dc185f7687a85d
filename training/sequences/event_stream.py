"""A stream of user histories as packed batches: `hybridrec train --follow` on an event stream.

`hybridrec preprocess --follow` on event files commits shards of rows, one per user of a
file: the user's kept history, then the file's events, each a next-item target from
`first_target` on (`pipeline.events.event_follow`). This source trains them in manifest order:

- every target once: a row's targets are cut into pieces from its end (the newest
  `length` positions, then the `length` before, ...), so the new events are trained with
  as much history as a row holds, and no position is trained twice;
- packed in order: pieces fill a batch's rows first-fit until one fits nowhere; the
  batch is then full and the position (shard, pieces of it trained) a prefix of the
  stream, which is what a checkpoint saves. After `flush_after` seconds without a new
  shard the last, partial batch is trained (the shape is the same: more padding);
- each shard is a window: before any of it is trained, the trainer evaluates it with
  the model as it is (the window T -> T+1 protocol: HR@K / NDCG@K over every new
  event, ranked among the catalogue so far), and only then do its items join the
  catalogue negatives are drawn from.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.pipeline import ManifestEntry, read_shards
from hybridrec.training.data.stream_reader import StreamPosition
from hybridrec.training.hybrid import StepResult
from hybridrec.training.job import Job
from hybridrec.training.sequences.batches import (
    Catalogue,
    Histories,
    Negatives,
    SequenceBatch,
    packed_batch,
)
from hybridrec.training.sequences.packing import Pieces, stream_pieces
from hybridrec.training.sequences.ranking import evaluate_sequences
from hybridrec.training.sources import Segment

MAX_SEGMENT = 64  # batches planned at once


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One batch: its pieces per shard [(shard, first piece, pieces)] and placements."""

    parts: tuple[tuple[int, int, int], ...]
    rows: np.ndarray
    offsets: np.ndarray
    after: StreamPosition
    full: bool


class SequenceStreamSource:
    """The committed shards of an event stream, from a position on, until stopped (the
    interface of `training.sources.StreamSource`; `windows` says which shards to
    evaluate before a segment is trained).

    Args:
        job: the run's job (`data.path` is the event stream; one process).
        flush_after: seconds without a new shard before a partial batch is trained.
        poll_interval: seconds between looks at the manifest when idle.
        max_idle: also end after this many seconds without a new shard (0: never).
    """

    kind = "stream"
    evaluates = False  # no evaluation split: each shard is evaluated as a window instead
    windows = True
    last_step = None

    def __init__(self, job: Job, *, flush_after: float = 1.0, poll_interval: float = 0.5, max_idle: float = 0.0):  # fmt: skip
        if job.process_count > 1:
            raise UserError("train --follow runs in one process")
        self.job = job
        self.root = job.metadata.root
        config = job.config
        self.rows, self.length = config.data.batch_size, config.model.sequence.max_length
        self.seed = config.seed
        self.actions = bool(job.metadata.raw["spec"].get("action_types"))
        self.times = config.model.sequence.reads_times
        self.sides = config.model.sequence.side_features
        self.flush_after, self.poll_interval, self.max_idle = flush_after, poll_interval, max_idle
        self.shards: list[ManifestEntry] = []
        self._loaded: dict[int, tuple[Histories, Pieces]] = {}
        self.position = StreamPosition()
        self.catalogue: Catalogue = job.catalogue
        self._catalogued = 0  # shards whose items are in the catalogue
        self._negatives = Negatives(self.catalogue, config.model.sequence.negatives, config.model.sequence.negatives_from)  # fmt: skip
        self.evaluated = -1  # the newest shard evaluated as a window
        self.targets = 0  # positions trained: each a stream event
        self.targets_by_shard: dict[str, int] = {}

    # ---- shards -----------------------------------------------------------------------

    def refresh(self) -> int:
        self.shards += read_shards(self.root, start=len(self.shards))
        return len(self.shards)

    def shard(self, index: int) -> tuple[Histories, Pieces]:
        """A shard's histories and pieces (the last few read are kept)."""
        if index not in self._loaded:
            entry = self.shards[index]
            if entry.rows:
                histories = Histories.read_files(
                    [self.root / entry.shard], actions=self.actions, times=self.times,
                    sides=self.sides,
                )  # fmt: skip
            else:
                empty = np.zeros(0, np.int64)
                sides = {name: np.zeros(0, np.uint64) for name in self.sides}
                histories = Histories(np.zeros(0, np.uint64), np.zeros(1, np.int64), empty, sides=sides)  # fmt: skip
            if len(histories) != entry.rows:
                raise UserError(f"{self.root / entry.shard}: {len(histories)} rows, the manifest line {entry.seq} says {entry.rows}")  # fmt: skip
            for old in [k for k in self._loaded if k < index - 2]:
                del self._loaded[old]
            self._loaded[index] = (histories, stream_pieces(histories, self.length))
        return self._loaded[index]

    def _plan(self, position: StreamPosition) -> _Plan | None:
        """The next batch from `position` (None: no piece left)."""
        fill = np.zeros(self.rows, np.int64)
        parts, rows, offsets = [], [], []
        shard, offset = position.shard, position.offset
        full = False
        while shard < len(self.shards) and not full:
            sizes = self.shard(shard)[1].sizes
            first = offset
            while offset < len(sizes):
                fits = np.flatnonzero(fill + sizes[offset] <= self.length)
                if not len(fits):
                    full = True
                    break
                rows.append(int(fits[0]))
                offsets.append(int(fill[fits[0]]))
                fill[fits[0]] += sizes[offset]
                offset += 1
            if offset > first:
                parts.append((shard, first, offset - first))
            if offset == len(sizes):
                shard, offset = shard + 1, 0
        if not parts:
            return None
        after = StreamPosition(shard, offset, position.batches + 1)
        return _Plan(tuple(parts), np.array(rows), np.array(offsets), after, full)

    # ---- the trainer's interface ---------------------------------------------------------

    def restore(self, saved: dict[str, Any] | None) -> float:
        if saved is not None:
            if "stream" not in saved:
                raise UserError("the checkpoint is of a batch run, not a --follow run")
            self.position = StreamPosition.from_dict(saved["stream"])
            self.targets = int(saved["rows"])
            self.targets_by_shard = dict(saved["rows_by_shard"])
            self.evaluated = int(saved.get("evaluated", self.position.shard - 1))
        if self.refresh() < self.position.shard + (self.position.offset > 0):
            raise UserError(
                f"the checkpoint is at shard {self.position.shard} of {self.root}, which has "
                f"{len(self.shards)} committed shards; a run follows one stream (start a new "
                "--run-dir for another)"
            )
        started = self.position.shard + (self.position.offset > 0)
        self._catalogue_to(started)
        return float(saved["seconds"]) if saved else 0.0

    def segments(self, step: int, stop: threading.Event):
        """Bursts of the batches committed so far; None while idle."""
        known, last_new = len(self.shards), time.monotonic()
        while True:
            if self.refresh() > known:
                known, last_new = len(self.shards), time.monotonic()
            idle = time.monotonic() - last_new
            # stopping for --max-idle trains the last, partial batch first
            flush = idle >= self.flush_after or bool(self.max_idle and idle >= self.max_idle)
            plans, position, newest = [], self.position, -1
            while len(plans) < MAX_SEGMENT:
                plan = self._plan(position)
                if plan is None or not (plan.full or flush):
                    break
                last = max(shard for shard, _, _ in plan.parts)
                if plans and last > max(newest, self.evaluated):
                    break  # a new window: evaluated after the ones before it are trained
                plans.append(plan)
                position, newest = plan.after, max(newest, last)
            if plans and not stop.is_set():
                windows = tuple(range(self.evaluated + 1, newest + 1))
                self.evaluated = max(self.evaluated, newest)
                yield Segment(self._batches(plans), len(plans), windows=windows)
                continue
            if stop.is_set() or (self.max_idle and idle >= self.max_idle):
                return
            yield None
            stop.wait(self.poll_interval)

    def _batches(self, plans: list[_Plan]) -> Iterator[SequenceBatch]:
        for plan in plans:
            parts = [self._part(shard, first, count) for shard, first, count in plan.parts]
            # the shards begun by the batch's end: what a checkpoint after it restores
            self._catalogue_to(plan.after.shard + (plan.after.offset > 0))
            histories = Histories.concat([h for h, _ in parts])
            shift = np.cumsum([0, *(len(h) for h, _ in parts[:-1])])
            pieces = Pieces(
                np.concatenate([p.history + s for (_, p), s in zip(parts, shift, strict=True)]),
                np.concatenate([p.start for _, p in parts]),
                np.concatenate([p.stop for _, p in parts]),
            )
            trained = _trained_per_part(histories, pieces, [p for _, p in parts])
            after = dataclasses.replace(
                plan.after,
                pieces=tuple((shard, n) for (shard, _, _), n in zip(plan.parts, trained, strict=True)),
            )  # fmt: skip
            rng = np.random.default_rng([self.seed, plan.after.batches, 1])
            yield packed_batch(
                histories, pieces, plan.rows, plan.offsets,
                shape=(self.rows, self.length), negatives=self._negatives, rng=rng, position=after,
                context=self.job.config.model.sequence.context, sides=self.sides,
            )  # fmt: skip

    def _part(self, shard: int, first: int, count: int) -> tuple[Histories, Pieces]:
        histories, pieces = self.shard(shard)
        return histories, Pieces(*(a[first : first + count] for a in (pieces.history, pieces.start, pieces.stop)))  # fmt: skip

    def _catalogue_to(self, shards: int) -> None:
        """Adds the items of shards [catalogued, shards) to the catalogue (negatives)."""
        if shards <= self._catalogued:
            return
        items = [self.shard(i)[0].targets() for i in range(self._catalogued, shards)]
        self.catalogue = self.catalogue.merged(np.concatenate(items))
        self._catalogued = shards
        sequence = self.job.config.model.sequence
        self._negatives = Negatives(self.catalogue, sequence.negatives, sequence.negatives_from)

    def evaluate_window(
        self, index: int, state: Any, store: Any, eval_step: Any
    ) -> tuple[ManifestEntry, dict[str, float] | None]:
        """A shard evaluated before it is trained (window T -> T + 1): its manifest line
        and its ranking metrics (None: no target, a file of new users' first events)."""
        histories, pieces = self.shard(index)
        if not len(pieces.history):
            return self.shards[index], None
        results = evaluate_sequences(
            self.job, state, store, eval_step, self.catalogue, histories=histories
        )
        return self.shards[index], results

    def advance(self, result: StepResult) -> int:
        self.position = result.position
        trained = 0
        for shard, count in result.position.pieces:
            self.targets_by_shard[str(shard)] = self.targets_by_shard.get(str(shard), 0) + count
            trained += count
        self.targets += trained
        return trained

    def trained(self) -> int:
        return self.targets

    def record(self) -> dict[str, Any]:
        return {
            "stream": self.position.to_dict(),
            "rows": self.targets,
            "rows_by_shard": self.targets_by_shard,
            "evaluated": min(self.evaluated, self.position.shard - (self.position.offset == 0)),
        }

    def fields(self) -> dict[str, Any]:
        return {"events_trained": self.targets, "shard": self.position.shard, "shards_seen": len(self.shards)}  # fmt: skip

    def published(self) -> dict[str, Any]:
        return {
            "rows_trained": self.targets,
            "position": self.position.to_dict(),
            "shards_complete": self.position.shard,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "rows_trained": self.targets,
            "rows_by_shard": dict(self.targets_by_shard),
            "position": self.position.to_dict(),
            "shards_seen": len(self.shards),
            "unit": "events",
        }


def _trained_per_part(histories: Histories, pieces: Pieces, parts: list[Pieces]) -> list[int]:
    """Trained positions of each part's pieces (position i trains when i + 1 >= first_target)."""
    first = histories.first_target[pieces.history]
    trained = np.maximum(pieces.stop - np.maximum(pieces.start, first - 1), 0)
    bounds = np.cumsum([0, *(len(part.history) for part in parts)])
    return [int(trained[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
