"""Concurrent lookups and updates from several threads leave an exactly predictable table."""

import threading

import numpy as np
from hybridrec.embedding_store import (
    EmbeddingStore,
    InitializerConfig,
    RaggedIds,
    SparseOptimizerConfig,
    TableConfig,
)


def test_concurrent_lookups_and_updates_lose_nothing():
    # SGD with lr 1 on zero-initialized rows and integer gradients: every partial sum is
    # exact in float32, so the final table is the same in any interleaving.
    table = TableConfig(
        name="t",
        dim=4,
        capacity=100_000,
        initializer=InitializerConfig(kind="zeros"),
        optimizer=SparseOptimizerConfig(name="sgd", learning_rate=1.0),
    )
    threads, rounds, vocab = 6, 40, 500
    expected = np.zeros((vocab, 4), np.float64)
    plans = []
    for t in range(threads):
        rng = np.random.default_rng(t)
        plan = []
        for _ in range(rounds):
            ids = rng.integers(0, vocab, size=256).astype(np.uint64)
            grads = rng.integers(-3, 4, size=(256, 4)).astype(np.float32)
            np.add.at(expected, ids.astype(np.int64), grads)
            plan.append((ids, grads))
        plans.append(plan)
    errors = []
    with EmbeddingStore([table], num_shards=3, num_workers=3) as store:

        def worker(plan):
            try:
                pending = []
                for i, (ids, grads) in enumerate(plan):
                    rows = store.lookup("t", ids).result()
                    assert rows.shape == (256, 4)
                    if i % 2:
                        pooled = store.lookup_features(
                            {"f": RaggedIds(values=ids, offsets=np.array([0, 128, 256]))},
                            feature_tables={"f": "t"},
                        ).result()
                        assert pooled.embeddings.shape == (2, 1, 4)
                    pending.append(store.apply_gradients("t", ids, grads))
                for future in pending:
                    future.result()
            except Exception as error:  # noqa: BLE001 - reported by the main thread
                errors.append(error)

        workers = [threading.Thread(target=worker, args=(plan,)) for plan in plans]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        store.flush()
        assert not errors, errors
        final = store.lookup("t", np.arange(vocab, dtype=np.uint64), train=False).result()
        assert store.stats()["updates"] > 0
    np.testing.assert_array_equal(final, -expected.astype(np.float32))
