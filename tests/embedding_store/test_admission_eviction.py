"""Admission (min-count, probability) and eviction (LRU at capacity, TTL by step)."""

import numpy as np
from hybridrec.embedding_store import (
    AdmissionConfig,
    EmbeddingStore,
    EvictionConfig,
    SparseOptimizerConfig,
    TableConfig,
)

SGD = SparseOptimizerConfig(name="sgd", learning_rate=1.0)


def test_min_count_admission():
    table = TableConfig(
        name="t", dim=4, capacity=100, optimizer=SGD, admission=AdmissionConfig(min_count=3)
    )
    with EmbeddingStore([table], num_shards=2) as store:
        ids = np.array([1, 2], np.uint64)
        for _ in range(2):
            rows = store.lookup("t", ids).result()
            np.testing.assert_array_equal(rows, 0)  # unadmitted ids read as zeros
            store.apply_gradients("t", ids, np.ones((2, 4), np.float32)).result()
        stats = store.stats()
        assert stats["rows"] == 0 and stats["updates_unadmitted"] == 4
        assert stats["pending_admission"] == 2
        # Repeats within one call count: id 2 reaches 3 sightings here, id 1 too.
        rows = store.lookup("t", np.array([1, 2, 2], np.uint64)).result()
        assert np.all(rows != 0)
        # The two earlier updates were not applied: the row is its initial value.
        initial = store.lookup("t", np.array([1], np.uint64), train=False).result()
        np.testing.assert_array_equal(rows[0], initial[0])
        assert store.stats()["rows"] == 2 and store.stats()["pending_admission"] == 0


def test_probability_admission_is_deterministic_and_proportional():
    table = TableConfig(
        name="t", dim=2, capacity=100_000, admission=AdmissionConfig(probability=0.25, seed=3)
    )
    ids = np.arange(20_000, dtype=np.uint64)
    admitted = []
    for _ in range(2):
        with EmbeddingStore([table], num_shards=3) as store:
            rows = store.lookup("t", ids).result()
            admitted.append(np.any(rows != 0, axis=1))
    np.testing.assert_array_equal(admitted[0], admitted[1])
    assert 0.23 < admitted[0].mean() < 0.27


def test_eval_lookup_changes_nothing():
    table = TableConfig(name="t", dim=4, capacity=100)
    with EmbeddingStore([table]) as store:
        ids = np.array([7, 8], np.uint64)
        evaluated = store.lookup("t", ids, train=False).result()
        assert store.stats()["rows"] == 0
        trained = store.lookup("t", ids).result()
        np.testing.assert_array_equal(evaluated, trained)


def test_lru_eviction_at_capacity_keeps_recent_rows():
    table = TableConfig(
        name="t",
        dim=2,
        capacity=100,
        optimizer=SGD,
        eviction=EvictionConfig(policy="lru", lru_batch_fraction=0.1),
    )
    with EmbeddingStore([table]) as store:
        for step in range(10):
            store.set_step(step)
            store.lookup("t", np.arange(step * 10, step * 10 + 10, dtype=np.uint64))
        hot = np.array([0, 1], np.uint64)
        store.set_step(10)
        store.apply_gradients("t", hot, np.ones((2, 2), np.float32))
        store.set_step(11)
        store.lookup("t", np.arange(1000, 1010, dtype=np.uint64)).result()
        stats = store.stats()
        assert stats["rows"] <= 100 and stats["evicted_lru"] == 10
        # The 10 least recently used rows went: ids 2..9 (step 0), two of 10..19 (step 1).
        assert stats["tables"]["t"]["evicted_lru"] == 10
        updated = store.lookup("t", hot, train=False).result()
        with EmbeddingStore([table]) as fresh:
            initial = fresh.lookup("t", hot).result()
        np.testing.assert_allclose(updated, initial - 1.0)  # kept, with its update
        admitted = stats["admitted"]
        kept = np.concatenate([np.arange(20, 100), np.arange(1000, 1010), [0, 1]])
        store.lookup("t", kept.astype(np.uint64)).result()
        assert store.stats()["admitted"] == admitted  # all still there
        store.lookup("t", np.arange(2, 10, dtype=np.uint64)).result()
        assert store.stats()["admitted"] == admitted + 8  # evicted, admitted again


def test_capacity_without_eviction_refuses_new_ids():
    table = TableConfig(name="t", dim=2, capacity=10, eviction=EvictionConfig(policy="none"))
    with EmbeddingStore([table]) as store:
        rows = store.lookup("t", np.arange(15, dtype=np.uint64)).result()
        assert np.all(rows[:10] != 0) and np.all(rows[10:] == 0)
        stats = store.stats()
        assert stats["rows"] == 10 and stats["capacity_rejected"] == 5


def test_ttl_eviction_by_step():
    table = TableConfig(
        name="t",
        dim=2,
        capacity=1000,
        optimizer=SGD,
        eviction=EvictionConfig(ttl_steps=5, ttl_sweep_every=1),
    )
    with EmbeddingStore([table], num_shards=2) as store:
        old, recent = np.arange(10, dtype=np.uint64), np.arange(10, 20, dtype=np.uint64)
        store.set_step(0)
        store.lookup("t", old)
        store.apply_gradients("t", old, np.ones((10, 2), np.float32))
        for step in range(1, 8):
            store.set_step(step)
            store.lookup("t", recent)
            # Access time is creation or the last update (a training lookup is always updated).
            store.apply_gradients("t", recent, np.zeros((10, 2), np.float32))
        store.flush()
        stats = store.stats()
        assert stats["evicted_ttl"] == 10 and stats["rows"] == 10
        # An evicted id comes back as a fresh row (its update is gone).
        again = store.lookup("t", old).result()
        np.testing.assert_array_equal(again, store.lookup("t", old, train=False).result())
        with EmbeddingStore([table]) as fresh:
            np.testing.assert_array_equal(again, fresh.lookup("t", old).result())
