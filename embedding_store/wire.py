"""Wire format of remote embedding shards: Arrow record batches over Arrow Flight.

One shard request is one Flight `DoExchange` call. Its descriptor command is a
small JSON header (operation, shard index, client id, sequence number); the body
is one record batch per table, named by the batch's `app_metadata`. The float and
id arrays are Arrow buffers end to end: numpy arrays are wrapped without copying
on the sending side and viewed without copying on the receiving side. Nothing on
the wire is pickled, and floats never pass through JSON.

The header may carry the training step (`set_step` of the client), so that a step
costs one call per shard for lookups and one for updates, nothing more.

Streams (version 1):

    lookup request    schema {ids: uint64}                      one batch per table
    lookup response   schema {values: float32}                  one batch per table,
                                                                n * dim values, row-major
    apply request     schema {ids: uint64, grads: list<float32>}  one batch per table,
                                                                each list exactly dim long
    apply response    metadata only: JSON {"applied": rows, "duplicate": bool}

Control calls (health, stats, set_step, checkpoint, commit_checkpoint,
load_checkpoint) are Flight actions whose bodies and results are small JSON objects.

Decoding validates everything a peer controls (header fields, schema, table
names, sizes, list offsets, nulls) and raises `WireError` before any state is
touched, so a malformed or oversized request is rejected as a whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

WIRE_VERSION = 1

LOOKUP = "lookup"
APPLY = "apply"
OPERATIONS = (LOOKUP, APPLY)

IDS_SCHEMA = pa.schema([pa.field("ids", pa.uint64(), nullable=False)])
VALUES_SCHEMA = pa.schema([pa.field("values", pa.float32(), nullable=False)])
APPLY_SCHEMA = pa.schema(
    [
        pa.field("ids", pa.uint64(), nullable=False),
        pa.field("grads", pa.list_(pa.field("item", pa.float32(), nullable=False)), nullable=False),
    ]
)

# The shared secret: its environment variable and the header that carries it.
TOKEN_ENV = "HYBRIDREC_EMBEDDING_TOKEN"
AUTH_HEADER = "authorization"

# Upper bound on a JSON header or action body; real ones are a few hundred bytes.
MAX_HEADER_BYTES = 64 * 1024
MAX_CLIENT_ID_CHARS = 128


class WireError(ValueError):
    """A request or response that does not follow the wire format or its limits."""


@dataclass(frozen=True)
class Header:
    """The descriptor command of one shard request.

    Attributes:
        op: "lookup" or "apply".
        shard: global shard index the request is for.
        client: identity of the sending client (random per client object).
        seq: per-client sequence number; (client, seq) makes an apply idempotent.
        train: lookup only: count sightings and admit new ids (False for evaluation).
        step: the training step to set on the shard before this request, or -1 for none
            (`set_step` rides on the next data request instead of costing a call).
    """

    op: str
    shard: int
    client: str = ""
    seq: int = 0
    train: bool = True
    step: int = -1


def encode_header(header: Header) -> bytes:
    return json.dumps(
        {
            "v": WIRE_VERSION,
            "op": header.op,
            "shard": header.shard,
            "client": header.client,
            "seq": header.seq,
            "train": header.train,
            "step": header.step,
        }
    ).encode()


def decode_json(raw: bytes | memoryview | pa.Buffer | None, what: str) -> dict[str, Any]:
    """Parses a small JSON object sent by a peer, with a size bound."""
    data = b"" if raw is None else bytes(raw)
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"{what}: {len(data)} bytes, more than the {MAX_HEADER_BYTES} allowed")
    try:
        value = json.loads(data.decode("utf-8")) if data else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"{what}: not a JSON object ({error})") from None
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def _int_field(data: Mapping[str, Any], key: str, what: str, *, minimum: int = 0) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WireError(f"{what}: field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def decode_header(raw: bytes | pa.Buffer | None) -> Header:
    data = decode_json(raw, "request header")
    if data.get("v") != WIRE_VERSION:
        raise WireError(
            f"request header: wire version {data.get('v')!r}, this server speaks {WIRE_VERSION}"
        )
    op = data.get("op")
    if op not in OPERATIONS:
        raise WireError(f"request header: unknown operation {op!r}")
    client = data.get("client", "")
    if not isinstance(client, str) or len(client) > MAX_CLIENT_ID_CHARS:
        raise WireError("request header: 'client' must be a short string")
    train = data.get("train", True)
    if not isinstance(train, bool):
        raise WireError("request header: 'train' must be true or false")
    return Header(
        op=op,
        train=train,
        shard=_int_field(data, "shard", "request header"),
        client=client,
        seq=_int_field(data, "seq", "request header"),
        step=_int_field(data, "step", "request header", minimum=-1) if "step" in data else -1,
    )


def _check_ids(ids: np.ndarray, where: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype != np.uint64 or ids.ndim != 1:
        raise WireError(f"{where}: ids must be a 1-D uint64 array, got {ids.dtype} {ids.shape}")
    return ids


# --- request encoding (client side) -------------------------------------------------------


def lookup_batches(requests: Mapping[str, np.ndarray]) -> Iterable[tuple[pa.RecordBatch, bytes]]:
    """Yields (record batch, table name) for a multi-table lookup request."""
    for table, ids in requests.items():
        ids = np.ascontiguousarray(_check_ids(ids, f"table {table!r}"))
        yield pa.record_batch([pa.array(ids, type=pa.uint64())], schema=IDS_SCHEMA), table.encode()


def apply_batches(
    updates: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> Iterable[tuple[pa.RecordBatch, bytes]]:
    """Yields (record batch, table name) for a multi-table gradient update.

    Args:
        updates: table -> (ids [n] uint64, grads [n, dim] float32).
    """
    for table, (ids, grads) in updates.items():
        ids = np.ascontiguousarray(_check_ids(ids, f"table {table!r}"))
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.ndim != 2 or grads.shape[0] != ids.shape[0]:
            raise WireError(
                f"table {table!r}: grads must be [{ids.shape[0]}, dim], got {grads.shape}"
            )
        dim = grads.shape[1]
        offsets = pa.array(np.arange(ids.shape[0] + 1, dtype=np.int32) * np.int32(dim))
        lists = pa.ListArray.from_arrays(offsets, pa.array(grads.reshape(-1)))
        batch = pa.record_batch([pa.array(ids, type=pa.uint64()), lists], schema=APPLY_SCHEMA)
        yield batch, table.encode()


def values_batch(rows: np.ndarray) -> pa.RecordBatch:
    """One lookup-response batch: rows [n, dim] float32, flattened without a copy."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    return pa.record_batch([pa.array(rows.reshape(-1))], schema=VALUES_SCHEMA)


