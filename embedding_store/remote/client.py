"""Remote shards: the `Shard` protocol over Arrow Flight, and server address lists.

`connect(addresses, tables)` asks every server which shards it hosts, checks that
together they host each of `num_shards` exactly once with the same table configs,
and returns one `RemoteShard` per shard index in order. Hand them to the store
and nothing else changes: routing stays `route_hash(id) % num_shards` in the
client, and every shard request is one Flight call carrying all its tables.

Example:
    shards = connect("10.0.0.5:7001,10.0.0.6:7001", tables, token=secret)
    store = EmbeddingStore(tables, num_shards=len(shards), shards=shards)

TLS: `connect(..., tls=TLSFiles(ca="ca.pem"))` dials every server as grpc+tls://, verifies
its certificate against the CA and the host name, and sends the token only inside the
TLS channel; `cert` and `key` add a client certificate for servers that require one.

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
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow.flight as flight
from hybridrec.common.tls import TLSFiles
from hybridrec.embedding_store.columns import stored_tables
from hybridrec.embedding_store.config import TableConfig
from hybridrec.embedding_store.remote import wire, wire_rows
from hybridrec.embedding_store.remote._connection import (
    DEFAULT_RETRY_TIMEOUT,
    RemoteShardError,
    ServerConnection,
    ServerUnavailableError,
    parse_addresses,
)
from hybridrec.embedding_store.remote._fingerprint import table_fingerprint

__all__ = [
    "DEFAULT_RETRY_TIMEOUT",
    "RemoteShard",
    "RemoteShardError",
    "ServerConnection",
    "ServerUnavailableError",
    "ServerSet",
    "connect",
    "parse_addresses",
]

_RECENT_LOOKUPS = 16  # training lookups per shard whose ids an update may reuse


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


class RemoteShard:
    """One shard index hosted by a server, implementing the store's Shard protocol.

    Args:
        connection: the server's connection (shared with its other shards).
        index: global shard index.
        table_dims: table name -> dim, to shape lookup results.
        wire_dtype: how looked-up rows and gradients travel (see `connect`).
        row_shapes: table name -> (dim, optimizer-state width) of whole rows
            (`write_rows`, `take_rows`, `read_rows`).
    """

    def __init__(
        self,
        connection: ServerConnection,
        index: int,
        table_dims: Mapping[str, int],
        wire_dtype: str = "float32",
        row_shapes: Mapping[str, tuple[int, int]] | None = None,
    ):
        self.connection = connection
        self.index = index
        self.table_dims = dict(table_dims)
        self.row_shapes = dict(row_shapes or {})  # without: no whole-rows calls
        self.wire_dtype = wire_dtype
        self._step = -1  # the client's training step, sent with every request (-1: unset)
        # Recent training lookups (seq, {table: ids}): an update of the same ids names
        # the lookup and sends gradients only (the server kept the ids).
        self._recent: collections.deque[tuple[int, Mapping[str, np.ndarray]]] = collections.deque(
            maxlen=_RECENT_LOOKUPS
        )
        self._recent_lock = threading.Lock()
        # Payload bytes this client sent and received, per operation (what the server
        # counts as wire_bytes_*: Arrow buffers, headers, table names; no gRPC framing).
        self._wire_bytes: collections.Counter[str] = collections.Counter()

    @property
    def wire_bytes(self) -> dict[str, int]:
        """{"lookup_sent", "lookup_received", "apply_sent", "apply_received", and for whole
        rows "rows_sent", "rows_received"}: payload bytes of this client's calls that
        completed, retries of one call counted once."""
        with self._recent_lock:
            return dict(self._wire_bytes)

    def _count_bytes(self, op: str, descriptor, batches, received: int) -> None:
        sent = len(descriptor.command) + sum(batch.nbytes + len(table) for batch, table in batches)
        with self._recent_lock:
            self._wire_bytes[f"{op}_sent"] += sent
            self._wire_bytes[f"{op}_received"] += received

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
                rows, received = {}, 0
                for table, ids in requests.items():
                    chunk = reader.read_chunk()
                    received += chunk.data.nbytes + len(chunk.app_metadata or b"")
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
                return rows, received
            finally:
                writer.close()

        rows, received = self.connection.call(attempt, f"lookup on shard {self.index}")
        self._count_bytes("lookup", descriptor, batches, received)
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
        self._send_for_reply("apply", descriptor, schema, batches, f"update on shard {self.index}")

    def _send_for_reply(self, kind: str, descriptor, schema, batches, what: str) -> None:
        """Sends one request whose reply is a small JSON object (an update, written rows);
        counts its bytes under `kind` ("apply", "rows")."""

        def attempt(client, options):
            writer, reader = _send(client, options, descriptor, schema, batches)
            try:
                chunk = reader.read_chunk()
                wire.decode_json(chunk.app_metadata, f"{kind} reply")
                return len(chunk.app_metadata or b"")
            finally:
                writer.close()

        received = self.connection.call(attempt, what)
        self._count_bytes(kind, descriptor, batches, received)

    def write_rows(self, updates: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """See `Shard.write_rows`: one call; setting rows twice is harmless, so a call whose
        reply was lost is simply sent again."""
        if not updates:
            return
        header = wire.Header(op=wire.WRITE_ROWS, shard=self.index, step=self._step)
        descriptor = flight.FlightDescriptor.for_command(wire.encode_header(header))
        batches = list(wire_rows.rows_batches(updates))
        what = f"write_rows on shard {self.index}"
        self._send_for_reply("rows", descriptor, wire_rows.ROWS_SCHEMA, batches, what)

    def take_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See `Shard.take_rows`."""
        header = wire.Header(op=wire.TAKE_ROWS, shard=self.index, step=self._step)
        _, values, state = self._rows(header, table, list(wire.lookup_batches({table: ids})))
        if len(values) != len(ids):
            raise RemoteShardError(
                f"shard {self.index} at {self.address}: take_rows of {len(ids)} ids of table "
                f"{table!r} answered {len(values)} rows"
            )
        return values, state

    def read_rows(
        self, table: str, prefixes: Sequence[int] | None = None, prefix_bits: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """See `Shard.read_rows`."""
        header = wire.Header(
            op=wire.READ_ROWS,
            shard=self.index,
            step=self._step,
            table=table,
            prefixes=None if prefixes is None else tuple(int(p) for p in prefixes),
            prefix_bits=int(prefix_bits),
        )
        return self._rows(header, table, [])

    def _rows(self, header: wire.Header, table: str, batches) -> tuple[np.ndarray, ...]:
        """Sends a take_rows or read_rows request; (ids, values, state) of `table`."""
        descriptor = flight.FlightDescriptor.for_command(wire.encode_header(header))
        shapes = {table: self._row_shape(table)}

        def attempt(client, options):
            writer, reader = _send(client, options, descriptor, wire.IDS_SCHEMA, batches)
            try:
                chunks = [(chunk.data, chunk.app_metadata) for chunk in reader]
                received = sum(data.nbytes + len(meta or b"") for data, meta in chunks)
                return wire_rows.decode_rows(chunks, reader.schema, shapes), received
            finally:
                writer.close()

        rows, received = self.connection.call(attempt, f"{header.op} on shard {self.index}")
        self._count_bytes("rows", descriptor, batches, received)
        dim, width = shapes[table]
        empty = (np.zeros(0, np.uint64), np.zeros((0, dim), np.float32))
        return rows.get(table, (*empty, np.zeros((0, width), np.float32)))

    def _row_shape(self, table: str) -> tuple[int, int]:
        if table not in self.row_shapes:
            raise RemoteShardError(f"shard {self.index} at {self.address}: no table {table!r}")
        return self.row_shapes[table]

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


@dataclasses.dataclass(frozen=True)
class ServerSet:
    """A run's remote shard servers and how to reach them (what `connect` takes).

    Attributes:
        addresses: Flight URIs ("grpc://host:port"); empty: in-process shards.
        source: where the addresses came from (a config key or an environment
            variable, for messages), or "" when there are none.
        token: the shared secret, or None for no token.
        retry_timeout: seconds to keep retrying an unreachable server.
    """

    addresses: tuple[str, ...] = ()
    source: str = ""
    token: str | None = None
    retry_timeout: float = DEFAULT_RETRY_TIMEOUT


def connect(
    addresses: str | Sequence[str],
    tables: Sequence[TableConfig],
    *,
    token: str | None = None,
    tls: TLSFiles | None = None,
    retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
    wire_dtype: str = "float32",
) -> list[RemoteShard]:
    """Connects to shard servers and returns their shards ordered by global index.

    Args:
        addresses: "host:port,..." or a list of "host:port" / "grpc://host:port".
        tables: the TableConfigs the client uses; every server must host the same.
        token: the shared secret, or None for no token.
        tls: the CA that signs the servers' certificates and, for servers that require
            one, this client's certificate and key; None: plaintext (unless an address
            is grpc+tls://, verified against the system's CAs).
        retry_timeout: seconds to wait for an unreachable server (also at startup).
        wire_dtype: float32 | bfloat16 | float16: how looked-up rows and gradients
            travel (the servers keep rows and run the optimizer in float32 either way).

    Raises:
        RemoteShardError: no addresses; a server unreachable within `retry_timeout`;
            servers disagreeing on the table configs or the shard count; a shard
            hosted twice or by no server; a TLS handshake refused by either side.
        UserError: a TLS file is missing or unreadable; a plaintext address with `tls`.
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
    row_shapes = {
        table.name: (int(table.dim), table.optimizer.state_width(table.dim))
        for table in stored_tables(tables)
    }
    if tls is not None:
        tls.check_client()
    connections = []
    try:
        for uri in uris:
            connections.append(
                ServerConnection(uri, token=token, tls=tls, retry_timeout=retry_timeout)
            )
    except BaseException:
        for connection in connections:
            connection.close()
        raise
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
    return [
        RemoteShard(owner[index], index, table_dims, wire_dtype, row_shapes)
        for index in range(num_shards)
    ]
