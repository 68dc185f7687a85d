"""`hybridrec serve-embeddings`: embedding shards behind an Arrow Flight server.

A server hosts one or more shards (global indices out of `num_shards`) of one set
of tables. Each shard is the same in-process `Shard` the embedded store uses; the
server only adds the transport: one `DoExchange` per shard request carrying every
table's ids (see `_wire`), Flight actions for control, a shared-secret token,
request limits, latency statistics and a graceful drain on SIGTERM.

Example:
    hybridrec serve-embeddings --tables tables.toml --num-shards 4 --shards 0,1 --port 7001
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow.flight as flight

from embedding_store import _wire
from hybridrec.errors import UserError

TOKEN_ENV = "HYBRIDREC_EMBEDDING_TOKEN"
AUTH_HEADER = "authorization"
DEFAULT_MAX_REQUEST_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_REQUEST_ROWS = 16 * 1024 * 1024
# Remembered (client, seq) pairs of applied updates, so a retried update is applied once.
_APPLIED_MEMORY = 65536
_LATENCY_WINDOW = 8192


class _TokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Rejects every call whose `authorization: Bearer <token>` header is wrong."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info, headers):
        values = headers.get(AUTH_HEADER) or headers.get(AUTH_HEADER.title()) or []
        given = values[0] if values else ""
        given = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given, self._expected):
            raise flight.FlightUnauthenticatedError("missing or wrong embedding-server token")
        return None


class _Latency:
    """A sliding window of request latencies for p50/p99."""

    def __init__(self):
        self._samples: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self.count = 0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.count += 1

    def summary(self) -> dict[str, float]:
        if not self._samples:
            return {"count": self.count, "p50_ms": 0.0, "p99_ms": 0.0}
        samples = np.fromiter(self._samples, dtype=np.float64) * 1e3
        p50, p99 = np.percentile(samples, [50, 99])
        return {"count": self.count, "p50_ms": float(p50), "p99_ms": float(p99)}


class ShardServer(flight.FlightServerBase):
    """An Arrow Flight server hosting some shards of one table set.

    Args:
        shards: global shard index -> Shard (the in-process backend) hosted here.
        num_shards: total shards of the table set across all servers.
        table_dims: table name -> embedding dim.
        fingerprint: digest of the table configs; clients refuse a mismatch.
        location: e.g. "grpc://127.0.0.1:0" (port 0 picks a free port).
        token: shared secret every call must present, or None for no check.
        max_request_bytes / max_request_rows: per-request limits; larger requests
            are rejected before any state is touched.
        restored_step: checkpoint step the shards were restored from, if any.
    """

    def __init__(
        self,
        shards: Mapping[int, Any],
        *,
        num_shards: int,
        table_dims: Mapping[str, int],
        fingerprint: str,
        location: str = "grpc://127.0.0.1:0",
        token: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS,
        restored_step: int | None = None,
    ):
        middleware = {"token": _TokenMiddlewareFactory(token)} if token else None
        super().__init__(location, middleware=middleware)
        self.shards = dict(shards)
        self.num_shards = num_shards
        self.table_dims = dict(table_dims)
        self.fingerprint = fingerprint
        self.max_request_bytes = max_request_bytes
        self.max_request_rows = max_request_rows
        self.restored_step = restored_step
        self.incarnation = uuid.uuid4().hex
        self.started = time.time()
        self._draining = threading.Event()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[int, float] = {}  # in-flight update id -> start time
        self._next_pending = 0
        self._applied: collections.OrderedDict[tuple[str, int], threading.Event] = (
            collections.OrderedDict()
        )
        self._latency = {op: _Latency() for op in _wire.OPERATIONS}
        self._counters = collections.Counter()
        self._step = 0

    # --- data path --------------------------------------------------------------------

    def do_exchange(self, context, descriptor, reader, writer):
        start = time.perf_counter()
        try:
            if self._draining.is_set():
                raise flight.FlightUnavailableError("embedding server is shutting down")
            header = _wire.decode_header(descriptor.command)
            shard = self.shards.get(header.shard)
            if shard is None:
                raise _wire.WireError(
                    f"shard {header.shard} is not hosted here (hosted: {sorted(self.shards)})"
                )
            limits = _wire.RequestLimits(
                max_rows=self.max_request_rows, max_bytes=self.max_request_bytes
            )
            chunks = ((chunk.data, chunk.app_metadata) for chunk in reader)
            if header.op == _wire.LOOKUP:
                requests = _wire.decode_lookup(chunks, reader.schema, self.table_dims, limits)
                rows = shard.lookup(requests)
                writer.begin(_wire.VALUES_SCHEMA)
                for table in requests:
                    writer.write_with_metadata(_wire.values_batch(rows[table]), table.encode())
                self._counters["rows_looked_up"] += limits.rows
            else:
                updates = _wire.decode_apply(chunks, reader.schema, self.table_dims, limits)
                duplicate = self._apply_once(shard, header, updates)
                reply = {"applied": 0 if duplicate else limits.rows, "duplicate": duplicate}
                writer.write_metadata(json.dumps(reply).encode())
                self._counters["rows_applied"] += 0 if duplicate else limits.rows
        except _wire.WireError as error:
            self._counters["rejected"] += 1
            raise flight.FlightServerError(f"rejected: {error}") from None
        except flight.FlightError:
            self._counters["rejected"] += 1
            raise
        self._counters[f"{header.op}_requests"] += 1
        self._latency[header.op].add(time.perf_counter() - start)

    def _apply_once(self, shard, header: _wire.Header, updates) -> bool:
        """Applies `updates` unless (client, seq) was applied already; True for a duplicate."""
        key = (header.client, header.seq)
        with self._lock:
            done = self._applied.get(key) if header.client else None
            if done is None:
                done = threading.Event()
                if header.client:
                    self._applied[key] = done
                    while len(self._applied) > _APPLIED_MEMORY:
                        self._applied.popitem(last=False)
                token = self._next_pending
                self._next_pending += 1
                self._pending[token] = time.monotonic()
                duplicate = False
            else:
                duplicate = True
        if duplicate:
            done.wait()
            self._counters["duplicates"] += 1
            return True
        try:
            shard.apply_gradients(updates)
        except BaseException:
            with self._lock:
                self._applied.pop(key, None)
            raise
        finally:
            done.set()
            with self._lock:
                del self._pending[token]
                if not self._pending:
                    self._idle.notify_all()
        return False

    # --- control path -----------------------------------------------------------------

    def list_actions(self, context):
        return [
            ("health", "readiness, hosted shards, table fingerprint (JSON)"),
            ("stats", "rows, latency p50/p99, pending updates (JSON)"),
            ("set_step", '{"step": int} for every hosted shard'),
            ("checkpoint", '{"url": str, "step": int, "shard": int}: write one shard part'),
        ]

    def do_action(self, context, action):
        try:
            body = _wire.decode_json(action.body, f"action {action.type!r}")
            result = self._action(action.type, body)
        except _wire.WireError as error:
            self._counters["rejected"] += 1
            raise flight.FlightServerError(f"rejected: {error}") from None
        return [json.dumps(result, default=_json_default).encode()]

    def _action(self, kind: str, body: dict[str, Any]) -> Any:
        if kind == "health":
            return self.health()
        if kind == "stats":
            return self.stats()
        if self._draining.is_set():
            raise flight.FlightUnavailableError("embedding server is shutting down")
        if kind == "set_step":
            step = body.get("step")
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise _wire.WireError(f"set_step: 'step' must be an integer >= 0, got {step!r}")
            self._step = step
            for shard in self.shards.values():
                shard.set_step(step)
            return {"step": step}
        if kind == "checkpoint":
            url, step, index = body.get("url"), body.get("step"), body.get("shard")
            if not isinstance(url, str) or not url:
                raise _wire.WireError("checkpoint: 'url' must be a non-empty string")
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise _wire.WireError("checkpoint: 'step' must be an integer >= 0")
            if index not in self.shards:
                raise _wire.WireError(f"checkpoint: shard {index!r} is not hosted here")
            self.wait_idle()
            try:
                return self.shards[index].write_checkpoint(url, step, index)
            except UserError as error:
                raise flight.FlightServerError(f"checkpoint failed: {error}") from None
        raise _wire.WireError(f"unknown action {kind!r}")

    def health(self) -> dict[str, Any]:
        return {
            "ready": not self._draining.is_set(),
            "incarnation": self.incarnation,
            "shards": sorted(self.shards),
            "num_shards": self.num_shards,
            "tables": self.table_dims,
            "fingerprint": self.fingerprint,
            "restored_step": self.restored_step,
            "wire_version": _wire.WIRE_VERSION,
        }

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._pending)
            oldest = min(self._pending.values(), default=None)
        shard_stats = {str(index): shard.stats() for index, shard in self.shards.items()}
        return {
            "incarnation": self.incarnation,
            "uptime_s": time.time() - self.started,
            "step": self._step,
            "rows": sum(int(s.get("rows", 0)) for s in shard_stats.values()),
            "latency": {op: latency.summary() for op, latency in self._latency.items()},
            "pending_updates": pending,
            "oldest_pending_update_ms": 0.0
            if oldest is None
            else (time.monotonic() - oldest) * 1e3,
            "counters": dict(self._counters),
            "shards": shard_stats,
        }

    # --- lifecycle --------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no update is in flight; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout=timeout)

    def drain_and_stop(self, timeout: float = 60.0) -> None:
        """Refuses new requests, finishes in-flight ones, stops serving, closes shards."""
        self._draining.set()
        self.wait_idle(timeout)
        self.shutdown()  # blocks until the requests still running have returned
        for shard in self.shards.values():
            shard.close()


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def table_fingerprint(tables: Sequence[Any]) -> str:
    """A short digest of the table configs that clients and servers must agree on."""
    from hybridrec import config

    text = json.dumps([config.to_dict(table) for table in tables], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
