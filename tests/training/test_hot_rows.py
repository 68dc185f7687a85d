"""A hot-row cache's admission rule (`training.device.hot_rows`): frequent ids come in, rows the
batch uses never leave, evicted ids wait out the staleness bound, counts age."""

from __future__ import annotations

import numpy as np
from hybridrec.training.device.hot_rows import HotRows


def _batch(hot: HotRows, ids, held: dict[int, int], times=1):
    """One batch of `ids` (each seen `times`: one count or one per id) through the cache
    whose id -> row map is `held` (updated); the ids it evicted."""
    ids = np.asarray(ids, np.uint64)
    slots = np.asarray([held.get(int(i), -1) for i in ids], np.int64)
    estimate = hot.seen(ids, np.broadcast_to(times, len(ids)))
    admitted, rows = hot.choose(ids, estimate, slots)
    taken = set(rows.tolist())
    leaving = {i: s for i, s in held.items() if s in taken}
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


def _fill(hot: HotRows, ids: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Gives `ids` (seen `times` each) the cache's free rows; their rows."""
    admitted, rows = hot.choose(ids, hot.seen(ids, times), np.full(len(ids), -1, np.int64))
    assert len(admitted) == len(ids)
    out = np.empty(len(ids), np.int64)
    out[admitted] = rows
    return out


def test_a_large_cache_evicts_from_a_sample_only_rows_its_candidates_beat():
    # past exact_below the least used rows are looked for in a sample of the cache
    hot = HotRows(100_000, width_bits=20, period=10**9, exact_below=0)
    ids = np.arange(1, 100_001, dtype=np.uint64)
    times = np.where(np.arange(100_000) % 2 == 0, 100, 1)  # even rows hot, odd rows cold
    rows = _fill(hot, ids, times)
    in_batch = rows[:2_000]  # held ids this batch uses again: never evicted
    batch = np.concatenate([ids[:2_000], np.arange(10**6, 10**6 + 3_000, dtype=np.uint64)])
    slots = np.concatenate([in_batch, np.full(3_000, -1, np.int64)])
    occurrences = np.concatenate([np.ones(2_000), np.full(3_000, 5)]).astype(np.int64)
    admitted, taken = hot.choose(batch, hot.seen(batch, occurrences), slots)
    assert len(admitted) == 3_000  # each seen 5 times: every one beats a cold row
    assert set(admitted.tolist()) == set(range(2_000, 5_000))
    hot_rows = set(rows[times == 100].tolist())
    assert not set(taken.tolist()) & hot_rows  # no row seen 100 times leaves for them
    assert not set(taken.tolist()) & set(in_batch.tolist())
    assert len(set(taken.tolist())) == 3_000


def test_a_sample_is_drawn_for_the_candidates_that_could_come_in():
    hot = HotRows(400_000, width_bits=21, period=10**9, exact_below=0)
    _fill(hot, np.arange(1, 400_001, dtype=np.uint64), np.ones(400_000, np.int64))
    # 20,000 candidates beat any row: far more than a first sample (8 x 512 draws) holds
    batch = np.arange(10**6, 10**6 + 20_000, dtype=np.uint64)
    admitted, taken = hot.choose(
        batch, hot.seen(batch, np.full(20_000, 3)), np.full(20_000, -1, np.int64)
    )
    assert len(admitted) == 20_000 and len(np.unique(taken)) == 20_000


def test_sampled_choices_are_the_same_on_every_process_and_hold_the_hot_set():
    """Two caches fed the same stream choose alike (every process of a job keeps its own
    HotRows), and a sampled cache holds about as many lookups as one comparing every row."""
    rng = np.random.default_rng(0)
    stream = [
        np.unique((rng.zipf(1.2, 6_000) % 500_000).astype(np.uint64), return_counts=True)
        for _ in range(60)
    ]
    caches = [
        HotRows(20_000, cooldown=2, exact_below=0),
        HotRows(20_000, cooldown=2, exact_below=0),
        HotRows(20_000, cooldown=2, exact_below=1 << 30),  # every row
    ]
    helds: list[dict[int, int]] = [{}, {}, {}]
    hits, lookups, history = [0, 0, 0], 0, [[], []]
    for ids, times in stream:
        lookups += int(times.sum())
        for index, (hot, held) in enumerate(zip(caches, helds, strict=True)):
            hits[index] += int(sum(t for i, t in zip(ids, times, strict=True) if int(i) in held))
            evicted = _batch(hot, ids, held, times)
            if index < 2:  # what each batch evicted, and which id holds which row after it
                history[index].append((evicted, dict(held)))
    assert history[0] == history[1]
    assert caches[0].used == 20_000  # full: the later batches evicted
    sampled, exact = hits[0] / lookups, hits[2] / lookups
    assert abs(sampled - exact) < 0.01, (sampled, exact)
