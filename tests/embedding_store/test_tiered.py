"""A table larger than its RAM budget: hot rows in RAM, the rest in a zarr3 cold tier."""

import dataclasses

import numpy as np
from hybridrec.embedding_store import (
    EmbeddingStore,
    SparseOptimizerConfig,
    TableConfig,
    TieringConfig,
)


def _run(table, num_shards, steps=30):
    rng = np.random.default_rng(0)
    with EmbeddingStore([table], num_shards=num_shards) as store:
        for step in range(steps):
            store.set_step(step)
            # Zipf-ish: a hot head and a long tail over 4000 ids.
            ids = (rng.zipf(1.3, size=800) % 4000).astype(np.uint64)
            rows = store.lookup("t", ids).result()
            grads = (rows * 0.1 + 0.01).astype(np.float32)  # depends on the values read
            store.apply_gradients("t", ids, grads)
        store.flush()
        stats = store.stats()
        final = store.lookup("t", np.arange(4000, dtype=np.uint64), train=False).result()
        checkpoint = (
            store.checkpoint("memory://tiered/", step=steps) if table.tiering.enabled else None
        )
    return final, stats, checkpoint


def test_tiered_table_matches_in_ram_table(tmp_path):
    in_ram = TableConfig(
        name="t",
        dim=8,
        capacity=10_000,
        optimizer=SparseOptimizerConfig(name="adagrad", learning_rate=0.05),
    )
    tiered = dataclasses.replace(
        in_ram,
        tiering=TieringConfig(ram_rows=1000, path=str(tmp_path / "cold"), chunk_rows=64),
    )
    expected, ram_stats, _ = _run(in_ram, 2)
    final, stats, checkpoint = _run(tiered, 2)
    assert stats["rows"] == ram_stats["rows"] > 2 * 1000  # more rows than the RAM budget
    assert stats["hot_rows"] <= 1000
    assert stats["cold_writes"] > 0 and stats["cold_reads"] > 0  # rows went out and came back
    np.testing.assert_array_equal(final, expected)
    assert any((tmp_path / "cold").rglob("manifest.ocdbt"))  # the cold tier is on disk
    # A tiered table's checkpoint holds every row, hot or cold, and restores anywhere.
    assert checkpoint["rows_written"] == stats["rows"]
    with EmbeddingStore.restore("memory://tiered/", [in_ram], num_shards=3) as restored:
        rows = restored.lookup("t", np.arange(4000, dtype=np.uint64), train=False).result()
    np.testing.assert_array_equal(rows, expected)


def test_cold_log_compaction_keeps_every_row(tmp_path):
    in_ram = TableConfig(
        name="t",
        dim=4,
        capacity=600,
        optimizer=SparseOptimizerConfig(name="sgd", learning_rate=0.5),
    )
    tiered = dataclasses.replace(
        in_ram, tiering=TieringConfig(ram_rows=100, path=str(tmp_path / "cold"), chunk_rows=16)
    )
    results = []
    for config in (in_ram, tiered):
        rng = np.random.default_rng(3)
        with EmbeddingStore([config]) as store:
            for _ in range(60):
                ids = rng.integers(0, 500, size=80).astype(np.uint64)
                store.lookup("t", ids)
                store.apply_gradients("t", ids, np.ones((80, 4), np.float32))
            store.flush()
            stats = store.stats()
            results.append(store.lookup("t", np.arange(500, dtype=np.uint64)).result())
    assert stats["compactions"] > 0 and stats["hot_rows"] <= 100
    np.testing.assert_array_equal(results[1], results[0])
