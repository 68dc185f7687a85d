"""Remote shards over Arrow Flight, with servers in this process (real gRPC on loopback).

Same results as the in-process store, checkpoints written by the servers, restore onto
another number of servers, the handshake's misconfiguration errors, the token, and
malformed or oversized requests that must leave the server serving and its rows intact.
"""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hybridrec.embedding_store import (
    EmbeddingStore,
    EvictionConfig,
    SparseOptimizerConfig,
    TableConfig,
    TieringConfig,
    shard_of,
)
from hybridrec.embedding_store.remote import wire, wire_rows
from hybridrec.embedding_store.remote.client import (
    RemoteShardError,
    ServerUnavailableError,
    connect,
    parse_addresses,
)

from hybridrec.cli.server_processes import contiguous_shards

from .remote_calls import addresses, same_calls

TABLES = [
    TableConfig(
        name="ads",
        dim=4,
        capacity=2000,
        optimizer=SparseOptimizerConfig(name="adagrad"),
        eviction=EvictionConfig(ttl_steps=2, ttl_sweep_every=1),  # set_step matters
    ),
    TableConfig(
        name="users",
        dim=8,
        capacity=2000,
        optimizer=SparseOptimizerConfig(name="adam", learning_rate=0.05),
    ),
]


def _all_rows(store, table, universe=300):
    return store.lookup(table, np.arange(universe, dtype=np.uint64), train=False).result()


def test_remote_matches_in_process_and_checkpoints(start_servers, tmp_path):
    servers = start_servers([[0, 1], [2]], num_shards=3)
    local = EmbeddingStore(TABLES, num_shards=3)
    remote = EmbeddingStore(TABLES, shards=connect(addresses(servers)[::-1], TABLES))
    assert remote.num_shards == 3
    same_calls([local, remote], np.random.default_rng(0), range(0, 4))
    for table in ("ads", "users"):
        np.testing.assert_array_equal(_all_rows(remote, table), _all_rows(local, table))
    remote_stats, local_stats = remote.stats(), local.stats()
    assert remote_stats == local_stats and remote_stats["rows"] > 0
    assert remote_stats["evicted_ttl"] > 0  # the step reached the servers' shards

    # Each server writes its own shards' parts; the client commits the manifest.
    url = str(tmp_path / "embeddings")
    full = remote.checkpoint(url, 3)
    same_calls([local, remote], np.random.default_rng(1), range(4, 6))
    delta = remote.checkpoint(url, 5)
    assert full["full"] and not delta["full"] and 0 < delta["rows_written"] < full["rows_written"]

    # Restore onto another number of servers and shards (2 servers, 2 shards) and in-process.
    other = start_servers([[0], [1]], num_shards=2)
    restored_remote = EmbeddingStore.restore(url, TABLES, shards=connect(addresses(other), TABLES))
    restored_local = EmbeddingStore.restore(url, TABLES, num_shards=1)
    for table in ("ads", "users"):
        expected = _all_rows(local, table)
        np.testing.assert_array_equal(_all_rows(restored_remote, table), expected)
        np.testing.assert_array_equal(_all_rows(restored_local, table), expected)
    same_calls([local, restored_remote, restored_local], np.random.default_rng(2), range(6, 9))

    # The trainer goes away: the servers keep the rows, a new client reattaches.
    expected = _all_rows(remote, "users")
    remote.close()
    again = EmbeddingStore(TABLES, shards=connect(addresses(servers), TABLES))
    np.testing.assert_array_equal(_all_rows(again, "users"), expected)
    stats = again.shards[0].server_stats()
    assert stats["latency"]["lookup"]["count"] > 0 and stats["latency"]["lookup"]["p99_ms"] > 0
    assert stats["pending_updates"] == 0 and stats["rows"] > 0
    for store in (local, restored_remote, restored_local, again):
        store.close()


