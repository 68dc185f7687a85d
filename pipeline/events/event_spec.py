"""Event-log specs: what the columns of a log of user actions mean (`kind = "events"`).

An event log holds one action a row (user, item, time, an action type, per-event side
features) or, in the `user_per_line` format of the public sequential benchmarks, one user a
line (`user item item ...`, items oldest first). The preprocessing job
(`pipeline.events.event_job`) groups a log's events by user, orders them by time and writes each
user's history as Parquet list columns, split leave-one-out or by time windows
(docs/pipeline.md, "Event logs"). Unknown keys are errors, like everywhere in hybridrec.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Literal

from hybridrec.common import config
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.pipeline.spec import repeated_name

# what a served sequence model's requests name their own inputs (infer and events): an
# event side feature comes with each event by its name, so it may not take one of these
REQUEST_INPUTS = ("history", "lengths", "times", "actions", "users", "candidates", "items")
_WIDTH = re.compile(r"^(\d+)([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_width(text: str) -> int:
    """Seconds of a window width such as `1d`, `12h`, `30m`, `2w`, `3600s`."""
    match = _WIDTH.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"window width {text!r}: expected a positive number and s, m, h, d or w")
    return int(match.group(1)) * _SECONDS[match.group(2)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActionSpec:
    """The action type of an event: a categorical column with its vocabulary, or a numeric
    one (a rating, a dwell time) cut into types by thresholds."""

    column: str  # the column holding the action
    values: tuple[str, ...] = ()  # categorical: the raw values, each its own type 1..n
    # numeric: ascending cut points; a value v gets the type of the first threshold above it:
    # thresholds [3, 4] give v < 3 -> names[0], 3 <= v < 4 -> names[1], v >= 4 -> names[2]
    thresholds: tuple[float, ...] = ()
    names: tuple[str, ...] = ()  # numeric: one name per type (len(thresholds) + 1)

    def __post_init__(self):
        if bool(self.values) == bool(self.thresholds):
            raise ValueError(
                f"action {self.column!r}: give either values (a categorical action) or "
                "thresholds and names (a numeric one)"
            )
        if self.values:
            if self.names:
                raise ValueError(f"action {self.column!r}: names go with thresholds, not values")
            if repeated_name(self.values):
                raise ValueError(f"action.values: {repeated_name(self.values)!r} is listed twice")
            if any(not value for value in self.values):
                raise ValueError("action.values: an empty value")
        else:
            if list(self.thresholds) != sorted(set(self.thresholds)):
                raise ValueError(f"action.thresholds must ascend, got {list(self.thresholds)}")
            if len(self.names) != len(self.thresholds) + 1:
                raise ValueError(
                    f"action.names: {len(self.thresholds)} thresholds make "
                    f"{len(self.thresholds) + 1} types, got {len(self.names)} names"
                )
        if len(self.type_names) > 127:
            raise ValueError("action: at most 127 types")

    @property
    def type_names(self) -> tuple[str, ...]:
        """The name of each action type, type t at index t - 1 (0: no action)."""
        return self.values or self.names


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventFeatureSpec:
    """A categorical side feature of each event (a device, a surface, a query)."""

    name: str  # its column
    table: str = ""  # embedding table; defaults to the name

    def __post_init__(self):
        if not self.name:
            raise ValueError("event_feature with an empty name")
        if not self.table:
            object.__setattr__(self, "table", self.name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ItemFeaturesSpec:
    """Categorical features of the items (category, brand, ...), from a file of one item a
    row joined to every event by item id."""

    path: str  # CSV / TSV (with a header) or Parquet; relative paths are the spec file's
    id: str  # the column holding the item id (the same raw ids as the events' item column)
    features: tuple[str, ...]  # its categorical columns, each its own table
    delimiter: str = ","  # text files: the field separator

    def __post_init__(self):
        if not self.features:
            raise ValueError("items.features: name at least one column")
        if repeated_name((self.id, *self.features)):
            raise ValueError(f"items: {repeated_name((self.id, *self.features))!r} is listed twice")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitSpec:
    """How events become training and evaluation examples."""

    # leave_one_out: each user's last event is the test target, the one before the
    # validation target, the rest the training history; time: windows of `width` (or the
    # explicit `boundaries`): training on events before the first evaluation window,
    # evaluation on the events of each of the `windows` windows after it
    kind: Literal["leave_one_out", "time"] = "leave_one_out"
    width: str = ""  # time: a window's width, e.g. "1d"; windows end at the last event's
    # time: boundaries between training and the evaluation windows (seconds since the
    # epoch, ascending: windows + 1 of them), instead of width
    boundaries: tuple[int, ...] = ()
    windows: int = 1  # time: evaluation windows written (window_1 .. window_N)

    def __post_init__(self):
        if self.kind == "leave_one_out":
            if self.width or self.boundaries or self.windows != 1:
                raise ValueError("split: width, boundaries and windows are for kind = 'time'")
            return
        if self.windows < 1:
            raise ValueError(f"split.windows must be >= 1, got {self.windows}")
        if bool(self.width) == bool(self.boundaries):
            raise ValueError("split: a time split takes either width or boundaries")
        if self.width:
            parse_width(self.width)
        elif len(self.boundaries) != self.windows + 1 or list(self.boundaries) != sorted(
            set(self.boundaries)
        ):
            raise ValueError(
                f"split.boundaries: {self.windows} window(s) need {self.windows + 1} ascending "
                f"times (the training end, then each window's end), got {list(self.boundaries)}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventSpec:
    """An event log's layout and what the job keeps of it."""

    kind: Literal["events"] = "events"
    name: str  # dataset name, recorded in metadata.json
    # delimited: one event a row; user_per_line: `user item item ...` a line, oldest first
    format: Literal["delimited", "user_per_line"] = "delimited"
    # the field separator: one to four bytes (",", "\t", MovieLens' "::"), or "whitespace"
    # (runs of spaces and tabs)
    delimiter: str = ","
    header: bool = False  # text: the first line of every file names `columns`
    columns: tuple[str, ...] = ()  # delimited: every field of a row, in order
    user: str = ""  # delimited: the column holding the user id
    item: str = ""  # delimited: the column holding the item id
    time: str = ""  # the column holding the time; "" = the file order within each user
    # how times are written: unix (seconds, integer or decimal), unix_ms, iso (2024-05-01,
    # 2024-05-01T12:30:00, a trailing Z), auto (decided from the first time of each block)
    time_format: Literal["auto", "unix", "unix_ms", "iso"] = "auto"
    action: ActionSpec | None = None  # the action type, if the log has one
    event_features: tuple[EventFeatureSpec, ...] = ()  # per-event categorical columns
    items: ItemFeaturesSpec | None = None  # per-item categorical features, joined by item id
    max_length: int = 200  # events of history kept per example (the most recent); 0 = all
    min_events: int = 3  # users with fewer events are left out (counted)
    drop_duplicates: bool = True  # drop events equal to an earlier one in every field
    # events kept of one user at the most (the latest; more are counted and the user named:
    # a bot or a crawler), bounding a worker's memory
    max_events_per_user: int = 100_000
    split: SplitSpec = dataclasses.field(default_factory=SplitSpec)
    prefix_bits: int = 8  # high bits of every id holding its table's prefix

    def __post_init__(self):
        if self.delimiter != "whitespace" and (
            not 1 <= len(self.delimiter.encode()) <= 4
            or "\r" in self.delimiter
            or "\n" in self.delimiter
        ):
            raise ValueError(
                "delimiter must be one to four bytes (no newline) or 'whitespace', got "
                f"{self.delimiter!r}"
            )
        if self.format == "user_per_line":
            if self.columns or self.user or self.item or self.time or self.action:
                raise ValueError(
                    "format = 'user_per_line' has no columns, user, item, time or action: "
                    "each line is a user id and its items, oldest first"
                )
            if self.event_features:
                raise ValueError("format = 'user_per_line' has no event_features")
        else:
            self._check_columns()
        if self.max_length < 0 or self.min_events < 1 or self.max_events_per_user < 1:
            raise ValueError("max_length must be >= 0, min_events and max_events_per_user >= 1")
        needed = 3 if self.split.kind == "leave_one_out" else 1
        if self.min_events < needed:
            raise ValueError(
                f"min_events = {self.min_events}: a leave-one-out split needs 3 events a user "
                "(a training event, a validation and a test target)"
            )
        if self.max_length and self.max_events_per_user < self.max_length + 2:
            raise ValueError("max_events_per_user must be at least max_length + 2")
        if not 1 <= self.prefix_bits <= 16:
            raise ValueError(f"prefix_bits must be in [1, 16], got {self.prefix_bits}")
        if self.split.kind == "time" and not self.time:
            raise ValueError("split.kind = 'time' needs a time column")

    def _check_columns(self) -> None:
        if not self.columns:
            raise ValueError("columns: list every field of a row, in order")
        if repeated_name(self.columns):
            raise ValueError(f"columns: {repeated_name(self.columns)!r} is listed twice")
        if not self.user or not self.item:
            raise ValueError("user and item: name the columns holding them")
        used = [self.user, self.item]
        used += [self.time] if self.time else []
        used += [self.action.column] if self.action else []
        used += [feature.name for feature in self.event_features]
        for name in used:
            if name not in self.columns:
                raise ValueError(f"{name!r} is not one of the spec's columns")
        if repeated_name(used):
            raise ValueError(f"column {repeated_name(used)!r} is used twice")

    @property
    def tables(self) -> tuple[str, ...]:
        """Every id table in prefix order (prefix = 1 + index): item, user, the event
        features' and the item features' tables."""
        event_tables = [feature.table for feature in self.event_features]
        return table_order(event_tables, list(self.items.features) if self.items else [])

    def prefix(self, table: str) -> int:
        return 1 + self.tables.index(table)

    @property
    def side_features(self) -> tuple[tuple[str, str], ...]:
        """(output column, table) of every per-position side feature: the event features',
        then the item features'."""
        sides = [(feature.name, feature.table) for feature in self.event_features]
        sides += [(name, name) for name in (self.items.features if self.items else ())]
        return tuple(sides)


