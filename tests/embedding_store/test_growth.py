"""Memory follows the rows held: tables start small and double up to their capacity.

Rows and optimizer state survive every growth step bit for bit, eviction starts at
capacity as before, checkpoints of a grown table restore onto another shard count,
and `stats()` reports the bytes held next to the bytes a full table would take.
"""

import numpy as np
import pytest
from hybridrec.embedding_store import (
    EmbeddingStore,
    EmbeddingStoreError,
    EvictionConfig,
    SparseOptimizerConfig,
    TableConfig,
    TieringConfig,
)
from hybridrec.embedding_store.remote.client import connect
from hybridrec.embedding_store.remote.shard_server import ShardServer

CHUNKS, CHUNK = 10, 1500  # 15k rows: slot arrays grow 1024 -> 2048 -> ... -> 16384


def _table(optimizer="adam", capacity=1_000_000, **kwargs):
    return TableConfig(
        name="items",
        dim=8,
        capacity=capacity,
        optimizer=SparseOptimizerConfig(name=optimizer, learning_rate=0.05),
        **kwargs,
    )


def _ids(count, seed=0):
    rng = np.random.default_rng(seed)
    return np.unique(rng.integers(1, 2**63, count * 2, dtype=np.uint64))[:count]


def _grads(ids, step):
    rng = np.random.default_rng(1000 + step)
    return rng.normal(size=(len(ids), 8)).astype(np.float32)


def _train(store, ids, *, admit_all_first, window=CHUNKS):
    """Chunk k of `ids` is admitted at step k, then the last `window` chunks admitted are
    updated each step.

    With `admit_all_first`, every id is admitted before step 0 (one growth step only);
    the update sequence each id sees is the same either way.
    """
    held = []
    if admit_all_first:
        store.lookup("items", ids).result()
    for step in range(CHUNKS):
        admitted = ids[max(0, step + 1 - window) * CHUNK : (step + 1) * CHUNK]
        store.lookup("items", admitted[-CHUNK:]).result()
        store.apply_gradients("items", admitted, _grads(admitted, step)).result()
        held.append(store.stats()["bytes_held"])
    return held


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_rows_and_optimizer_state_survive_growth(optimizer, tmp_path):
    ids = _ids(CHUNKS * CHUNK)
    with (
        EmbeddingStore([_table(optimizer)], num_shards=1) as growing,
        EmbeddingStore([_table(optimizer)], num_shards=1) as grown_once,
    ):
        held = _train(growing, ids, admit_all_first=False)
        _train(grown_once, ids, admit_all_first=True)
        assert len(set(held)) >= 4, held  # several growth steps happened
        assert held == sorted(held)
        np.testing.assert_array_equal(
            growing.lookup("items", ids, train=False).result(),
            grown_once.lookup("items", ids, train=False).result(),
        )
        # Optimizer state too: one more identical update keeps them equal.
        for store in (growing, grown_once):
            store.apply_gradients("items", ids, _grads(ids, 99)).result()
        expected = grown_once.lookup("items", ids, train=False).result()
        np.testing.assert_array_equal(growing.lookup("items", ids, train=False).result(), expected)

        growing.checkpoint(str(tmp_path), step=1)
        with EmbeddingStore.restore(str(tmp_path), [_table(optimizer)], num_shards=3) as restored:
            np.testing.assert_array_equal(
                restored.lookup("items", ids, train=False).result(), expected
            )
            assert restored.stats()["rows"] == len(ids)
            # ... including the optimizer state: the next update matches too.
            for store in (restored, grown_once):
                store.apply_gradients("items", ids, _grads(ids, 100)).result()
            np.testing.assert_array_equal(
                restored.lookup("items", ids, train=False).result(),
                grown_once.lookup("items", ids, train=False).result(),
            )


def test_memory_held_follows_rows_and_is_reported_with_the_ceiling():
    table = _table("adagrad", capacity=8_000_000)
    with EmbeddingStore([table], num_shards=4) as store:
        empty = store.stats()
        # dim 8 float32 values + 8 adagrad accumulators + 21 bytes of metadata per row,
        # plus the slot map, for 8M rows: more than 8M * 85 bytes.
        assert empty["bytes_at_capacity"] > 8_000_000 * 85
        assert empty["bytes_held"] < 1_000_000
        ids = _ids(20_000)
        store.lookup("items", ids).result()
        stats = store.stats()
        assert 20_000 * 85 < stats["bytes_held"] < 20 * 20_000 * 85
        assert stats["bytes_at_capacity"] == empty["bytes_at_capacity"]  # the ceiling is fixed
        assert stats["tables"]["items"]["bytes_held"] == stats["bytes_held"]


