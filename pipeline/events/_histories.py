"""Events -> user histories: the numpy core of the event-log job (`pipeline.events.event_job`).

Two steps, both on whole arrays:
- per input chunk (`prune_chunk`): exact duplicates dropped, and each user's events cut to
  the most recent the splits can use (a leave-one-out split needs the last max_length + 2,
  any split at most max_events_per_user), so that a worker's memory is bounded by its
  chunk's users, never by one user's millions of events; how many events each user had
  is kept, for the statistics and to name capped users;
- per bucket of users (`build_histories`): every chunk's events of those users, ordered
  by (user, time, input position), duplicates across chunks dropped, then cut into the
  splits' examples (`split_examples`).

An example is a row: the user, list columns of its events (items, times, actions, side
features) and `first_target`, the first position that is a prediction target (training
rows: 1, every next event; evaluation rows: the events after the history).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
from hybridrec.pipeline.events.event_spec import EventSpec
from hybridrec.pipeline.events.event_stats import NAMED_CAPPED_USERS, EventStats


@dataclasses.dataclass
class Events:
    """Columnar events. `order` columns (file, chunk, line, position) are the input order:
    the tie-break of equal times, so a user's history is the same on every runner."""

    users: np.ndarray  # uint64
    items: np.ndarray  # uint64
    times: np.ndarray  # int64 seconds
    actions: np.ndarray  # int8
    sides: dict[str, np.ndarray]  # uint64 each
    files: np.ndarray  # int32 input file index
    chunks: np.ndarray  # int32 chunk index in its file
    lines: np.ndarray  # int64 line (row) in its chunk
    positions: np.ndarray  # int32 place in its line (user_per_line), else 0

    def __len__(self) -> int:
        return len(self.users)

    def take(self, index: np.ndarray) -> Events:
        return Events(
            **{
                name: ({k: v[index] for k, v in value.items()} if name == "sides" else value[index])
                for name, value in self._columns().items()
            }
        )

    def _columns(self) -> dict:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @staticmethod
    def concat(parts: list[Events], side_names) -> Events:
        def joined(name, dtype):
            arrays = [getattr(part, name) for part in parts]
            return np.concatenate(arrays) if arrays else np.zeros(0, dtype)

        return Events(
            users=joined("users", np.uint64),
            items=joined("items", np.uint64),
            times=joined("times", np.int64),
            actions=joined("actions", np.int8),
            sides={
                name: np.concatenate([p.sides[name] for p in parts])
                if parts
                else np.zeros(0, np.uint64)
                for name in side_names
            },
            files=joined("files", np.int32),
            chunks=joined("chunks", np.int32),
            lines=joined("lines", np.int64),
            positions=joined("positions", np.int32),
        )

    def to_table(self) -> pa.Table:
        columns = {k: v for k, v in self._columns().items() if k != "sides"}
        columns.update({f"side:{name}": ids for name, ids in self.sides.items()})
        return pa.table(columns)

    @staticmethod
    def from_table(table: pa.Table) -> Events:
        def column(name):
            return table.column(name).to_numpy()

        names = [n for n in table.column_names if not n.startswith("side:")]
        sides = {n[5:]: column(n) for n in table.column_names if n.startswith("side:")}
        return Events(**{name: column(name) for name in names}, sides=sides)

    def time_order(self) -> np.ndarray:
        """Indices ordering the events by (user, time, input position), for events that are
        in input order wherever they share a user and a time: a chunk's events as parsed,
        or chunks' events each so ordered and concatenated in chunk order (np.lexsort is
        stable)."""
        return np.lexsort((self.times, self.users))

    def duplicate_mask(self, order: np.ndarray) -> np.ndarray:
        """For the events in `time_order` `order`: True for each one equal in user, item,
        time, action and side ids to an earlier one (in input order), exactly."""
        users, times = self.users[order], self.times[order]
        duplicate = np.zeros(len(order), bool)
        same = (users[1:] == users[:-1]) & (times[1:] == times[:-1])
        if not same.any():
            return duplicate
        # only events sharing their user and time with a neighbour can be duplicates
        candidate = np.zeros(len(order), bool)
        candidate[1:] |= same
        candidate[:-1] |= same
        index = np.flatnonzero(candidate)
        part = self.take(order[index])
        keys = [*part.sides.values(), part.actions, part.items, part.times, part.users]
        within = np.lexsort((part.positions, part.lines, part.chunks, part.files, *keys))
        equal = np.ones(len(within) - 1, bool)
        for key in keys:
            sorted_key = key[within]
            equal &= sorted_key[1:] == sorted_key[:-1]
        duplicate[index[within[1:][equal]]] = True
        return duplicate


