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
    lookup response   schema {values: T}                        one batch per table,
                                                                n * dim values, row-major
    apply request     schema {ids: uint64, grads: list<T>}      one batch per table,
                                                                each list exactly dim long
                  or  schema {grads: T}                         n * dim values, row-major,
                                                                for the ids of a lookup
    apply response    metadata only: JSON {"applied": rows, "duplicate": bool}

Whole rows with their optimizer state, for the tables and hot-row caches trained on the
devices (always float32: they are the rows themselves, not updates to them):

    write_rows request    schema ROWS {ids: uint64, values: list<float32>,
                          state: list<float32>}, batches named by table (a table's
                          rows may span several); lists exactly dim and state-width long
    write_rows response   metadata only: JSON {"written": rows}
    take_rows request     schema {ids: uint64}, one batch per table (unique ids)
    take_rows response    schema ROWS, the rows of the request's ids in its order
    read_rows request     no batches: the header names `table`, and `prefixes` with
                          `prefix_bits` to pick one feature's rows of a fused table
    read_rows response    schema ROWS, in batches of at most ROWS_PER_BATCH rows
                          (their encoding: `wire_rows`)

`T` is the header's wire dtype (`dtype`): float32 (default), float16, or bfloat16 sent
as its 16 raw bits (uint16; Arrow has no bfloat16). Gradients sent as float16 are
multiplied by 2^e per table (`grad_exponents`, chosen by the client so the largest
fits) and divided again on the server, so small gradients do not underflow. The server
decodes to float32 and runs the optimizer in float32.

Reusing a lookup's ids: a training lookup carries (client, seq); the server remembers
its ids for a while, and an update of exactly those ids (the backward of that batch)
names the lookup (`lookup`) and sends gradients only. A server that no longer has them
answers "unknown lookup" and the client resends the update with its ids.

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

import ml_dtypes
import numpy as np
import pyarrow as pa

WIRE_VERSION = 1

LOOKUP = "lookup"
APPLY = "apply"
WRITE_ROWS = "write_rows"
TAKE_ROWS = "take_rows"
READ_ROWS = "read_rows"
OPERATIONS = (LOOKUP, APPLY, WRITE_ROWS, TAKE_ROWS, READ_ROWS)

WIRE_DTYPES = ("float32", "bfloat16", "float16")
_ARROW_TYPES = {"float32": pa.float32(), "bfloat16": pa.uint16(), "float16": pa.float16()}
UNKNOWN_LOOKUP = "unknown lookup"  # the server's answer when it no longer has a lookup's ids


def values_schema(dtype: str = "float32") -> pa.Schema:
    """Lookup responses, and updates that reuse a lookup's ids: {values|grads: T}."""
    return pa.schema([pa.field("values", _ARROW_TYPES[dtype], nullable=False)])


def apply_schema(dtype: str = "float32") -> pa.Schema:
    """Updates that carry their ids: {ids: uint64, grads: list<T>}."""
    item = pa.field("item", _ARROW_TYPES[dtype], nullable=False)
    return pa.schema(
        [pa.field("ids", pa.uint64(), nullable=False), pa.field("grads", pa.list_(item), False)]
    )


