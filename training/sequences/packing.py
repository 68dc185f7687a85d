"""Histories cut into pieces and packed into rows: the static shapes of a sequence batch
(`training.sequences.batches`).

A piece is a stretch of one history, one segment of a row; first-fit packing places the
pieces of a batch into its rows, in order, and none waits longer than `rows` pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Stretches of histories, each one segment of a row: positions [start, stop) of
    history `history` (position i: input item i, target item i + 1)."""

    history: np.ndarray  # [pieces] int64
    start: np.ndarray
    stop: np.ndarray

    @property
    def sizes(self) -> np.ndarray:
        return self.stop - self.start


def cut_pieces(histories: Any, length: int, *, split: bool) -> Pieces:
    """Every history's positions (of `training.sequences.batches.Histories`) in pieces of at most
    `length`: consecutive pieces (`split`), or only its most recent `length`; pieces
    without a target are left out."""
    positions = histories.lengths - 1
    if not split:
        start = np.maximum(positions - length, 0)
        history = np.arange(len(histories))
        pieces = Pieces(history, start, positions)
    else:
        counts = np.maximum(-(-positions // length), 0)
        history = np.repeat(np.arange(len(histories)), counts)
        first_piece = np.repeat(np.cumsum(counts) - counts, counts)
        start = (np.arange(len(history)) - first_piece) * length
        pieces = Pieces(history, start, np.minimum(start + length, positions[history]))
    # a piece trains positions i with i + 1 >= first_target
    keep = (pieces.stop > pieces.start) & (pieces.stop >= histories.first_target[pieces.history])
    return Pieces(pieces.history[keep], pieces.start[keep], pieces.stop[keep])


def stream_pieces(histories: Any, length: int) -> Pieces:
    """Pieces covering every trained position of each history once, cut from its end,
    oldest first within a history; the first piece may start before `first_target` (its
    earlier positions are context, not trained)."""
    positions = histories.lengths - 1
    first = np.maximum(histories.first_target - 1, 0)  # the first trained position
    counts = -(-np.maximum(positions - first, 0) // length)
    history = np.repeat(np.arange(len(histories)), counts)
    local = np.arange(len(history)) - np.repeat(np.cumsum(counts) - counts, counts)
    stop = positions[history] - (counts[history] - 1 - local) * length
    return Pieces(history, np.maximum(stop - length, 0), stop)


def pack(
    sizes: np.ndarray, rows: int, length: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """First-fit packing of pieces (of `sizes`, in order) into batches of `rows` rows of
    `length`: per batch (piece indices, their rows, their offsets in the rows).

    A piece that fits no row of the open batch waits; once `rows` pieces wait (or the
    pieces end) the batch closes and the waiting ones open the next, in order.
    """
    if len(sizes) and int(sizes.max()) > length:
        raise ValueError(f"a piece of {int(sizes.max())} positions exceeds the row length {length}")
    batches = []
    fill = np.zeros(rows, np.int64)
    placed: list[tuple[int, int, int]] = []
    waiting: list[int] = []

    def close():
        nonlocal fill, placed
        if placed:
            index, row, offset = (
                np.array(column, np.int64) for column in zip(*placed, strict=True)
            )
            batches.append((index, row, offset))
        fill, placed = np.zeros(rows, np.int64), []

    def place(piece: int) -> bool:
        size = sizes[piece]
        fits = np.flatnonzero(fill + size <= length)
        if not len(fits):
            return False
        row = int(fits[0])
        placed.append((piece, row, int(fill[row])))
        fill[row] += size
        return True

    for piece in range(len(sizes)):
        if not place(piece):
            waiting.append(piece)
        if len(waiting) >= rows:
            close()
            waiting = [p for p in waiting if not place(p)]
    while waiting:
        close()
        waiting = [p for p in waiting if not place(p)]
    close()
    return batches


def ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """np.concatenate([np.arange(s, s + n) for s, n in zip(starts, sizes)])."""
    total = int(sizes.sum())
    if not total:
        return np.zeros(0, np.int64)
    repeated = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
    return repeated + np.arange(total)
