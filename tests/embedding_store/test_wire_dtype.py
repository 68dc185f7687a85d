"""Reduced-precision transfers to remote shards: rounding only on the wire, float32 math on
the server, float16 gradient scaling, updates that reuse their lookup's ids, fallbacks."""

import ml_dtypes
import numpy as np
import pytest
from hybridrec.embedding_store import EmbeddingStore, SparseOptimizerConfig, TableConfig
from hybridrec.embedding_store.remote import wire
from hybridrec.embedding_store.remote.client import RemoteShardError, connect
from hybridrec.embedding_store.remote.shard_server import ShardServer

TABLES = [
    TableConfig(name="ads", dim=16, capacity=5000, optimizer=SparseOptimizerConfig(name="adagrad")),
    TableConfig(name="users", dim=8, capacity=5000, optimizer=SparseOptimizerConfig(name="adam")),
]
ROUND = {
    "float32": lambda x: x,
    "bfloat16": lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32),
    "float16": lambda x: x.astype(np.float16).astype(np.float32),
}


@pytest.fixture
def remote():
    """remote(wire_dtype) -> (store over 2 servers, servers); all closed at teardown."""
    opened = []

    def start(wire_dtype):
        servers = [ShardServer(TABLES, [index], num_shards=2) for index in (0, 1)]
        addresses = [f"127.0.0.1:{server.port}" for server in servers]
        shards = connect(addresses, TABLES, wire_dtype=wire_dtype)
        store = EmbeddingStore(TABLES, num_shards=2, shards=shards)
        opened.append((store, servers))
        return store, servers

    yield start
    for store, servers in opened:
        store.close()
        for server in servers:
            server.drain_and_stop(timeout=5)


def _wire_bytes(servers, kind):
    return sum(server.stats()["counters"].get(f"wire_bytes_{kind}", 0) for server in servers)


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_rows_are_rounded_on_the_wire_and_updated_in_float32(remote, wire_dtype):
    store, servers = remote(wire_dtype)
    rng = np.random.default_rng(0)
    with EmbeddingStore(TABLES, num_shards=2) as reference:
        for step in range(3):
            ids = rng.integers(0, 400, size=256).astype(np.uint64)
            features = {"a": ids[:128], "b": ids[128:]}
            feature_tables = {"a": "ads", "b": "ads"}
            got = store.lookup_features(features, feature_tables=feature_tables).result()
            want = reference.lookup_features(features, feature_tables=feature_tables).result()
            # The server's rows are float32; only their trip over the wire rounds them.
            np.testing.assert_array_equal(
                got.embeddings, ROUND[wire_dtype](want.embeddings), err_msg=f"step {step}"
            )
            # Gradients of a batch-mean loss are tiny. These are exact in the wire dtype
            # once scaled, so the server's float32 optimizer must give the same bits.
            grads = ROUND[wire_dtype](rng.normal(size=got.embeddings.shape).astype(np.float32))
            grads = np.ldexp(grads, -22)
            store.apply_pooled_gradients(got, grads).result()
            reference.apply_pooled_gradients(want, grads).result()
        ids = np.arange(400, dtype=np.uint64)
        np.testing.assert_array_equal(
            store.lookup("ads", ids, train=False).result(),
            ROUND[wire_dtype](reference.lookup("ads", ids, train=False).result()),
        )
    assert sum(s.stats()["counters"].get("rows_applied", 0) for s in servers) > 0


def test_updates_after_a_lookup_send_gradients_only_and_half_the_bytes(remote):
    ids = np.arange(1000, dtype=np.uint64)
    grads = np.full((1000, 16), 0.5, np.float32)
    per_id = {}
    for wire_dtype in ("float32", "bfloat16"):
        store, servers = remote(wire_dtype)
        store.lookup("ads", ids).result()
        store.apply_gradients("ads", ids, grads).result()  # the same ids: reuses the lookup
        reused = _wire_bytes(servers, "apply")
        store.apply_gradients("ads", ids[::-1].copy(), grads).result()  # no lookup: with ids
        with_ids = _wire_bytes(servers, "apply") - reused
        assert with_ids - reused >= 8 * 1000  # the ids were not sent again
        per_id[wire_dtype] = (_wire_bytes(servers, "lookup") + reused) / 1000
    # dim 16, per id: 8 (id) + 64 + 64 bytes at float32; 8 + 32 + 32 at bfloat16.
    assert per_id["float32"] >= 136 and per_id["bfloat16"] / per_id["float32"] < 0.55, per_id