def test_clients_count_the_payload_bytes_their_servers_count(start_servers):
    servers = start_servers([[0], [1]], num_shards=2)
    shards = connect(addresses(servers), TABLES)
    store = EmbeddingStore(TABLES, num_shards=2, shards=shards)
    rng = np.random.default_rng(3)
    for _ in range(3):
        ids = rng.integers(0, 500, size=100).astype(np.uint64)
        rows = store.lookup("users", ids).result()
        store.apply_gradients("users", ids, np.ones_like(rows)).result()
        store.lookup("ads", ids[:10], train=False).result()
    for shard, server in zip(shards, servers, strict=True):
        counted = shard.wire_bytes
        assert counted["lookup_sent"] > 8 * 50 and counted["apply_sent"] > 4 * 8 * 50
        counters = server.stats()["counters"]
        lookups = counters["wire_bytes_lookup"] + counters["wire_bytes_eval_lookup"]
        assert counted["lookup_sent"] + counted["lookup_received"] == lookups
        assert counted["apply_sent"] + counted["apply_received"] == counters["wire_bytes_apply"]
    store.close()


def test_whole_rows_travel_like_in_process(start_servers):
    """take_rows, write_rows and read_rows (the rows trained on the devices, with their
    optimizer state) give a remote store the in-process store's rows."""
    servers = start_servers([[0, 1], [2]], num_shards=3)
    shards = connect(addresses(servers), TABLES)
    local, remote = EmbeddingStore(TABLES, num_shards=3), EmbeddingStore(TABLES, shards=shards)
    rng = np.random.default_rng(4)
    same_calls([local, remote], rng, range(0, 2))
    # ids of two features of a fused table: the top 8 bits name the feature
    ids = np.concatenate([(np.uint64(p) << np.uint64(56)) + np.arange(40, dtype=np.uint64)
                          for p in (3, 5)])  # fmt: skip
    for store in (local, remote):  # creates the rows not held, as a lookup would
        taken = [store.take_rows(table, ids).result() for table in ("ads", "users")]
    for (values, state), (values_l, state_l) in zip(
        taken, [local.take_rows(t, ids).result() for t in ("ads", "users")], strict=True
    ):
        np.testing.assert_array_equal(values, values_l)
        np.testing.assert_array_equal(state, state_l)
    assert taken[1][1].shape == (80, 17)  # Adam: two moments and the step count
    new_values = rng.normal(size=(40, 8)).astype(np.float32)
    new_state = rng.random((40, 17)).astype(np.float32)
    for store in (local, remote):
        store.write_rows("users", ids[::2], new_values, new_state).result()
    for prefixes in (None, [5], [3, 5], [9]):
        read = [store.read_rows("users", prefixes, 8) for store in (local, remote)]
        order = [np.argsort(ids_) for ids_, _, _ in read]
        for part_l, part_r in zip(read[0], read[1], strict=True):
            np.testing.assert_array_equal(part_r[order[1]], part_l[order[0]])
    got_ids, got_values, got_state = remote.read_rows("users", [3, 5], 8)
    assert len(got_ids) == 80
    at = np.searchsorted(got_ids, ids[::2], sorter=np.argsort(got_ids))
    at = np.argsort(got_ids)[at]
    np.testing.assert_array_equal(got_values[at], new_values)
    np.testing.assert_array_equal(got_state[at], new_state)
    assert len(remote.read_rows("users", [9], 8)[0]) == 0
    bytes_sent = sum(shard.wire_bytes["rows_sent"] for shard in shards)
    counted = sum(server.stats()["counters"]["wire_bytes_rows"] for server in servers)
    received = sum(shard.wire_bytes["rows_received"] for shard in shards)
    assert bytes_sent + received == counted and received > 80 * (8 + 17) * 4
    for store in (local, remote):
        store.close()


