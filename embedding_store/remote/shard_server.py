"""Embedding shards behind an Arrow Flight server: the transport of remote shards.

A server hosts one or more shards (global indices out of `num_shards`) of one set
of tables. Each shard is the same in-process `LocalShard` the embedded store uses;
the server only adds the transport: one `DoExchange` per shard request carrying every
table's ids (see `wire`), Flight actions for control, a shared-secret token, TLS
(optionally requiring client certificates), request limits, latency statistics and a
graceful drain.

The `hybridrec serve-embeddings` command runs one (hybridrec/serve_embeddings.py);
`hybridrec.cli.server_processes` starts such commands as subprocesses.

Example:
    server = ShardServer(tables, [0, 1], num_shards=4, location="grpc://0.0.0.0:7001")
    ...                         # serving on server.port until
    server.drain_and_stop()
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow.flight as flight
from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSFiles
from hybridrec.embedding_store.checkpoint import (
    PRECISIONS,
    check_compatible,
    latest_checkpoint_step,
    read_manifest,
)
from hybridrec.embedding_store.columns import stored_tables
from hybridrec.embedding_store.config import TableConfig
from hybridrec.embedding_store.errors import EmbeddingStoreError
from hybridrec.embedding_store.remote import _tls, wire, wire_rows
from hybridrec.embedding_store.remote._fingerprint import table_fingerprint
from hybridrec.embedding_store.remote._server_parts import (
    Latency,
    TokenMiddlewareFactory,
    field,
    json_default,
)
from hybridrec.embedding_store.shard import LocalShard

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_MAX_REQUEST_ROWS", "ShardServer"]

DEFAULT_MAX_REQUEST_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_REQUEST_ROWS = 16 * 1024 * 1024
# Remembered (client, seq) pairs of applied updates, so a retried update is applied once.
_APPLIED_MEMORY = 65536
# Remembered training lookups (their ids), so the update of the same batch sends gradients
# only: at most this many lookups and ids (8 bytes each) per server, oldest forgotten first.
_LOOKUP_MEMORY = 1024
_LOOKUP_MEMORY_IDS = 8 * 1024 * 1024


class ShardServer(flight.FlightServerBase):
    """An Arrow Flight server hosting some shards of one table set.

    Args:
        tables: the table configs (every client must use the same).
        shard_indices: global indices of the shards hosted here.
        num_shards: total shards of the table set across all servers.
        location: e.g. "grpc://127.0.0.1:0" (port 0 picks a free port).
        token: shared secret every call must present, or None for no check.
        tls: certificate and key to serve over TLS (the location becomes grpc+tls://);
            with a CA, every client must present a certificate it signed. None: plaintext.
        max_request_bytes / max_request_rows: per-request limits; larger requests
            are rejected before any state is touched.
        restore: checkpoint URL to load the hosted shards from at start (the
            latest step, or `restore_step`); a URL without a checkpoint starts empty.
        restore_step: the step to restore instead of the latest.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        shard_indices: Sequence[int],
        *,
        num_shards: int,
        location: str = "grpc://127.0.0.1:0",
        token: str | None = None,
        tls: TLSFiles | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS,
        restore: str | None = None,
        restore_step: int | None = None,
    ):
        location = _tls.server_location(location, tls)
        tls_options = _tls.server_options(tls)  # the files are checked before any work
        # The shards hold each table or its column slices; clients compare the tables given.
        self.fingerprint = table_fingerprint(tuple(tables))
        self.tables = tuple(stored_tables(tables))
        self.num_shards = num_shards
        self.table_dims = {table.name: int(table.dim) for table in self.tables}
        self.row_shapes = {  # whole rows: (dim, optimizer-state width)
            table.name: (int(table.dim), table.optimizer.state_width(table.dim))
            for table in self.tables
        }
        self.shards = {index: self._new_shard(index) for index in sorted(set(shard_indices))}
        self.max_request_bytes = max_request_bytes
        self.max_request_rows = max_request_rows
        self.incarnation = uuid.uuid4().hex
        self.started = time.time()
        self._draining = threading.Event()
        self._stopped = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[int, float] = {}  # in-flight update id -> start time
        self._next_pending = 0
        self._applied: collections.OrderedDict[tuple[str, int], threading.Event] = (
            collections.OrderedDict()
        )
        self._lookups: collections.OrderedDict[
            tuple[str, int], tuple[int, dict[str, np.ndarray]]
        ] = collections.OrderedDict()
        self._lookup_ids = 0  # ids held by self._lookups
        self._latency = {op: Latency() for op in wire.OPERATIONS}
        self._counters: collections.Counter[str] = collections.Counter()
        self._step = 0
        self._shard_steps: dict[int, int] = {}
        self.restored_step = None
        if restore is not None:
            step = restore_step if restore_step is not None else latest_checkpoint_step(restore)
            if step is not None:
                for index in self.shards:
                    self._load(index, restore, step)
                self.restored_step = step
            elif restore_step is not None:
                raise UserError(f"{restore}: no committed checkpoint for step {restore_step}")
        self.token_required = bool(token)
        self.tls = tls is not None
        self.client_certificates_required = tls is not None and bool(tls.ca)
        middleware = {"token": TokenMiddlewareFactory(token)} if token else None
        super().__init__(location, middleware=middleware, **tls_options)  # serving starts here

    def _new_shard(self, index: int) -> LocalShard:
        return LocalShard(self.tables, shard_index=index, num_shards=self.num_shards)

    def _load(self, index: int, url: str, step: int) -> dict[str, int]:
        """Replaces shard `index` by a fresh one holding its rows of checkpoint `step`."""
        manifest = read_manifest(url, step)
        check_compatible(url, manifest, self.tables)
        shard = self._new_shard(index)
        try:
            loaded = shard.load_checkpoint(url, manifest, index, self.num_shards)
        except BaseException:
            shard.close()
            raise
        old, self.shards[index] = self.shards.get(index), shard
        with self._lock:
            self._shard_steps.pop(index, None)  # the fresh shard has not seen a step yet
        if old is not None:
            old.close()
        return loaded

    def _count(self, key: str, value: int = 1) -> None:
        with self._lock:
            self._counters[key] += value

    # --- data path --------------------------------------------------------------------

    def do_exchange(self, context, descriptor, reader, writer):
        start = time.perf_counter()
        try:
            if self._draining.is_set():
                raise flight.FlightUnavailableError("embedding server is shutting down")
            header = wire.decode_header(descriptor.command)
            shard = self._shard(header.shard)
            if header.step >= 0:
                self._set_step(header.shard, header.step)
            limits = wire.RequestLimits(
                max_rows=self.max_request_rows, max_bytes=self.max_request_bytes
            )
            chunks = ((chunk.data, chunk.app_metadata) for chunk in reader)
            received = len(descriptor.command)
            if header.op == wire.LOOKUP:
                requests = wire.decode_lookup(chunks, reader.schema, self.table_dims, limits)
                rows = shard.lookup(requests, train=header.train)
                if header.train and header.client:
                    self._remember(header, requests)
                writer.begin(wire.values_schema(header.dtype))
                sent = 0
                for table in requests:
                    batch = wire.values_batch(rows[table], header.dtype)
                    writer.write_with_metadata(batch, table.encode())
                    sent += batch.nbytes + len(table)
                self._count("rows_looked_up", limits.rows)
                kind = "lookup" if header.train else "eval_lookup"
                received += sum(len(table) for table in requests)
            elif header.op in (wire.WRITE_ROWS, wire.TAKE_ROWS, wire.READ_ROWS):
                names, sent = self._whole_rows(shard, header, chunks, reader, writer, limits)
                kind, received = "rows", received + names
            else:
                lookup_ids = self._recall(header)
                updates = wire.decode_apply(
                    chunks, reader.schema, self.table_dims, limits, header, lookup_ids
                )
                duplicate = self._apply_once(shard, header, updates)
                if lookup_ids is not None:
                    with self._lock:
                        self._forget((header.client, header.lookup))
                applied = 0 if duplicate else limits.rows
                reply = json.dumps({"applied": applied, "duplicate": duplicate}).encode()
                writer.write_metadata(reply)
                self._count("rows_applied", applied)
                kind, sent = "apply", len(reply)
                received += sum(len(table) for table in updates)
            # Payload bytes (Arrow buffers, headers, table names), without gRPC framing.
            self._count(f"wire_bytes_{kind}", received + limits.bytes + sent)
        except (wire.WireError, EmbeddingStoreError) as error:
            self._count("rejected")
            raise flight.FlightServerError(f"rejected: {error}") from None
        except flight.FlightError:
            self._count("rejected")
            raise
        self._count(f"{header.op}_requests")
        self._latency[header.op].add(time.perf_counter() - start)

    def _whole_rows(
        self, shard, header: wire.Header, chunks, reader, writer, limits
    ) -> tuple[int, int]:
        """Serves write_rows, take_rows or read_rows (rows with their optimizer state, for
        the tables trained on the trainers' devices); returns the bytes of the request's
        table names and of the reply."""
        if header.op == wire.WRITE_ROWS:
            rows = wire_rows.decode_rows(chunks, reader.schema, self.row_shapes, limits)
            with self._update_in_flight():
                shard.write_rows(rows)
            written = sum(len(ids) for ids, _, _ in rows.values())
            reply = json.dumps({"written": written}).encode()
            writer.write_metadata(reply)
            self._count("rows_written", written)
            return sum(len(table) for table in rows), len(reply)
        if header.op == wire.TAKE_ROWS:
            requests = wire.decode_lookup(chunks, reader.schema, self.table_dims, limits)
            rows = {table: (ids, *shard.take_rows(table, ids)) for table, ids in requests.items()}
            names = sum(len(table) for table in requests)
        else:
            if header.table not in self.row_shapes:
                raise wire.WireError(f"unknown table {header.table[:64]!r}")
            if any(True for _ in chunks):  # (also waits for the client's end of the stream)
                raise wire.WireError("a read_rows request carries no record batches")
            rows = {
                header.table: shard.read_rows(header.table, header.prefixes, header.prefix_bits)
            }
            names = 0
        writer.begin(wire_rows.ROWS_SCHEMA)
        sent = 0
        for batch, table in wire_rows.rows_batches(rows):
            writer.write_with_metadata(batch, table)
            sent += batch.nbytes + len(table)
        self._count("rows_read", sum(len(ids) for ids, _, _ in rows.values()))
        return names, sent

    @contextlib.contextmanager
    def _update_in_flight(self):
        """Counts an update as in flight (`wait_idle`, `drain_and_stop`) while it runs."""
        with self._lock:
            token = self._next_pending
            self._next_pending += 1
            self._pending[token] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                del self._pending[token]
                if not self._pending:
                    self._idle.notify_all()

    def _set_step(self, index: int, step: int) -> None:
        """Sets shard `index`'s training step when it changed (LRU time, TTL sweeps)."""
        with self._lock:
            changed = self._shard_steps.get(index) != step
            self._shard_steps[index] = step
            self._step = max(self._step, step)
        if changed:
            self.shards[index].set_step(step)

    def _step_from(self, index: int, body: Mapping[str, Any], key: str) -> None:
        """Applies the client's current step carried by a control call, if any."""
        step = body.get(key, -1)
        if isinstance(step, bool) or not isinstance(step, int) or step < -1:
            raise wire.WireError(f"field {key!r} must be an integer >= -1, got {step!r}")
        if step >= 0:
            self._set_step(index, step)

    def _shard(self, index: Any) -> LocalShard:
        shard = self.shards.get(index) if isinstance(index, int) else None
        if shard is None:
            raise wire.WireError(
                f"shard {index!r} is not hosted here (hosted: {sorted(self.shards)})"
            )
        return shard

    def _remember(self, header: wire.Header, requests: dict[str, np.ndarray]) -> None:
        """Keeps the ids of a training lookup for the update of the same batch."""
        with self._lock:
            self._lookups[(header.client, header.seq)] = (header.shard, requests)
            self._lookup_ids += sum(len(ids) for ids in requests.values())
            while len(self._lookups) > _LOOKUP_MEMORY or self._lookup_ids > _LOOKUP_MEMORY_IDS:
                self._forget(next(iter(self._lookups)))

    def _forget(self, key: tuple[str, int]) -> None:
        """Drops a remembered lookup (call with the lock held)."""
        _, requests = self._lookups.pop(key, (None, {}))
        self._lookup_ids -= sum(len(ids) for ids in requests.values())

    def _recall(self, header: wire.Header) -> dict[str, np.ndarray] | None:
        """The ids of the lookup an update names, None if it names none; WireError if forgotten."""
        if header.lookup < 0:
            return None
        with self._lock:
            shard, requests = self._lookups.get((header.client, header.lookup), (None, None))
        if requests is None or shard != header.shard:
            raise wire.WireError(
                f"{wire.UNKNOWN_LOOKUP} {header.lookup} of client {header.client[:16]!r} on "
                f"shard {header.shard} (forgotten or never seen here); send the ids"
            )
        return requests

    def _apply_once(self, shard, header: wire.Header, updates) -> bool:
        """Applies `updates` unless (client, seq) was applied already; True for a duplicate."""
        key = (header.client, header.seq)
        with self._lock:
            done = self._applied.get(key) if header.client else None
            duplicate = done is not None
            if not duplicate:
                done = threading.Event()
                if header.client:
                    self._applied[key] = done
                    while len(self._applied) > _APPLIED_MEMORY:
                        self._applied.popitem(last=False)
        if duplicate:
            done.wait()
            self._count("duplicates")
            return True
        try:
            with self._update_in_flight():
                shard.apply_gradients(updates)
        except BaseException:
            with self._lock:
                self._applied.pop(key, None)
            raise
        finally:
            done.set()
        return False

    # --- control path -----------------------------------------------------------------

    def list_actions(self, context):
        return [
            ("health", "readiness, hosted shards, table fingerprint (JSON)"),
            ("stats", "rows, latency p50/p99, pending updates (JSON)"),
            ("shard_stats", '{"shard"}: the shard\'s per-table counters'),
            ("set_step", '{"shard", "step"}'),
            (
                "checkpoint",
                '{"shard", "url", "step", "num_shards", "full", "precision"}: write a part',
            ),
            ("commit_checkpoint", '{"shard", "step"}: the manifest of step is committed'),
            ("load_checkpoint", '{"shard", "url", "step", "num_shards"}: reset, then load'),
        ]

    def do_action(self, context, action):
        try:
            body = wire.decode_json(action.body, f"action {action.type!r}")
            result = self._action(action.type, body)
        except (wire.WireError, EmbeddingStoreError) as error:
            self._count("rejected")
            raise flight.FlightServerError(f"rejected: {error}") from None
        return [json.dumps(result, default=json_default).encode()]

    def _action(self, kind: str, body: dict[str, Any]) -> Any:
        if kind == "health":
            return self.health()
        if kind == "stats":
            return self.stats()
        if self._draining.is_set():
            raise flight.FlightUnavailableError("embedding server is shutting down")
        if kind == "shard_stats":
            index = body.get("shard")
            self._shard(index)
            self._step_from(index, body, "step")
            return self.shards[index].stats()
        if kind == "set_step":
            index = body.get("shard")
            self._shard(index)
            self._set_step(index, field(body, "step", int))
            return {}
        if kind == "checkpoint":
            index = body.get("shard")
            shard = self._shard(index)
            url, step = field(body, "url", str), field(body, "step", int)
            self._check_num_shards(field(body, "num_shards", int))
            precision = body.get("precision", "fp32")  # older clients send none
            if precision not in PRECISIONS:
                raise wire.WireError(f"field 'precision' must be one of {PRECISIONS}")
            self._step_from(index, body, "step_now")
            self.wait_idle()
            return shard.write_checkpoint(
                url,
                step,
                index,
                num_shards=self.num_shards,
                full=field(body, "full", bool),
                precision=precision,
            )
        if kind == "commit_checkpoint":
            self._shard(body.get("shard")).commit_checkpoint(field(body, "step", int))
            return {}
        if kind == "load_checkpoint":
            index = body.get("shard")
            self._shard(index)
            self._check_num_shards(field(body, "num_shards", int))
            self.wait_idle()
            return self._load(index, field(body, "url", str), field(body, "step", int))
        raise wire.WireError(f"unknown action {kind!r}")

    def _check_num_shards(self, num_shards: int) -> None:
        if num_shards != self.num_shards:
            raise wire.WireError(
                f"client has {num_shards} shards, this server is one of {self.num_shards}"
            )

    def health(self) -> dict[str, Any]:
        return {
            "ready": not self._draining.is_set(),
            "incarnation": self.incarnation,
            "shards": sorted(self.shards),
            "num_shards": self.num_shards,
            "tables": self.table_dims,
            "fingerprint": self.fingerprint,
            "restored_step": self.restored_step,
            "wire_version": wire.WIRE_VERSION,
        }

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._pending)
            oldest = min(self._pending.values(), default=None)
            counters = dict(self._counters)
        shard_stats = {str(index): shard.stats() for index, shard in self.shards.items()}
        return {
            "incarnation": self.incarnation,
            "uptime_s": time.time() - self.started,
            "step": self._step,
            "rows": sum(
                int(table.get("rows", 0))
                for shard in shard_stats.values()
                for table in shard.values()
            ),
            "latency": {op: latency.summary() for op, latency in self._latency.items()},
            "pending_updates": pending,
            "oldest_pending_update_ms": 0.0
            if oldest is None
            else (time.monotonic() - oldest) * 1e3,
            "counters": counters,
            "shards": shard_stats,
        }

    # --- lifecycle --------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no update is in flight; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout=timeout)

    def drain_and_stop(self, timeout: float = 60.0) -> None:
        """Refuses new requests, finishes in-flight ones, stops serving, closes shards.

        Idempotent; `timeout` bounds the wait for in-flight updates.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._draining.set()
        self.wait_idle(timeout)
        self.shutdown()  # blocks until the requests still running have returned
        for shard in self.shards.values():
            shard.close()
