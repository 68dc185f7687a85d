"""Streaming, resumable training input from the Parquet shards of `hybridrec preprocess`.

Each reader walks its share of the files one row group at a time, never a whole
split. Shuffling is exact and resumable without saving any buffered rows:

* every epoch permutes the reader's row groups with `rng(seed, epoch)`;
* consecutive row groups are gathered into *windows* of at least `shuffle_buffer`
  rows, and each window's rows are permuted with `rng(seed, epoch, window)`;
* batches are cut from the concatenation of the permuted windows.

So the position after any batch is just `(epoch, window, offset)`: on resume the
reader re-reads that window's row groups, recomputes its permutation and skips
`offset` rows. Memory is bounded by `read_threads` + 1 windows (the current one and those
read ahead, a thread each) plus one batch.

Batches have a static shape (the jitted step compiles once): training drops the
last partial batch of an epoch, evaluation pads it and marks the padding rows
invalid. Every reader of one job yields the same number of batches, so processes
of a multi-host job always call the collective step the same number of times.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import FeatureIds
from hybridrec.pipeline import DatasetMetadata
from hybridrec.training.data.row_tables import (
    Columns,
    Rows,
    concat_rows,
    ids_of,
    padding_rows,
    rows_from_arrow,
    slice_rows,
)


def default_read_threads() -> int:
    """Window-reading threads when data.read_threads is 0: half the cores, 1 to 8 (the
    other half runs the step's host work and the store's shards)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where a reader resumes: the next row is row `offset` of window `window` of `epoch`."""

    epoch: int = 0  # epoch of the next row
    window: int = 0  # index of the shuffle window in this epoch's order
    offset: int = 0  # rows of that window already consumed
    batches: int = 0  # batches produced since the start of training

    def to_dict(self) -> dict[str, int]:
        """The position as a JSON-serializable {field: int} dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataPosition:
        """The position saved by `to_dict`; every field must be present."""
        return cls(**{f.name: int(data[f.name]) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class Batch:
    """One local batch.

    Attributes:
        dense: [batch, num_dense] float32.
        labels: [batch] float32.
        ids: feature name -> [batch] uint64 (single-valued) or RaggedIds with
            `batch + 1` offsets (multi-valued).
        valid: [batch] bool; False marks padding rows (evaluation only).
        position: the reader position after this batch (what a checkpoint saves).
    """

    dense: np.ndarray
    labels: np.ndarray
    ids: dict[str, FeatureIds]
    valid: np.ndarray
    position: DataPosition

    @property
    def size(self) -> int:
        """Rows in the batch, padding rows included."""
        return int(self.labels.shape[0])


@dataclasses.dataclass(frozen=True)
class _RowGroup:
    file: int
    index: int
    rows: int


class ParquetReader:
    """Yields static-shape batches from a share of a split's Parquet files.

    Example:
        reader = ParquetReader(files, label="label", dense=["I1"], categorical=["C1"],
                               batch_size=512, seed=0, shard_index=jax.process_index(),
                               shard_count=jax.process_count())
        for batch in reader.batches(num_batches=reader.batches_per_epoch * 2):
            ...

    Args:
        files: every file of the split (all readers get the same list).
        label, dense, categorical: column names; a batch's ids are in `categorical`
            order (the tower's feature order).
        multi: those of `categorical` that are list<uint64> columns (bags).
        batch_size: rows per batch of this reader.
        seed: shuffling seed; equal seeds give equal streams.
        shuffle_buffer: minimum rows per shuffle window; 0 disables shuffling.
        shard_index, shard_count: this reader reads files[shard_index::shard_count].
        pad_final: pad the last partial batch (evaluation) instead of dropping it.
        id_map: maps each batch's ids to bucket ids (`training.learned_hash.IdMap`), or None.
        read_threads: windows read (and shuffled) ahead, each on a thread of its own.
    """

    def __init__(
        self,
        files: Sequence[str | Path],
        *,
        label: str,
        dense: Sequence[str],
        categorical: Sequence[str],
        multi: Sequence[str] = (),
        batch_size: int,
        seed: int = 0,
        shuffle_buffer: int = 0,
        shard_index: int = 0,
        shard_count: int = 1,
        pad_final: bool = False,
        id_map: Any = None,
        read_threads: int = 1,
    ):
        if batch_size <= 0:
            raise UserError(f"batch size must be positive, got {batch_size}")
        if read_threads < 1:
            raise UserError(f"data.read_threads must be >= 1 (0 = auto), got {read_threads}")
        all_files = [Path(f) for f in files]
        if len(all_files) < shard_count:
            raise UserError(
                f"{len(all_files)} data files cannot be shared by {shard_count} readers; "
                "write at least one file per process (preprocess --num-shards)"
            )
        self.columns = Columns(label, tuple(dense), tuple(categorical), tuple(multi))
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.pad_final = pad_final
        self.id_map = id_map
        self.files = all_files[shard_index::shard_count]
        self.read_threads = read_threads
        self._footers: dict[int, pq.FileMetaData] = {}  # this reader's files', by position
        rows_per_shard = []
        self._row_groups: list[_RowGroup] = []
        for shard in range(shard_count):
            shard_groups = []
            for position, path in enumerate(all_files[shard::shard_count]):
                try:
                    metadata = pq.ParquetFile(path).metadata
                except (OSError, pa.ArrowInvalid) as error:
                    raise UserError(f"{path}: cannot read Parquet footer: {error}") from None
                shard_groups += [
                    _RowGroup(position, i, metadata.row_group(i).num_rows)
                    for i in range(metadata.num_row_groups)
                ]
                if shard == shard_index:
                    self._footers[position] = metadata
            rows_per_shard.append(sum(g.rows for g in shard_groups))
            if shard == shard_index:
                self._row_groups = [g for g in shard_groups if g.rows > 0]
        self.rows = rows_per_shard[shard_index]
        # Every reader of the job yields the same number of batches per epoch.
        if pad_final:
            self.batches_per_epoch = max(-(-r // batch_size) for r in rows_per_shard)
        else:
            self.batches_per_epoch = min(r // batch_size for r in rows_per_shard)
        if self.batches_per_epoch == 0:
            raise UserError(
                f"split has fewer rows per reader ({min(rows_per_shard)}) than one batch "
                f"({batch_size}); lower data.batch_size or add data"
            )
        # the next windows of the stream, in order, read (and shuffled) on `read_threads`
        # threads while this one's batches go out
        self._ahead: dict[tuple[int, int], Future] = {}
        self._windows: dict[int, list[list[_RowGroup]]] = {}  # the epochs' windows, as cut
        self._streams = 0  # `batches` calls so far: the last one owns the windows ahead
        self._workers: ThreadPoolExecutor | None = None

    @classmethod
    def of_dataset(
        cls, metadata: DatasetMetadata, files: Sequence[str | Path], **options: Any
    ) -> ParquetReader:
        """A reader of `files` of the dataset `metadata` describes (its label, dense and
        categorical columns); `options` are the other arguments (batch_size, seed, ...)."""
        columns = Columns.of_dataset(metadata)
        return cls(
            files,
            label=columns.label,
            dense=columns.dense,
            categorical=columns.categorical,
            multi=columns.multi,
            **options,
        )

    def _epoch_windows(self, epoch: int) -> list[list[_RowGroup]]:
        """The epoch's windows of row groups, in the order it reads them."""
        if epoch not in self._windows:
            self._windows = {e: w for e, w in self._windows.items() if e >= epoch - 1}
            self._windows[epoch] = self._cut_windows(epoch)
        return self._windows[epoch]

    def _cut_windows(self, epoch: int) -> list[list[_RowGroup]]:
        groups = list(self._row_groups)
        if self.shuffle_buffer > 0:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(groups))
            groups = [groups[i] for i in order]
        windows: list[list[_RowGroup]] = []
        current: list[_RowGroup] = []
        rows = 0
        for group in groups:
            current.append(group)
            rows += group.rows
            if rows >= self.shuffle_buffer:
                windows.append(current)
                current, rows = [], 0
        if current:
            windows.append(current)
        return windows

    def _read_group(self, group: _RowGroup) -> pa.Table:
        """One row group's columns (each read opens its file: a reader's threads share no
        handle; the footer is the one read at start-up)."""
        path = self.files[group.file]
        try:
            with pq.ParquetFile(path, metadata=self._footers[group.file]) as handle:
                return handle.read_row_group(group.index, columns=self.columns.all)
        except (OSError, pa.ArrowInvalid) as error:
            raise UserError(f"{path}: row group {group.index}: {error}") from None

    def _read_window(self, epoch: int, index: int, groups: list[_RowGroup]) -> Rows:
        """A window's rows, permuted when the reader shuffles (each column gathered once)."""
        tables = [self._read_group(group) for group in groups]
        names = [f"{self.files[g.file]} row group {g.index}" for g in groups]
        where = names[0]
        if len(groups) > 1:
            where += f" (or one of the {len(groups) - 1} read with it)"
        try:  # files of other column types (int32 ids, float64 features) are widened
            table = pa.concat_tables(tables, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            other = [n for n, t in zip(names, tables, strict=True) if t.schema != tables[0].schema]  # fmt: skip
            raise UserError(
                f"{(other or names)[0]}: its columns do not match those of {names[0]} ({error})"
            ) from None
        order = None
        if self.shuffle_buffer > 0:
            rng = np.random.default_rng([self.seed, epoch, index])
            order = rng.permutation(table.num_rows)
        rows = rows_from_arrow(table, self.columns, where, order)
        if self.id_map is not None:
            mapped = self.id_map.apply(ids_of(rows, self.columns.categorical))
            for row, name in enumerate(rows.get("names", ())):
                rows["single"][row] = mapped[name]
            rows["ids"] = {name: mapped[name] for name in rows["ids"]}
        return rows

    def _window(
        self, epoch: int, index: int, windows: list[list[_RowGroup]], num_batches: int
    ) -> Rows:
        """Window `index` of `epoch` (read ahead when the calls before expected it), after
        setting the threads to read the windows after it that the stream of `num_batches`
        batches goes on to, up to `read_threads` of them."""
        wanted = (epoch, index)
        if self._ahead and next(iter(self._ahead)) != wanted:
            self._drop_ahead()  # another position: a resume, a new stream
        future = self._ahead.pop(wanted, None)
        if self._workers is None:
            self._workers = ThreadPoolExecutor(
                self.read_threads, thread_name_prefix="hybridrec-read"
            )
        if future is None:
            future = self._workers.submit(self._read_window, epoch, index, windows[index])
        for following in self._following(epoch, index, windows, num_batches):
            if len(self._ahead) >= self.read_threads:
                break
            if following not in self._ahead:
                e, i = following
                groups = windows if e == epoch else self._epoch_windows(e)
                self._ahead[following] = self._workers.submit(self._read_window, e, i, groups[i])
        return future.result()

    def _following(
        self, epoch: int, index: int, windows: list[list[_RowGroup]], num_batches: int
    ) -> Iterator[tuple[int, int]]:
        """The windows after (epoch, index) that the stream's batches reach, in order."""
        start = sum(group.rows for window in windows[: index + 1] for group in window)
        while True:
            index += 1
            if index == len(windows):
                epoch, index, start = epoch + 1, 0, 0
                windows = self._epoch_windows(epoch)
            batch = start // self.batch_size  # the first batch with rows of this window
            if batch < self.batches_per_epoch:  # (else past the epoch's last batch)
                if epoch * self.batches_per_epoch + batch >= num_batches:
                    return
                yield epoch, index
            start += sum(group.rows for group in windows[index])

    def _drop_ahead(self, wait: bool = True) -> None:
        """Forgets the windows read ahead: the reads not started are cancelled, those in
        flight waited for (`wait`: their memory is free before new reads start) or left to
        end on their threads."""
        ahead, self._ahead = self._ahead, {}
        for future in ahead.values():
            if not future.cancel() and wait:
                future.exception()

    def position_after(self, batches: int) -> DataPosition:
        """Where this reader's stream stands after `batches` batches from the start of
        training (row-group sizes only, nothing read): what `batches()` yields at that
        point. A job resumed on a different number of processes starts each new reader
        there, so the global step, epoch and share of the epoch carry over."""
        epoch, in_epoch = divmod(batches, self.batches_per_epoch)
        rows = in_epoch * self.batch_size
        windows = self._epoch_windows(epoch)
        for index, window in enumerate(windows):
            size = sum(group.rows for group in window)
            if rows < size:
                return DataPosition(epoch, index, rows, batches)
            rows -= size
        return DataPosition(epoch, len(windows), 0, batches)

    def batches(
        self, num_batches: int | None = None, position: DataPosition | None = None
    ) -> Iterator[Batch]:
        """Yields batches from `position` (default: the start) until `num_batches` in total.

        `num_batches` counts from the start of training (position.batches), so a
        resumed stream ends where the uninterrupted one would. None: one epoch.
        """
        self._streams += 1
        stream = self._streams
        try:
            yield from self._batches(num_batches, position or DataPosition())
        finally:  # a stream closed or dropped early: forget the windows read for it
            if self._streams == stream:  # (unless a newer stream took the reader over)
                self._drop_ahead(wait=False)

    def _batches(self, num_batches: int | None, position: DataPosition) -> Iterator[Batch]:
        if num_batches is None:
            num_batches = self.batches_per_epoch
        epoch, window, offset, produced = (
            position.epoch,
            position.window,
            position.offset,
            position.batches,
        )
        in_epoch = produced - epoch * self.batches_per_epoch if self.batches_per_epoch else 0
        pending: list[Rows] = []
        pending_rows = 0
        while produced < num_batches:
            if in_epoch >= self.batches_per_epoch:
                epoch, window, offset, in_epoch = epoch + 1, 0, 0, 0
                pending, pending_rows = [], 0  # leftover rows of an epoch are dropped
                continue
            windows = self._epoch_windows(epoch)
            if window >= len(windows):  # epoch's rows exhausted: pad (eval) the last batch
                missing = self.batch_size - pending_rows
                rows = concat_rows([*pending, padding_rows(self.columns, missing)])
                valid = np.arange(self.batch_size) < pending_rows
                pending, pending_rows = [], 0
                produced += 1
                in_epoch += 1
                yield self._batch(rows, valid, DataPosition(epoch, window, 0, produced))
                continue
            rows = self._window(epoch, window, windows, num_batches)
            count = len(rows["label"])
            while offset < count and produced < num_batches:
                take = min(self.batch_size - pending_rows, count - offset)
                pending.append(slice_rows(rows, offset, offset + take))
                pending_rows += take
                offset += take
                if pending_rows == self.batch_size:
                    batch_rows = concat_rows(pending)
                    pending, pending_rows = [], 0
                    produced += 1
                    in_epoch += 1
                    next_window, next_offset = (
                        (window, offset) if offset < count else (window + 1, 0)
                    )
                    yield self._batch(
                        batch_rows,
                        np.ones(self.batch_size, bool),
                        DataPosition(epoch, next_window, next_offset, produced),
                    )
                    if in_epoch >= self.batches_per_epoch:
                        break
            if in_epoch < self.batches_per_epoch and offset >= count:
                window, offset = window + 1, 0

    def _batch(self, rows: Rows, valid: np.ndarray, position: DataPosition) -> Batch:
        return Batch(
            dense=np.ascontiguousarray(rows["dense"], np.float32),
            labels=np.ascontiguousarray(rows["label"], np.float32),
            ids=ids_of(rows, self.columns.categorical),
            valid=valid,
            position=position,
        )