def test_handshake_rejects_a_misconfigured_server_set(start_servers):
    gap = start_servers([[0], [2]], num_shards=3)
    with pytest.raises(RemoteShardError, match=r"hosts shard\(s\) \[1\] of 3"):
        connect(addresses(gap), TABLES)
    overlap = start_servers([[0, 1], [1]], num_shards=2)
    with pytest.raises(RemoteShardError, match="shard 1 is hosted by both"):
        connect(addresses(overlap), TABLES)
    other_tables = [TABLES[0], TableConfig(name="users", dim=16, capacity=2000)]
    mismatch = start_servers([[0]], num_shards=1, tables=other_tables)
    with pytest.raises(RemoteShardError, match="different table configs"):
        connect(addresses(mismatch), TABLES)
    with pytest.raises(RemoteShardError, match="says num_shards"):
        connect([addresses(gap)[0], addresses(overlap)[1]], TABLES)


def test_a_server_may_tier_its_tables_without_the_client_knowing(start_servers, tmp_path):
    tiered = [
        dataclasses.replace(
            table, tiering=TieringConfig(ram_rows=500, path=str(tmp_path / table.name))
        )
        for table in TABLES
    ]
    servers = start_servers([[0]], num_shards=1, tables=tiered)
    with EmbeddingStore(TABLES, shards=connect(addresses(servers), TABLES)) as remote:
        for start in range(0, 1500, 300):  # more rows in all than the server keeps in RAM
            ids = np.arange(start, start + 300, dtype=np.uint64)
            grads = np.ones((300, TABLES[0].dim), np.float32)
            remote.apply_gradients(TABLES[0].name, ids, grads).result()
        assert remote.stats()["cold_writes"] > 0


def test_address_lists_and_shard_splits():
    assert parse_addresses("a:1, grpc://b:2") == ["grpc://a:1", "grpc://b:2"]
    for bad in ("a", "a:port", "a:1,a:1", ""):
        with pytest.raises(RemoteShardError):
            parse_addresses(bad)
    assert [contiguous_shards(i, 3, 8) for i in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]


def test_unreachable_server_fails_with_its_address(start_servers):
    (server,) = start_servers([[0]], num_shards=1)
    shards = connect(addresses([server]), TABLES, retry_timeout=0.5)
    server.drain_and_stop(timeout=5)
    with pytest.raises(ServerUnavailableError, match=f"127.0.0.1:{server.port}.*lookup on shard 0"):
        shards[0].lookup({"ads": np.arange(3, dtype=np.uint64)})


def test_token_is_enforced(start_servers):
    (server,) = start_servers([[0]], num_shards=1, token="s3cret")
    address = addresses([server])
    with pytest.raises(RemoteShardError, match="refused the token"):
        connect(address, TABLES, token="wrong", retry_timeout=1)
    with pytest.raises(RemoteShardError, match="refused the token"):
        connect(address, TABLES, token="", retry_timeout=1)
    client = flight.FlightClient(f"grpc://{address[0]}")
    with pytest.raises(flight.FlightUnauthenticatedError):
        list(client.do_action(flight.Action("health", b"")))
    (shard,) = connect(address, TABLES, token="s3cret")
    assert shard.lookup({"ads": np.arange(3, dtype=np.uint64)})["ads"].shape == (3, 4)


def _exchange(client, header, schema, batches):
    """Sends one raw DoExchange; returns the server's reply chunks or raises its error."""
    command = header if isinstance(header, bytes) else json.dumps(header).encode()
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command))
    try:
        writer.begin(schema)
        for batch, metadata in batches:
            if metadata is None:
                writer.write_batch(batch)
            else:
                writer.write_with_metadata(batch, metadata)
        writer.done_writing()
        return list(reader)
    finally:
        writer.close()


def _header(op="apply", shard=0, **extra):
    return {"v": 1, "op": op, "shard": shard, "client": "raw", "seq": 1, **extra}


def _apply_batch(ids, grads, dim):
    offsets = pa.array(np.arange(len(ids) + 1, dtype=np.int32) * dim)
    lists = pa.ListArray.from_arrays(offsets, pa.array(grads.reshape(-1)))
    return pa.record_batch([pa.array(ids, pa.uint64()), lists], schema=wire.APPLY_SCHEMA)