def test_an_update_whose_lookup_the_server_forgot_is_resent_with_its_ids(remote):
    store, servers = remote("bfloat16")
    ids = np.arange(300, dtype=np.uint64)
    grads = np.ones((300, 16), np.float32)
    with EmbeddingStore(TABLES, num_shards=2) as reference:
        for target in (store, reference):
            target.lookup("ads", ids).result()
        for server in servers:  # as after a restart, or when too many are in flight
            with server._lock:
                for key in list(server._lookups):
                    server._forget(key)
            assert server._lookup_ids == 0
        for target in (store, reference):
            target.apply_gradients("ads", ids, grads).result()
        np.testing.assert_array_equal(
            store.lookup("ads", ids, train=False).result(),
            ROUND["bfloat16"](reference.lookup("ads", ids, train=False).result()),
        )
    counters = [server.stats()["counters"] for server in servers]
    assert sum(c.get("rejected", 0) for c in counters) == 2  # one refusal per shard
    assert sum(c.get("rows_applied", 0) for c in counters) == 300  # applied once


def test_wire_dtype_bad_input():
    with pytest.raises(RemoteShardError, match="wire dtype 'int8' is not one of"):
        connect("127.0.0.1:1", TABLES, wire_dtype="int8")
    header = b'{"v": 1, "op": "apply", "shard": 0, "seq": 1, "dtype": "float64"}'
    with pytest.raises(wire.WireError, match="wire dtype 'float64'"):
        wire.decode_header(header)
    header = b'{"v": 1, "op": "apply", "shard": 0, "seq": 1, "grad_exponents": {"ads": 999}}'
    with pytest.raises(wire.WireError, match="grad_exponents"):
        wire.decode_header(header)
    exponent = wire.gradient_exponent(np.array([[3e-7, -1e-6]], np.float32))
    assert 2**13 <= 1e-6 * 2**exponent <= 2**14  # the largest lands just under float16's top
    assert wire.gradient_exponent(np.zeros((2, 2), np.float32)) == 0


def test_gradients_only_updates_are_validated_against_the_named_lookup():
    dims = {"ads": 16, "users": 8}
    lookup_ids = {"ads": np.arange(3, dtype=np.uint64)}
    header = wire.Header(op=wire.APPLY, shard=0, client="c", seq=2, dtype="float16", lookup=1)

    def decode(batches, schema=None):
        limits = wire.RequestLimits(max_rows=10**6, max_bytes=10**9)
        schema = schema or wire.values_schema("float16")
        return wire.decode_apply(batches, schema, dims, limits, header, lookup_ids)

    def batch(values, dtype="float16"):
        return wire.values_batch(np.asarray(values, np.float32).reshape(-1, 1), dtype)

    good = decode([(batch(np.ones(48)), b"ads")])
    np.testing.assert_array_equal(good["ads"][0], lookup_ids["ads"])
    assert good["ads"][1].shape == (3, 16) and good["ads"][1].dtype == np.float32
    with pytest.raises(wire.WireError, match="47 values for the lookup's 3 ids of dim 16"):
        decode([(batch(np.ones(47)), b"ads")])
    with pytest.raises(wire.WireError, match="'users' was not in the lookup"):
        decode([(batch(np.ones(24)), b"users")])
    with pytest.raises(wire.WireError, match="apply request schema must be"):
        decode([(batch(np.ones(48), "float32"), b"ads")], wire.values_schema("float32"))
