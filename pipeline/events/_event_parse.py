"""Vectorized parsing of event logs: text blocks and Parquet batches -> `EventBlock`s.

Three inputs give the same events:
- delimited text (one event a line; a delimiter of one to four bytes, such as `,` or
  MovieLens' `::`, or runs of whitespace);
- the `user_per_line` form (`user item item ...`: integer ids, oldest item first);
- Parquet (columns by name; strings, integers, or timestamps for the time).
Every cell is reduced to bytes (`Cells`: a buffer with a start and a length per row), so
ids hash exactly as the click-log job hashes categoricals (`pipeline.hashing`, the same
raw id gives the same id everywhere) and times parse by one set of rules whatever the
input. A row that cannot be an event is rejected with its reason; input that cannot be
read as the spec says (a time column mixing formats, a non-integer token in the
user-per-line form) stops the job with a message naming the file and line.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hybridrec.pipeline import hashing
from hybridrec.pipeline._errors import InputError
from hybridrec.pipeline._parse import binary_cells, line_text, parse_floats, parse_ints
from hybridrec.pipeline._text_fields import text_fields, text_lines
from hybridrec.pipeline.events.event_spec import EventSpec

REASONS = (
    "wrong_field_count",
    "missing_user",
    "missing_item",
    "missing_time",
    "bad_time",
    "bad_action",
)
_ISO_DIGITS = (0, 1, 2, 3, 5, 6, 8, 9)  # YYYY-MM-DD
_TIME_DIGITS = (11, 12, 14, 15)  # HH:MM
_MS_ABOVE = 10**11  # auto: unix times above this are milliseconds (after 5138 in seconds)


@dataclasses.dataclass
class Cells:
    """One column's cells: bytes `buffer[starts[i] : starts[i] + lengths[i]]` of row i."""

    buffer: np.ndarray  # uint8
    starts: np.ndarray  # int64 [rows]
    lengths: np.ndarray  # int64 [rows]

    def text(self, row: int) -> str:
        start = int(self.starts[row])
        raw = self.buffer[start : start + int(self.lengths[row])].tobytes()
        return raw.decode("utf-8", errors="backslashreplace")

    def take(self, rows: np.ndarray) -> Cells:
        return Cells(self.buffer, self.starts[rows], self.lengths[rows])

    def to_arrow(self) -> pa.Array:
        """The cells as one large_binary array (gathered without a Python object a cell)."""
        offsets = np.zeros(len(self.lengths) + 1, np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        source = np.repeat(self.starts - offsets[:-1], self.lengths) + np.arange(offsets[-1])
        data = self.buffer[source] if len(source) else np.zeros(0, np.uint8)
        return pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), len(self.lengths), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
        )

    @staticmethod
    def of_binary(array: pa.Array) -> Cells:
        """The cells of a large_binary array (null: an empty cell)."""
        array = array.cast(pa.large_binary()) if array.type != pa.large_binary() else array
        buffer, starts, lengths = binary_cells(array)
        return Cells(buffer, starts.copy(), lengths)


@dataclasses.dataclass
class EventBlock:
    """The valid events of a block, in input order.

    Attributes:
        users, items: uint64 [events] ids (tables `user` and `item`).
        times: int64 [events] seconds since the epoch (0 without a time column).
        actions: int8 [events] action type 1..n (0: the log has no action).
        sides: event feature name -> uint64 [events] ids.
        lines: int64 [events] the event's line (Parquet: row) index in the block.
        positions: int32 [events] its place in its line (user_per_line), else 0.
        user_cells: the raw user id of each event (to name a capped user).
        item_cells: the raw item id of each event (the dataset's item names).
        rejected: (line in block, reason, detail, text) of each rejected line.
        lines_read: lines (rows) of the block.
        time_format: the time format the block's times were read in ("" without times).
    """

    users: np.ndarray
    items: np.ndarray
    times: np.ndarray
    actions: np.ndarray
    sides: dict[str, np.ndarray]
    lines: np.ndarray
    positions: np.ndarray
    user_cells: Cells
    item_cells: Cells
    rejected: list[tuple[int, str, str, str]]
    lines_read: int
    time_format: str = ""

    def __len__(self) -> int:
        return len(self.users)