IDS_SCHEMA = pa.schema([pa.field("ids", pa.uint64(), nullable=False)])
VALUES_SCHEMA = values_schema()
APPLY_SCHEMA = apply_schema()

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
        dtype: the wire dtype of values and gradients (float32, bfloat16, float16).
        lookup: apply only: the seq of this client's lookup whose ids the update is for
            (gradients only on the wire), or -1 (the update carries its ids).
        grad_exponents: apply only, float16: {table: e}, gradients were sent times 2^e.
        table: read_rows only: the table whose rows are read.
        prefixes: read_rows only: read the rows whose ids' top `prefix_bits` bits are
            one of these; None: every row.
    """

    op: str
    shard: int
    client: str = ""
    seq: int = 0
    train: bool = True
    step: int = -1
    dtype: str = "float32"
    lookup: int = -1
    grad_exponents: Mapping[str, int] | None = None
    table: str = ""
    prefixes: tuple[int, ...] | None = None
    prefix_bits: int = 0


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
            "dtype": header.dtype,
            "lookup": header.lookup,
            **({"grad_exponents": dict(header.grad_exponents)} if header.grad_exponents else {}),
            **({"table": header.table} if header.table else {}),
            **(
                {"prefixes": [int(p) for p in header.prefixes], "prefix_bits": header.prefix_bits}
                if header.prefixes is not None
                else {}
            ),
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
    dtype = data.get("dtype", "float32")
    if dtype not in WIRE_DTYPES:
        raise WireError(f"request header: wire dtype {dtype!r} is not one of {WIRE_DTYPES}")
    exponents = data.get("grad_exponents") or {}
    if not isinstance(exponents, dict) or not all(
        isinstance(e, int) and not isinstance(e, bool) and -64 <= e <= 64
        for e in exponents.values()
    ):
        raise WireError("request header: 'grad_exponents' must map tables to integers in [-64, 64]")
    table = data.get("table", "")
    if not isinstance(table, str) or (op == READ_ROWS and not table):
        raise WireError("request header: 'table' must name a table")
    prefixes, prefix_bits = data.get("prefixes"), 0
    if prefixes is not None:
        prefix_bits = _int_field(data, "prefix_bits", "request header", minimum=1)
        if (
            prefix_bits > 63
            or not isinstance(prefixes, list)
            or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 1 << prefix_bits
                for p in prefixes
            )
        ):
            raise WireError(
                "request header: 'prefixes' must be integers below 2^prefix_bits "
                "(prefix_bits from 1 to 63)"
            )
        prefixes = tuple(prefixes)
    return Header(
        op=op,
        train=train,
        shard=_int_field(data, "shard", "request header"),
        client=client,
        seq=_int_field(data, "seq", "request header"),
        step=_int_field(data, "step", "request header", minimum=-1) if "step" in data else -1,
        dtype=dtype,
        lookup=_int_field(data, "lookup", "request header", minimum=-1) if "lookup" in data else -1,
        grad_exponents=exponents,
        table=table,
        prefixes=prefixes,
        prefix_bits=prefix_bits,
    )


def check_ids(ids: np.ndarray, where: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype != np.uint64 or ids.ndim != 1:
        raise WireError(f"{where}: ids must be a 1-D uint64 array, got {ids.dtype} {ids.shape}")
    return ids


# --- floats in a wire dtype ---------------------------------------------------------------


def to_wire(values: np.ndarray, dtype: str) -> pa.Array:
    """float32 values (any shape) -> a flat Arrow array of `dtype` (no copy at float32)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if dtype == "float32":
        return pa.array(flat)
    if dtype == "float16":
        return pa.array(flat.astype(np.float16), type=pa.float16())
    return pa.array(flat.astype(ml_dtypes.bfloat16).view(np.uint16), type=pa.uint16())


def from_wire(column: pa.Array, dtype: str, where: str) -> np.ndarray:
    """A flat Arrow array of `dtype` -> float32 numpy (a view at float32, else a copy)."""
    if not column.type.equals(_ARROW_TYPES[dtype]):
        raise WireError(f"{where}: expected {dtype} values, got {column.type}")
    if column.null_count:
        raise WireError(f"{where}: nulls are not allowed")
    raw = column.to_numpy(zero_copy_only=True)
    if dtype == "bfloat16":
        return raw.view(ml_dtypes.bfloat16).astype(np.float32)
    return raw.astype(np.float32, copy=False)


def gradient_exponent(grads: np.ndarray) -> int:
    """The power of two that brings the largest |gradient| near 2^14 (float16's max is ~2^16).

    Float16's smallest normal is 2^-14: unscaled, gradients of a batch-mean loss (often
    1e-6 and below) would lose most of their bits or vanish.
    """
    finite = np.abs(grads[np.isfinite(grads)])
    largest = float(finite.max()) if finite.size else 0.0
    if largest == 0.0:
        return 0
    return int(np.clip(14 - int(np.ceil(np.log2(largest))), -64, 64))


# --- request encoding (client side) -------------------------------------------------------


def lookup_batches(requests: Mapping[str, np.ndarray]) -> Iterable[tuple[pa.RecordBatch, bytes]]:
    """Yields (record batch, table name) for a multi-table lookup request."""
    for table, ids in requests.items():
        ids = np.ascontiguousarray(check_ids(ids, f"table {table!r}"))
        yield pa.record_batch([pa.array(ids, type=pa.uint64())], schema=IDS_SCHEMA), table.encode()


def apply_batches(
    updates: Mapping[str, tuple[np.ndarray, np.ndarray]],
    dtype: str = "float32",
    *,
    with_ids: bool = True,
    exponents: Mapping[str, int] | None = None,
) -> Iterable[tuple[pa.RecordBatch, bytes]]:
    """Yields (record batch, table name) for a multi-table gradient update.

    Args:
        updates: table -> (ids [n] uint64, grads [n, dim] float32).
        dtype: the wire dtype of the gradients.
        with_ids: False when the update names the lookup whose ids it is for: gradients
            only, in `values_schema(dtype)`; True: `apply_schema(dtype)`.
        exponents: float16 only: {table: e}, gradients are sent times 2^e.
    """
    for table, (ids, grads) in updates.items():
        ids = np.ascontiguousarray(check_ids(ids, f"table {table!r}"))
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.ndim != 2 or grads.shape[0] != ids.shape[0]:
            raise WireError(
                f"table {table!r}: grads must be [{ids.shape[0]}, dim], got {grads.shape}"
            )
        exponent = (exponents or {}).get(table, 0)
        values = to_wire(np.ldexp(grads, exponent) if exponent else grads, dtype)
        if not with_ids:
            yield pa.record_batch([values], schema=values_schema(dtype)), table.encode()
            continue
        dim = grads.shape[1]
        offsets = pa.array(np.arange(ids.shape[0] + 1, dtype=np.int32) * np.int32(dim))
        lists = pa.ListArray.from_arrays(offsets, values)
        batch = pa.record_batch(
            [pa.array(ids, type=pa.uint64()), lists], schema=apply_schema(dtype)
        )
        yield batch, table.encode()