def table_order(event_tables: list[str], item_features: list[str]) -> tuple[str, ...]:
    """Every id table in prefix order (prefix = 1 + index): item, user, the event
    features' tables, the item features'."""
    unique: list[str] = []
    for name in ["item", "user", *event_tables, *item_features]:
        if name not in unique:
            unique.append(name)
    return tuple(unique)


def recorded_prefixes(spec: dict) -> dict[str, int]:
    """table -> prefix of a spec as metadata.json records it (`EventSpec.prefix`)."""
    event_tables = [feature["table"] for feature in spec.get("event_features") or []]
    item_features = list((spec.get("items") or {}).get("features") or [])
    return {table: 1 + i for i, table in enumerate(table_order(event_tables, item_features))}


def spec_kind(name_or_path: str | Path) -> str:
    """ "events" for an event-log spec file, "clicks" for anything else (a click-log spec
    file or a built-in click-log spec's name)."""
    path = Path(str(name_or_path))
    if path.suffix != ".toml" or not path.is_file():
        return "clicks"
    try:
        data = config.read_toml(path)
    except ConfigError:
        return "clicks"  # the click-log loader reports the syntax error
    return "events" if data.get("kind") == "events" else "clicks"


def load_event_spec(path: str | Path) -> EventSpec:
    """Loads an event-log spec file (`kind = "events"`); an item features file's relative
    path is resolved against the spec file's folder.

    Raises:
        UserError: missing file, TOML syntax error, unknown key or an inconsistent spec;
            the message names the file.
    """
    path = Path(str(path))
    if not path.exists():
        raise UserError(f"spec file {path} does not exist")
    data = config.read_toml(path)
    try:
        spec = config.from_dict(EventSpec, data)
    except ConfigError as error:
        message = str(error).removeprefix(f"{EventSpec.__name__}: ")
        raise ConfigError(f"spec {path}: {message}") from None
    if spec.items is not None and not Path(spec.items.path).is_absolute():
        items = dataclasses.replace(spec.items, path=str(path.parent / spec.items.path))
        spec = dataclasses.replace(spec, items=items)
    return spec
