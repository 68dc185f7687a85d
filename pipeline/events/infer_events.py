"""Recognizing an event log in a sample (`hybridrec spec --sample FILE`) and proposing its
event spec (`kind = "events"`, pipeline.events.event_spec), with a reason for every column.

A sample is an event log when it has a **user-like** and an **item-like** column (ids that
repeat: a user acts many times, an item is acted on by many users; named so, or the two
columns of most distinct repeated values) and a **time-like** one (ISO dates or times,
epoch seconds or milliseconds), or no time and no column that can be a click label (the
`user item` pairs of the SASRec paper's files, a `user,item` CSV: each user's events in
file order), or when its lines are `user item item ...` integer tokens of varying length
(the user-per-line form of the public sequential benchmarks).
Then:
- a rating-like column (a name such as rating / score / stars, small numbers) becomes the
  action, cut at a threshold into negative and positive;
- a column of a few distinct words (view, click, buy, ...) becomes the action;
- other columns of a few distinct values are per-event features; the rest are ignored.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib

from hybridrec.common import config
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.pipeline._sample import ColumnGuess, number
from hybridrec.pipeline.events.event_spec import EventSpec

USER_NAMES = re.compile(r"(^|_)(user|uid|customer|visitor|member|account|reviewer)(_?id)?$", re.I)
ITEM_NAMES = re.compile(
    r"(^|_)(item|iid|product|movie|video|song|track|business|sku|asin|article|book|"
    r"photo|post|ad|content)(_?id)?$",
    re.I,
)
TIME_NAMES = re.compile(r"(time|timestamp|ts|date|datetime|when|created)(_?at)?$", re.I)
RATING_NAMES = re.compile(r"(rating|score|stars|star|grade)$", re.I)
_TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}([ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?Z?)?$")
_EPOCH = (946_684_800, 4_102_444_800)  # 2000 .. 2100, in seconds
MAX_FEATURE_VALUES = 50  # a per-event feature or a word action has at most this many values


@dataclasses.dataclass(frozen=True)
class ProposedEventSpec:
    """An event spec proposed from a sample: the spec, its TOML text and the reasons."""

    spec: EventSpec
    columns: tuple[ColumnGuess, ...]
    toml: str
    rows: int
    skipped_lines: tuple[int, ...] = ()


def _time_kind(values: list[str]) -> str | None:
    """ "iso", "unix", "unix_ms" when every value is one, else None."""
    if values and all(_TIMESTAMP.match(v) for v in values):
        return "iso"
    numbers = [number(v) for v in values]
    if not values or any(n is None or n != int(n) for n in numbers):
        return None
    if all(_EPOCH[0] <= n < _EPOCH[1] for n in numbers):
        return "unix"
    if all(_EPOCH[0] * 1000 <= n < _EPOCH[1] * 1000 for n in numbers):
        return "unix_ms"
    return None


def user_per_line(lines: list[str]) -> bool:
    """Lines of whitespace-separated integer tokens, of varying counts (user item item ...)."""
    tokens = [line.split() for line in lines]
    counts = {len(t) for t in tokens}
    return (
        len(lines) >= 2
        and len(counts) > 1
        and min(counts) >= 2
        and all(token.isdigit() for t in tokens for token in t)
    )


def propose_user_per_line(path, lines: list[str]) -> ProposedEventSpec:
    users = len(lines)
    events = sum(len(line.split()) - 1 for line in lines)
    text = "\n".join(
        [
            f"# Proposed by `hybridrec spec` from the first {users} lines: one user a line, an",
            "# integer user id then the user's integer item ids, oldest first (the form of the",
            f"# public sequential benchmarks; {events / users:.1f} items a user in the sample).",
            "",
            'kind = "events"',
            f'name = "{_name(path)}"',
            'format = "user_per_line"',
            'delimiter = "whitespace"',
            "max_length = 200",
            "min_events = 3",
            "# no times: an item a user has twice is a repeat (Yelp's), not a duplicate row",
            "drop_duplicates = false",
            "",
            "[split]",
            'kind = "leave_one_out"',
        ]
    )
    columns = (
        ColumnGuess("token 1", "user", "the first integer of every line"),
        ColumnGuess("tokens 2..", "item", "the other integers, oldest first"),
    )
    return ProposedEventSpec(_load(path, text + "\n"), columns, text + "\n", users)


def propose_events(
    path, delimiter, header, names, columns, *, label_present: bool
) -> ProposedEventSpec | None:
    """An event spec for a delimited sample, or None when it does not look like an event log
    (with a two-valued column that can be a click label, only user and item columns named
    so make it one)."""
    rows = len(columns[0])
    guesses: dict[int, ColumnGuess] = {}
    times = [(i, _time_kind([v for v in c if v])) for i, c in enumerate(columns)]
    times = [(i, kind) for i, kind in times if kind]
    time_index, time_format = None, ""
    if times:
        named_time = [i for i, _ in times if TIME_NAMES.search(names[i])]
        time_index, time_format = next(((i, k) for i, k in times if i in named_time), times[0])
        guesses[time_index] = ColumnGuess(names[time_index], "time", f"{time_format} times")
    elif label_present:
        return None  # no time, and a column that can be a click label: a click log
    ids = _id_columns(names, columns, exclude={time_index}, named_only=label_present)
    if ids is None:
        return None
    (user, user_reason), (item, item_reason) = ids
    guesses[user] = ColumnGuess(names[user], "user", user_reason)
    guesses[item] = ColumnGuess(names[item], "item", item_reason)
    action = None
    for index, values in enumerate(columns):
        if index in guesses:
            continue
        present = [v for v in values if v]
        distinct = sorted(set(present))
        numbers = [number(v) for v in present]
        if not present:
            guesses[index] = ColumnGuess(names[index], "ignored", "always empty")
        elif (
            action is None
            and all(n is not None for n in numbers)
            and _rating_like(names[index], present)
        ):
            top = max(numbers)
            threshold = 3.5 if top <= 5 else top * 0.7
            action = ("thresholds", index, threshold)
            guesses[index] = ColumnGuess(
                names[index],
                "action",
                f"ratings {min(numbers):g}..{top:g}: below {threshold:g} negative",
            )
        elif (
            action is None
            and all(n is None for n in numbers)
            and len(distinct) <= MAX_FEATURE_VALUES // 5
        ):
            action = ("values", index, distinct)
            guesses[index] = ColumnGuess(
                names[index], "action", f"{len(distinct)} action words ({', '.join(distinct[:6])})"
            )
        elif len(distinct) <= MAX_FEATURE_VALUES:
            guesses[index] = ColumnGuess(
                names[index], "event feature", f"{len(distinct)} distinct values"
            )
        else:
            guesses[index] = ColumnGuess(
                names[index],
                "ignored",
                f"{len(distinct)} distinct values: neither an id that repeats nor a few codes",
            )
    ordered = tuple(guesses[i] for i in range(len(names)))
    text = _toml(path, delimiter, header, names, ordered, time_format, action, rows)
    return ProposedEventSpec(_load(path, text), ordered, text, rows)


def _id_columns(names, columns, exclude, named_only: bool):
    """((user index, reason), (item index, reason)), or None: two columns of repeated ids."""
    candidates = []
    for index, values in enumerate(columns):
        if index in exclude:
            continue
        present = [v for v in values if v]
        distinct = len(set(present))
        if len(present) < len(values) or distinct < 2 or distinct == len(values):
            continue  # missing values, a constant, or every value once: not a repeated id
        candidates.append((distinct, index))
    if len(candidates) < 2:
        return None
    ids = [c for c in candidates if not _rating_like(names[c[1]], columns[c[1]])]
    if len(ids) >= 2:  # a rating's few values repeat too, but it is no id
        candidates = ids
    user = next((i for _, i in candidates if USER_NAMES.search(names[i])), None)
    item = next((i for _, i in candidates if ITEM_NAMES.search(names[i]) and i != user), None)
    if user is not None and item is not None:
        return (user, f"named like a user id, {_distinct(columns[user])}"), (
            item,
            f"named like an item id, {_distinct(columns[item])}",
        )
    if named_only:
        return None
    if user is None and item is None:
        # users repeat in runs (a log sorted or grouped by user); items do not
        by_runs = sorted(candidates, key=lambda c: -_runs_share(columns[c[1]]))
        user = by_runs[0][1]
        rest = sorted((c for c in candidates if c[1] != user), reverse=True)
        item = rest[0][1]
    elif user is None:
        user = max(
            (c for c in candidates if c[1] != item), key=lambda c: _runs_share(columns[c[1]])
        )[1]
    else:
        item = max(c for c in candidates if c[1] != user)[1]
    return (user, f"repeated ids in runs, {_distinct(columns[user])}"), (
        item,
        f"repeated ids, {_distinct(columns[item])}",
    )


def _rating_like(name: str, values: list[str]) -> bool:
    """A rating: named so, or small numbers (at most 11 values, none above 10)."""
    numbers = [number(v) for v in values if v]
    if not numbers or any(n is None for n in numbers):
        return False
    return bool(RATING_NAMES.search(name)) or (len(set(numbers)) <= 11 and max(numbers) <= 10)


def _distinct(values) -> str:
    return f"{len(set(values))} distinct in {len(values)} rows"


def _runs_share(values: list[str]) -> float:
    """Share of rows that repeat the row before (a user's events one after another)."""
    return sum(a == b for a, b in zip(values, values[1:], strict=False)) / max(len(values) - 1, 1)


def _name(path) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", path.name.split(".")[0] or "events")


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\t", "\\t") + '"'


def _toml(path, delimiter, header, names, guesses, time_format, action, rows) -> str:
    width = max(len(g.name) for g in guesses)
    by_kind = {g.kind: g.name for g in guesses}
    lines = [
        f"# Proposed by `hybridrec spec` from the first {rows} rows: an event log (one user",
        "# action a row); check every column. Column kinds and why:",
        *(f"#   {g.name:<{width}}  {g.kind:<13}  {g.reason}" for g in guesses),
        "",
        'kind = "events"',
        f"name = {_quote(_name(path))}",
        f"delimiter = {_quote(delimiter)}",
        f"header = {'true' if header else 'false'}",
        f"columns = [{', '.join(_quote(n) for n in names)}]",
        f"user = {_quote(by_kind['user'])}",
        f"item = {_quote(by_kind['item'])}",
    ]
    if "time" in by_kind:
        lines += [f"time = {_quote(by_kind['time'])}", f"time_format = {_quote(time_format)}"]
    else:
        lines += [
            "# no time column: each user's events in the order of the file, and an event",
            "# equal to an earlier one is a repeat, not a duplicate row",
            "drop_duplicates = false",
        ]
    lines += [
        "max_length = 200  # events of history kept per example",
        "min_events = 3  # fewer: the user is left out (counted)",
    ]
    if action is not None:
        kind, index, detail = action
        lines += ["", "[action]", f"column = {_quote(names[index])}"]
        if kind == "values":
            lines.append(f"values = [{', '.join(_quote(v) for v in detail)}]")
        else:
            lines += [f"thresholds = [{detail:g}]", 'names = ["negative", "positive"]']
    for guess in guesses:
        if guess.kind == "event feature":
            lines += ["", "[[event_features]]", f"name = {_quote(guess.name)}"]
    split = 'kind = "leave_one_out"' + ('  # or "time" with width = "1d", windows = 1' if "time" in by_kind else "")  # fmt: skip
    lines += ["", "[split]", split]
    return "\n".join(lines) + "\n"


def _load(path, text: str) -> EventSpec:
    try:
        return config.from_dict(EventSpec, tomllib.loads(text))
    except (ConfigError, tomllib.TOMLDecodeError) as error:
        raise UserError(f"{path}: the proposed event spec does not load: {error}") from None
