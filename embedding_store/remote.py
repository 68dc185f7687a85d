"""Remote shards: the `Shard` protocol over Arrow Flight, and server address lists.

`connect(addresses, tables)` asks every server which shards it hosts, checks that
together they host each of `num_shards` exactly once with the same table configs,
and returns one `RemoteShard` per shard index in order. Hand them to the store
and nothing else changes: routing stays `route_hash(id) % num_shards` in the
client, and every shard request is one Flight call carrying all its tables.

Example:
    shards = connect("10.0.0.5:7001,10.0.0.6:7001", tables, token=secret)
    store = EmbeddingStore(tables, num_shards=len(shards), shards=shards)

Faults: a call that cannot reach its server is retried with exponential backoff
until `retry_timeout` seconds have passed, then fails with `ServerUnavailableError`
naming the address. Updates carry (client id, sequence number), so an update whose
reply was lost is applied once when retried. When a server comes back as a new
process (restarted from its last checkpoint), the client notices the new
incarnation, logs what was lost and carries on.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow.flight as flight

from common.errors import UserError
from embedding_store import wire
from embedding_store._fingerprint import table_fingerprint
from embedding_store.columns import stored_tables
from embedding_store.config import TableConfig
from embedding_store.wire import AUTH_HEADER, TOKEN_ENV

DEFAULT_RETRY_TIMEOUT = 60.0
_RECENT_LOOKUPS = 16  # training lookups per shard whose ids an update may reuse

log = logging.getLogger(__name__)

# Errors that mean "the server is not there right now"; anything else is an answer.
_RETRYABLE = (flight.FlightUnavailableError, flight.FlightTimedOutError, ConnectionError)


def _send(client, options, descriptor, schema, batches):
    """Opens a DoExchange and writes every (record batch, table name) of one request.

    Returns the (writer, reader) pair; the caller reads the reply and closes the writer.
    """
    writer, reader = client.do_exchange(descriptor, options)
    try:
        writer.begin(schema)
        for batch, table in batches:
            writer.write_with_metadata(batch, table)
        writer.done_writing()
    except BaseException:
        writer.close()
        raise
    return writer, reader


class RemoteShardError(UserError):
    """A server refused a request, or the servers do not form a valid shard set."""


class ServerUnavailableError(RemoteShardError):
    """A server did not answer within the retry timeout."""


def parse_addresses(value: str | Sequence[str]) -> list[str]:
    """Normalizes "h1:p1,h2:p2" or a list of "host:port" / "grpc://host:port" strings.

    Returns:
        Flight URIs ("grpc://host:port"), in the given order.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    addresses = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        uri = item if "://" in item else f"grpc://{item}"
        host_port = uri.split("://", 1)[1]
        host, sep, port = host_port.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RemoteShardError(f"embedding server address {item!r} is not host:port")
        addresses.append(uri)
    if not addresses:
        raise RemoteShardError("the embedding server address list is empty")
    if len(set(addresses)) != len(addresses):
        raise RemoteShardError(f"embedding server address list repeats an address: {value!r}")
    return addresses


