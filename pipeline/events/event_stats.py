"""Statistics of an event-log dataset: mergeable partial summaries, in metadata.json as
`sequence` (users, events, history lengths, actions, what was dropped, cut or capped) and
`tables` (distinct ids and id frequencies per table, which the device planner reads).

Each input chunk and each bucket of users makes an `EventStats`; merged in any order they
give the same result on every runner and for any number of workers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hybridrec.pipeline import hashing
from hybridrec.pipeline.stats import IdSample

NAMED_CAPPED_USERS = 20  # capped users named in metadata.json, the most events first


def _add_counts(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + value
    return out


@dataclasses.dataclass
class EventStats:
    """Counts of part of an event log (a chunk's, a bucket's, or all of them merged)."""

    lines: int = 0  # input lines (Parquet rows) read, headers excluded
    events: int = 0  # valid events read
    rejected_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    duplicates: int = 0  # events dropped as equal to an earlier one
    time_min: int | None = None
    time_max: int | None = None
    time_formats: dict[str, str] = dataclasses.field(default_factory=dict)  # format -> a file
    chunk_lines: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    # per bucket, after grouping
    users: int = 0  # users written
    users_below_min_events: int = 0
    truncated_histories: int = 0  # users whose training history was cut to max_length
    capped_users: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # events, id
    capped_users_count: int = 0
    events_per_user: dict[int, int] = dataclasses.field(default_factory=dict)  # count -> users
    history_lengths: dict[int, int] = dataclasses.field(default_factory=dict)  # train rows
    actions: dict[int, int] = dataclasses.field(default_factory=dict)  # type -> events
    rows_by_split: dict[str, int] = dataclasses.field(default_factory=dict)
    files: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)  # split, key, rows
    id_samples: dict[str, IdSample] = dataclasses.field(default_factory=dict)

    def merge(self, other: EventStats) -> EventStats:
        for name in (
            "lines",
            "events",
            "duplicates",
            "users",
            "users_below_min_events",
            "truncated_histories",
            "capped_users_count",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("rejected_by_reason", "events_per_user", "history_lengths", "actions"):
            setattr(self, name, _add_counts(getattr(self, name), getattr(other, name)))
        self.rows_by_split = _add_counts(self.rows_by_split, other.rows_by_split)
        for bound, pick in (("time_min", min), ("time_max", max)):
            values = [v for v in (getattr(self, bound), getattr(other, bound)) if v is not None]
            setattr(self, bound, pick(values) if values else None)
        self.time_formats = {**other.time_formats, **self.time_formats}
        self.chunk_lines += other.chunk_lines
        self.files += other.files
        self.capped_users = sorted(self.capped_users + other.capped_users, reverse=True)
        self.capped_users = self.capped_users[:NAMED_CAPPED_USERS]
        for table, sample in other.id_samples.items():
            current = self.id_samples.get(table)
            self.id_samples[table] = sample if current is None else current.merge(sample)
        return self

    def count_ids(self, table: str, ids: np.ndarray) -> None:
        """Adds occurrences of a table's ids (distinct-sampled as `IdSample` does)."""
        current = self.id_samples.get(table)
        level = current.level if current is not None else 0
        if level:
            ids = ids[hashing.splitmix64(ids) & np.uint64((1 << level) - 1) == 0]
        sample = IdSample.of(ids, level)
        self.id_samples[table] = sample if current is None else current.merge(sample)

    def to_json(self, spec) -> dict:
        """The `sequence` and `tables` sections of metadata.json."""
        lengths = _quantiles(self.history_lengths)
        per_user = _quantiles(self.events_per_user)
        names = spec.action.type_names if spec.action is not None else ()
        sequence = {
            "users": self.users,
            "events_read": self.events,
            "lines_read": self.lines,
            "events_per_user": per_user,
            "history_length": lengths,
            "duplicates_dropped": self.duplicates,
            "users_below_min_events": self.users_below_min_events,
            "truncated_histories": self.truncated_histories,
            "capped_users": self.capped_users_count,
            "capped_users_named": [[user, events] for events, user in self.capped_users],
            "time": {"min": self.time_min, "max": self.time_max, "formats": self.time_formats},
        }
        if names:
            sequence["actions"] = {
                names[kind - 1]: count for kind, count in sorted(self.actions.items()) if kind
            }
        tables = {
            table: sample.summary(int(sample.counts.sum()) * 2**sample.level)
            for table, sample in sorted(self.id_samples.items())
        }
        return {"sequence": sequence, "tables": tables}


def _quantiles(histogram: dict[int, int]) -> dict:
    """count, mean, p50 / p90 / p99 and max of values given as {value: how many}."""
    if not histogram:
        return {"count": 0}
    values = np.array(sorted(histogram), np.int64)
    weights = np.array([histogram[v] for v in values], np.int64)
    cumulative = np.cumsum(weights)
    total = int(cumulative[-1])

    def quantile(q: float) -> int:
        return int(values[np.searchsorted(cumulative, q * total, side="left")])

    return {
        "count": total,
        "mean": round(float((values * weights).sum() / total), 3),
        "p50": quantile(0.5),
        "p90": quantile(0.9),
        "p99": quantile(0.99),
        "max": int(values[-1]),
    }
