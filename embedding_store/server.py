"""`hybridrec serve-embeddings`: embedding shards behind an Arrow Flight server.

A server hosts one or more shards (global indices out of `num_shards`) of one set
of tables. Each shard is the same in-process `Shard` the embedded store uses; the
server only adds the transport: one `DoExchange` per shard request carrying every
table's ids (see `_wire`), Flight actions for control, a shared-secret token,
request limits, latency statistics and a graceful drain on SIGTERM.

Example:
    hybridrec serve-embeddings --tables tables.toml --num-shards 4 --shards 0,1 --port 7001

From Python, `start_server_process` / `start_servers` (re-exported from `_processes`)
start servers as subprocesses and wait until they serve.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.flight as flight

from common import config
from common.errors import UserError
from common.progress import Progress
from embedding_store import _wire
from embedding_store._processes import (
    ServerProcess,
    contiguous_shards,
    start_server_process,
    start_servers,
    stop_servers,
)
from embedding_store._wire import AUTH_HEADER, TOKEN_ENV
from embedding_store.checkpoint import latest_checkpoint_step, read_manifest
from embedding_store.config import TableConfig
from embedding_store.errors import EmbeddingStoreError
from embedding_store.shard import LocalShard
from embedding_store.store import _check_compatible
from hybridrec import _flags  # moves with main() to the command layer

__all__ = [
    "ServerProcess",
    "ShardServer",
    "contiguous_shards",
    "load_tables",
    "main",
    "parse_shard_list",
    "start_server_process",
    "start_servers",
    "stop_servers",
    "table_fingerprint",
    "training_tables",
]

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
        self._lock = threading.Lock()
        self.count = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)
            self.count += 1

    def summary(self) -> dict[str, float]:
        with self._lock:
            count, samples = self.count, np.array(self._samples, dtype=np.float64) * 1e3
        if not len(samples):
            return {"count": count, "p50_ms": 0.0, "p99_ms": 0.0}
        p50, p99 = np.percentile(samples, [50, 99])
        return {"count": count, "p50_ms": float(p50), "p99_ms": float(p99)}


class ShardServer(flight.FlightServerBase):
    """An Arrow Flight server hosting some shards of one table set.

    Args:
        tables: the table configs (every client must use the same).
        shard_indices: global indices of the shards hosted here.
        num_shards: total shards of the table set across all servers.
        location: e.g. "grpc://127.0.0.1:0" (port 0 picks a free port).
        token: shared secret every call must present, or None for no check.
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
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS,
        restore: str | None = None,
        restore_step: int | None = None,
    ):
        self.tables = tuple(tables)
        self.num_shards = num_shards
        self.table_dims = {table.name: int(table.dim) for table in self.tables}
        self.fingerprint = table_fingerprint(self.tables)
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
        self._latency = {op: _Latency() for op in _wire.OPERATIONS}
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
        middleware = {"token": _TokenMiddlewareFactory(token)} if token else None
        super().__init__(location, middleware=middleware)  # serving starts here

    def _new_shard(self, index: int) -> LocalShard:
        return LocalShard(self.tables, shard_index=index, num_shards=self.num_shards)

    def _load(self, index: int, url: str, step: int) -> dict[str, int]:
        """Replaces shard `index` by a fresh one holding its rows of checkpoint `step`."""
        manifest = read_manifest(url, step)
        _check_compatible(url, manifest, self.tables)
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
            header = _wire.decode_header(descriptor.command)
            shard = self._shard(header.shard)
            if header.step >= 0:
                self._set_step(header.shard, header.step)
            limits = _wire.RequestLimits(
                max_rows=self.max_request_rows, max_bytes=self.max_request_bytes
            )
            chunks = ((chunk.data, chunk.app_metadata) for chunk in reader)
            if header.op == _wire.LOOKUP:
                requests = _wire.decode_lookup(chunks, reader.schema, self.table_dims, limits)
                rows = shard.lookup(requests, train=header.train)
                writer.begin(_wire.VALUES_SCHEMA)
                for table in requests:
                    writer.write_with_metadata(_wire.values_batch(rows[table]), table.encode())
                self._count("rows_looked_up", limits.rows)
            else:
                updates = _wire.decode_apply(chunks, reader.schema, self.table_dims, limits)
                duplicate = self._apply_once(shard, header, updates)
                applied = 0 if duplicate else limits.rows
                writer.write_metadata(
                    json.dumps({"applied": applied, "duplicate": duplicate}).encode()
                )
                self._count("rows_applied", applied)
        except (_wire.WireError, EmbeddingStoreError) as error:
            self._count("rejected")
            raise flight.FlightServerError(f"rejected: {error}") from None
        except flight.FlightError:
            self._count("rejected")
            raise
        self._count(f"{header.op}_requests")
        self._latency[header.op].add(time.perf_counter() - start)

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
            raise _wire.WireError(f"field {key!r} must be an integer >= -1, got {step!r}")
        if step >= 0:
            self._set_step(index, step)

    def _shard(self, index: Any) -> LocalShard:
        shard = self.shards.get(index) if isinstance(index, int) else None
        if shard is None:
            raise _wire.WireError(
                f"shard {index!r} is not hosted here (hosted: {sorted(self.shards)})"
            )
        return shard

    def _apply_once(self, shard, header: _wire.Header, updates) -> bool:
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
                token = self._next_pending
                self._next_pending += 1
                self._pending[token] = time.monotonic()
        if duplicate:
            done.wait()
            self._count("duplicates")
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
            ("shard_stats", '{"shard"}: the shard\'s per-table counters'),
            ("set_step", '{"shard", "step"}'),
            ("checkpoint", '{"shard", "url", "step", "num_shards", "full"}: write a part'),
            ("commit_checkpoint", '{"shard", "step"}: the manifest of step is committed'),
            ("load_checkpoint", '{"shard", "url", "step", "num_shards"}: reset, then load'),
        ]

    def do_action(self, context, action):
        try:
            body = _wire.decode_json(action.body, f"action {action.type!r}")
            result = self._action(action.type, body)
        except (_wire.WireError, EmbeddingStoreError) as error:
            self._count("rejected")
            raise flight.FlightServerError(f"rejected: {error}") from None
        return [json.dumps(result, default=_json_default).encode()]

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
            self._set_step(index, _field(body, "step", int))
            return {}
        if kind == "checkpoint":
            index = body.get("shard")
            shard = self._shard(index)
            url, step = _field(body, "url", str), _field(body, "step", int)
            self._check_num_shards(_field(body, "num_shards", int))
            self._step_from(index, body, "step_now")
            self.wait_idle()
            return shard.write_checkpoint(
                url, step, index, num_shards=self.num_shards, full=_field(body, "full", bool)
            )
        if kind == "commit_checkpoint":
            self._shard(body.get("shard")).commit_checkpoint(_field(body, "step", int))
            return {}
        if kind == "load_checkpoint":
            index = body.get("shard")
            self._shard(index)
            self._check_num_shards(_field(body, "num_shards", int))
            self.wait_idle()
            return self._load(index, _field(body, "url", str), _field(body, "step", int))
        raise _wire.WireError(f"unknown action {kind!r}")

    def _check_num_shards(self, num_shards: int) -> None:
        if num_shards != self.num_shards:
            raise _wire.WireError(
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
            "wire_version": _wire.WIRE_VERSION,
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


def _field(body: Mapping[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    valid = isinstance(value, kind) and (kind is not int or not isinstance(value, bool))
    if kind is int:
        valid = valid and value >= 0
    if kind is str:
        valid = valid and bool(value)
    if not valid:
        raise _wire.WireError(f"field {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def table_fingerprint(tables: Sequence[TableConfig]) -> str:
    """A short digest of the table configs clients and servers must agree on (any order).

    Tiering is left out: where a server keeps its cold rows is its own business.
    """
    configs = sorted(
        ({k: v for k, v in config.to_dict(table).items() if k != "tiering"} for table in tables),
        key=lambda t: t["name"],
    )
    text = json.dumps(configs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- command line -------------------------------------------------------------------------


def parse_shard_list(text: str, num_shards: int) -> list[int]:
    """ "0,1,5" or "0-3" or "0-3,8" -> sorted shard indices, each in [0, num_shards)."""
    indices: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            span = range(int(first), int(last) + 1) if sep else range(int(first), int(first) + 1)
        except ValueError:
            raise UserError(f"--shards: {part!r} is not an index or a range like 0-3") from None
        if not span:
            raise UserError(f"--shards: empty range {part!r}")
        indices.update(span)
    if not indices:
        raise UserError("--shards: no shard index given")
    bad = sorted(i for i in indices if not 0 <= i < num_shards)
    if bad:
        raise UserError(f"--shards: {bad} outside 0..{num_shards - 1} (--num-shards {num_shards})")
    return sorted(indices)


def _server_index(text: str) -> int:
    """An integer, or "auto": $HYBRIDREC_SERVER_INDEX, else the hostname's trailing ordinal
    (a Kubernetes StatefulSet pod is named <set>-<ordinal>)."""
    if text != "auto":
        try:
            return int(text)
        except ValueError:
            raise UserError(f"--server-index: {text!r} is not an integer or 'auto'") from None
    env = os.environ.get("HYBRIDREC_SERVER_INDEX", "")
    if env.isdigit():
        return int(env)
    hostname = socket.gethostname()
    ordinal = hostname.rsplit("-", 1)[-1]
    if not ordinal.isdigit():
        raise UserError(
            f"--server-index auto: $HYBRIDREC_SERVER_INDEX is unset and hostname {hostname!r} "
            "does not end in -<ordinal>"
        )
    return int(ordinal)


def _read_token(path: str | None) -> str | None:
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as error:
            raise UserError(f"--token-file {path}: {error.strerror}") from None
        if not token:
            raise UserError(f"--token-file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridrec serve-embeddings",
        description="Host embedding shards behind an Arrow Flight server.",
    )
    parser.add_argument(
        "--tables",
        help="table configs: a TOML or JSON file (or preset name) with a list of tables",
    )
    parser.add_argument(
        "--config",
        help="or: the training preset (with --data): the tables `hybridrec train` would build",
    )
    parser.add_argument("--data", help="with --config: preprocessed data dir (its feature spec)")
    _flags.add_override_flag(
        parser, "with --config: a training config override, e.g. embedding.dim=32"
    )
    parser.add_argument("--num-shards", type=int, help="total shards across all servers")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--shards", help='shard indices hosted here: "0,1" or "0-3"')
    which.add_argument(
        "--server-index",
        help='this server\'s index for a contiguous split ("auto": env or StatefulSet ordinal)',
    )
    parser.add_argument("--num-servers", type=int, help="servers sharing --num-shards")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 to accept remote clients)"
    )
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: pick a free one)")
    parser.add_argument(
        "--token-file", help=f"file holding the shared secret (default: ${TOKEN_ENV}, else none)"
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=DEFAULT_MAX_REQUEST_BYTES / 2**20,
        help="largest request body accepted, MiB",
    )
    parser.add_argument(
        "--max-request-rows",
        type=int,
        default=DEFAULT_MAX_REQUEST_ROWS,
        help="most ids in one request",
    )
    parser.add_argument(
        "--restore",
        metavar="URL",
        help="checkpoint URL to load the hosted shards from (latest step; none yet: start empty)",
    )
    parser.add_argument("--restore-step", type=int, help="restore this step instead of latest")
    parser.add_argument(
        "--ready-file", help="write {address, pid, shards} as JSON here once serving"
    )
    parser.add_argument(
        "--stats-interval", type=float, default=30.0, help="seconds between stats lines"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM, seconds to wait for in-flight updates before stopping",
    )
    parser.add_argument(
        "--check",
        metavar="ADDRESS",
        help="probe a running server (host:port): exit 0 if ready, 1 if not",
    )
    parser.add_argument(
        "--stats",
        metavar="ADDRESS",
        help="print a running server's stats as JSON (rows, latency p50/p99, pending updates)",
    )
    return parser


def _probe(address: str, token: str | None, action: str) -> int:
    """`--check` / `--stats`: one action against a running server, printed as JSON."""
    from embedding_store.remote import ServerConnection, parse_addresses

    connection = ServerConnection(parse_addresses(address)[0], token=token, retry_timeout=0.0)
    try:
        result = connection.action(action, retry=False)
    except flight.FlightError as error:
        print(f"not ready: {error}", file=sys.stderr)
        return 1
    finally:
        connection.close()
    print(json.dumps(result, indent=None if action == "health" else 1))
    return 0 if action != "health" or result.get("ready") else 1


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    token = _read_token(args.token_file)
    if args.check or args.stats:
        return _probe(args.check or args.stats, token, "health" if args.check else "stats")
    if bool(args.tables) == bool(args.config) or not args.num_shards:
        raise UserError(
            "give --num-shards and one of --tables FILE or --config PRESET (or --check ADDRESS)"
        )
    if args.num_shards < 1:
        raise UserError(f"--num-shards must be >= 1, got {args.num_shards}")
    if args.shards:
        indices = parse_shard_list(args.shards, args.num_shards)
    elif args.server_index is not None:
        if not args.num_servers:
            raise UserError("--server-index needs --num-servers")
        indices = contiguous_shards(
            _server_index(args.server_index), args.num_servers, args.num_shards
        )
    else:
        indices = list(range(args.num_shards))
    if args.tables:
        tables = load_tables(args.tables)
    else:
        tables = training_tables(args.config, args.data, args.overrides)
    server = ShardServer(
        tables,
        indices,
        num_shards=args.num_shards,
        location=f"grpc://{args.host}:{args.port}",
        token=token,
        max_request_bytes=int(args.max_request_mb * 2**20),
        max_request_rows=args.max_request_rows,
        restore=args.restore,
        restore_step=args.restore_step,
    )
    return _serve(server, args)


def _serve(server: ShardServer, args: argparse.Namespace) -> int:
    stop = threading.Event()

    def request_stop(*_):
        stop.set()
        # A second signal during the drain (or while the interpreter exits, when Python
        # restores default handlers) must not kill the process half-way: ignore it.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, request_stop)
    # A wildcard bind is reachable on loopback; that is what local launchers connect to.
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    address = f"{host}:{server.port}"
    restored = (
        f", restored from step {server.restored_step}" if server.restored_step is not None else ""
    )
    print(
        f"[serve-embeddings] serving shards {sorted(server.shards)} of {server.num_shards} "
        f"on {address}{restored}; token {'required' if server.token_required else 'off'}",
        file=sys.stderr,
        flush=True,
    )
    if args.ready_file:
        ready = Path(args.ready_file)
        temporary = ready.with_name(ready.name + ".tmp")
        temporary.write_text(
            json.dumps({"address": address, "pid": os.getpid(), "shards": sorted(server.shards)})
        )
        temporary.replace(ready)  # atomic: a reader never sees half a file
    progress = Progress("serve-embeddings", unit="requests", interval=0.0)
    seen = 0
    while not stop.wait(args.stats_interval):
        try:
            stats = server.stats()
        except Exception as error:  # noqa: BLE001 - a stats line must never stop the server
            print(f"[serve-embeddings] stats unavailable: {error}", file=sys.stderr, flush=True)
            continue
        requests = sum(latency["count"] for latency in stats["latency"].values())
        progress.update(
            requests - seen,
            rows=stats["rows"],
            lookup_p99_ms=stats["latency"]["lookup"]["p99_ms"],
            apply_p99_ms=stats["latency"]["apply"]["p99_ms"],
            pending=stats["pending_updates"],
        )
        seen = requests
    print("[serve-embeddings] stopping: finishing in-flight updates", file=sys.stderr, flush=True)
    server.drain_and_stop(args.drain_timeout)
    stats = server.stats()
    progress.count = sum(latency["count"] for latency in stats["latency"].values())
    progress.close(rows=stats["rows"], rejected=stats["counters"].get("rejected", 0))
    return 0


def load_tables(source: str | Path) -> list[Any]:
    """Reads TableConfigs from a TOML/JSON file or preset name.

    The file holds a list of tables either at the top level (`[[tables]]`) or in a
    section (`[[embedding.tables]]`, e.g. a whole training preset).
    """
    path = Path(source)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: no such table config file") from None
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: invalid JSON: {error}") from None
    else:
        path = config.resolve_preset(source)
        data = config.read_toml(path)
    found = [("tables", data.get("tables"))] if isinstance(data, dict) else []
    if isinstance(data, dict):
        found += [
            (f"{key}.tables", value["tables"])
            for key, value in data.items()
            if isinstance(value, dict) and "tables" in value
        ]
    found = [(where, value) for where, value in found if value is not None]
    if isinstance(data, list):
        found = [("", data)]
    if len(found) != 1 or not isinstance(found[0][1], list) or not found[0][1]:
        raise UserError(
            f"{path}: expected exactly one non-empty list of tables "
            "(`[[tables]]` or `[[<section>.tables]]`)"
        )
    where, items = found[0]
    tables = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise UserError(f"{path}: {where}[{i}] is not a table")
        try:
            tables.append(config.from_dict(TableConfig, item, where=f"{where}[{i}]"))
        except UserError as error:
            raise UserError(f"{path}: {error}") from None
    names = [table.name for table in tables]
    if len(set(names)) != len(names):
        raise UserError(f"{path}: table names repeat: {names}")
    return tables


def training_tables(preset: str, data: str | None, overrides: Sequence[str]) -> list[TableConfig]:
    """The TableConfigs `hybridrec train --config preset --data data` builds, in its order:
    one per table named by the dataset's feature spec, from the `[embedding]` section."""
    from pipeline import read_metadata
    from training.config import PRESET_DIR, TrainConfig

    overrides = list(overrides)
    if data:
        overrides.append(f"data.path={json.dumps(str(data))}")
    train_config = config.load(TrainConfig, preset, overrides, preset_dir=PRESET_DIR)
    if not train_config.data.path:
        raise UserError("--config needs --data (or data.path in the preset): it names the tables")
    metadata = read_metadata(train_config.data.path)
    names = dict.fromkeys(feature.table for feature in metadata.categorical)
    return [train_config.embedding.table(name) for name in names]
