"""What the spec proposals (`infer_spec` for click logs, `infer_events` for event logs)
share: a column's guessed kind with its reason, and reading a sample value as a number."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class ColumnGuess:
    """One column of the sample: its name, kind and the reason for it."""

    name: str
    kind: str  # click logs: label, numeric, categorical, ignored; event logs: user, item, ...
    reason: str


def number(value: str) -> float | None:
    """`value` as a finite number, or None."""
    try:
        parsed = float(value)
    except ValueError:
        return None
    return parsed if math.isfinite(parsed) else None
