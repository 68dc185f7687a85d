"""A hot-row cache's admission rule (`training.hot_rows`): frequent ids come in, rows the
batch uses never leave, evicted ids wait out the staleness bound, counts age."""

from __future__ import annotations

import numpy as np
from hybridrec.training.hot_rows import HotRows


def _batch(hot: HotRows, ids, held: dict[int, int], times: int = 1):
    ids = np.asarray(ids, np.uint64)
    slots = np.asarray([held.get(int(i), -1) for i in ids], np.int64)
    estimate = hot.seen(ids, np.full(len(ids), times))
    admitted, rows = hot.choose(ids, estimate, slots)
    leaving = {i: s for i, s in held.items() if s in set(rows.tolist())}
    for i in leaving:
        del held[i]
    hot.evicted(np.asarray(list(leaving), np.uint64))
    held.update({int(ids[a]): int(r) for a, r in zip(admitted, rows, strict=True)})
    return set(leaving)


def test_a_full_cache_admits_only_ids_seen_more_often_than_the_rows_they_replace():
    hot, held = HotRows(4, width_bits=12, period=10**6), {}
    _batch(hot, [1, 2, 3, 4], held, times=5)  # fills the free rows, whatever their counts
    assert sorted(held) == [1, 2, 3, 4] and hot.used == 4
    assert _batch(hot, [7], held) == set() and 7 not in held  # seen once: not above 5
    for seen in range(1, 7):
        evicted = _batch(hot, [8, 1, 2, 3], held)
        assert (8 in held) == (seen > 5), seen  # in once seen more often than 4's 5 times
    assert evicted == {4}  # the one row the batch does not use leaves
    assert sorted(held) == [1, 2, 3, 8]


def test_rows_of_the_batch_stay_and_evicted_ids_wait_out_the_cooldown():
    hot, held = HotRows(2, cooldown=2, width_bits=12), {}
    _batch(hot, [1, 2], held)
    # 3 is far more frequent, but both held rows are in the batch: nothing leaves
    assert _batch(hot, [1, 2, 3], held, times=9) == set() and 3 not in held
    assert _batch(hot, [3], held, times=9) == {1}  # a tie of counts: the first row leaves
    # 1 comes back hot at once, but was evicted within the last 2 batches: kept out
    _batch(hot, [1], held, times=50)
    assert 1 not in held
    _batch(hot, [9], held)
    _batch(hot, [1], held, times=50)  # the cooldown is over
    assert 1 in held


def test_counts_halve_so_an_old_hot_set_can_be_replaced():
    hot, held = HotRows(1, width_bits=12, period=40), {}
    _batch(hot, [1], held, times=30)
    for _ in range(8):  # each batch adds 5 accesses; the halvings age 1's count
        _batch(hot, [2], held, times=5)
    assert 2 in held and 1 not in held