def test_malformed_and_oversized_requests_leave_the_server_intact(start_servers):
    (server,) = start_servers([[0]], num_shards=1, max_request_rows=100, max_request_bytes=2048)
    (shard,) = connect(addresses([server]), TABLES)
    ids = np.arange(20, dtype=np.uint64)
    shard.apply_gradients({"ads": (ids, np.ones((20, 4), np.float32))})
    before = shard.lookup({"ads": ids, "users": ids}, train=False)
    before = {table: rows.copy() for table, rows in before.items()}
    client = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    good_ids = pa.record_batch([pa.array(ids[:3], pa.uint64())], schema=wire.IDS_SCHEMA)
    ones = np.ones((3, 4), np.float32)
    wide = _apply_batch(ids[:3], np.ones((3, 5), np.float32), 5)  # users-width mismatch for ads
    ragged = pa.record_batch(
        [
            pa.array(ids[:2], pa.uint64()),
            pa.ListArray.from_arrays(pa.array([0, 3, 8], pa.int32()), pa.array(np.ones(8, "f4"))),
        ],
        schema=wire.APPLY_SCHEMA,
    )
    null_ids = pa.record_batch(
        [pa.array([1, None, 3], pa.uint64()), pa.array([[0.0] * 4] * 3, pa.list_(pa.float32()))],
        schema=pa.schema([("ids", pa.uint64()), ("grads", pa.list_(pa.float32()))]),
    )
    float_ids = pa.record_batch([pa.array([1.0, 2.0])], names=["ids"])
    cases = {
        "not json": (b"\xff\x00garbage", wire.IDS_SCHEMA, [(good_ids, b"ads")]),
        "json list": (b"[1, 2]", wire.IDS_SCHEMA, [(good_ids, b"ads")]),
        "wire version": ({**_header("lookup"), "v": 99}, wire.IDS_SCHEMA, [(good_ids, b"ads")]),
        "unknown op": (_header("drop_table"), wire.IDS_SCHEMA, [(good_ids, b"ads")]),
        "shard not hosted": (_header("lookup", shard=7), wire.IDS_SCHEMA, [(good_ids, b"ads")]),
        "negative shard": (_header("lookup", shard=-1), wire.IDS_SCHEMA, [(good_ids, b"ads")]),
        "float ids": (_header("lookup"), float_ids.schema, [(float_ids, b"ads")]),
        "unknown table": (_header("lookup"), wire.IDS_SCHEMA, [(good_ids, b"nope")]),
        "no table name": (_header("lookup"), wire.IDS_SCHEMA, [(good_ids, None)]),
        "table twice": (
            _header(),
            wire.APPLY_SCHEMA,
            [(_apply_batch(ids[:3], ones, 4), b"ads")] * 2,
        ),
        "wrong grad width": (_header(), wire.APPLY_SCHEMA, [(wide, b"ads")]),
        "ragged grads": (_header(), wire.APPLY_SCHEMA, [(ragged, b"ads")]),
        "null ids": (_header(), null_ids.schema, [(null_ids, b"ads")]),
        "lookup schema for apply": (_header(), wire.IDS_SCHEMA, [(good_ids, b"ads")]),
        "too many ids": (
            _header(),
            wire.APPLY_SCHEMA,
            [(_apply_batch(np.arange(101, dtype=np.uint64), np.ones((101, 4), "f4"), 4), b"ads")],
        ),
        "too many bytes": (
            _header(),
            wire.APPLY_SCHEMA,
            [(_apply_batch(np.arange(90, dtype=np.uint64), np.ones((90, 4), "f4"), 4), b"ads")],
        ),
        "rows of the wrong state width": (
            _header("write_rows"),
            wire_rows.ROWS_SCHEMA,
            list(wire_rows.rows_batches({"ads": (ids[:3], ones, np.ones((3, 2), "f4"))})),
        ),
        "rows in the apply schema": (
            _header("write_rows"),
            wire.APPLY_SCHEMA,
            [(_apply_batch(ids[:3], ones, 4), b"ads")],
        ),
        "read_rows of no table": (_header("read_rows"), wire.IDS_SCHEMA, []),
        "read_rows of an unknown table": (
            _header("read_rows", table="nope"),
            wire.IDS_SCHEMA,
            [],
        ),
        "prefixes without their bits": (
            _header("read_rows", table="ads", prefixes=[1]),
            wire.IDS_SCHEMA,
            [],
        ),
        "a prefix wider than its bits": (
            _header("read_rows", table="ads", prefixes=[4], prefix_bits=2),
            wire.IDS_SCHEMA,
            [],
        ),
        # A valid first table followed by a bad second one: nothing may be applied.
        "good then bad": (
            _header(),
            wire.APPLY_SCHEMA,
            [(_apply_batch(ids[:3], ones, 4), b"ads"), (wide, b"users")],
        ),
        "good rows then bad": (
            _header("write_rows"),
            wire_rows.ROWS_SCHEMA,
            [
                *wire_rows.rows_batches({"ads": (ids[:3], ones * 7, ones)}),
                *wire_rows.rows_batches({"users": (ids[:3], ones, np.ones((3, 17), "f4"))}),
            ],
        ),
    }
    for name, (header, schema, batches) in cases.items():
        with pytest.raises(flight.FlightError) as error:
            _exchange(client, header, schema, batches)
        assert "rejected: " in str(error.value), name
        assert ("request too large" in str(error.value)) == name.startswith("too many"), name
    for kind, body in [
        ("checkpoint", b"{not json"),
        ("set_step", json.dumps({"shard": 0, "step": -5}).encode()),
        ("load_checkpoint", json.dumps({"shard": 0, "url": "", "step": 1}).encode()),
        ("no_such_action", b"{}"),
        ("set_step", b"x" * (wire.MAX_HEADER_BYTES + 1)),
    ]:
        with pytest.raises(flight.FlightServerError, match="rejected"):
            list(client.do_action(flight.Action(kind, body)))
    after = shard.lookup({"ads": ids, "users": ids}, train=False)
    for table in before:
        np.testing.assert_array_equal(after[table], before[table])
    stats = shard.server_stats()
    assert stats["counters"]["rejected"] >= len(cases) and stats["counters"]["rows_applied"] == 20
    assert json.loads(next(iter(client.do_action(flight.Action("health", b"")))).body.to_pybytes())[
        "ready"
    ]


def test_retried_update_is_applied_once(start_servers):
    (server,) = start_servers([[0]], num_shards=1)
    client = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    ids = np.array([3, 4], np.uint64)
    batch = _apply_batch(ids, np.ones((2, 4), np.float32), 4)
    (shard,) = connect(addresses([server]), TABLES)
    before = shard.lookup({"ads": ids})["ads"].copy()
    header = _header(client="trainer-1", seq=42)
    first = _exchange(client, header, wire.APPLY_SCHEMA, [(batch, b"ads")])
    again = _exchange(client, header, wire.APPLY_SCHEMA, [(batch, b"ads")])
    assert json.loads(first[0].app_metadata.to_pybytes()) == {"applied": 2, "duplicate": False}
    assert json.loads(again[0].app_metadata.to_pybytes())["duplicate"] is True
    once = shard.lookup({"ads": ids})["ads"]
    reference = EmbeddingStore(TABLES[:1])
    reference.lookup("ads", ids).result()
    reference.apply_gradients("ads", ids, np.ones((2, 4), np.float32)).result()
    np.testing.assert_array_equal(once, reference.lookup("ads", ids).result())
    assert not np.array_equal(once, before)
    assert shard_of(ids, 1).tolist() == [0, 0]