def ids_of(cells: Cells, prefix: int, prefix_bits: int) -> np.ndarray:
    """uint64 ids of cells (an empty cell: the table's missing id)."""
    raw = hashing.hash_fields(hashing.padded_words(cells.buffer), cells.starts, cells.lengths)
    return hashing.feature_ids(raw, cells.lengths == 0, prefix, prefix_bits)


# ---- times ---------------------------------------------------------------------------------


def _digits(cells: Cells, offsets) -> tuple[np.ndarray, np.ndarray]:
    """The digit values at `offsets` of each cell, and whether every one is a digit."""
    at = cells.starts[:, None] + np.asarray(offsets)[None, :]
    raw = cells.buffer[np.minimum(at, len(cells.buffer) - 1)].astype(np.int64) - ord("0")
    return raw, ((raw >= 0) & (raw <= 9)).all(axis=1)


def _days_from_civil(year, month, day):
    """Days since 1970-01-01 of proleptic Gregorian dates (Hinnant's algorithm)."""
    year = year - (month <= 2)
    era = np.floor_divide(year, 400)
    year_of_era = year - era * 400
    day_of_year = (153 * (month + np.where(month > 2, -3, 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146097 + day_of_era - 719468


def _iso_seconds(cells: Cells) -> tuple[np.ndarray, np.ndarray]:
    """Seconds since the epoch of ISO-8601 cells (YYYY-MM-DD, then optionally [T ]HH:MM,
    :SS, .fraction, Z), and which cells are such; other cells (time zones too) are not."""
    n = len(cells.lengths)
    ok = cells.lengths >= 10
    if not len(cells.buffer):
        return np.zeros(n, np.int64), np.zeros(n, bool)
    date, digits_ok = _digits(cells, _ISO_DIGITS)
    byte = lambda k: cells.buffer[np.minimum(cells.starts + k, len(cells.buffer) - 1)]  # noqa: E731
    ok &= digits_ok & (byte(4) == ord("-")) & (byte(7) == ord("-"))
    year = date[:, 0] * 1000 + date[:, 1] * 100 + date[:, 2] * 10 + date[:, 3]
    month, day = date[:, 4] * 10 + date[:, 5], date[:, 6] * 10 + date[:, 7]
    length = cells.lengths
    has_time = length >= 16
    clock, clock_ok = _digits(cells, _TIME_DIGITS)
    separator = byte(10)
    ok &= ~has_time | (
        clock_ok & ((separator == ord("T")) | (separator == ord(" "))) & (byte(13) == ord(":"))
    )
    ok &= (length == 10) | has_time | ((length == 11) & (byte(10) == ord("Z")))
    hours = np.where(has_time, clock[:, 0] * 10 + clock[:, 1], 0)
    minutes = np.where(has_time, clock[:, 2] * 10 + clock[:, 3], 0)
    has_seconds = length >= 19
    second_digits, seconds_ok = _digits(cells, (17, 18))
    ok &= ~has_seconds | (seconds_ok & (byte(16) == ord(":")))
    seconds = np.where(has_seconds, second_digits[:, 0] * 10 + second_digits[:, 1], 0)
    # what follows HH:MM or HH:MM:SS: nothing, Z, or .digits with an optional Z
    tail_start = np.where(has_seconds, 19, 16)
    for row in np.flatnonzero(ok & has_time & (length > tail_start)):
        start = cells.starts[row] + tail_start[row]
        tail = cells.buffer[start : cells.starts[row] + length[row]].tobytes()
        body = tail[:-1] if tail.endswith(b"Z") else tail
        if body and not (has_seconds[row] and body[:1] == b"." and body[1:].isdigit()):
            ok[row] = False
    days_in_month = np.array([31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31])
    ok &= (month >= 1) & (month <= 12) & (day >= 1)
    ok &= day <= days_in_month[np.clip(month - 1, 0, 11)]
    leap = (year % 4 == 0) & ((year % 100 != 0) | (year % 400 == 0))
    ok &= ~((month == 2) & (day == 29) & ~leap)
    ok &= (hours < 24) & (minutes < 60) & (seconds < 61)
    days = _days_from_civil(year, month, day)
    return days * 86400 + hours * 3600 + minutes * 60 + seconds, ok


def _numeric_seconds(cells: Cells, milliseconds: bool) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of unix-time cells (integers or decimals), and which cells are numbers."""
    values, missing, non_numeric, overflow = parse_ints(cells.buffer, cells.starts, cells.lengths)
    ok = ~missing & ~non_numeric & ~overflow
    seconds = values // 1000 if milliseconds else values
    decimal = np.flatnonzero(non_numeric | overflow)  # 1700000000.5, 1.7e9: as floats
    if len(decimal):
        floats, _, bad, *_ = parse_floats(
            cells.buffer, cells.starts[decimal], cells.lengths[decimal]
        )
        floats = floats / 1000.0 if milliseconds else floats
        good = ~bad & np.isfinite(floats) & (np.abs(floats) < 2**62)
        seconds[decimal[good]] = np.floor(floats[good]).astype(np.int64)
        ok[decimal[good]] = True
    return np.where(ok, seconds, 0), ok


def _looks_numeric(cells: Cells) -> np.ndarray:
    first = cells.buffer[np.minimum(cells.starts, max(len(cells.buffer) - 1, 0))]
    digit = (first >= ord("0")) & (first <= ord("9")) | (first == ord("-"))
    four = cells.lengths >= 5
    if len(cells.buffer):
        dash = cells.buffer[np.minimum(cells.starts + 4, len(cells.buffer) - 1)] == ord("-")
    else:
        dash = np.zeros(len(cells.lengths), bool)
    return digit & ~(four & dash)


def parse_times(cells: Cells, time_format: str, seen: str, where) -> tuple:
    """Seconds since the epoch of time cells.

    Args:
        time_format: the spec's (auto: decided by the first non-empty cell, then kept).
        seen: the format earlier blocks of the same input were read in ("" for none).
        where: row -> "FILE: line N" for messages.

    Returns:
        (seconds int64, bad bool, the format read in). An empty cell is bad.

    Raises:
        InputError: the column mixes formats (numbers and ISO dates, seconds and
            milliseconds as `auto` decides them), naming the first cell of the other one.
    """
    present = cells.lengths > 0
    numeric = _looks_numeric(cells)
    fmt = time_format if time_format != "auto" else seen
    if not fmt and present.any():
        first = int(np.flatnonzero(present)[0])
        if numeric[first]:
            value, _ = _numeric_seconds(cells.take(np.array([first])), False)
            fmt = "unix_ms" if abs(int(value[0])) > _MS_ABOVE else "unix"
        else:
            fmt = "iso"
    if not fmt:
        return np.zeros(len(cells.lengths), np.int64), ~present, seen
    if fmt == "iso":
        seconds, ok = _iso_seconds(cells)
        other = present & numeric
    else:
        seconds, ok = _numeric_seconds(cells, fmt == "unix_ms")
        other = present & ~numeric
        if other.any():  # only the cells that are not numbers can be ISO times
            candidates = np.flatnonzero(other)
            other[candidates] = _iso_seconds(cells.take(candidates))[1]
        if time_format == "auto" and fmt == "unix":
            other |= ok & (np.abs(seconds) > _MS_ABOVE)
        elif time_format == "auto":
            other |= ok & (np.abs(seconds) * 1000 <= _MS_ABOVE) & (seconds != 0)
    if other.any():
        row = int(np.flatnonzero(other)[0])
        raise InputError(
            f"{where(row)}: the time column mixes formats: {cells.text(row)!r} is not "
            f"{_FORMAT_NAMES[fmt]} like the times before it; write one format, or set "
            "time_format in the spec"
        )
    return seconds, ~ok, fmt


_FORMAT_NAMES = {
    "unix": "unix seconds",
    "unix_ms": "unix milliseconds",
    "iso": "an ISO-8601 date or time",
}


class EventParser:
    """Parses the blocks of one spec; build once per worker and reuse.

    Args:
        spec: the event spec.
    """

    def __init__(self, spec: EventSpec):
        self.spec = spec
        self.bits = spec.prefix_bits
        if spec.format == "delimited":
            self.column = {name: index for index, name in enumerate(spec.columns)}
        if spec.action is not None and spec.action.values:
            values = [value.encode() for value in spec.action.values]
            self.action_hashes = hashing.hash_bytes_list(values)

    def parse_text(self, block: bytes, where, seen_format: str = "") -> EventBlock:
        """A block of complete lines; `where(line)` names a line of it ("FILE: line N");
        `seen_format` is the time format the input's earlier blocks were read in."""
        buffer, line_starts, line_ends = text_lines(block)
        starts, ends, field_lines = text_fields(buffer, line_starts, line_ends, self.spec.delimiter)
        per_line = np.bincount(field_lines, minlength=len(line_starts))
        if self.spec.format == "user_per_line":
            return self._user_lines(
                buffer, line_starts, line_ends, starts, ends, field_lines, where
            )
        blank = line_ends == line_starts
        width = len(self.spec.columns)
        rejected = []
        for line in np.flatnonzero((per_line != width) & ~blank):
            text = line_text(buffer, line_starts[line], line_ends[line])
            found = f"{per_line[line]} fields, the spec has {width}"
            rejected.append((int(line), "wrong_field_count", found, text))
        good_line = (per_line == width) & ~blank
        good = np.flatnonzero(good_line)
        keep = good_line[field_lines]
        cell_starts = starts[keep].reshape(-1, width)
        cell_lengths = (ends[keep] - starts[keep]).reshape(-1, width)

        def column(name: str) -> Cells:
            index = self.column[name]
            return Cells(buffer, cell_starts[:, index], cell_lengths[:, index])

        def shown(row: int) -> str:
            return line_text(buffer, line_starts[good[row]], line_ends[good[row]])

        return self._events(column, good, shown, where, rejected, len(line_starts), seen_format)

    def parse_batch(self, batch: pa.RecordBatch, where, seen_format: str = "") -> EventBlock:
        """A Parquet record batch whose columns are named as the spec's."""
        rows = np.arange(batch.num_rows)
        times = None
        if self.spec.time and pa.types.is_timestamp(batch.column(self.spec.time).type):
            column = batch.column(self.spec.time)
            times = pc.cast(column, pa.timestamp("s", tz=column.type.tz)).cast(pa.int64())

        def column(name: str) -> Cells:
            array = batch.column(name)
            if pa.types.is_dictionary(array.type):
                array = array.dictionary_decode()
            if not (pa.types.is_string(array.type) or pa.types.is_binary(array.type)) and not (
                pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
            ):
                array = pc.cast(array, pa.string())
            return Cells.of_binary(array)

        def shown(row: int) -> str:
            return str({name: batch.column(name)[row].as_py() for name in batch.schema.names})

        return self._events(
            column, rows, shown, where, [], batch.num_rows, seen_format, timestamps=times
        )

    def _events(self, column, rows, shown, where, rejected, lines_read, seen="", timestamps=None):
        """The events of parsed rows: `column(name)` gives a column's cells for `rows`."""
        spec = self.spec
        reason = np.zeros(len(rows), np.int8)
        details: dict[int, str] = {}

        def reject(mask: np.ndarray, name: str, describe) -> None:
            for row in np.flatnonzero(mask & (reason == 0)):
                reason[row] = REASONS.index(name) + 1
                details[int(row)] = describe(int(row))

        user_cells, item_cells = column(spec.user), column(spec.item)
        reject(user_cells.lengths == 0, "missing_user", lambda row: f"{spec.user} is empty")
        reject(item_cells.lengths == 0, "missing_item", lambda row: f"{spec.item} is empty")
        times = np.zeros(len(rows), np.int64)
        time_format = ""
        if spec.time and timestamps is not None:
            missing = timestamps.is_null().to_numpy(zero_copy_only=False)
            times = timestamps.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            reject(missing, "missing_time", lambda row: f"{spec.time} is empty")
            time_format = "timestamp"
        elif spec.time:
            cells = column(spec.time)
            times, bad, time_format = parse_times(
                cells, spec.time_format, seen, lambda row: where(int(rows[row]))
            )
            reject(cells.lengths == 0, "missing_time", lambda row: f"{spec.time} is empty")
            reject(bad, "bad_time", lambda row: f"{spec.time}={cells.text(row)!r} is not a time")
        actions = np.zeros(len(rows), np.int8)
        if spec.action is not None:
            actions = self._actions(column(spec.action.column), reject)
        sides = {
            feature.name: ids_of(column(feature.name), spec.prefix(feature.table), self.bits)
            for feature in spec.event_features
        }
        for row in np.flatnonzero(reason):
            rejected.append((int(rows[row]), REASONS[reason[row] - 1], details[row], shown(row)))
        keep = reason == 0
        return EventBlock(
            users=ids_of(user_cells, spec.prefix("user"), self.bits)[keep],
            items=ids_of(item_cells, spec.prefix("item"), self.bits)[keep],
            times=times[keep],
            actions=actions[keep],
            sides={name: ids[keep] for name, ids in sides.items()},
            lines=np.asarray(rows, np.int64)[keep],
            positions=np.zeros(int(keep.sum()), np.int32),
            user_cells=user_cells.take(np.flatnonzero(keep)),
            item_cells=item_cells.take(np.flatnonzero(keep)),
            rejected=sorted(rejected),
            lines_read=lines_read,
            time_format=time_format,
        )

    def _actions(self, cells: Cells, reject) -> np.ndarray:
        action = self.spec.action
        name = action.column
        if action.values:
            raw = hashing.hash_fields(
                hashing.padded_words(cells.buffer), cells.starts, cells.lengths
            )
            matches = raw[:, None] == self.action_hashes[None, :]
            known = matches.any(axis=1)
            listed = ", ".join(action.values)
            reject(
                ~known,
                "bad_action",
                lambda row: f"{name}={cells.text(row)!r} is not one of {listed}",
            )
            return np.where(known, matches.argmax(axis=1) + 1, 0).astype(np.int8)
        values, missing, non_numeric, *_ = parse_floats(cells.buffer, cells.starts, cells.lengths)
        bad = missing | non_numeric | ~np.isfinite(values)
        reject(bad, "bad_action", lambda row: f"{name}={cells.text(row)!r} is not a number")
        types = np.searchsorted(np.asarray(action.thresholds), values, side="right") + 1
        return np.where(bad, 0, types).astype(np.int8)

    def _user_lines(self, buffer, line_starts, line_ends, starts, ends, field_lines, where):
        """`user item item ...` lines: integer ids, items oldest first."""
        lengths = ends - starts
        is_digit = (buffer >= ord("0")) & (buffer <= ord("9"))
        digits = np.concatenate([[0], np.cumsum(is_digit)])
        bad = digits[ends] - digits[starts] != lengths
        if bad.any():
            token = int(np.flatnonzero(bad)[0])
            line = int(field_lines[token])
            place = token - int(np.searchsorted(field_lines, line))
            text = buffer[starts[token] : ends[token]].tobytes().decode("utf-8", "backslashreplace")
            kind = "user id" if place == 0 else f"item {place}"
            raise InputError(
                f"{where(line)}: token {place + 1} ({kind}) is {text[:60]!r}, not an integer: "
                "the user_per_line format holds integer ids separated by whitespace"
            )
        first = np.ones(len(starts), bool)
        first[1:] = field_lines[1:] != field_lines[:-1]
        user_token = np.maximum.accumulate(np.where(first, np.arange(len(starts)), 0))
        item = ~first
        cells = Cells(buffer, starts, lengths)
        user_ids = ids_of(cells.take(user_token[item]), self.spec.prefix("user"), self.bits)
        positions = (np.arange(len(starts)) - user_token)[item] - 1
        return EventBlock(
            users=user_ids,
            items=ids_of(cells.take(np.flatnonzero(item)), self.spec.prefix("item"), self.bits),
            times=np.zeros(int(item.sum()), np.int64),
            actions=np.zeros(int(item.sum()), np.int8),
            sides={},
            lines=field_lines[item].astype(np.int64),
            positions=positions.astype(np.int32),
            user_cells=cells.take(user_token[item]),
            item_cells=cells.take(np.flatnonzero(item)),
            rejected=[],
            lines_read=len(line_starts),
        )
