"""Each user's most recent events: the state an event stream extends (`pipeline.events.event_follow`).

Users are kept sorted with the (start, length) of their events in flat columns (items,
times, actions and each side feature). A user whose events change gets a new stretch at
the end of the columns; the old one becomes garbage, and the columns are compacted when
the garbage outgrows the live events, so a file's update costs its users' events, not the
whole state's (inserting new users moves three index arrays, never the events).

The state after manifest line N is a function of the reference dataset and shards 0..N:
a user's events are the last `keep` of the user's newest row. A snapshot
(`state/state-NNNNNN.arrow`, the state after N lines) plus the shards after it rebuild it
exactly after a kill.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.common.files import fsync_directory
from hybridrec.pipeline.events._histories import ranges

STATE_DIR = "state"
_DTYPES = {"items": np.uint64, "times": np.int64, "actions": np.int8}


class UserState:
    """Users' last `keep` events, columns `items`, `times`, `actions` and `sides`."""

    def __init__(self, sides: list[str], keep: int):
        self.columns = {**_DTYPES, **{name: np.uint64 for name in sides}}
        self.keep = keep
        self.users = np.zeros(0, np.uint64)
        self.start = np.zeros(0, np.int64)
        self.length = np.zeros(0, np.int64)
        self.data = {name: np.zeros(1024, dtype) for name, dtype in self.columns.items()}
        self.used = 0  # entries of the columns written (live and garbage)

    def __len__(self) -> int:
        return len(self.users)

    @property
    def events(self) -> int:
        return int(self.length.sum())

    def histories(self, users: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(events of each of `users` [n], their events' columns concatenated in order)."""
        where = np.minimum(np.searchsorted(self.users, users), max(len(self.users) - 1, 0))
        found = (self.users[where] == users) if len(self.users) else np.zeros(len(users), bool)
        lengths = np.where(found, self.length[where] if len(self.users) else 0, 0)
        index = ranges(np.where(found, self.start[where] if len(self.users) else 0, 0), lengths)
        return lengths, {name: column[index] for name, column in self.data.items()}

    def set(self, users: np.ndarray, lengths: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        """Each of `users` (distinct) now has the last `keep` of its `lengths` events."""
        users = np.asarray(users, np.uint64)
        kept = np.minimum(lengths, self.keep)
        offsets = np.cumsum(lengths) - lengths
        index = ranges(offsets + lengths - kept, kept)
        total = len(index)
        self._reserve(total)
        for name, column in self.data.items():
            column[self.used : self.used + total] = columns[name][index]
        starts = self.used + np.cumsum(kept) - kept
        self.used += total
        order = np.argsort(users, kind="stable")
        users, starts, kept = users[order], starts[order], kept[order]
        where = np.searchsorted(self.users, users)
        known = where < len(self.users)
        known[known] = self.users[where[known]] == users[known]
        self.start[where[known]] = starts[known]
        self.length[where[known]] = kept[known]
        fresh = ~known
        if fresh.any():
            self.users = np.insert(self.users, where[fresh], users[fresh])
            self.start = np.insert(self.start, where[fresh], starts[fresh])
            self.length = np.insert(self.length, where[fresh], kept[fresh])
        if self.used > 2 * max(self.events, 1 << 16):
            self._compact()

    def _reserve(self, extra: int) -> None:
        if self.used + extra <= len(self.data["items"]):
            return
        if self.used > 2 * self.events:
            self._compact()
        capacity = len(self.data["items"])
        if self.used + extra > capacity:
            size = max(self.used + extra, 2 * capacity)
            for name, column in self.data.items():
                grown = np.zeros(size, column.dtype)
                grown[: self.used] = column[: self.used]
                self.data[name] = grown

    def _compact(self) -> None:
        index = ranges(self.start, self.length)
        capacity = max(len(index) * 2, 1024)
        for name, column in self.data.items():
            packed = np.zeros(capacity, column.dtype)
            packed[: len(index)] = column[index]
            self.data[name] = packed
        self.start = np.cumsum(self.length) - self.length
        self.used = len(index)

    # ---- snapshots -------------------------------------------------------------------

    def to_table(self) -> pa.Table:
        index = ranges(self.start, self.length)
        offsets = pa.array(np.concatenate([[0], np.cumsum(self.length)]).astype(np.int64))
        columns = {"user": pa.array(self.users, pa.uint64())}
        for name, column in self.data.items():
            columns[name] = pa.LargeListArray.from_arrays(offsets, pa.array(column[index]))
        return pa.table(columns)

    def save(self, path: Path) -> None:
        """Writes the state atomically (temporary name, fsync, rename)."""
        temp = path.with_name(path.name + ".tmp")
        with pa.OSFile(str(temp), "wb") as sink:
            table = self.to_table()
            with pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, path)
        fsync_directory(path.parent)

    @classmethod
    def load(cls, path: Path, sides: list[str], keep: int) -> UserState:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
        state = cls(sides, keep)
        state.update_from_rows(table)
        return state

    def update_from_rows(self, table: pa.Table) -> None:
        """Each row's user now has the row's last `keep` events (a shard's rows, or a
        snapshot's): later rows of a user win."""
        if not table.num_rows:
            return
        users = table.column("user").to_numpy().astype(np.uint64)
        # the last row of each user
        reverse = users[::-1]
        _, first = np.unique(reverse, return_index=True)
        rows = np.sort(len(users) - 1 - first)
        lists = {name: table.column(name).combine_chunks() for name in self.columns if name in table.column_names}  # fmt: skip
        items = lists["items"]
        offsets = items.offsets.to_numpy().astype(np.int64)
        lengths = np.diff(offsets)[rows]
        index = ranges(offsets[rows], lengths)
        columns = {}
        for name, dtype in self.columns.items():
            if name in lists:
                values = lists[name].values.to_numpy(zero_copy_only=False)
                columns[name] = values.astype(dtype, copy=False)[index]
            else:
                columns[name] = np.zeros(len(index), dtype)
        self.set(users[rows], lengths, columns)


def snapshots(out: Path) -> list[tuple[int, Path]]:
    """(lines covered, path) of each state snapshot of a stream, oldest first."""
    found = []
    for path in (out / STATE_DIR).glob("state-*.arrow"):
        digits = path.stem.removeprefix("state-")
        if digits.isdigit():
            found.append((int(digits), path))
    return sorted(found)


def read_rows(paths: list[Path], columns: list[str]) -> pa.Table:
    """The rows of Parquet files, only `columns` that exist in them."""
    tables = []
    for path in paths:
        schema = pq.read_schema(path)
        tables.append(pq.read_table(path, columns=[c for c in columns if c in schema.names]))
    return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})
