"""User histories in packed batches: what a sequence run reads (`model.tower = "sasrec" |
"hstu"` on an event-log dataset, docs/training.md "Sequences").

A split's rows are histories of item ids, oldest first, with `first_target` the first
position that is a prediction target (docs/pipeline.md). A history of n items gives n - 1
positions: the item at position i is the input, the item at i + 1 its target, trained
where i + 1 >= first_target.

Batches are `rows` rows of `length` positions each (the token budget), and a row holds
several histories one after the other, each a segment: there is no padding to the
longest history of the batch, only what is left at the end of a row. Histories are taken
in a shuffled order and placed first-fit into the batch's rows; one that fits no row
waits for the next batch (at most `rows` wait, so none is ever dropped). A history longer
than a row is split into pieces of one row (or truncated to its most recent positions).

A batch's ids are its distinct items (inputs, targets and negatives) and the ids of the
side features the tower reads (which share the item table): the store looks each up
once, and the step's gradient of a row sums every position it appears at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.common.errors import UserError
from hybridrec.pipeline import read_shards
from hybridrec.pipeline.metadata import ITEM_FEATURE, EventMetadata, read_dataset
from hybridrec.training.data.input import DataPosition
from hybridrec.training.sequences.packing import Pieces, cut_pieces, pack, ranges


@dataclasses.dataclass(frozen=True)
class Histories:
    """A split's histories: history h is `items[offsets[h]:offsets[h + 1]]`."""

    items: np.ndarray  # [tokens] uint64
    offsets: np.ndarray  # [histories + 1] int64
    first_target: np.ndarray  # [histories] int64
    actions: np.ndarray | None = None  # [tokens] int8 action type 1..n (0: none), if any
    times: np.ndarray | None = None  # [tokens] int64 seconds, when the tower reads times
    # side feature -> [tokens] uint64 ids (the event's or its item's), those the tower reads
    sides: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(
        cls, metadata: EventMetadata, split: str, *, times: bool = False, sides: tuple = ()
    ) -> Histories:
        files = metadata.split_files(split)
        if not files:
            raise UserError(f"{metadata.root}: split {split!r} has no files")
        actions = bool((metadata.raw.get("spec") or {}).get("action_types"))
        return cls.read_files(files, actions=actions, times=times, sides=sides)

    @classmethod
    def read_files(
        cls, files, *, actions: bool, times: bool = False, sides: tuple = ()
    ) -> Histories:
        """The histories of Parquet files of rows (a split's, or a stream's shards), with
        the side features' columns named by `sides`."""
        columns = ["items", "first_target"] + (["actions"] if actions else [])
        columns += ["times"] if times else []
        columns += list(sides)
        tables = []
        for path in files:
            try:
                tables.append(pq.read_table(path, columns=columns))
            except (OSError, pa.ArrowInvalid, KeyError) as error:
                raise UserError(f"{path}: cannot read its histories: {error}") from None
        table = pa.concat_tables(tables)

        def flat(name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
            column = table.column(name).combine_chunks()
            offsets = column.offsets.to_numpy().astype(np.int64)
            values = column.values.to_numpy()[offsets[0] : offsets[-1]]
            return values.astype(dtype, copy=False), offsets - offsets[0]

        items, offsets = flat("items", np.uint64)
        action_ids = flat("actions", np.int8)[0] if actions else None
        stamps = flat("times", np.int64)[0] if times else None
        first = table.column("first_target").to_numpy().astype(np.int64)
        side_ids = {}
        for name in sides:
            side_ids[name], side_offsets = flat(name, np.uint64)
            if not np.array_equal(side_offsets, offsets):
                shown = files[0] if len(files) == 1 else f"{files[0]} (and {len(files) - 1} more)"
                raise UserError(f"{shown}: column {name!r} has not one value per item")
        return cls(items, offsets, first, action_ids, stamps, side_ids)

    @staticmethod
    def concat(parts: list[Histories]) -> Histories:
        sizes = [len(part.items) for part in parts]
        shifts = np.cumsum([0, *sizes[:-1]])
        offsets = [part.offsets[:-1] + shift for part, shift in zip(parts, shifts, strict=True)]

        def joined(name: str):
            if not parts or getattr(parts[0], name) is None:
                return None
            return np.concatenate([getattr(part, name) for part in parts])

        return Histories(
            np.concatenate([part.items for part in parts]),
            np.concatenate([*offsets, [sum(sizes)]]).astype(np.int64),
            np.concatenate([part.first_target for part in parts]),
            joined("actions"),
            joined("times"),
            {
                name: np.concatenate([part.sides[name] for part in parts])
                for name in (parts[0].sides if parts else {})
            },
        )

    def __len__(self) -> int:
        return len(self.first_target)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def targets(self) -> np.ndarray:
        """The item ids at the histories' target positions (from `first_target` on): a
        stream row's new events, each once however often its user's history repeats."""
        first = np.minimum(np.maximum(self.first_target, 1), self.lengths)
        return self.items[ranges(self.offsets[:-1] + first, self.lengths - first)]


@dataclasses.dataclass(frozen=True)
class Catalogue:
    """The items of the training split: the ids negatives are drawn from and evaluation
    ranks, with how often each occurs."""

    items: np.ndarray  # [C] uint64, sorted
    counts: np.ndarray  # [C] int64

    @classmethod
    def of(cls, histories: Histories) -> Catalogue:
        items, counts = np.unique(histories.items, return_counts=True)
        return cls(items, counts.astype(np.int64))

    @classmethod
    def of_run(cls, metadata: EventMetadata, split: str, shards: int | None = None) -> Catalogue:
        """A run's catalogue: its training split's items; for a stream dataset, its
        reference's and those of its first `shards` committed shards (None: all)."""
        dataset, files = _stream_parts(metadata, shards)
        catalogue = cls.of(Histories.read(dataset, split))
        if files:  # each stream event once: the rows' targets (their histories repeat)
            catalogue = catalogue.merged(Histories.read_files(files, actions=False).targets())
        return catalogue

    @staticmethod
    def item_sides(
        metadata: EventMetadata, names: tuple[str, ...], shards: int | None = None
    ) -> dict[str, np.ndarray]:
        """{"item": [n] uint64 ascending, name: [n] uint64 each}: the item features `names`
        of every item of a dataset's splits (a stream's: its reference's, and its first
        `shards` shards'), as the histories carry them, each item's latest."""
        dataset, files = _stream_parts(metadata, shards)
        files = [f for split in dataset.raw["splits"] for f in dataset.split_files(split)] + files
        histories = Histories.read_files(files, actions=False, sides=names)
        latest = len(histories.items) - 1 - np.unique(histories.items[::-1], return_index=True)[1]
        return {"item": histories.items[latest]} | {n: histories.sides[n][latest] for n in names}

    def merged(self, items: np.ndarray) -> Catalogue:
        """The catalogue with `items` (each occurrence counted) added."""
        if not len(items):
            return self
        every = np.concatenate([self.items, items])
        unique, inverse = np.unique(every, return_inverse=True)
        weights = np.concatenate([self.counts, np.ones(len(items), np.int64)])
        return Catalogue(unique, np.bincount(inverse, weights=weights).astype(np.int64))

    def __len__(self) -> int:
        return len(self.items)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        where = np.minimum(np.searchsorted(self.items, ids), len(self.items) - 1)
        return self.items[where] == ids


def _stream_parts(metadata: EventMetadata, shards: int | None) -> tuple[EventMetadata, list]:
    """(the dataset whose splits hold the histories, the shard files with rows after them):
    a stream dataset's reference and its first `shards` committed shards (None: all); any
    other dataset itself and none."""
    if "stream" not in metadata.raw:
        return metadata, []
    entries = read_shards(metadata.root)[:shards]
    files = [metadata.root / entry.shard for entry in entries if entry.rows]
    return read_dataset(metadata.raw["stream"]["reference"]), files


@dataclasses.dataclass
class SequenceBatch:
    """One packed batch: its distinct item ids (what the store looks up) and the step's
    index arrays into their rows (`model.sequence_step`)."""

    ids: dict[str, np.ndarray]  # {"item": [U] uint64 distinct ids}
    # inputs, targets, segments, positions, weights [R, L]; sides [R, L, F] with side features
    arrays: dict[str, np.ndarray]
    negatives: np.ndarray  # [N] int32 into ids
    negative_logq: np.ndarray  # [N] float32
    position: DataPosition
    histories: np.ndarray  # [pieces] the history of each segment, in placing order
    starts: np.ndarray  # [pieces] the history position each segment starts at
    tokens: int  # positions holding an item (the rest is padding)

    @property
    def size(self) -> int:
        return int(self.arrays["inputs"].shape[0])


class Negatives:
    """Negatives per batch: `count` items drawn uniformly from the catalogue, from the
    batch's own targets (so by popularity), or half each; with log(N q(item)) of each,
    q the probability of drawing it (popularity estimated by the catalogue's counts)."""

    def __init__(self, catalogue: Catalogue, count: int, source: str):
        if count > len(catalogue):
            raise UserError(
                f"model.sequence.negatives = {count} is more than the {len(catalogue):,} items "
                "of the training split"
            )
        self.catalogue, self.count, self.source = catalogue, count, source
        self.frequency = catalogue.counts / catalogue.counts.sum()

    def draw(self, rng: np.random.Generator, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids [count], log(count q) [count]) given the batch's trained targets."""
        catalogue = self.catalogue
        from_batch = {"catalogue": 0, "batch": self.count, "mixed": self.count // 2}[self.source]
        if not len(targets):
            from_batch = 0
        uniform = catalogue.items[rng.integers(len(catalogue), size=self.count - from_batch)]
        drawn = np.concatenate([uniform, targets[rng.integers(len(targets), size=from_batch)]])
        share = from_batch / self.count
        where = np.searchsorted(catalogue.items, drawn)
        q = (1.0 - share) / len(catalogue) + share * self.frequency[where]
        return drawn, np.log(self.count * q).astype(np.float32)


class SequenceReader:
    """Packed batches of a split, epoch after epoch (training: shuffled by `seed` and the
    epoch, with negatives), or once in order (evaluation: histories truncated, every
    history its own segment, no negatives).

    Args:
        histories: the split's histories.
        rows, length: the batch's rows and positions per row.
        split_long: cut histories longer than a row into pieces (else keep the most recent).
        negatives: the training negatives (None: evaluation).
        pieces: the pieces to read instead (`stream_pieces`: every target of a window).
        context: what the tower reads of each event (`SequenceConfig.context`).
        sides: the side features added to each event's item row
            (`SequenceConfig.side_features`).
    """

    def __init__(
        self,
        histories: Histories,
        *,
        rows: int,
        length: int,
        seed: int = 0,
        split_long: bool = True,
        negatives: Negatives | None = None,
        pieces: Pieces | None = None,
        context: tuple[str, ...] = (),
        sides: tuple[str, ...] = (),
    ):
        self.histories, self.rows, self.length = histories, rows, length
        self.sides = sides
        self.seed, self.negatives = seed, negatives
        self.train = negatives is not None
        if pieces is None:
            pieces = cut_pieces(histories, length, split=split_long and self.train)
        self.pieces, self.context = pieces, context
        if not len(self.pieces.history):
            raise UserError("no history has a position to train or evaluate")
        self._plans: dict[int, list] = {}
        self.batches_per_epoch = len(self._plan(0))

    def _order(self, epoch: int) -> np.ndarray:
        if not self.train:
            return np.arange(len(self.pieces.sizes))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.pieces.sizes))

    def _plan(self, epoch: int) -> list:
        if epoch not in self._plans:
            order = self._order(epoch)
            batches = pack(self.pieces.sizes[order], self.rows, self.length)
            self._plans = {epoch: [(order[i], r, o) for i, r, o in batches]}
        return self._plans[epoch]

    def position_after(self, batches: int) -> DataPosition:
        epoch, index = divmod(batches, self.batches_per_epoch)
        return DataPosition(epoch=epoch, offset=index, batches=batches)

    def batches(
        self, num_batches: int | None = None, position: DataPosition | None = None
    ) -> Iterator[SequenceBatch]:
        """Batches from `position` until `num_batches` in all (counted from the start of
        training, as `position.batches`); evaluation: the split once."""
        position = position or DataPosition()
        done = position.batches
        epoch, index = position.epoch, position.offset
        while num_batches is None or done < num_batches:
            plan = self._plan(epoch)
            if index >= len(plan):
                if not self.train:
                    return
                epoch, index = epoch + 1, 0
                continue
            done += 1
            after = DataPosition(epoch=epoch, offset=index + 1, batches=done)
            yield self._batch(*plan[index], epoch=epoch, index=index, position=after)
            index += 1

    def _batch(self, order, rows, offsets, *, epoch, index, position) -> SequenceBatch:
        pieces = self.pieces
        rng = None
        if self.negatives is not None:
            rng = np.random.default_rng([self.seed, epoch, index, 1])
        return packed_batch(
            self.histories,
            Pieces(pieces.history[order], pieces.start[order], pieces.stop[order]),
            rows,
            offsets,
            shape=(self.rows, self.length),
            negatives=self.negatives,
            rng=rng,
            position=position,
            context=self.context,
            sides=self.sides,
        )