def values_batch(rows: np.ndarray, dtype: str = "float32") -> pa.RecordBatch:
    """One lookup-response batch: rows [n, dim] float32, flattened (no copy at float32)."""
    return pa.record_batch([to_wire(rows, dtype)], schema=values_schema(dtype))


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


def table_name(metadata: pa.Buffer | None, dims: Mapping[str, int], seen: set[str]) -> str:
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


def column_numpy(column: pa.Array, dtype: np.dtype, where: str) -> np.ndarray:
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
        table = table_name(metadata, dims, set(requests))
        limits.charge(batch.num_rows, batch.nbytes)
        requests[table] = column_numpy(batch.column(0), np.uint64, f"table {table!r} ids")
    return requests


def decode_apply(
    chunks: Iterable[tuple[pa.RecordBatch, pa.Buffer | None]],
    schema: pa.Schema,
    dims: Mapping[str, int],
    limits: RequestLimits,
    header: Header | None = None,
    lookup_ids: Mapping[str, np.ndarray] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Reads an update into table -> (ids [n] uint64, grads [n, dim] float32), validated.

    Args:
        header: the request header (wire dtype, float16 exponents); default float32.
        lookup_ids: {table: ids} of the lookup the header names, when it names one:
            the batches then hold gradients only, for exactly those ids.
    """
    dtype = header.dtype if header is not None else "float32"
    exponents = (header.grad_exponents if header is not None else None) or {}
    expected_schema = values_schema(dtype) if lookup_ids is not None else apply_schema(dtype)
    if not schema.equals(expected_schema):
        raise WireError(f"apply request schema must be {expected_schema}, got {schema}")
    updates: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for batch, metadata in chunks:
        table = table_name(metadata, dims, set(updates))
        limits.charge(batch.num_rows, batch.nbytes)
        dim = dims[table]
        where = f"table {table!r} grads"
        if lookup_ids is not None:
            if table not in lookup_ids:
                raise WireError(f"table {table!r} was not in the lookup this update names")
            ids = lookup_ids[table]
            if batch.num_rows != len(ids) * dim:
                raise WireError(
                    f"{where}: {batch.num_rows} values for the lookup's {len(ids)} ids of dim {dim}"
                )
            flat = from_wire(batch.column(0), dtype, where)
        else:
            ids = column_numpy(batch.column(0), np.uint64, f"table {table!r} ids")
            lists = batch.column(1)
            if lists.null_count:
                raise WireError(f"{where}: nulls are not allowed")
            offsets = lists.offsets.to_numpy(zero_copy_only=True)
            expected = np.int64(offsets[0]) + np.arange(len(ids) + 1, dtype=np.int64) * dim
            if offsets.shape != expected.shape or not np.array_equal(offsets, expected):
                raise WireError(f"{where}: every gradient must have dim {dim}")
            flat = from_wire(lists.values.slice(int(offsets[0]), len(ids) * dim), dtype, where)
        if exponents.get(table):
            flat = np.ldexp(flat, -exponents[table]).astype(np.float32)
        updates[table] = (ids, flat.reshape(len(ids), dim))
    return updates


# --- response decoding (client side) ------------------------------------------------------


def decode_values(
    batch: pa.RecordBatch,
    metadata: pa.Buffer | None,
    table: str,
    n: int,
    dim: int,
    dtype: str = "float32",
) -> np.ndarray:
    """One lookup-response batch as rows [n, dim] float32.

    At float32 a view of the received buffer (no copy): read-only. Callers that hand
    the rows on as their own result copy them.
    """
    if metadata is None or bytes(metadata).decode("utf-8", "replace") != table:
        raise WireError(f"lookup response out of order: expected table {table!r}")
    if not batch.schema.equals(values_schema(dtype)) or batch.num_rows != n * dim:
        raise WireError(
            f"lookup response for table {table!r}: expected {n} x {dim} {dtype} values, "
            f"got {batch.num_rows} of {batch.schema}"
        )
    return from_wire(batch.column(0), dtype, table).reshape(n, dim)
