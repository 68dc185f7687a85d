"""Pooled lookups and their backward pass against a numpy reference."""

import numpy as np
import pytest
from hybridrec.embedding_store import EmbeddingStore, RaggedIds, SparseOptimizerConfig, TableConfig

DIM = 8


def _tables():
    sgd = SparseOptimizerConfig(name="sgd", learning_rate=1.0)
    return [
        TableConfig(name="items", dim=DIM, capacity=10_000, optimizer=sgd),
        TableConfig(name="users", dim=DIM, capacity=10_000, optimizer=sgd),
    ]


def _batch(rng, batch=32):
    lengths = rng.integers(0, 5, size=batch)  # includes empty bags
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {
        "item": rng.integers(0, 50, size=batch).astype(np.uint64),
        "history": RaggedIds(
            values=rng.integers(0, 50, size=offsets[-1]).astype(np.uint64), offsets=offsets
        ),
        "user": rng.integers(100, 140, size=batch).astype(np.uint64),
    }


FEATURE_TABLES = {"item": "items", "history": "items", "user": "users"}


def _reference_pool(rows_of, features, pooling):
    """rows_of(table, ids) -> [n, dim]; loops per bag, the obvious way."""
    out = []
    for name, ids in features.items():
        table = FEATURE_TABLES[name]
        if isinstance(ids, RaggedIds):
            bags = []
            for b in range(len(ids.offsets) - 1):
                bag = ids.values[ids.offsets[b] : ids.offsets[b + 1]]
                total = rows_of(table, bag).sum(axis=0) if len(bag) else np.zeros(DIM)
                scale = {"sum": 1, "mean": max(len(bag), 1), "sqrtn": np.sqrt(max(len(bag), 1))}
                bags.append(total / scale[pooling])
            out.append(np.stack(bags))
        else:
            out.append(rows_of(table, ids))
    return np.stack(out, axis=1)


@pytest.mark.parametrize("pooling", ["sum", "mean", "sqrtn"])
def test_pooled_forward_and_backward_match_reference(pooling):
    rng = np.random.default_rng(1)
    features = _batch(rng)
    with EmbeddingStore(_tables(), num_shards=3) as store:
        everything = {
            t: store.lookup(t, np.arange(200, dtype=np.uint64)).result() for t in ("items", "users")
        }

        def rows_of(table, ids):
            return everything[table][ids.astype(np.int64)]

        result = store.lookup_features(
            features, feature_tables=FEATURE_TABLES, pooling=pooling
        ).result()
        assert result.features == ("item", "history", "user")
        expected = _reference_pool(rows_of, features, pooling)
        np.testing.assert_allclose(result.embeddings, expected, rtol=1e-5, atol=1e-7)

        # Backward: SGD with lr 1 subtracts dL/d(row); the reference accumulates per occurrence.
        grads = rng.normal(size=result.embeddings.shape).astype(np.float32)
        store.apply_pooled_gradients(result, grads).result()
        expected_rows = {t: v.copy() for t, v in everything.items()}
        for f, (name, ids) in enumerate(features.items()):
            table = expected_rows[FEATURE_TABLES[name]]
            if isinstance(ids, RaggedIds):
                for b in range(len(ids.offsets) - 1):
                    bag = ids.values[ids.offsets[b] : ids.offsets[b + 1]]
                    scale = {"sum": 1, "mean": len(bag), "sqrtn": np.sqrt(len(bag))}[pooling]
                    for i in bag:
                        table[int(i)] -= grads[b, f] / scale
            else:
                for b, i in enumerate(ids):
                    table[int(i)] -= grads[b, f]
        for t in ("items", "users"):
            after = store.lookup(t, np.arange(200, dtype=np.uint64), train=False).result()
            np.testing.assert_allclose(after, expected_rows[t], rtol=1e-5, atol=1e-6)


def test_single_table_single_valued_is_a_plain_gather():
    with EmbeddingStore(_tables(), num_shards=2) as store:
        ids = np.array([3, 3, 9], np.uint64)
        pooled = store.lookup_features({"item": ids}, feature_tables={"item": "items"}).result()
        np.testing.assert_array_equal(pooled.embeddings[:, 0], store.lookup("items", ids).result())
