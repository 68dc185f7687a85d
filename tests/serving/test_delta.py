"""Delta exports: a table read through its chain of versions, newest first, deletions honoured."""

from __future__ import annotations

import numpy as np

from serving.delta import LayeredTable
from serving.model import ServedTable


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
