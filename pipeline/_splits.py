"""Which split a click-log row goes to: train, valid (on request) or eval, by its position
in the input or by a hash of its bytes (`hybridrec preprocess --split`, `--eval-fraction`,
`--valid-fraction`). A hash split is decided as a chunk is parsed; a position split only
once every chunk's line count is known (`PositionSplit`)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hybridrec.pipeline import hashing


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """Train / valid / eval assignment.

    `position`: the last `eval_fraction` of input lines (over all files, in input order)
    is eval, the `valid_fraction` before them valid. `hash`: a line is eval when
    splitmix64(hash of its bytes) falls in the first `eval_fraction` of the 64-bit range,
    valid in the `valid_fraction` after it.
    """

    mode: str
    eval_fraction: float
    eval_start_line: int  # position mode: first global line index of eval
    valid_fraction: float = 0.0
    valid_start_line: int = 2**62  # position mode: first global line index of valid

    @property
    def names(self) -> tuple[str, ...]:
        """The splits rows go to, in `assign`'s order."""
        return ("train", "valid", "eval") if self.valid_fraction else ("train", "eval")

    def assign(self, global_lines: np.ndarray, row_hashes: np.ndarray) -> np.ndarray:
        """[rows] int8: each row's index in `names`."""
        eval_index = len(self.names) - 1
        if self.mode == "position":
            out = np.where(global_lines >= self.eval_start_line, eval_index, 0).astype(np.int8)
            if self.valid_fraction:
                out[(global_lines >= self.valid_start_line) & (out == 0)] = 1
            return out
        mixed = hashing.splitmix64(row_hashes)
        out = np.where(mixed < _threshold(self.eval_fraction), eval_index, 0).astype(np.int8)
        if self.valid_fraction:
            top = _threshold(self.eval_fraction + self.valid_fraction)
            out[(mixed < top) & (out == 0)] = 1
        return out


def _threshold(fraction: float) -> np.uint64:
    return np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))


@dataclasses.dataclass(frozen=True)
class PositionSplit:
    """A position split's boundaries once the input's line count is known: the first
    global line of valid and of eval."""

    valid_start: int
    eval_start: int

    @classmethod
    def of(cls, total: int, eval_fraction: float, valid_fraction: float) -> PositionSplit:
        eval_start = total - int(round(total * eval_fraction))
        valid_start = eval_start - int(round(total * valid_fraction))
        return cls(valid_start, eval_start)

    def split_of(self, line: int) -> str:
        """The split of global line index `line`."""
        return (
            "eval" if line >= self.eval_start else "valid" if line >= self.valid_start else "train"
        )