def test_eviction_starts_at_capacity():
    capacity = 5000
    table = _table("adagrad", capacity=capacity, eviction=EvictionConfig(lru_batch_fraction=0.1))
    ids = _ids(capacity + 1000)
    with EmbeddingStore([table], num_shards=1) as store:
        for step, start in enumerate(range(0, capacity, 1000)):
            store.set_step(step)
            store.lookup("items", ids[start : start + 1000]).result()
        full = store.stats()
        assert full["rows"] == capacity and full["evicted_lru"] == 0
        assert full["bytes_held"] <= full["bytes_at_capacity"]
        store.set_step(10)
        store.lookup("items", ids[capacity:]).result()  # 1000 new ids at capacity
        after = store.stats()
        # One LRU round frees the larger of the request and 10% of capacity, oldest first.
        assert after["evicted_lru"] == 1000
        assert after["rows"] == capacity
        assert after["bytes_held"] <= after["bytes_at_capacity"]
        hits = after["hits"]
        store.lookup("items", ids[:1000], train=False).result()  # the oldest rows: evicted
        store.lookup("items", ids[1000:2000], train=False).result()  # the next ones: kept
        assert store.stats()["hits"] - hits == 1000


def test_tiered_table_grows_and_matches_the_in_ram_table(tmp_path):
    tiered = _table(
        "adagrad",
        capacity=100_000,
        tiering=TieringConfig(ram_rows=4000, path=str(tmp_path / "cold"), chunk_rows=256),
    )
    ids = _ids(CHUNKS * CHUNK)
    with (
        EmbeddingStore([tiered], num_shards=2) as cold,
        EmbeddingStore([_table("adagrad", capacity=100_000)], num_shards=2) as warm,
    ):
        held = _train(cold, ids, admit_all_first=False, window=2)
        _train(warm, ids, admit_all_first=False, window=2)
        assert held[-1] > held[0] and cold.stats()["cold_writes"] > 0
        np.testing.assert_array_equal(
            cold.lookup("items", ids, train=False).result(),
            warm.lookup("items", ids, train=False).result(),
        )


def test_tiered_request_larger_than_the_ram_tier_is_a_clear_error(tmp_path):
    tiered = _table(
        "adagrad",
        capacity=100_000,
        tiering=TieringConfig(ram_rows=2000, path=str(tmp_path / "cold"), chunk_rows=256),
    )
    ids = _ids(3000)
    with EmbeddingStore([tiered], num_shards=1) as store:
        for start in range(0, 3000, 1000):
            store.lookup("items", ids[start : start + 1000]).result()
        before = store.lookup("items", ids[:1000], train=False).result()
        with pytest.raises(EmbeddingStoreError, match="tiering.ram_rows budget of 2000"):
            store.apply_gradients("items", ids, _grads(ids, 0)).result()
        # nothing was applied, and the store keeps serving
        np.testing.assert_array_equal(
            store.lookup("items", ids[:1000], train=False).result(), before
        )


def test_remote_shards_grow_like_in_process_ones(tmp_path):
    tables = [_table("adam")]
    ids = _ids(CHUNKS * CHUNK)
    servers = [ShardServer(tables, [index], num_shards=2) for index in range(2)]
    try:
        addresses = [f"127.0.0.1:{server.port}" for server in servers]
        with (
            EmbeddingStore(tables, shards=connect(addresses, tables)) as remote,
            EmbeddingStore(tables, num_shards=2) as local,
        ):
            held = _train(remote, ids, admit_all_first=False)
            _train(local, ids, admit_all_first=False)
            assert len(set(held)) >= 3 and held == sorted(held)
            expected = local.lookup("items", ids, train=False).result()
            np.testing.assert_array_equal(
                remote.lookup("items", ids, train=False).result(), expected
            )
            remote.checkpoint(str(tmp_path), step=1)  # written by the servers
        with EmbeddingStore.restore(str(tmp_path), tables, num_shards=3) as restored:
            np.testing.assert_array_equal(
                restored.lookup("items", ids, train=False).result(), expected
            )
    finally:
        for server in servers:
            server.drain_and_stop(timeout=5)