# --- request decoding (server side) -------------------------------------------------------


class RequestLimits:
    """Per-request bounds a server enforces while it reads a request.

    Args:
        max_rows: most ids in one request, summed over tables.
        max_bytes: most body bytes in one request.
    """

    def __init__(self, *, max_rows: int, max_bytes: int):
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.rows = 0
        self.bytes = 0

    def charge(self, rows: int, nbytes: int) -> None:
        self.rows += rows
        self.bytes += nbytes
        if self.rows > self.max_rows:
            raise WireError(f"request too large: more than {self.max_rows} ids")
        if self.bytes > self.max_bytes:
            raise WireError(f"request too large: more than {self.max_bytes} bytes")


def _table_name(metadata: pa.Buffer | None, dims: Mapping[str, int], seen: set[str]) -> str:
    if metadata is None:
        raise WireError("record batch without a table name in its app_metadata")
    try:
        table = bytes(metadata).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("table name is not UTF-8") from None
    if table not in dims:
        shown = table if len(table) <= 64 else table[:64] + "..."
        raise WireError(f"unknown table {shown!r}; this server hosts {sorted(dims)}")
    if table in seen:
        raise WireError(f"table {table!r} appears twice in one request")
    seen.add(table)
    return table


def _column_numpy(column: pa.Array, dtype: np.dtype, where: str) -> np.ndarray:
    if column.null_count:
        raise WireError(f"{where}: nulls are not allowed")
    return column.to_numpy(zero_copy_only=True).astype(dtype, copy=False)


def decode_lookup(
    chunks: Iterable[tuple[pa.RecordBatch, pa.Buffer | None]],
    schema: pa.Schema,
    dims: Mapping[str, int],
    limits: RequestLimits,
) -> dict[str, np.ndarray]:
    """Reads a lookup request into table -> ids [n] uint64, validating all of it."""
    if not schema.equals(IDS_SCHEMA):
        raise WireError(f"lookup request schema must be {IDS_SCHEMA}, got {schema}")
    requests: dict[str, np.ndarray] = {}
    for batch, metadata in chunks:
        table = _table_name(metadata, dims, set(requests))
        limits.charge(batch.num_rows, batch.nbytes)
        requests[table] = _column_numpy(batch.column(0), np.uint64, f"table {table!r} ids")
    return requests


def decode_apply(
    chunks: Iterable[tuple[pa.RecordBatch, pa.Buffer | None]],
    schema: pa.Schema,
    dims: Mapping[str, int],
    limits: RequestLimits,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Reads an update into table -> (ids [n] uint64, grads [n, dim] float32), validated."""
    if not schema.equals(APPLY_SCHEMA):
        raise WireError(f"apply request schema must be {APPLY_SCHEMA}, got {schema}")
    updates: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for batch, metadata in chunks:
        table = _table_name(metadata, dims, set(updates))
        limits.charge(batch.num_rows, batch.nbytes)
        dim = dims[table]
        ids = _column_numpy(batch.column(0), np.uint64, f"table {table!r} ids")
        lists = batch.column(1)
        if lists.null_count:
            raise WireError(f"table {table!r} grads: nulls are not allowed")
        offsets = lists.offsets.to_numpy(zero_copy_only=True)
        expected = np.int64(offsets[0]) + np.arange(len(ids) + 1, dtype=np.int64) * dim
        if offsets.shape != expected.shape or not np.array_equal(offsets, expected):
            raise WireError(f"table {table!r} grads: every gradient must have dim {dim}")
        values = lists.values.slice(int(offsets[0]), len(ids) * dim)
        flat = _column_numpy(values, np.float32, f"table {table!r} grads")
        updates[table] = (ids, flat.reshape(len(ids), dim))
    return updates


# --- response decoding (client side) ------------------------------------------------------


def decode_values(
    batch: pa.RecordBatch, metadata: pa.Buffer | None, table: str, n: int, dim: int
) -> np.ndarray:
    """One lookup-response batch as rows [n, dim] float32.

    A view of the received buffer (no copy): read-only. Callers that hand the rows
    on as their own result copy them.
    """
    if metadata is None or bytes(metadata).decode("utf-8", "replace") != table:
        raise WireError(f"lookup response out of order: expected table {table!r}")
    if not batch.schema.equals(VALUES_SCHEMA) or batch.num_rows != n * dim:
        raise WireError(
            f"lookup response for table {table!r}: expected {n} x {dim} float32 values, "
            f"got {batch.num_rows} of {batch.schema}"
        )
    return _column_numpy(batch.column(0), np.float32, table).reshape(n, dim)
