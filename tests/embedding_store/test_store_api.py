"""The public API end to end on a small store: lookups, updates, pooling, stats."""

import numpy as np
import pytest
from hybridrec.embedding_store import (
    EmbeddingStore,
    LocalShard,
    RaggedIds,
    SparseOptimizerConfig,
    TableConfig,
)


def _table(**overrides):
    settings = {
        "name": "ads",
        "dim": 4,
        "capacity": 1000,
        "optimizer": SparseOptimizerConfig(name="sgd", learning_rate=0.5),
    }
    return TableConfig(**{**settings, **overrides})


@pytest.mark.parametrize("num_shards", [1, 3])
def test_lookup_apply_round_trip(num_shards):
    with EmbeddingStore([_table()], num_shards=num_shards) as store:
        ids = np.array([5, 7, 5, 11], np.uint64)
        before = store.lookup("ads", ids).result()
        assert before.shape == (4, 4) and before.dtype == np.float32
        np.testing.assert_array_equal(before[0], before[2])
        grads = np.ones((4, 4), np.float32)
        store.apply_gradients("ads", ids, grads).result()
        after = store.lookup("ads", ids).result()
        # id 5 appears twice: its gradients are summed before the SGD step.
        np.testing.assert_allclose(after[0], before[0] - 0.5 * 2, rtol=1e-6)
        np.testing.assert_allclose(after[1], before[1] - 0.5, rtol=1e-6)
        stats = store.stats()
        assert stats["rows"] == 3 and stats["tables"]["ads"]["admitted"] == 3
        assert stats["num_shards"] == num_shards


def test_lookup_features_one_request_per_shard():
    calls = []

    class CountingShard(LocalShard):
        def lookup(self, requests, *, train=True):
            calls.append((self.shard_index, "lookup"))
            return super().lookup(requests, train=train)

        def apply_gradients(self, updates):
            calls.append((self.shard_index, "apply_gradients"))
            super().apply_gradients(updates)

    tables = [_table(), _table(name="users")]
    shards = [CountingShard(tables, shard_index=i, num_shards=2) for i in range(2)]
    with EmbeddingStore(tables, shards=shards) as store:
        features = {
            "a": np.array([1, 2, 3], np.uint64),
            "b": RaggedIds(
                values=np.array([1, 4, 9, 2], np.uint64), offsets=np.array([0, 2, 2, 4])
            ),
            "c": np.array([8, 8, 9], np.uint64),
        }
        result = store.lookup_features(
            features, feature_tables={"a": "ads", "b": "ads", "c": "users"}
        ).result()
        assert result.embeddings.shape == (3, 3, 4)
        assert sorted(calls) == [(0, "lookup"), (1, "lookup")]
        calls.clear()
        store.apply_pooled_gradients(result, np.ones((3, 3, 4), np.float32)).result()
        assert sorted(calls) == [(0, "apply_gradients"), (1, "apply_gradients")]


@pytest.mark.parametrize("num_shards", [1, 3])
def test_repeated_ids_go_to_their_shard_once(num_shards):
    """A lookup or update with repeats sends each distinct id once; the results are those
    of sending every occurrence (rows expanded back, gradients summed in call order)."""
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 50, 400).astype(np.uint64)
    grads = rng.normal(size=(400, 4)).astype(np.float32)
    adagrad = SparseOptimizerConfig(name="adagrad", learning_rate=0.3)
    with EmbeddingStore([_table(optimizer=adagrad)], num_shards=num_shards) as store:
        rows = store.lookup("ads", ids).result()
        assert store.stats()["lookups"] == len(np.unique(ids))
        store.apply_gradients("ads", ids, grads).result()
        after = store.lookup("ads", ids, train=False).result()
    with EmbeddingStore([_table(optimizer=adagrad)], num_shards=num_shards) as store:
        for i in range(len(ids)):  # one occurrence per call: the first sighting creates the row
            np.testing.assert_array_equal(
                store.lookup("ads", ids[i : i + 1]).result(), rows[i : i + 1]
            )
        unique, inverse = np.unique(ids, return_inverse=True)
        summed = np.zeros((len(unique), 4), np.float32)
        for i, g in zip(inverse, grads, strict=True):
            summed[i] += g  # in call order
        store.apply_gradients("ads", unique, summed).result()
        np.testing.assert_array_equal(store.lookup("ads", ids, train=False).result(), after)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_a_lookup_of_no_ids_is_empty_and_its_update_a_no_op(num_shards):
    # a sequence batch whose items a hot-row cache holds all looks up none from the host
    with EmbeddingStore([_table()], num_shards=num_shards) as store:
        lookup = store.lookup_features(
            {"item": np.zeros(0, np.uint64)}, feature_tables={"item": "ads"}
        ).result()
        assert lookup.embeddings.shape == (0, 1, 4)
        store.apply_pooled_gradients(lookup, np.zeros((0, 1, 4), np.float32)).result()
        assert store.stats()["rows"] == 0
