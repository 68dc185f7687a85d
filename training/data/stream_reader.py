"""A stream dataset as batches: the source of follow-mode training.

`hybridrec preprocess --follow` appends shards to a dataset and commits each with a line
of its manifest (`pipeline.manifest`). `StreamReader` reads the committed shards from a
`StreamPosition` (next shard, rows of it trained) in batches of the sizes asked for;
`batch_sizes` says which sizes to ask for: full batches while rows keep coming, then the
rest in decreasing powers of two once the stream has been idle (each shape compiles once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.common.errors import UserError
from hybridrec.pipeline import ManifestEntry, read_shards
from hybridrec.training.data.input import Batch, Columns, rows_from_arrow
from hybridrec.training.data.row_tables import concat_rows, ids_of, slice_rows


@dataclasses.dataclass(frozen=True)
class StreamPosition:
    """The next row to train: row `offset` of shard `shard` (manifest shard order)."""

    shard: int = 0  # index of the next shard among the manifest's shard lines
    offset: int = 0  # rows of that shard already trained
    batches: int = 0  # batches trained since the start of the run
    pieces: tuple[tuple[int, int], ...] = ()  # (shard, rows) of the batch ending here

    def to_dict(self) -> dict[str, int]:
        return {"shard": self.shard, "offset": self.offset, "batches": self.batches}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamPosition:
        return cls(int(data["shard"]), int(data["offset"]), int(data["batches"]))


def batch_sizes(rows: int, batch_size: int, divisor: int, *, flush: bool) -> list[int]:
    """Batch sizes to train `rows` available rows with (static shapes, few of them).

    Full batches of `batch_size`; with `flush`, then the rest as decreasing powers of two
    times `divisor` (fewer than `divisor` rows stay for later).
    """
    sizes = [batch_size] * (rows // batch_size)
    if flush:
        units = (rows - len(sizes) * batch_size) // divisor
        for bit in reversed(range(units.bit_length())):
            if units >> bit & 1:
                sizes.append(divisor << bit)
    return sizes


class StreamReader:
    """Batches of a stream dataset's committed shards, from a position.

    Args:
        data_dir: the stream dataset (`hybridrec preprocess --follow` output).
        columns: the label, dense and id columns to read.
    """

    def __init__(self, data_dir: str | Path, columns: Columns):
        self.root = Path(data_dir)
        self.columns = columns
        self.shards: list[ManifestEntry] = []
        self._cached: tuple[int, dict] | None = None

    def refresh(self) -> int:
        """Reads newly committed shard lines; returns how many shards are known."""
        self.shards += read_shards(self.root, start=len(self.shards))
        return len(self.shards)

    def available(self, position: StreamPosition) -> int:
        """Rows committed and not yet trained from `position` on."""
        rows = sum(entry.rows for entry in self.shards[position.shard :])
        return rows - position.offset

    def batches(self, position: StreamPosition, sizes: list[int]) -> Iterator[Batch]:
        """Yields one batch per size, from `position` (the rows must be available)."""
        shard, offset, produced = position.shard, position.offset, position.batches
        for size in sizes:
            parts, pieces = [], []
            while size:
                rows = self._shard_rows(shard)
                take = min(size, len(rows["label"]) - offset)
                parts.append(slice_rows(rows, offset, offset + take))
                pieces.append((shard, take))
                offset += take
                size -= take
                if offset == len(rows["label"]):
                    shard, offset = shard + 1, 0
            produced += 1
            merged = concat_rows(parts)
            yield Batch(
                dense=np.ascontiguousarray(merged["dense"], np.float32),
                labels=np.ascontiguousarray(merged["label"], np.float32),
                ids=ids_of(merged, self.columns.categorical),
                valid=np.ones(len(merged["label"]), bool),
                position=StreamPosition(shard, offset, produced, tuple(pieces)),
            )

    def _shard_rows(self, index: int) -> dict:
        if self._cached is None or self._cached[0] != index:
            entry = self.shards[index]
            path = self.root / entry.shard
            try:
                table = pq.read_table(path, columns=self.columns.all)
            except (OSError, pa.ArrowInvalid) as error:
                raise UserError(f"{path}: cannot read shard: {error}") from None
            if table.num_rows != entry.rows:
                raise UserError(
                    f"{path}: {table.num_rows} rows, the manifest line {entry.seq} says {entry.rows}"
                )
            self._cached = (index, rows_from_arrow(table, self.columns, str(path)))
        return self._cached[1]