class ServerConnection:
    """One Flight client to one server, shared by the RemoteShards it hosts.

    Args:
        address: "grpc://host:port".
        token: shared secret, or None.
        retry_timeout: seconds to keep retrying an unreachable server before failing.
        call_timeout: seconds one attempt may take before it is abandoned and retried.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        call_timeout: float = 120.0,
    ):
        self.address = address
        self.retry_timeout = retry_timeout
        self._headers = [(AUTH_HEADER.encode(), f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(timeout=call_timeout, headers=self._headers)
        # Checkpoint writes and loads take as long as the shard is big: no per-attempt limit.
        self._slow_options = flight.FlightCallOptions(headers=self._headers)
        self._client = flight.FlightClient(address)
        self.client_id = uuid.uuid4().hex
        self._seq = 0
        self._lock = threading.Lock()
        self.health: dict[str, Any] = {}
        self._health_lock = threading.Lock()
        self.restarts = 0

    def next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def call(self, attempt, what: str):
        """Runs `attempt(client, options)`, retrying while the server is unreachable."""
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        failed = False
        while True:
            try:
                if failed:
                    self._check_incarnation()
                return attempt(self._client, self._options)
            except _RETRYABLE as error:
                failed = True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServerUnavailableError(
                        f"embedding server {self.address} did not answer {what} for "
                        f"{self.retry_timeout:g} s (retry_timeout): {_first_line(error)}"
                    ) from None
                log.debug("%s: %s failed (%s); retrying", self.address, what, error)
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 2.0)
            except flight.FlightUnauthenticatedError:
                raise RemoteShardError(
                    f"embedding server {self.address} refused the token "
                    f"(set the same secret on both sides, e.g. ${TOKEN_ENV})"
                ) from None
            except flight.FlightError as error:
                raise RemoteShardError(
                    f"embedding server {self.address}: {what}: {_first_line(error)}"
                ) from None

    def action(
        self,
        kind: str,
        body: Mapping[str, Any] | None = None,
        *,
        retry: bool = True,
        slow: bool = False,
    ):
        """Runs a control action; its JSON result."""
        payload = json.dumps(body or {}).encode()

        def attempt(client, options):
            options = self._slow_options if slow else options
            results = list(client.do_action(flight.Action(kind, payload), options))
            return json.loads(results[0].body.to_pybytes()) if results else None

        if not retry:
            return attempt(self._client, self._options)
        return self.call(attempt, kind)

    def handshake(self) -> dict[str, Any]:
        self.health = self.call(
            lambda client, options: json.loads(
                next(
                    iter(client.do_action(flight.Action("health", b""), options))
                ).body.to_pybytes()
            ),
            "health",
        )
        return self.health

    def _check_incarnation(self) -> None:
        """After a failure: if the server is a new process, say what that means and go on."""
        with self._health_lock:  # shards of one server may all notice at once: report once
            self._check_incarnation_locked()

    def _check_incarnation_locked(self) -> None:
        before = self.health
        health = self.action("health", retry=False)
        if before and health.get("incarnation") != before.get("incarnation"):
            self.restarts += 1
            layout = ("shards", "num_shards", "fingerprint")
            if any(health.get(key) != before.get(key) for key in layout):
                raise RemoteShardError(
                    f"embedding server {self.address} restarted with different shards or "
                    f"tables: {[health.get(k) for k in layout]} vs {[before.get(k) for k in layout]}"
                )
            restored = health.get("restored_step")
            if restored is None:
                log.warning(
                    "embedding server %s restarted without a checkpoint: every update to "
                    "shards %s is lost (rows start again from their initial values)",
                    self.address,
                    health.get("shards"),
                )
            else:
                log.warning(
                    "embedding server %s restarted from its checkpoint at step %s; updates "
                    "to shards %s since then are lost",
                    self.address,
                    restored,
                    health.get("shards"),
                )
        self.health = health

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


class RemoteShard:
    """One shard index hosted by a server, implementing the store's Shard protocol.

    Args:
        connection: the server's connection (shared with its other shards).
        index: global shard index.
        table_dims: table name -> dim, to shape lookup results.
    """

    def __init__(
        self,
        connection: ServerConnection,
        index: int,
        table_dims: Mapping[str, int],
        wire_dtype: str = "float32",
    ):
        self.connection = connection
        self.index = index
        self.table_dims = dict(table_dims)
        self.wire_dtype = wire_dtype
        self._step = -1  # the client's training step, sent with every request (-1: unset)
        # Recent training lookups (seq, {table: ids}): an update of the same ids names
        # the lookup and sends gradients only (the server kept the ids).
        self._recent: collections.deque[tuple[int, Mapping[str, np.ndarray]]] = collections.deque(
            maxlen=_RECENT_LOOKUPS
        )
        self._recent_lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.connection.address

    def lookup(
        self, requests: Mapping[str, np.ndarray], *, train: bool = True
    ) -> dict[str, np.ndarray]:
        """Rows for each table's ids, in one call: table -> [n, dim] float32."""
        if not requests:
            return {}
        header = wire.Header(
            op=wire.LOOKUP,
            shard=self.index,
            train=bool(train),
            step=self._step,
            dtype=self.wire_dtype,
            # A training lookup is remembered by the server under (client, seq).
            client=self.connection.client_id if train else "",
            seq=self.connection.next_seq() if train else 0,
        )
        descriptor = flight.FlightDescriptor.for_command(wire.encode_header(header))
        batches = list(wire.lookup_batches(requests))

        def attempt(client, options):
            writer, reader = _send(client, options, descriptor, wire.IDS_SCHEMA, batches)
            try:
                rows = {}
                for table, ids in requests.items():
                    chunk = reader.read_chunk()
                    view = wire.decode_values(
                        chunk.data,
                        chunk.app_metadata,
                        table,
                        len(ids),
                        self.table_dims[table],
                        self.wire_dtype,
                    )
                    # Writable, like the in-process shard's rows (at float32 one memcpy;
                    # the receive buffer itself is immutable).
                    rows[table] = view if view.flags.writeable else view.copy()
                return rows
            finally:
                writer.close()

        rows = self.connection.call(attempt, f"lookup on shard {self.index}")
        if train:
            with self._recent_lock:
                self._recent.append((header.seq, dict(requests)))
        return rows

    def _lookup_of(self, updates: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> int:
        """The seq of a recent training lookup of exactly these ids (then forgotten), or -1."""
        with self._recent_lock:
            for position in range(len(self._recent) - 1, -1, -1):
                seq, requests = self._recent[position]
                if requests.keys() == updates.keys() and all(
                    np.array_equal(requests[table], ids) for table, (ids, _) in updates.items()
                ):
                    del self._recent[position]
                    return seq
        return -1

    def apply_gradients(self, updates: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Sends every table's (ids [n], grads [n, dim]) in one call; returns once applied."""
        if not updates:
            return
        exponents = None
        if self.wire_dtype == "float16":
            exponents = {table: wire.gradient_exponent(g) for table, (_, g) in updates.items()}
        header = wire.Header(
            op=wire.APPLY,
            shard=self.index,
            client=self.connection.client_id,
            seq=self.connection.next_seq(),
            step=self._step,
            dtype=self.wire_dtype,
            lookup=self._lookup_of(updates),
            grad_exponents=exponents,
        )
        try:
            self._send_update(header, updates)
        except RemoteShardError as error:
            if header.lookup < 0 or wire.UNKNOWN_LOOKUP not in str(error):
                raise
            # The server forgot the lookup (restarted, or too many in flight): send the ids.
            self._send_update(dataclasses.replace(header, lookup=-1), updates)

    def _send_update(self, header: wire.Header, updates) -> None:
        descriptor = flight.FlightDescriptor.for_command(wire.encode_header(header))
        with_ids = header.lookup < 0
        schema = wire.apply_schema(header.dtype) if with_ids else wire.values_schema(header.dtype)
        batches = list(
            wire.apply_batches(
                updates, header.dtype, with_ids=with_ids, exponents=header.grad_exponents
            )
        )

        def attempt(client, options):
            writer, reader = _send(client, options, descriptor, schema, batches)
            try:
                chunk = reader.read_chunk()
                return wire.decode_json(chunk.app_metadata, "apply reply")
            finally:
                writer.close()

        self.connection.call(attempt, f"update on shard {self.index}")

    def set_step(self, step: int) -> None:
        """Remembers the step; every later request of this shard carries it (no extra call).

        The server applies it when it differs from the shard's current step, so a server
        restarted in the meantime learns the step from the next request.
        """
        self._step = int(step)

    def stats(self) -> dict[str, dict[str, int]]:
        """{table: counters} of this shard, as the in-process shard reports them."""
        return self.connection.action("shard_stats", {"shard": self.index, "step": self._step})

    def server_stats(self) -> dict[str, Any]:
        """The whole server's stats: rows, latency p50/p99, pending updates, counters."""
        return self.connection.action("stats")

    def write_checkpoint(
        self,
        url: str,
        step: int,
        shard_index: int,
        *,
        num_shards: int,
        full: bool,
        precision: str = "fp32",
    ) -> dict[str, dict[str, Any]]:
        """The server writes this shard's part of `step` straight to `url`."""
        self._check_index(shard_index)
        body = {
            "shard": self.index,
            "url": url,
            "step": int(step),
            "num_shards": int(num_shards),
            "full": bool(full),
            "precision": str(precision),
            "step_now": self._step,
        }
        return self.connection.action("checkpoint", body, slow=True)

    def commit_checkpoint(self, step: int) -> None:
        self.connection.action("commit_checkpoint", {"shard": self.index, "step": int(step)})

    def load_checkpoint(
        self, url: str, manifest: Mapping[str, Any], shard_index: int, num_shards: int
    ) -> dict[str, int]:
        """The server resets this shard and loads its rows of the checkpoint from `url`."""
        self._check_index(shard_index)
        body = {
            "shard": self.index,
            "url": url,
            "step": int(manifest["step"]),
            "num_shards": int(num_shards),
        }
        return self.connection.action("load_checkpoint", body, slow=True)

    def _check_index(self, shard_index: int) -> None:
        if shard_index != self.index:
            raise RemoteShardError(
                f"shard {self.index} at {self.address} was asked about shard {shard_index}"
            )

    def close(self) -> None:
        """Closes the client side only; the server keeps its rows for the next trainer."""
        self.connection.close()


def connect(
    addresses: str | Sequence[str],
    tables: Sequence[TableConfig],
    *,
    token: str | None = None,
    retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
    wire_dtype: str = "float32",
) -> list[RemoteShard]:
    """Connects to shard servers and returns their shards ordered by global index.

    Args:
        addresses: "host:port,..." or a list of "host:port" / "grpc://host:port".
        tables: the TableConfigs the client uses; every server must host the same.
        token: the shared secret, or None for no token.
        retry_timeout: seconds to wait for an unreachable server (also at startup).
        wire_dtype: float32 | bfloat16 | float16: how looked-up rows and gradients
            travel (the servers keep rows and run the optimizer in float32 either way).

    Raises:
        RemoteShardError: no addresses; a server unreachable within `retry_timeout`;
            servers disagreeing on the table configs or the shard count; a shard
            hosted twice or by no server.
    """
    if not addresses:
        raise RemoteShardError("no embedding server addresses (embedding.servers)")
    if wire_dtype not in wire.WIRE_DTYPES:
        raise RemoteShardError(
            f"embedding wire dtype {wire_dtype!r} is not one of {', '.join(wire.WIRE_DTYPES)}"
        )
    uris = parse_addresses(addresses)
    expected_fingerprint = table_fingerprint(tables)
    table_dims = {table.name: int(table.dim) for table in stored_tables(tables)}
    connections = [ServerConnection(uri, token=token, retry_timeout=retry_timeout) for uri in uris]
    owner: dict[int, ServerConnection] = {}
    num_shards = None
    try:
        for connection in connections:
            health = connection.handshake()
            where = f"embedding server {connection.address}"
            if health.get("fingerprint") != expected_fingerprint:
                raise RemoteShardError(
                    f"{where} hosts different table configs (fingerprint "
                    f"{health.get('fingerprint')}, tables {health.get('tables')}) than this "
                    f"client (fingerprint {expected_fingerprint}, tables {table_dims})"
                )
            if num_shards is None:
                num_shards = health["num_shards"]
            elif health["num_shards"] != num_shards:
                raise RemoteShardError(
                    f"{where} says num_shards={health['num_shards']}, "
                    f"{connections[0].address} says {num_shards}"
                )
            for index in health["shards"]:
                if index in owner:
                    raise RemoteShardError(
                        f"shard {index} is hosted by both {owner[index].address} and "
                        f"{connection.address}"
                    )
                owner[index] = connection
        missing = sorted(set(range(num_shards)) - set(owner))
        if missing:
            raise RemoteShardError(
                f"no server in {', '.join(uris)} hosts shard(s) {missing} of {num_shards}"
            )
    except BaseException:
        for connection in connections:
            connection.close()
        raise
    return [RemoteShard(owner[index], index, table_dims, wire_dtype) for index in range(num_shards)]
