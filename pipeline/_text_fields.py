"""Delimited text split into lines and fields, vectorized over a whole block: one pass
of numpy over the bytes, no Python object a field. A delimiter is one to four bytes (`,`,
a tab, MovieLens' `::`) or "whitespace" (runs of spaces and tabs); a line ends at a
newline, a CR before it dropped.
"""

from __future__ import annotations

import numpy as np

_SPACE, _TAB, _NEWLINE = 32, 9, 10


def text_lines(block: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(buffer, line starts, line ends without the newline or a CR before it)."""
    if block and not block.endswith(b"\n"):
        block += b"\n"  # the last line of a file may lack its newline
    buffer = np.frombuffer(block, np.uint8)
    newlines = np.flatnonzero(buffer == _NEWLINE)
    starts = np.zeros(len(newlines), np.int64)
    starts[1:] = newlines[:-1] + 1
    ends = newlines.astype(np.int64)
    carriage = (ends > starts) & (buffer[np.maximum(ends - 1, 0)] == 13)
    return buffer, starts, ends - carriage


def text_fields(buffer, line_starts, line_ends, delimiter: str):
    """Every field of every line: (starts, ends, line of each), in order."""
    if delimiter == "whitespace":
        blank = (buffer == _SPACE) | (buffer == _TAB) | (buffer == _NEWLINE) | (buffer == 13)
        previous = np.concatenate([[True], blank[:-1]])
        following = np.concatenate([blank[1:], [True]])
        starts = np.flatnonzero(~blank & previous)
        ends = np.flatnonzero(~blank & following) + 1
    else:
        # every field ends at a delimiter or at its line's end (before a CR); the next one
        # starts after it
        marks = _delimiter_starts(buffer, delimiter.encode())
        separators = np.union1d(marks, np.flatnonzero(buffer == _NEWLINE))
        is_newline = buffer[separators] == _NEWLINE
        starts = np.zeros(len(separators), np.int64)
        starts[1:] = separators[:-1] + np.where(is_newline[:-1], 1, len(delimiter.encode()))
        ends = separators.astype(np.int64)
        ends[is_newline] = line_ends
        lines = np.cumsum(is_newline) - is_newline
        return starts, ends, lines
    lines = np.searchsorted(line_ends, starts, side="left")
    return starts.astype(np.int64), ends.astype(np.int64), lines


def _delimiter_starts(buffer: np.ndarray, delimiter: bytes) -> np.ndarray:
    """Where each occurrence of `delimiter` starts in `buffer`, read left to right: of
    overlapping matches (`:::` for `::`) the first is taken, as `str.split` does."""
    if len(delimiter) == 1:
        return np.flatnonzero(buffer == delimiter[0])
    width = len(delimiter)
    tail = len(buffer) - width + 1
    if tail <= 0:
        return np.zeros(0, np.int64)
    match = buffer[:tail] == delimiter[0]
    for offset in range(1, width):
        match &= buffer[offset : offset + tail] == delimiter[offset]
    found = np.flatnonzero(match)
    close = np.flatnonzero(np.diff(found) < width)
    if not len(close):
        return found
    kept, last = [], -width  # rare (a run of the delimiter's bytes): left to right
    for start in found.tolist():
        if start >= last + width:
            kept.append(start)
            last = start
    return np.asarray(kept, np.int64)