def user_runs(users_sorted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each run of equal users in a sorted array."""
    if not len(users_sorted):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.flatnonzero(users_sorted[1:] != users_sorted[:-1]) + 1
    starts = np.concatenate([[0], change]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [len(users_sorted)]]))
    return starts, lengths


def keep_last(starts: np.ndarray, lengths: np.ndarray, limit: int) -> np.ndarray:
    """Indices (into the sorted events) of each run's last `limit` events, in order."""
    kept = np.minimum(lengths, limit)
    first = starts + lengths - kept
    return ranges(first, kept)


def ranges(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of range(first, first + count) for each pair."""
    counts = counts.astype(np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(firsts - offsets, counts) + np.arange(total)


def chunk_limit(spec: EventSpec) -> int:
    """Events of one user one chunk keeps (the most recent)."""
    if spec.split.kind == "leave_one_out" and spec.max_length:
        return spec.max_length + 2
    return spec.max_events_per_user


@dataclasses.dataclass
class ChunkPrune:
    """What `prune_chunk` kept and counted."""

    events: Events  # the kept events, ordered by (user, time, input position)
    users: np.ndarray  # uint64 each user of the chunk
    counts: np.ndarray  # int64 their events (duplicates dropped)
    duplicates: int  # events dropped as duplicates
    over_limit: np.ndarray  # int64 indices into `users` of users cut to the limit


def prune_chunk(events: Events, spec: EventSpec) -> ChunkPrune:
    """Drops duplicates (when the spec says so) and keeps each user's most recent events."""
    index = events.time_order()
    duplicates = 0
    if spec.drop_duplicates and len(index):
        duplicate = events.duplicate_mask(index)
        duplicates = int(duplicate.sum())
        if duplicates:
            index = index[~duplicate]
    starts, lengths = user_runs(events.users[index])
    limit = chunk_limit(spec)
    kept = index[keep_last(starts, lengths, limit)]
    users = events.users[index[starts]]
    return ChunkPrune(
        events=events.take(kept),
        users=users,
        counts=lengths,
        duplicates=duplicates,
        over_limit=np.flatnonzero(lengths > limit),
    )


@dataclasses.dataclass
class Examples:
    """One split's rows: per row its events (indices into the ordered events, concatenated,
    with offsets) and its first target position."""

    users: np.ndarray  # uint64 [rows]
    offsets: np.ndarray  # int32 [rows + 1]
    events: np.ndarray  # int64 [total] indices
    first_target: np.ndarray  # int32 [rows]

    @staticmethod
    def of(users, firsts, counts, first_target, events: np.ndarray | None = None) -> Examples:
        """Rows of `counts` events each, from `firsts` on (or the given event indices)."""
        offsets = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        return Examples(
            users=users,
            offsets=offsets.astype(np.int32),
            events=ranges(firsts, counts) if events is None else events,
            first_target=np.broadcast_to(np.asarray(first_target, np.int32), len(counts)).copy(),
        )


def _history_limit(max_length: int) -> int:
    """Events of history a row keeps at most (max_length 0: every one)."""
    return max_length if max_length else np.iinfo(np.int64).max // 4


def leave_one_out(starts, lengths, users, max_length: int) -> dict[str, Examples]:
    """Training rows (all but the last two events), validation rows (the history, then the
    second-to-last event) and test rows (the history, then the last), each history cut to
    its last `max_length` events (0: all)."""
    limit = _history_limit(max_length)
    ends = starts + lengths
    history = np.minimum(lengths - 2, limit)  # the training events, the validation history
    test_history = np.minimum(lengths - 1, limit)
    trained = history >= 2  # one event is no next-event target
    return {
        "train": Examples.of(users[trained], (ends - 2 - history)[trained], history[trained], 1),
        "valid": Examples.of(users, ends - 2 - history, history + 1, history),
        "test": Examples.of(users, ends - 1 - test_history, test_history + 1, test_history),
    }


def time_windows(starts, lengths, users, times, boundaries, spec: EventSpec):
    """Training rows (each user's last max_length events before boundaries[0]) and per
    window w (boundaries[w - 1] <= time < boundaries[w]) rows of the user's last
    max_length events before it, then the window's events (its most recent
    max_events_per_user), the window's first event the first target."""
    limit = _history_limit(spec.max_length)
    user_of = np.repeat(np.arange(len(starts)), lengths)
    before = np.zeros(len(starts), np.int64)  # events of each user before the window
    splits = {}
    for window in range(len(boundaries)):
        end = np.bincount(user_of, weights=times < boundaries[window], minlength=len(starts))
        end = end.astype(np.int64)
        if window == 0:
            count = np.minimum(end, limit)
            trained = count >= 2
            splits["train"] = Examples.of(
                users[trained], (starts + end - count)[trained], count[trained], 1
            )
        else:
            history = np.minimum(before, limit)
            targets = np.minimum(end - before, spec.max_events_per_user)
            present = targets > 0
            history_first, target_first = starts + before - history, starts + end - targets
            pairs = np.stack([history, targets], axis=1)[present].reshape(-1)
            firsts = np.stack([history_first, target_first], axis=1)[present].reshape(-1)
            splits[f"window_{window}"] = Examples.of(
                users[present],
                None,
                (history + targets)[present],
                history[present],
                events=ranges(firsts, pairs),
            )
        before = end
    return splits


def example_table(examples: Examples, events: Events, spec: EventSpec) -> pa.Table:
    """A split's rows as Arrow: user, items, times, [actions], side features, first_target."""
    index = examples.events
    offsets = pa.array(examples.offsets, pa.int32())

    def lists(values: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(values[index]))

    columns = {"user": pa.array(examples.users, pa.uint64()), "items": lists(events.items)}
    if spec.time:
        columns["times"] = lists(events.times)
    if spec.action is not None:
        columns["actions"] = lists(events.actions)
    for name, _ in spec.side_features:
        columns[name] = lists(events.sides[name])
    columns["first_target"] = pa.array(examples.first_target, pa.int32())
    return pa.table(columns)


def split_encodings(table: pa.Table) -> dict:
    """Parquet encodings for a split's columns: the ids of users and items (millions of
    distinct values) plain, times as deltas (ascending within a history), the rest (action
    types, side ids: small vocabularies) as dictionaries. 16% less time writing than a
    dictionary tried on every column, the same time reading."""

    def path(field: pa.Field) -> str:  # a list column's values are NAME.list.element
        return f"{field.name}.list.element" if pa.types.is_list(field.type) else field.name

    fields = {field.name: field for field in table.schema}
    plain = ("user", "items", "times")
    encodings = {"use_dictionary": [path(f) for n, f in fields.items() if n not in plain]}
    if "times" in fields:
        encodings["column_encoding"] = {path(fields["times"]): "DELTA_BINARY_PACKED"}
    return encodings


class IdIndex:
    """Where each of a set of distinct uint64 ids is, by open addressing with linear probing
    in numpy (a table twice the ids' count, probed for every query at once, round by
    round): one or two random reads a query where a binary search over a million ids
    makes twenty (the event job joins every event's item this way)."""

    _MIX = np.uint64(0x9E3779B97F4A7C15)

    def __init__(self, ids: np.ndarray):
        self.ids = np.asarray(ids, np.uint64)
        self.bits = max(4, int(len(self.ids) * 2 - 1).bit_length())
        self.mask = np.int64((1 << self.bits) - 1)
        self.slots = np.full(1 << self.bits, -1, np.int64)  # slot -> index in ids, -1: empty
        pending = np.arange(len(self.ids))
        home = self._home(self.ids)
        offset = 0
        while len(pending):
            slot = (home[pending] + offset) & self.mask
            free = self.slots[slot] < 0
            # among the free slots' claimants, the first of each slot takes it
            claimed, first = np.unique(slot[free], return_index=True)
            taken = np.flatnonzero(free)[first]
            self.slots[claimed] = pending[taken]
            left = np.ones(len(pending), bool)
            left[taken] = False
            pending = pending[left]
            offset += 1

    def _home(self, ids: np.ndarray) -> np.ndarray:
        mixed = np.asarray(ids, np.uint64) * self._MIX  # wraps: a multiplicative hash
        return (mixed >> np.uint64(64 - self.bits)).astype(np.int64)

    def find(self, queries: np.ndarray) -> np.ndarray:
        """[n] int64: each query's index in `ids`, -1 where it is not there."""
        queries = np.asarray(queries, np.uint64)
        out = np.full(len(queries), -1, np.int64)
        todo = np.arange(len(queries))
        home = self._home(queries)
        offset = 0
        while len(todo):
            index = self.slots[(home + offset) & self.mask]
            occupied = index >= 0
            hit = np.zeros(len(todo), bool)
            hit[occupied] = self.ids[index[occupied]] == queries[todo[occupied]]
            out[todo[hit]] = index[hit]
            keep = occupied & ~hit  # an empty slot ends the probe: not there
            todo, home = todo[keep], home[keep]
            offset += 1
        return out


@dataclasses.dataclass
class ItemFeatures:
    """Per-item side ids, joined to events by item id."""

    items: np.ndarray  # uint64 distinct item ids
    ids: dict[str, np.ndarray]  # feature -> uint64 [items]
    missing: dict[str, int]  # feature -> its table's missing id (an item not in the file)
    index: IdIndex | None = None  # built on first use

    def join(self, items: np.ndarray) -> dict[str, np.ndarray]:
        if not len(self.items):
            return {name: np.full(len(items), self.missing[name], np.uint64) for name in self.ids}
        if self.index is None:
            self.index = IdIndex(self.items)
        where = self.index.find(items)
        found = where >= 0
        where = np.where(found, where, 0)
        return {
            name: np.where(found, ids[where], np.uint64(self.missing[name]))
            for name, ids in self.ids.items()
        }


def build_bucket(
    events: Events,
    users: np.ndarray,
    counts: np.ndarray,
    names: dict[int, str],
    spec: EventSpec,
    boundaries: np.ndarray | None,
    item_features: ItemFeatures | None,
):
    """One bucket's examples and statistics from every chunk's events of its users.

    Args:
        events: the chunks' kept events of the bucket's users: each chunk's as
            `prune_chunk` ordered them, chunks in input order (`Events.time_order`).
        users, counts: each chunk's users and their event counts (a user once per chunk).
        names: raw ids of users some chunk cut to its limit (to name capped users).
        boundaries: a time split's boundaries (training end, then each window's end).
        item_features: the items' side ids, when the spec has them.

    Returns:
        ({split: Arrow table}, EventStats).
    """
    stats = EventStats()
    known, inverse = np.unique(users, return_inverse=True)
    totals = np.bincount(inverse, weights=counts, minlength=len(known)).astype(np.int64)
    index = events.time_order()
    if spec.drop_duplicates and len(index):  # equal events in different chunks
        duplicate = events.duplicate_mask(index)
        if duplicate.any():
            stats.duplicates = int(duplicate.sum())
            dropped = np.searchsorted(known, events.users[index[duplicate]])
            totals -= np.bincount(dropped, minlength=len(known))
            index = index[~duplicate]
    starts, lengths = user_runs(events.users[index])
    index = index[keep_last(starts, lengths, chunk_limit(spec))]
    starts, lengths = user_runs(events.users[index])
    run_users = events.users[index[starts]]
    total = totals[np.searchsorted(known, run_users)]
    enough = total >= spec.min_events
    stats.users_below_min_events = int((totals < spec.min_events).sum())
    capped = np.flatnonzero(totals > spec.max_events_per_user)
    stats.capped_users_count = len(capped)
    stats.capped_users = sorted(
        ((int(totals[i]), names.get(int(known[i]), f"id {int(known[i])}")) for i in capped),
        reverse=True,
    )[:NAMED_CAPPED_USERS]
    ordered = events.take(index[ranges(starts[enough], lengths[enough])])  # the one copy
    starts, lengths = user_runs(ordered.users)
    run_users, total = run_users[enough], total[enough]
    if item_features is not None:
        ordered.sides.update(item_features.join(ordered.items))
    if spec.split.kind == "leave_one_out":
        splits = leave_one_out(starts, lengths, run_users, spec.max_length)
        if spec.max_length:
            stats.truncated_histories = int((total - 2 > spec.max_length).sum())
    else:
        splits = time_windows(starts, lengths, run_users, ordered.times, boundaries, spec)
        if spec.max_length:
            stats.truncated_histories = int((lengths > spec.max_length).sum())
    tables = {name: example_table(rows, ordered, spec) for name, rows in splits.items()}
    stats.users = len(run_users)
    stats.events_per_user = _histogram(total)
    stats.history_lengths = _histogram(np.diff(splits["train"].offsets))
    stats.rows_by_split = {name: table.num_rows for name, table in tables.items()}
    stats.count_ids("item", ordered.items)
    stats.count_ids("user", run_users)
    for name, table in spec.side_features:
        stats.count_ids(table, ordered.sides[name])
    return tables, stats


def _histogram(values: np.ndarray) -> dict[int, int]:
    unique, counts = np.unique(values, return_counts=True)
    return {int(v): int(c) for v, c in zip(unique, counts, strict=True)}
