"""The side features a served sequence model adds to each event's item row (`model.sequence.
side_features`): their ids, whose rows the exported item table holds.

An event feature's values come with each event of a request (raw values, hashed as the
event job hashes them with the feature's prefix); an item feature's ids come with the
item, from the export's item_sides.parquet (an item not in it: the feature's missing id,
as the event job gives an item missing from the items file).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.pipeline import hashing
from hybridrec.pipeline.events.event_spec import REQUEST_INPUTS
from hybridrec.serving import _format
from hybridrec.serving._format import ITEM_SIDES_FILE
from hybridrec.serving.sequence_query import CONTEXT


class SideFeatures:
    """An export's side features (features.json "side_features").

    Args:
        path: the export version directory.
        entries: [{"name", "of": "event" | "item", "prefix"}].
        prefix_bits: the spec's prefix bits.
        scale: what each side row is multiplied by before it is added (`side_scale`).
        accepted: {name: prefix} of the dataset's event features (features.json
            "event_features"): a request may send them with its events, read or not.
    """

    def __init__(
        self,
        path: Path,
        entries: list[dict],
        prefix_bits: int,
        scale: float = 1.0,
        accepted: dict[str, int] | None = None,
    ):
        self.prefix_bits, self.scale = prefix_bits, np.float32(scale)
        self.names = tuple(e["name"] for e in entries)  # the order training sums them in
        reserved = set(REQUEST_INPUTS) & {e["name"] for e in entries if e["of"] == "event"}
        if reserved:
            raise _format.ExportError(f"{path}: event side feature(s) {sorted(reserved)} are named as a request's own inputs")  # fmt: skip
        # event features: name -> the prefix its values are hashed with
        self.events = {e["name"]: int(e["prefix"]) for e in entries if e["of"] == "event"}
        # what a request may send of each event: the read ones and the dataset's others
        others = {n: int(p) for n, p in (accepted or {}).items() if n not in self.events}
        self.accepted = {**self.events, **others}
        items = {e["name"]: int(e["prefix"]) for e in entries if e["of"] == "item"}
        self.item_features = tuple(items)
        self.items = np.zeros(0, np.uint64)
        self.ids: list[np.ndarray] = []
        self.missing = [np.uint64(hashing.missing_id(p, prefix_bits)) for p in items.values()]
        if items:
            file = path / ITEM_SIDES_FILE
            try:
                table = pq.read_table(file, columns=["item", *items])
            except (OSError, KeyError, pa.ArrowInvalid) as error:
                raise _format.ExportError(f"{file}: unreadable ({error})") from None
            self.items = table.column("item").to_numpy().astype(np.uint64)
            self.ids = [table.column(name).to_numpy().astype(np.uint64) for name in items]

    def event_ids(self, name: str, values: list[bytes]) -> np.ndarray:
        """An event feature's raw values -> [n] uint64 ids (an empty value: its missing id)."""
        if not values:
            return np.zeros(0, np.uint64)
        raw = hashing.hash_bytes_list(values)
        missing = np.array([not value for value in values], bool)
        return hashing.feature_ids(raw, missing, self.accepted[name], self.prefix_bits)

    def given(self, sides: dict) -> dict[str, list[np.ndarray]]:
        """{feature: per history its events' raw values} -> their ids as int64, as a
        model's context holds them."""
        out = {}
        for name, histories in sides.items():
            if name not in self.accepted:
                raise ValueError(f"{name!r} is not an event feature of this model's dataset ({list(self.accepted) or 'none'})")  # fmt: skip
            if name not in self.events:
                continue  # the dataset's, but this model does not read it
            encoded = ([v.encode() if isinstance(v, str) else v for v in values] for values in histories)  # fmt: skip
            out[name] = [self.event_ids(name, values).view(np.int64) for values in encoded]
        return out

    def of(self, items: np.ndarray, events: dict | None) -> list[np.ndarray]:
        """The side ids (uint64) of events of `items` [m], per feature in the order training
        sums them: an event feature's from `events` (its ids as int64, [m] each), an item
        feature's the items'."""
        if self.events and events is None:
            raise ValueError(f"this model reads each event's {', '.join(self.events)}: give them with the items")  # fmt: skip
        of_items = dict(zip(self.item_features, self.of_items(items), strict=True))
        return [
            np.asarray(events[name]).view(np.uint64) if name in self.events else of_items[name]
            for name in self.names
        ]

    def added(self, rows: np.ndarray, items: np.ndarray, events: dict | None, lookup) -> np.ndarray:  # fmt: skip
        """`rows` [m, D] of `items` plus their events' side rows (read by `lookup`, ids ->
        (rows, found)) times the scale, as training adds them."""
        side_ids = self.of(items, events)
        if not side_ids:
            return rows
        extra, _ = lookup(np.concatenate(side_ids))
        return rows + self.scale * extra.reshape(len(side_ids), *rows.shape).sum(axis=0)

    def of_items(self, items: np.ndarray) -> list[np.ndarray]:
        """Per item feature, the ids of `items` [m] uint64."""
        if not self.item_features:
            return []
        where = np.minimum(np.searchsorted(self.items, items), max(len(self.items) - 1, 0))
        found = self.items[where] == items if len(self.items) else np.zeros(len(items), bool)
        return [
            np.where(found, ids[where] if len(ids) else missing, missing)
            for ids, missing in zip(self.ids, self.missing, strict=True)
        ]

    def of_events(self, context, cuts: list[slice], rows=None) -> dict[str, np.ndarray]:
        """Per event feature, its ids (as int64) of the histories' events `cuts` (one a
        history: those of `rows` of `context`, default all) concatenated."""
        out = {}
        for name in self.events:
            given = context[name] if rows is None else [context[name][row] for row in rows]
            parts = [np.asarray(values, np.int64)[cut] for values, cut in zip(given, cuts, strict=True)]  # fmt: skip
            out[name] = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return out


def describe(name: str) -> str:
    """What a name a model reads of each event is, for messages."""
    return CONTEXT.get(name, f"{name} (a side feature)")
