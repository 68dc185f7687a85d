"""Delta exports: a table read through its chain of versions, newest first, deletions honoured."""

from __future__ import annotations

import numpy as np
from hybridrec.embedding_store import EmbeddingStore, TableConfig, checkpoint
from hybridrec.serving.delta import LayeredTable, changed_rows
from hybridrec.serving.model import ServedTable


def _table(directory, ids, values, deleted=None) -> tuple[ServedTable, np.ndarray]:
    directory.mkdir(parents=True)
    order = np.argsort(ids)
    np.save(directory / "ids.npy", np.asarray(ids, np.uint64)[order])
    np.save(directory / "values.npy", np.asarray(values, np.float32).reshape(len(ids), 2)[order])
    removed = np.sort(np.asarray(deleted if deleted is not None else [], np.uint64))
    return ServedTable(directory, "t", "fp32"), removed


def test_layered_table_takes_the_newest_row_and_hides_deleted_ids(tmp_path):
    base, base_deleted = _table(tmp_path / "1", [1, 2, 3, 4], [[1, 1], [2, 2], [3, 3], [4, 4]])
    middle, middle_deleted = _table(tmp_path / "2", [2, 5], [[20, 20], [50, 50]], deleted=[3])
    newest, newest_deleted = _table(tmp_path / "3", [5, 3], [[500, 500], [300, 300]], deleted=[4])
    table = LayeredTable(
        [newest, middle, base], [newest_deleted, middle_deleted, np.zeros(0, np.uint64)]
    )
    query = np.array([1, 2, 3, 4, 5, 6], np.uint64)
    index, found = table.find(query)
    # 3 was deleted in version 2 and written again in 3; 4 deleted in 3; 6 never existed
    assert found.tolist() == [True, True, True, False, True, False]
    rows = table.rows(index[found])
    np.testing.assert_array_equal(rows[:, 0], [1, 20, 300, 500])


def test_changed_rows_applied_to_the_base_give_the_newer_snapshot(tmp_path):
    url = str(tmp_path / "ckpt")
    table = TableConfig(name="t", dim=2, capacity=50)
    with EmbeddingStore([table], num_shards=3) as store:
        store.lookup("t", np.arange(50, dtype=np.uint64)).result()
        store.checkpoint(url, step=1)
        for step, first in ((5, 100), (9, 200)):  # each evicts old rows and updates some
            store.set_step(step)
            store.lookup("t", np.arange(first, first + 10, dtype=np.uint64)).result()
            ids = np.arange(first, first + 5, dtype=np.uint64)
            store.apply_gradients("t", ids, np.ones((5, 2), np.float32))
            store.checkpoint(url, step=step)
    base_ids, base_values = checkpoint.read_table_rows(url, 1, "t")
    ids, values, deleted = changed_rows(url, 1, 9, "t")
    assert len(deleted) > 0  # evictions since the base are carried
    keep = ~np.isin(base_ids, np.concatenate([ids, deleted]))
    merged_ids = np.concatenate([base_ids[keep], ids])
    merged_values = np.concatenate([base_values[keep], values])
    order = np.argsort(merged_ids)
    expected_ids, expected_values = checkpoint.read_table_rows(url, 9, "t")
    np.testing.assert_array_equal(merged_ids[order], expected_ids)
    np.testing.assert_array_equal(merged_values[order], expected_values)
    assert changed_rows(url, 2, 9, "t") is None  # not a step of the chain: no delta