def packed_batch(
    histories: Histories,
    pieces: Pieces,
    rows: np.ndarray,
    offsets: np.ndarray,
    *,
    shape: tuple[int, int],
    negatives: Negatives | None,
    rng: np.random.Generator | None,
    position: Any,
    context: tuple[str, ...] = (),
    sides: tuple[str, ...] = (),
) -> SequenceBatch:
    """The batch of `pieces` placed at (`rows`, `offsets`) of a [rows, length] batch, with
    negatives drawn by `rng` (training) or none (evaluation), the `context` the tower
    reads of each event: `times` (seconds since the piece's first event), `actions` (the
    input event's type, as `event_actions`), and the ids of its `sides` features, which
    share the item table (their ids carry their own hash prefix): `sides` [R, L, F], each
    an index into the batch's distinct ids like `inputs`."""
    length = shape[1]
    start, sizes, history = pieces.start, pieces.sizes, pieces.history
    source = ranges(histories.offsets[history] + start, sizes)  # input item of a position
    dest = ranges(rows * length + offsets, sizes)
    segment = np.repeat(np.arange(len(history)), sizes)
    inputs = histories.items[source]
    targets = histories.items[source + 1]
    step_position = ranges(np.zeros(len(history), np.int64), sizes)
    trained = start.repeat(sizes) + step_position + 1 >= histories.first_target[history].repeat(
        sizes
    )
    drawn, logq = np.zeros(0, np.uint64), np.zeros(0, np.float32)
    if negatives is not None:
        drawn, logq = negatives.draw(rng, targets[trained])
    side_ids = [histories.sides[name][source] for name in sides]
    ids, inverse = np.unique(np.concatenate([inputs, targets, drawn, *side_ids]), return_inverse=True)  # fmt: skip
    inverse = inverse.astype(np.int32)
    count = len(inputs)
    if sides:  # after the negatives: [count, F]
        after = 2 * count + len(drawn)
        arrays_sides = inverse[after:].reshape(len(sides), count).T
        inverse = inverse[:after]
    arrays = {
        "inputs": np.zeros(shape, np.int32),
        "targets": np.zeros(shape, np.int32),
        "segments": np.full(shape, -1, np.int32),
        "positions": np.zeros(shape, np.int32),
        "weights": np.zeros(shape, np.float32),
        "actions": np.zeros(shape, np.int32),  # the next event's action type (0: none)
    }
    if "times" in context:
        first = np.repeat(histories.times[histories.offsets[history] + start], sizes)
        gaps = np.clip(histories.times[source] - first, 0, np.iinfo(np.int32).max)
        arrays["times"] = np.zeros(shape, np.int32)
        arrays["times"].reshape(-1)[dest] = gaps
    if "actions" in context:
        arrays["event_actions"] = np.zeros(shape, np.int32)
        arrays["event_actions"].reshape(-1)[dest] = histories.actions[source]
    if sides:
        arrays["sides"] = np.zeros((*shape, len(sides)), np.int32)
        arrays["sides"].reshape(-1, len(sides))[dest] = arrays_sides
    for key, values in (
        ("inputs", inverse[:count]),
        ("targets", inverse[count : 2 * count]),
        ("segments", segment),
        ("positions", step_position),
        ("weights", trained),
        ("actions", 0 if histories.actions is None else histories.actions[source + 1]),
    ):
        arrays[key].reshape(-1)[dest] = values
    return SequenceBatch(
        ids={ITEM_FEATURE.name: ids},
        arrays=arrays,
        negatives=inverse[2 * count :],
        negative_logq=logq,
        position=position,
        histories=history,
        starts=start,
        tokens=count,
    )


def packed_reader(
    config: Any,
    metadata: EventMetadata,
    split: str,
    histories: Histories | None,
    catalogue: Catalogue,
    train: bool,
) -> SequenceReader:
    """The reader of a run's split (`histories`: the split's, when already read):
    training batches with negatives, or evaluation batches."""
    sequence, data = config.model.sequence, config.data
    negatives = None
    if train:
        negatives = Negatives(catalogue, sequence.negatives, sequence.negatives_from)
    return SequenceReader(
        histories
        or Histories.read(
            metadata, split, times=sequence.reads_times, sides=sequence.side_features
        ),
        rows=data.batch_size if train else data.eval_batch_size or data.batch_size,
        length=sequence.max_length,
        seed=config.seed,
        split_long=sequence.long_histories == "split",
        negatives=negatives,
        context=sequence.context,
        sides=sequence.side_features,
    )
