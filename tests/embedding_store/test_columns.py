"""Column-wise sharding: split tables equal the unsplit table exactly; the planner."""

import dataclasses

import numpy as np
import pytest
from hybridrec.embedding_store import (
    EmbeddingStore,
    IncompatibleCheckpointError,
    RaggedIds,
    SparseOptimizerConfig,
    TableConfig,
)
from hybridrec.embedding_store.columns import (
    column_slices,
    describe_plan,
    plan_column_shards,
    shard_loads,
)
from hybridrec.embedding_store.remote.client import connect
from hybridrec.embedding_store.remote.shard_server import ShardServer


def _tables(column_shards):
    return [
        TableConfig(
            name="ads",
            dim=16,
            capacity=10_000,
            optimizer=SparseOptimizerConfig(name="adam", learning_rate=0.05),
            column_shards=column_shards,
        ),
        TableConfig(name="users", dim=16, capacity=10_000, column_shards=min(column_shards, 2)),
    ]


def _drive(store, seed=0):
    """Pooled and single-table lookups and updates; returns every result."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(4):
        store.set_step(step)
        ids = rng.integers(0, 500, size=96).astype(np.uint64)
        features = {
            "a": ids[:32],
            "b": RaggedIds(ids[32:], np.arange(0, 65, 2, dtype=np.int64)),
            "u": ids[:32] + np.uint64(7),
        }
        lookup = store.lookup_features(
            features, feature_tables={"a": "ads", "b": "ads", "u": "users"}
        ).result()
        out.append(lookup.embeddings)
        grads = rng.normal(size=lookup.embeddings.shape).astype(np.float32)
        store.apply_pooled_gradients(lookup, grads).result()
        single = rng.integers(0, 500, size=40).astype(np.uint64)
        out.append(store.lookup("ads", single).result())
        store.apply_gradients("ads", single, rng.normal(size=(40, 16)).astype(np.float32))
    store.flush()
    every = np.arange(500, dtype=np.uint64)
    out += [store.lookup(t, every, train=False).result() for t in ("ads", "users")]
    return out


@pytest.mark.parametrize("column_shards,num_shards", [(2, 4), (4, 4), (2, 1), (4, 3)])
def test_split_tables_equal_the_unsplit_table_exactly(column_shards, num_shards, tmp_path):
    with EmbeddingStore(_tables(1), num_shards=1) as whole:
        expected = _drive(whole)
    with EmbeddingStore(_tables(column_shards), num_shards=num_shards) as split:
        for got, want in zip(_drive(split), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        assert "ads.col1" in split.stats()["tables"]
        split.checkpoint(str(tmp_path), step=4)
        after = split.lookup("ads", np.arange(500, dtype=np.uint64), train=False).result()
    with pytest.raises(IncompatibleCheckpointError, match="need the column_shards"):
        EmbeddingStore.restore(str(tmp_path), _tables(1))
    # The slices restore onto another shard count, each id routed with its slice's offset.
    with EmbeddingStore.restore(str(tmp_path), _tables(column_shards), num_shards=2) as restored:
        np.testing.assert_array_equal(
            restored.lookup("ads", np.arange(500, dtype=np.uint64), train=False).result(), after
        )


def test_slices_of_one_row_sit_on_different_shards():
    store = EmbeddingStore(_tables(4), num_shards=4)
    with store:
        store.lookup("ads", np.array([12345], np.uint64)).result()
        per_shard = [shard.stats()["ads.col0"]["rows"] for shard in store.shards]
        held = [
            sum(shard.stats()[f"ads.col{i}"]["rows"] for i in range(4)) for shard in store.shards
        ]
    assert sum(per_shard) == 1 and held == [1, 1, 1, 1]


def test_remote_servers_host_the_slices():
    tables = _tables(2)
    servers = [ShardServer(tables, [index], num_shards=2) for index in (0, 1)]
    try:
        shards = connect([f"127.0.0.1:{server.port}" for server in servers], tables)
        with EmbeddingStore(tables, num_shards=2, shards=shards) as remote:
            got = _drive(remote)
    finally:
        for server in servers:
            server.drain_and_stop(timeout=5)
    with EmbeddingStore(_tables(1), num_shards=1) as whole:
        for a, b in zip(got, _drive(whole), strict=True):
            np.testing.assert_array_equal(a, b)


def test_bad_column_splits_are_refused():
    with pytest.raises(ValueError, match="column_shards must be >= 1 and divide dim 16"):
        TableConfig(name="t", dim=16, capacity=10, column_shards=3)
    with pytest.raises(ValueError, match="rowwise_adagrad needs whole rows"):
        TableConfig(
            name="t",
            dim=16,
            capacity=10,
            column_shards=2,
            optimizer=SparseOptimizerConfig(name="rowwise_adagrad"),
        )
    assert [t.name for t in column_slices(_tables(2)[0])] == ["ads.col0", "ads.col1"]


def test_planner_splits_the_wide_table_with_few_rows_per_batch():
    rng = np.random.default_rng(0)
    tables = [
        TableConfig(name="items", dim=16, capacity=10**6),  # many distinct rows per batch
        TableConfig(name="country", dim=256, capacity=100),  # 8 hot rows, very wide
        TableConfig(name="narrow", dim=4, capacity=100),  # too narrow to split
    ]
    accesses = {
        "items": [((rng.zipf(1.1, 1024) - 1) % 10**6).astype(np.uint64) for _ in range(20)],
        "country": [((rng.zipf(1.5, 1024) - 1) % 8).astype(np.uint64) for _ in range(20)],
        "narrow": [((rng.zipf(1.5, 1024) - 1) % 8).astype(np.uint64) for _ in range(20)],
    }
    plan = plan_column_shards(tables, accesses, num_shards=4)
    assert plan == {"items": 1, "country": 4, "narrow": 1}
    before = shard_loads(tables, accesses, 4)
    planned = [dataclasses.replace(t, column_shards=plan[t.name]) for t in tables]
    after = shard_loads(planned, accesses, 4)
    assert after.max() / after.mean() < 1.05 < before.max() / before.mean()
    assert np.isclose(after.sum(), before.sum())  # the same bytes, spread differently
    # The simulation counts what a store over 4 shards really sends them.
    with EmbeddingStore(planned, num_shards=4) as store:
        for batch in accesses["country"]:
            store.lookup("country", np.unique(batch)).result()
        served = [
            sum(4 * 256 // 4 * c["lookups"] for n, c in shard.stats().items() if "country" in n)
            for shard in store.shards
        ]
    alone = shard_loads(planned[1:2], {"country": accesses["country"]}, 4)
    np.testing.assert_allclose(alone / 2, served)
    text = describe_plan(tables, plan, accesses, 4)
    assert "country: dim 256" in text and "column_shards 4" in text


def test_a_checkpoint_reads_a_column_split_table_as_the_unsplit_one(tmp_path):
    """read_table_rows joins a table's column slices: the rows (what `hybridrec export`
    serves) equal the checkpoint of the same training on the unsplit table."""
    from hybridrec.embedding_store.checkpoint import read_table_rows

    rows = {}
    for column_shards in (1, 4):
        url = str(tmp_path / f"split{column_shards}")
        with EmbeddingStore(_tables(column_shards), num_shards=4) as store:
            _drive(store)
            store.checkpoint(url, step=4)
        rows[column_shards] = read_table_rows(url, 4, "ads")
    (whole_ids, whole), (split_ids, split) = rows[1], rows[4]
    np.testing.assert_array_equal(split_ids, whole_ids)
    np.testing.assert_array_equal(split, whole)
    assert split.shape == (len(whole_ids), 16) and np.abs(split).sum() > 0
