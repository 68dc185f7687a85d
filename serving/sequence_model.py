"""A loaded export of a sequence run: retrieval of the next items and ranking of candidates.

    raw item ids ──► ids (hashed as the event job hashes them) ──► rows of the item table
                     (memory-mapped; an item never trained: its initial row)
    history rows [n, L, D], lengths [n] ──► encoder (jax.export module) ──► queries [n, D]
    queries ──► every catalogue item scored, chunk by chunk (exact; int8 exports score
                their dequantized rows) ──► top-K ──► raw item ids and scores
    queries, candidates ──► the ranking head (with the ranking objective): a probability
                per candidate and action type; else each candidate's retrieval score

A history longer than the tower's `max_length` keeps its most recent events, as
`hybridrec evaluate` reads it. Top-K is ordered by score, ties by catalogue order.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from hybridrec.pipeline import hashing
from hybridrec.serving import _format
from hybridrec.serving._format import CATALOGUE_FILE, EXTEND_FILE, ITEM_NAMES_FILE, RANKING_FILE
from hybridrec.serving.catalogue import ExactCatalogue
from hybridrec.serving.model import (
    DefaultRows,
    ServedVersion,
    batch_buckets,
    load_array,
    load_module,
    open_tables,
    pad_rows,
)
from hybridrec.serving.sequence_query import (
    CachedHistory,
    SequenceAnswer,
    SequenceQuery,
)
from hybridrec.serving.sequence_sides import SideFeatures, describe

ITEM_PREFIX = 1  # the item table's prefix in every event spec (`EventSpec.tables`)
MIN_CANDIDATES = 8  # candidate lists are padded to a power of two from here


class ServedSequenceModel(ServedVersion):
    """One export version of a sequence run.

    Args:
        path: an export version directory, or a base directory (its newest version).
        max_batch: the most histories the encoder runs at once (compiled up front).
        checksums: check every file's sha256 against the manifest first.
    """

    kind = "sequences"  # the manifest's kind (the task that trained it)
    takes_events = True  # users' histories may be kept and appended to (POST .../events)

    def __init__(self, path: str | Path, *, max_batch: int = 64, checksums: bool = True):
        super().__init__(path, checksums=checksums)
        features, features_path = self.features, self.features_path
        try:
            self.max_length = int(features["max_length"])
            self.similarity = features["similarity"]
            self.dim = int(features["embedding_dim"])
            self.action_types = list(features["action_types"])
            self.exclude_history = bool(features["exclude_history"])
            self.prefix_bits = int(features["spec"]["prefix_bits"])
            default_rows = features["default_rows"]
            self.table_name = features["feature_tables"]["item"]
            sides = list(features.get("side_features") or [])
            side_scale = float(features.get("side_scale", 1.0))
            accepted = dict(features.get("event_features") or {})
        except (ValueError, KeyError, TypeError) as error:
            raise _format.ExportError(f"{features_path}: unreadable ({error})") from None
        self.table = open_tables(self.path, [self.table_name], checksums)[self.table_name]
        self._defaults = DefaultRows(default_rows)
        self.catalogue = np.asarray(load_array(self.path / CATALOGUE_FILE, np.uint64, 1))
        self._name_ids, self._names = _read_names(self.path / ITEM_NAMES_FILE)
        self._encoder = load_module(self.path / _format.MODEL_FILE)
        ranking = self.path / RANKING_FILE
        self._ranker = load_module(ranking) if ranking.exists() else None
        extend = self.path / EXTEND_FILE
        self._extend = load_module(extend) if extend.exists() else None
        self.cache_shape = tuple(features.get("cache_shape") or ())
        self.context = tuple(features.get("context") or ())
        # what a request gives of each event besides its item: the modules' context, then
        # the event side features (their ids, as int64)
        self.sides = SideFeatures(self.path, sides, self.prefix_bits, side_scale, accepted)
        self.event_sides = tuple(self.sides.events)
        # what a request may send of each event besides its item and context: the event
        # side features it reads, then the dataset's others (kept, otherwise ignored)
        self.event_features = tuple(self.sides.accepted)
        self.reads = self.context + self.event_sides
        self.outputs = len(self.action_types) if self._ranker else 1
        self.scan = ExactCatalogue(self.catalogue, read_rows=self._scan_rows, dim=self.dim)
        self.max_batch = max_batch
        # from one history up: a single user's request is the common case, and a history's
        # forward pass costs as much as its padded batch's
        self.buckets = batch_buckets(max_batch, smallest=1)
        self._lock = threading.Lock()
        self.histories_encoded = 0
        self.unseen_items = 0
        for bucket in self.buckets:  # compile every shape now, not on a request
            rows = np.zeros((bucket, self.max_length, self.dim), np.float32)
            extra = tuple(np.zeros((bucket, self.max_length), np.int32) for _ in self.context)
            self._encode_rows(rows, np.ones(bucket, np.int32), extra)

    # ------------------------------------------------------------------ ids and names

    def item_ids(self, names: list[bytes]) -> np.ndarray:
        """Raw item ids -> [n] uint64 ids, as the event job hashes them."""
        if not names:
            return np.zeros(0, np.uint64)
        raw = hashing.hash_bytes_list(names)
        missing = np.array([not name for name in names], bool)
        return hashing.feature_ids(raw, missing, ITEM_PREFIX, self.prefix_bits)

    def action_ids(self, names: Sequence[str | bytes]) -> np.ndarray:
        """Action type names -> [n] int64 type ids (1..A, as the dataset numbers them)."""
        index = {name: i + 1 for i, name in enumerate(self.action_types)}
        out = np.zeros(len(names), np.int64)
        for i, name in enumerate(names):
            text = name.decode() if isinstance(name, bytes) else name
            if text not in index:
                raise ValueError(f"action type {text!r} is not one of {self.action_types}")
            out[i] = index[text]
        return out

    def item_names(self, ids: np.ndarray) -> list[str]:
        """Ids -> the raw ids they were hashed from (an id without a name: "#<id>")."""
        flat = np.asarray(ids, np.uint64).reshape(-1)
        position = np.minimum(np.searchsorted(self._name_ids, flat), len(self._name_ids) - 1)
        known = self._name_ids[position] == flat if len(self._name_ids) else np.zeros(0, bool)
        names = self._names.take(position[known]).to_pylist() if known.any() else []
        out, taken = [], iter(names)
        for index, item in enumerate(flat):
            if len(known) and known[index]:
                out.append(next(taken).decode("utf-8", "backslashreplace"))
            else:
                out.append(f"#{int(item)}")
        return out

    # ------------------------------------------------------------------ rows

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids [m] uint64 -> (rows [m, D] float32, found [m]: False where the item got its
        initial row, never trained)."""
        index, found = self.table.find(ids)
        if found.all():
            return self.table.rows(index), found
        out = np.empty((len(ids), self.dim), np.float32)
        out[found] = self.table.rows(index[found])
        out[~found] = self._defaults(self.table_name, ids[~found], self.dim)
        return out, found

    def input_rows(self, ids: np.ndarray, events: dict | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """The tower's input rows of events (item ids [m]; `events`: per event side feature
        its ids [m], as int64): the item's row plus its side features' rows, as training
        adds them; (rows [m, D], found [m]: whether the item had a trained row)."""
        rows, found = self.rows(ids)
        return self.sides.added(rows, ids, events, self.rows), found

    def _scored(self, rows: np.ndarray) -> np.ndarray:
        if self.similarity == "cosine":
            return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-6)
        return rows

    def _scan_rows(self, index: np.ndarray) -> np.ndarray:
        """[m, D] float32: the rows of the catalogue's items at `index` as scores compare
        them (dequantized; normalized for cosine similarity)."""
        return self._scored(self.rows(self.catalogue[index])[0])

    # ------------------------------------------------------------------ forward

    def _encode_rows(self, rows: np.ndarray, lengths: np.ndarray, extra=()) -> np.ndarray:
        n = len(rows)
        bucket = next(b for b in self.buckets if b >= n)
        rows, lengths = pad_rows(rows, bucket), pad_rows(lengths, bucket, 1)
        extra = tuple(pad_rows(values, bucket) for values in extra)
        return np.asarray(self._encoder(rows, lengths, *extra))[:n]

    @property
    def reads_times(self) -> bool:
        return "times" in self.context

    def _context_rows(self, histories: list[np.ndarray], context, width: int) -> tuple:
        """The modules' context arguments, one [n, width] int32 array a name in `CONTEXT`
        order the model reads: times as seconds since each history's first kept event,
        action types as their ids, each history's most recent max_length events."""
        self.check_context(histories, context)
        out = []
        for name in self.context:
            values = np.zeros((len(histories), width), np.int32)
            for row, given in enumerate(context[name]):
                kept = np.asarray(given[-self.max_length :], np.int64)
                if name == "times":
                    kept = np.clip(kept - kept[0], 0, np.iinfo(np.int32).max)
                values[row, : len(kept)] = kept
            out.append(values)
        return tuple(out)

    def check_context(self, histories: list[np.ndarray], context) -> None:
        """A ValueError naming what the model reads and the histories lack."""
        for name in self.reads:
            given = (context or {}).get(name)
            if given is None or any(values is None for values in given):
                raise ValueError(f"this model reads each event's {describe(name)}: give {name} with the histories")  # fmt: skip
            for row, (history, values) in enumerate(zip(histories, given, strict=True)):
                if len(values) != len(history):
                    raise ValueError(f"history {row}: {len(history)} items but {len(values)} {name}")  # fmt: skip

    def _history_rows(self, histories: list[np.ndarray], context=None):
        """(rows [n, L, D], lengths [n] int32, truncated rows, per row the items that got
        their initial row [n]) of histories, each cut to its most recent max_length items
        (with the event side features of `context`)."""
        length = self.max_length
        kept = [history[-length:] for history in histories]
        truncated = [i for i, history in enumerate(histories) if len(history) > length]
        lengths = np.array([len(history) for history in kept], np.int32)
        ids = np.concatenate(kept) if kept else np.zeros(0, np.uint64)
        flat, found = self.input_rows(
            ids, self.sides.of_events(context, [slice(-length, None)] * len(histories))
        )
        rows = np.zeros((len(kept), length, self.dim), np.float32)
        place = np.arange(length)[None, :] < lengths[:, None]
        rows[place] = flat
        unseen = np.bincount(np.repeat(np.arange(len(kept)), lengths)[~found], minlength=len(kept))
        with self._lock:
            self.unseen_items += int(unseen.sum())
            self.histories_encoded += len(kept)
        return rows, lengths, truncated, unseen

    def encode(self, histories: list[np.ndarray], context=None) -> tuple[np.ndarray, list[int], int]:  # fmt: skip
        """Histories (item ids, oldest first; none empty; with the `context` the model reads
        of each event: `SequenceQuery.context`) -> (queries [n, D], truncated rows, per row
        the items that got their initial row)."""
        extra = self._context_rows(histories, context, self.max_length)
        rows, lengths, truncated, unseen = self._history_rows(histories, context)
        parts = [
            self._encode_rows(
                rows[start : start + self.max_batch],
                lengths[start : start + self.max_batch],
                tuple(values[start : start + self.max_batch] for values in extra),
            )
            for start in range(0, len(rows), self.max_batch)
        ]
        queries = np.concatenate(parts) if parts else np.zeros((0, self.dim), np.float32)
        return queries, truncated, unseen

    def encode_kept(
        self, histories: list[np.ndarray], cached: list[CachedHistory | None], context=None
    ) -> tuple[np.ndarray, list[int], np.ndarray, list[CachedHistory | None], int]:
        """`encode` for kept histories: a history whose cache holds its first events runs the
        tower on its new events only, and each gets its cache back (None where the model
        cannot cache, or the history is longer than max_length: the window then moves with
        every event). Returns (queries, truncated rows, unseen per row, caches, per row the
        events the tower ran on)."""
        n = len(histories)
        queries = np.zeros((n, self.dim), np.float32)
        unseen = np.zeros(n, np.int64)
        computed = np.zeros(n, np.int64)
        caches: list[CachedHistory | None] = [None] * n
        self.check_context(histories, context)
        extend, full = [], []
        for row, history in enumerate(histories):
            if self._extend is None or len(history) > self.max_length:
                full.append(row)
                continue
            cache = cached[row]
            usable = (
                cache is not None
                and cache.version == self.version
                and len(cache.items) <= len(history)
                and np.array_equal(history[: len(cache.items)], cache.items)
                and all(
                    np.array_equal(context[name][row][: len(cache.items)], cache.context[name])
                    for name in self.reads
                )
            )
            if usable and len(cache.items) == len(history):  # nothing new: the cached query
                queries[row], caches[row] = cache.query, cache
            else:
                extend.append((row, cache if usable else None))
        for start in range(0, len(extend), self.max_batch):
            part = extend[start : start + self.max_batch]
            self._extend_rows(histories, context, part, queries, unseen, caches, computed)
        truncated = []
        if full:
            picked = {name: [context[name][row] for row in full] for name in self.reads}
            encoded, truncated, full_unseen = self.encode([histories[row] for row in full], picked)
            queries[full], unseen[full] = encoded, full_unseen
            truncated = [full[i] for i in truncated]
            computed[full] = [min(len(histories[row]), self.max_length) for row in full]
        return queries, truncated, unseen, caches, computed

    def _extend_rows(self, histories, context, part, queries, unseen, caches, computed) -> None:
        """Runs extend.stablehlo on rows [(row, usable cache | None)], filling the outputs."""
        prefix = np.array([len(c.items) if c else 0 for _, c in part], np.int32)
        count = np.array([len(histories[row]) for row, _ in part], np.int32) - prefix
        width = min(1 << int(count.max() - 1).bit_length(), self.max_length)
        bucket = next(b for b in self.buckets if b >= len(part))
        rows = np.zeros((bucket, width, self.dim), np.float32)
        new_ids = np.concatenate(
            [histories[row][p:] for (row, _), p in zip(part, prefix, strict=True)]
        )
        cuts = [slice(p, None) for p in prefix]  # the new events' side ids
        new_sides = self.sides.of_events(context, cuts, [row for row, _ in part])
        flat, found = self.input_rows(new_ids, new_sides)
        place = np.arange(width)[None, :] < count[:, None]
        rows[: len(part)][place] = flat
        blocks, heads, head_dim = self.cache_shape
        shape = (blocks, bucket, self.max_length, heads, head_dim)
        keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for index, (_, cache) in enumerate(part):
            if cache is not None:
                keys[:, index], values[:, index] = cache.keys, cache.values
        rows_of = [row for row, _ in part]  # every position's context: cached and new events
        mine = {name: [context[name][row] for row in rows_of] for name in self.reads}
        extra = self._context_rows([histories[row] for row in rows_of], mine, self.max_length)
        extra = tuple(pad_rows(values, bucket) for values in extra)
        query, keys, values = self._extend(
            rows, pad_rows(prefix, bucket), pad_rows(count, bucket, 1), keys, values, *extra
        )
        query, keys, values = (np.asarray(a) for a in (query, keys, values))
        missed = np.bincount(np.repeat(np.arange(len(part)), count)[~found], minlength=len(part))
        with self._lock:
            self.unseen_items += int(missed.sum())
            self.histories_encoded += len(part)
        for index, (row, _) in enumerate(part):
            queries[row], unseen[row], computed[row] = query[index], missed[index], count[index]
            caches[row] = CachedHistory(
                self.version,
                histories[row].copy(),
                {name: np.asarray(context[name][row], np.int64).copy() for name in self.reads},
                keys[:, index].copy(),
                values[:, index].copy(),
                query[index].copy(),
            )

    def recommend(
        self,
        histories: Sequence[Sequence[str | bytes]],
        k: int = 10,
        *,
        exclude_history=None,
        times: Sequence[Sequence[int]] | None = None,
        actions: Sequence[Sequence[str]] | None = None,
        sides: dict[str, Sequence[Sequence[str]]] | None = None,
    ) -> list[list[tuple[str, float]]]:
        """Each history's top-`k` next items as (raw item id, score), best first, as `serve`
        answers a retrieval request: histories of raw item ids, oldest first (none empty),
        with each event's time in seconds, action type name and event side features' raw
        values (`sides`, by feature) for a model that reads them (`reads`);
        `exclude_history` default: as the run was evaluated."""
        if not histories or any(not len(history) for history in histories):
            raise ValueError("every history needs at least one item")
        exclude = self.exclude_history if exclude_history is None else exclude_history
        ids = [
            self.item_ids([i.encode() if isinstance(i, str) else i for i in h]) for h in histories
        ]
        context = {}
        if times is not None:
            context["times"] = [np.asarray(t, np.int64) for t in times]
        if actions is not None:
            context["actions"] = [self.action_ids(names) for names in actions]
        context |= self.sides.given(sides or {})
        queries, _, _ = self.encode(ids, context)
        items, scores = self.top_k(queries, k, ids if exclude else None)
        names = self.item_names(items)
        width = items.shape[1]
        return [
            list(zip(names[row * width : (row + 1) * width], scores[row].tolist(), strict=True))
            for row in range(len(histories))
        ]

    def top_k(
        self, queries: np.ndarray, k: int, exclude: list[np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(items [n, k] uint64, scores [n, k] float32): the best `k` catalogue items per
        query, exactly (`serving.catalogue.ExactCatalogue.top_k`)."""
        return self.scan.top_k(queries, k, exclude)

    def score_candidates(
        self, histories: list[np.ndarray], candidates: np.ndarray, context=None
    ) -> tuple[np.ndarray, list[int], int]:
        """(scores [n, C, A], truncated rows, unseen candidates) of candidate item ids
        [n, C] after each history: the ranking head's probability per action type, or
        without one the retrieval score ([n, C, 1])."""
        n, count = candidates.shape
        flat, found = self.rows(candidates.reshape(-1))
        unseen = int(np.count_nonzero(~found))
        with self._lock:
            self.unseen_items += unseen
        candidate_rows = flat.reshape(n, count, self.dim)
        if self._ranker is None:
            queries, truncated, seen_unseen = self.encode(histories, context)
            scores = np.einsum("nd,ncd->nc", queries, self._scored(candidate_rows))
            return scores[..., None].astype(np.float32), truncated, unseen + int(seen_unseen.sum())
        extra = self._context_rows(histories, context, self.max_length)
        rows, lengths, truncated, history_unseen = self._history_rows(histories, context)
        unseen += int(history_unseen.sum())
        width = max(MIN_CANDIDATES, 1 << (count - 1).bit_length())
        padded = np.zeros((n, width, self.dim), np.float32)
        padded[:, :count] = candidate_rows
        out = []
        for start in range(0, n, self.max_batch):
            stop = min(start + self.max_batch, n)
            bucket = next(b for b in self.buckets if b >= stop - start)
            logits = self._ranker(
                pad_rows(rows[start:stop], bucket),
                pad_rows(lengths[start:stop], bucket, 1),
                pad_rows(padded[start:stop], bucket),
                *(pad_rows(values[start:stop], bucket) for values in extra),
            )
            out.append(np.asarray(logits)[: stop - start, :count])
        logits = np.concatenate(out).astype(np.float64)
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32), truncated, unseen

    # ------------------------------------------------------------------ batches

    def run_batch(self, queries: list[SequenceQuery]) -> list[SequenceAnswer | Exception]:
        """Every request of a batch: the retrieval ones share one encoder pass and one scan
        of the catalogue."""
        answers: list[Any] = [None] * len(queries)
        retrieval = [i for i, query in enumerate(queries) if query.candidates is None]
        if retrieval:
            histories = [h for i in retrieval for h in queries[i].histories]
            cached = [c for i in retrieval for c in (queries[i].cached or [None] * queries[i].rows)]
            kept = [queries[i].cached is not None for i in retrieval for _ in queries[i].histories]
            context = {
                name: [
                    v
                    for i in retrieval
                    for v in (queries[i].context or {}).get(name) or [None] * queries[i].rows
                ]  # fmt: skip
                for name in self.reads
            }
            if any(kept):
                encoded, truncated, unseen, caches, computed = self.encode_kept(histories, cached, context)  # fmt: skip
                caches = [c if k else None for c, k in zip(caches, kept, strict=True)]
            else:
                encoded, truncated, unseen = self.encode(histories, context)
                caches = [None] * len(histories)
                computed = np.array([min(len(h), self.max_length) for h in histories])
            exclude = [
                h if queries[i].exclude_history else np.zeros(0, np.uint64)
                for i in retrieval
                for h in queries[i].histories
            ]
            k = max(queries[i].k for i in retrieval)
            items, scores = self.top_k(encoded, k, exclude)
            start = 0
            for i in retrieval:
                stop = start + queries[i].rows
                k_i = min(queries[i].k, items.shape[1])
                mine = [t - start for t in truncated if start <= t < stop]
                answers[i] = SequenceAnswer(
                    scores[start:stop, :k_i],
                    items[start:stop, :k_i],
                    mine,
                    int(unseen[start:stop].sum()),
                    caches[start:stop] if queries[i].cached is not None else None,
                    computed_events=int(computed[start:stop].sum()),
                )
                start = stop
        for i, query in enumerate(queries):
            if query.candidates is not None:
                scores, truncated, unseen = self.score_candidates(
                    query.histories, query.candidates, query.context
                )
                answers[i] = SequenceAnswer(scores, None, truncated, unseen)
        return answers

    def work(self) -> str:
        """What it has done, for the server's closing line."""
        return f"{self.histories_encoded:,} histories encoded"

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "histories_encoded": self.histories_encoded,
                "unseen_items": self.unseen_items,
                "catalogue": len(self.catalogue),
            }

    def close(self) -> None:
        self._defaults.close()


def _read_names(path: Path):
    try:
        table = pq.read_table(path)
        ids = table.column("item").to_numpy().astype(np.uint64)
        names = table.column("name").combine_chunks()
    except (OSError, KeyError, ValueError) as error:
        raise _format.ExportError(f"{path}: unreadable item names ({error})") from None
    return ids, names
