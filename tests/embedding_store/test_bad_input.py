"""Bad input is a clear UserError or a counted skip; no row is ever silently corrupted."""

import numpy as np
import pytest
from hybridrec.common import config
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.embedding_store import (
    EmbeddingStore,
    InvalidInputError,
    RaggedIds,
    SparseOptimizerConfig,
    TableConfig,
    UnknownTableError,
)


@pytest.fixture
def store():
    table = TableConfig(
        name="t", dim=4, capacity=100, optimizer=SparseOptimizerConfig(name="adagrad")
    )
    with EmbeddingStore([table], num_shards=2) as s:
        yield s


@pytest.mark.parametrize(
    "ids, message",
    [
        (np.array([1, 2], np.int64), "uint64.*int64"),
        (np.array([1.0, 2.0]), "uint64.*float64"),
        (np.array([[1, 2]], np.uint64), r"1-D.*shape \(1, 2\)"),
        ([1, 2], "list"),
    ],
)
def test_bad_ids(store, ids, message):
    with pytest.raises(InvalidInputError, match=message):
        store.lookup("t", ids)
    with pytest.raises(InvalidInputError, match=message):
        store.apply_gradients("t", ids, np.zeros((2, 4), np.float32))


@pytest.mark.parametrize(
    "grads, message",
    [
        (np.zeros((2, 3), np.float32), r"shape \[2, 4\].*got \[2, 3\]"),
        (np.zeros((3, 4), np.float32), r"shape \[2, 4\].*got \[3, 4\]"),
        (np.zeros((2, 4), np.int32), "float numpy array, got int32"),
        (None, "NoneType"),
    ],
)
def test_bad_gradients(store, grads, message):
    ids = np.array([1, 2], np.uint64)
    before = store.lookup("t", ids).result()
    with pytest.raises(InvalidInputError, match=message):
        store.apply_gradients("t", ids, grads)
    np.testing.assert_array_equal(store.lookup("t", ids).result(), before)


def test_nonfinite_gradients_are_skipped_and_counted(store):
    ids = np.array([1, 2, 3, 2], np.uint64)
    before = store.lookup("t", ids).result()
    grads = np.ones((4, 4), np.float32)
    grads[0, 1] = np.nan  # id 1: skipped
    grads[3, 0] = np.inf  # id 2 (second occurrence): the summed row is not finite, skipped
    store.apply_gradients("t", ids, grads).result()
    after = store.lookup("t", ids).result()
    np.testing.assert_array_equal(after[[0, 1, 3]], before[[0, 1, 3]])
    assert np.all(after[2] < before[2]) and np.all(np.isfinite(after))
    stats = store.stats()
    assert stats["nonfinite_skipped"] == 2 and stats["updates"] == 1


def test_unknown_table_and_feature_errors(store):
    with pytest.raises(UnknownTableError, match="'nope'.*tables: t"):
        store.lookup("nope", np.zeros(1, np.uint64))
    ids = np.array([1, 2], np.uint64)
    with pytest.raises(InvalidInputError, match="'f' has no entry in feature_tables"):
        store.lookup_features({"f": ids}, feature_tables={})
    with pytest.raises(UnknownTableError, match="unknown table 'x'"):
        store.lookup_features({"f": ids}, feature_tables={"f": "x"})
    with pytest.raises(InvalidInputError, match="batch 3, earlier features 2"):
        store.lookup_features(
            {"f": ids, "g": np.arange(3, dtype=np.uint64)}, feature_tables={"f": "t", "g": "t"}
        )
    with pytest.raises(InvalidInputError, match="offsets must start at 0"):
        bad = RaggedIds(values=ids, offsets=np.array([0, 3]))
        store.lookup_features({"f": bad}, feature_tables={"f": "t"})
    with pytest.raises(InvalidInputError, match="pooling"):
        store.lookup_features({"f": ids}, feature_tables={"f": "t"}, pooling="max")
    pooled = store.lookup_features({"f": ids}, feature_tables={"f": "t"}).result()
    with pytest.raises(InvalidInputError, match=r"shape \[2, 1, 4\]"):
        store.apply_pooled_gradients(pooled, np.zeros((2, 2, 4), np.float32))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="unknown config key optimizer.lerning_rate"):
        config.from_dict(
            TableConfig,
            {"name": "t", "dim": 4, "capacity": 10, "optimizer": {"lerning_rate": 0.1}},
        )
    with pytest.raises(ConfigError, match="optimizer.name.*'rmsprop' is not one of"):
        config.from_dict(
            TableConfig, {"name": "t", "dim": 4, "capacity": 10, "optimizer": {"name": "rmsprop"}}
        )
    with pytest.raises(ConfigError, match="dim must be >= 1"):
        config.from_dict(TableConfig, {"name": "t", "dim": 0, "capacity": 10})
    with pytest.raises(ConfigError, match="admission.probability"):
        config.from_dict(
            TableConfig,
            {"name": "t", "dim": 4, "capacity": 10, "admission": {"probability": 0.0}},
        )
    table = config.from_dict(
        TableConfig,
        {"name": "t", "dim": 4, "capacity": 10, "storage_dtype": "bfloat16"},
    )
    assert config.from_dict(TableConfig, config.to_dict(table)) == table


def test_closed_store_and_duplicate_tables():
    table = TableConfig(name="t", dim=4, capacity=10)
    with pytest.raises(InvalidInputError, match="duplicate table names"):
        EmbeddingStore([table, table])
    store = EmbeddingStore([table])
    store.close()
    with pytest.raises(UserError, match="closed"):
        store.lookup("t", np.zeros(1, np.uint64))
