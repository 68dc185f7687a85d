"""The embedding store client: validation, dedupe, routing, futures, checkpoints.

Calls return `concurrent.futures.Future`s. Each shard has one worker thread that
runs its requests in submission order, so calls made one after another from one
thread reach every shard in that order, while different shards work in parallel
(numpy releases the GIL for large gathers and scatters).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import _pooling
from hybridrec.embedding_store import checkpoint as _checkpoint
from hybridrec.embedding_store._arrays import sum_duplicates, take_rows, unique_inverse
from hybridrec.embedding_store._calls import Inline, join_rows, when_all
from hybridrec.embedding_store._pooling import FeatureIds, PooledLookup
from hybridrec.embedding_store.columns import (
    column_slices,
    piece_columns,
    put_piece_columns,
    stored_tables,
)
from hybridrec.embedding_store.config import TableConfig
from hybridrec.embedding_store.errors import CheckpointError, InvalidInputError, UnknownTableError
from hybridrec.embedding_store.routing import partition, table_offset
from hybridrec.embedding_store.shard import LocalShard, Shard


def _rows(array: np.ndarray, where: np.ndarray | slice) -> np.ndarray:
    return array[where] if isinstance(where, slice) else take_rows(array, where)


class EmbeddingStore:
    """Sharded embedding tables with async lookups and sparse optimizer updates.

    Args:
        tables: the tables' configs (unique names).
        num_shards: number of in-process shards (ignored when `shards` is given).
        shards: shard backends (e.g. remote shards); shard i must own the ids with
            `routing.shard_of(id, len(shards)) == i`.
        num_workers: client threads that combine shard results and pool features.

    With one in-process shard, calls run on the caller's thread (the returned futures
    are done); with several shards or remote ones, each shard has a worker thread so
    that shards work in parallel, and the futures complete as they answer.

    Example:
        store = EmbeddingStore([TableConfig(name="ads", dim=16, capacity=10**6)], num_shards=4)
        rows = store.lookup("ads", ids).result()            # [n, 16] float32
        store.apply_gradients("ads", ids, grads).result()
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        num_shards: int = 1,
        shards: Sequence[Shard] | None = None,
        num_workers: int = 2,
    ):
        tables = tuple(tables)
        if not tables:
            raise InvalidInputError("an embedding store needs at least one table")
        for table in tables:
            if not isinstance(table, TableConfig):
                raise InvalidInputError(f"tables must be TableConfig objects, got {table!r}")
        self._configs = {table.name: table for table in tables}
        if len(self._configs) != len(tables):
            raise InvalidInputError(f"duplicate table names in {[t.name for t in tables]}")
        # What the shards hold: each table, or its column slices (see `columns`).
        self._slices = {table.name: column_slices(table) for table in tables}
        try:
            self._stored = stored_tables(tables)
        except ValueError as error:
            raise InvalidInputError(str(error)) from None
        if shards is not None:
            shards = list(shards)
            num_shards = len(shards)
        if num_shards < 1:
            raise InvalidInputError(f"num_shards must be >= 1, got {num_shards}")
        if shards is None:
            shards = [
                LocalShard(self._stored, shard_index=i, num_shards=num_shards)
                for i in range(num_shards)
            ]
        self._shards: list[Shard] = shards
        if num_shards == 1 and isinstance(shards[0], LocalShard):
            self._executors, self._pool = [Inline()], Inline()
        else:
            self._executors = [
                ThreadPoolExecutor(1, thread_name_prefix=f"embedding-shard-{i}")
                for i in range(num_shards)
            ]
            self._pool = ThreadPoolExecutor(
                max(1, num_workers), thread_name_prefix="embedding-client"
            )
        self._background: list[Future] = []
        self._step = 0
        self._chain: tuple[str, int] | None = None  # (url, step) this store's rows extend
        self._closed = False

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def inline(self) -> bool:
        """Whether calls run on the caller's thread (one in-process shard): every returned
        future is done."""
        return isinstance(self._pool, Inline)

    @property
    def tables(self) -> dict[str, TableConfig]:
        return dict(self._configs)

    @property
    def shards(self) -> tuple[Shard, ...]:
        """The shard backends, shard i hosting the ids with `shard_of(id, num_shards) == i`."""
        return tuple(self._shards)

    # ----------------------------------------------------------------- validation

    def _config(self, table: str) -> TableConfig:
        if self._closed:
            raise UserError("the embedding store is closed")
        try:
            return self._configs[table]
        except KeyError:
            raise UnknownTableError(
                f"unknown embedding table {table!r}; tables: {', '.join(self._configs)}"
            ) from None

    # ----------------------------------------------------------------- routing

    def _route(self, ids: np.ndarray, offset: int = 0) -> list[tuple[int, np.ndarray | slice]]:
        """[(shard, positions)] for the shards that receive any of `ids`."""
        if self.num_shards == 1:
            return [(0, slice(None))]
        order, bounds = partition(ids, self.num_shards, offset)
        return [
            (shard, order[bounds[shard] : bounds[shard + 1]])
            for shard in range(self.num_shards)
            if bounds[shard + 1] > bounds[shard]
        ]

    def _submit(self, shard: int, method: str, *args, **kwargs) -> Future:
        return self._executors[shard].submit(getattr(self._shards[shard], method), *args, **kwargs)

    # ----------------------------------------------------------------- single table

    def lookup(self, table: str, ids: np.ndarray, *, train: bool = True) -> Future:
        """Rows of `ids`: a future of [n, dim] float32.

        Args:
            table: table name.
            ids: [n] uint64 (duplicates allowed).
            train: count sightings for admission and create admitted rows; with False
                (evaluation) nothing changes and unknown ids read as their initial value
                (or zeros when admission is restricted).

        Each distinct id goes to its shard once, unless a repeat is a sighting that
        admission counts (training lookups of a table with `min_count` or `probability`).
        """
        config = self._config(table)
        ids = _pooling._check_ids(f"table {table!r}", ids)
        expand = None
        if not train or config.admission.admits_all:
            unique, inverse = unique_inverse(ids)
            if len(unique) < len(ids):
                ids, expand = unique, inverse
        if self.num_shards == 1 and expand is None:
            ids = ids.copy()  # the caller may reuse its array before the lookup runs
        routes = [
            (piece, shard, where)
            for piece in self._slices[table]
            for shard, where in self._route(ids, table_offset(piece))
        ]
        futures = [
            self._submit(shard, "lookup", {piece.name: ids[where]}, train=train)
            for piece, shard, where in routes
        ]

        def combine(results):
            if len(results) == 1 and isinstance(routes[0][2], slice):
                out = results[0][table]
            else:
                out = np.empty((len(ids), config.dim), np.float32)
                for (piece, _, where), result in zip(routes, results, strict=True):
                    put_piece_columns(out, where, piece, result[piece.name])
            return out if expand is None else take_rows(out, expand)

        return when_all(futures, combine, self._pool)

    def apply_gradients(self, table: str, ids: np.ndarray, grads: np.ndarray) -> Future:
        """Applies the table's optimizer; a future of None.

        Args:
            table: table name.
            ids: [n] uint64; gradients of repeated ids are summed before the step.
            grads: [n, dim] float (cast to float32); rows with NaN/inf are skipped and counted.
        """
        config = self._config(table)
        ids = _pooling._check_ids(f"table {table!r}", ids)
        grads = _pooling.check_rows(config, grads, len(ids))
        summed_ids, summed = sum_duplicates(ids, grads)  # in call order, as a shard would
        if summed_ids is not ids:
            ids, grads = summed_ids, summed  # new arrays: each distinct id is sent once
        elif self.num_shards == 1:  # routing copies; otherwise copy: the caller may reuse them
            ids, grads = ids.copy(), grads.copy()
        futures = [
            self._submit(
                shard,
                "apply_gradients",
                {piece.name: (ids[where], _rows(piece_columns(grads, piece), where))},
            )
            for piece in self._slices[table]
            for shard, where in self._route(ids, table_offset(piece))
        ]
        return when_all(futures, lambda _: None, self._pool)

    def write_rows(self, table: str, ids: np.ndarray, values: np.ndarray, state: Any) -> Future:
        """Sets whole rows with their optimizer state (unique ids [n], values [n, dim], state
        [n, width]), creating those not held: rows trained on the devices come back."""
        config = self._whole_rows(table)
        ids = _pooling._check_ids(f"table {table!r}", ids)
        values, state = _pooling.check_rows(config, values, len(ids)), state.astype(np.float32)
        calls = [
            self._submit(shard, "write_rows", {table: (ids[at], values[at], state[at])})
            for shard, at in self._route(ids, table_offset(config))
        ]
        return when_all(calls, lambda _: None, self._pool)

    def take_rows(self, table: str, ids: np.ndarray) -> Future:
        """A future of (values [n, dim], state [n, width]) of unique ids [n], creating the
        rows not held: rows a device cache takes over, with their optimizer state."""
        config = self._whole_rows(table)
        ids = _pooling._check_ids(f"table {table!r}", ids)
        routes = self._route(ids, table_offset(config))
        calls = [self._submit(shard, "take_rows", table, ids[at]) for shard, at in routes]
        return when_all(calls, lambda parts: join_rows(routes, parts, len(ids)), self._pool)

    def read_rows(self, table: str, prefixes: Sequence[int] | None = None, prefix_bits: int = 0):
        """(ids, values, state) of held rows: all, or those with a prefix (`Shard.read_rows`)."""
        self._whole_rows(table)
        parts = [shard.read_rows(table, prefixes, prefix_bits) for shard in self._shards]
        return tuple(np.concatenate([part[i] for part in parts]) for i in range(3))

    def _whole_rows(self, table: str) -> TableConfig:
        if len(self._slices[self._config(table).name]) > 1:
            raise InvalidInputError(f"table {table!r} is split by columns: no whole rows")
        return self._configs[table]

    # ----------------------------------------------------------------- pooled features

    def lookup_features(
        self,
        features: Mapping[str, FeatureIds],
        *,
        feature_tables: Mapping[str, str],
        pooling: str = "sum",
        train: bool = True,
    ) -> Future:
        """Pooled embeddings of a batch: a future of `PooledLookup` ([batch, features, dim]).

        Args:
            features: {feature: ids}; ids are [batch] uint64 (single-valued) or RaggedIds.
            feature_tables: {feature: table}; several features may share a table.
            pooling: how a multi-valued bag combines its rows: sum, mean or sqrtn.
            train: as in `lookup`.

        Ids are deduplicated per table across all features: one request per shard.
        """
        if self._closed:
            raise UserError("the embedding store is closed")
        dims = {name: config.dim for name, config in self._configs.items()}
        planned, tables, batch, dim = _pooling.plan(features, feature_tables, dims, pooling)
        requests: dict[int, dict[str, np.ndarray]] = {}
        for table, ids in tables.items():
            # {stored piece: [(shard, positions in ids.unique)]}, kept for the backward pass
            ids.routes = {}
            for piece in self._slices[table]:
                ids.routes[piece.name] = self._route(ids.unique, table_offset(piece))
                for shard, where in ids.routes[piece.name]:
                    requests.setdefault(shard, {})[piece.name] = ids.unique[where]
        shards = sorted(requests)
        futures = [self._submit(s, "lookup", requests[s], train=train) for s in shards]

        def combine(results):
            by_shard = dict(zip(shards, results, strict=True))
            rows = {}
            for table, ids in tables.items():
                pieces = self._slices[table]
                routes = ids.routes[pieces[0].name]
                if len(pieces) == 1 and len(routes) == 1 and isinstance(routes[0][1], slice):
                    rows[table] = by_shard[routes[0][0]][pieces[0].name]  # one shard: as is
                    continue
                unique_rows = np.empty((len(ids.unique), dim), np.float32)
                for piece in pieces:
                    for shard, where in ids.routes[piece.name]:
                        put_piece_columns(unique_rows, where, piece, by_shard[shard][piece.name])
                rows[table] = unique_rows
            embeddings = _pooling.pool(planned, tables, rows, batch, dim, pooling)
            return PooledLookup(embeddings, tuple(features), pooling, planned, tables)

        return when_all(futures, combine, self._pool)

    def apply_pooled_gradients(self, lookup: PooledLookup, grads: np.ndarray) -> Future:
        """Backward of `lookup_features`: a future of None.

        Args:
            lookup: the PooledLookup these gradients belong to.
            grads: [batch, features, dim] dL/d(embeddings), as returned by the train step.
        """
        if not isinstance(lookup, PooledLookup):
            raise InvalidInputError(f"expected the PooledLookup of a batch, got {type(lookup)}")
        if not isinstance(grads, np.ndarray) or grads.dtype.kind != "f":
            raise InvalidInputError("pooled gradients must be a float numpy array")
        if grads.shape != lookup.embeddings.shape:
            raise InvalidInputError(
                f"pooled gradients must have the embeddings' shape {list(lookup.embeddings.shape)}, "
                f"got {list(grads.shape)}"
            )
        per_table = _pooling.unpool(lookup, grads.astype(np.float32, copy=False))
        requests: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        for table, table_grads in per_table.items():
            ids = lookup._tables[table]
            for piece in self._slices[table]:
                piece_grads = piece_columns(table_grads, piece)
                for shard, where in ids.routes[piece.name]:
                    requests.setdefault(shard, {})[piece.name] = (
                        ids.unique[where],
                        _rows(piece_grads, where),
                    )
        futures = [self._submit(s, "apply_gradients", r) for s, r in sorted(requests.items())]
        return when_all(futures, lambda _: None, self._pool)

    # ----------------------------------------------------------------- control

    def set_step(self, step: int) -> None:
        """Sets the training step (last-access time for LRU/TTL eviction)."""
        self._step = int(step)
        self._background = [f for f in self._background if not f.done() or f.exception()]
        self._background += [
            self._submit(s, "set_step", self._step) for s in range(self.num_shards)
        ]

    def flush(self) -> None:
        """Waits until every call submitted so far has been applied on every shard."""
        for executor in self._executors:
            executor.submit(lambda: None).result()
        background, self._background = self._background, []
        for future in background:
            future.result()

    def _on_all_shards(self, method: str, *args_per_shard) -> list:
        futures = [
            self._submit(s, method, *(a[s] for a in args_per_shard)) for s in range(self.num_shards)
        ]
        return [f.result() for f in futures]

    def stats(self) -> dict[str, Any]:
        """Counters per table (summed over shards) and totals."""
        return self.stats_async().result()

    def stats_async(self) -> Future:
        """A future of `stats()`, answered once each shard has done the work queued before it."""
        step = self._step
        futures = [self._submit(s, "stats") for s in range(self.num_shards)]
        return when_all(futures, lambda per_shard: self._merge_stats(step, per_shard), self._pool)

    def _merge_stats(self, step: int, per_shard: list[dict]) -> dict[str, Any]:
        tables: dict[str, dict[str, int]] = {}
        totals: dict[str, int] = {}
        for shard_stats in per_shard:
            for table, counters in shard_stats.items():
                merged = tables.setdefault(table, {})
                for key, value in counters.items():
                    merged[key] = merged.get(key, 0) + value
                    totals[key] = totals.get(key, 0) + value
        return {"step": step, "num_shards": self.num_shards, **totals, "tables": tables}

    # ----------------------------------------------------------------- checkpoints

    def checkpoint(
        self, url: str, step: int, *, full: bool | None = None, precision: str = "fp32"
    ) -> dict[str, Any]:
        """Snapshots every table at `step` under `url` (local path or tensorstore kvstore URL).

        Atomic: the manifest is written only after every shard wrote its part.
        Incremental: when `url` holds the checkpoint this store last wrote or was
        restored from, only rows changed since then are written (unless `full`).
        Precision: fp32 (exact), fp16, or int8 / int4 row-wise quantization with a
        per-row scale and bias (ids stay exact; see `embedding_store._quantize`). The
        precision is recorded per part, so `restore` needs no setting for it.

        Returns:
            {"step", "url", "full", "precision", "rows_written", "ids_deleted",
            "bytes_written", "seconds"}
        """
        start = time.perf_counter()
        _checkpoint.check_precision(precision)
        self.flush()
        tables = self._stored
        extends = self._chain[1] if self._chain and self._chain[0] == url else None
        base = _checkpoint.snapshot_base(url, step, tables, None if full else extends)
        n = self.num_shards
        futures = [
            self._submit(
                s,
                "write_checkpoint",
                url,
                step,
                s,
                num_shards=n,
                full=base is None,
                precision=precision,
            )
            for s in range(n)
        ]
        parts, failures = [], []
        for shard, future in enumerate(futures):
            try:
                parts.append(future.result())
            except Exception as error:  # noqa: BLE001 - reported below, nothing committed
                failures.append(f"shard {shard}: {error}")
        if failures:
            raise CheckpointError(
                f"{url}: checkpoint of step {step} not committed; {'; '.join(failures)}"
            )
        _checkpoint.write_manifest(url, step, _checkpoint.new_manifest(step, tables, parts, base))
        self._on_all_shards("commit_checkpoint", [step] * n)
        self._chain = (url, step)
        written = [entry for shard_parts in parts for entry in shard_parts.values()]
        return {
            "step": step,
            "url": url,
            "full": base is None,
            "precision": precision,
            "rows_written": sum(entry["rows"] for entry in written),
            "ids_deleted": sum(entry["deleted"] for entry in written),
            "bytes_written": sum(entry["bytes"] for entry in written),
            "seconds": time.perf_counter() - start,
        }

    @classmethod
    def restore(
        cls,
        url: str,
        tables: Sequence[TableConfig],
        *,
        step: int | None = None,
        num_shards: int = 1,
        shards: Sequence[Shard] | None = None,
        num_workers: int = 2,
    ) -> EmbeddingStore:
        """Builds a store from the checkpoint of `step` (default: latest) under `url`.

        The shard count may differ from the one that wrote the checkpoint. Hyper-
        parameters (learning rate, admission, eviction, capacity) may change; what the
        stored rows depend on (dim, optimizer, table set) must match.
        """
        manifest = _checkpoint.read_manifest(url, step)
        _checkpoint.check_compatible(url, manifest, stored_tables(tables))
        store = cls(tables, num_shards=num_shards, shards=shards, num_workers=num_workers)
        try:
            n = store.num_shards
            store._on_all_shards("load_checkpoint", [url] * n, [manifest] * n, range(n), [n] * n)
        except BaseException:
            store.close()
            raise
        store._chain = (url, manifest["step"])
        store._step = manifest["step"]
        store.set_step(manifest["step"])
        return store

    def close(self) -> None:
        """Waits for pending calls, then releases shards and threads."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            for executor in self._executors:
                executor.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            for shard in self._shards:
                shard.close()

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
