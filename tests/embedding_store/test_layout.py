"""Deterministic initialization, routing and the vectorized slot map."""

import numpy as np
import pytest
from hybridrec.embedding_store import (
    EmbeddingStore,
    InitializerConfig,
    TableConfig,
    _slot_map,
    shard_of,
)
from hybridrec.embedding_store._slot_map import SlotMap
from hybridrec.embedding_store.routing import partition


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 2**64 - 1, size=n, dtype=np.uint64)


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_initial_rows_identical_across_shard_counts_and_order(kind):
    table = TableConfig(name="t", dim=16, capacity=10_000, initializer=InitializerConfig(kind=kind))
    ids = _ids(2000)
    results = []
    for num_shards, order in ((1, slice(None)), (4, slice(None, None, -1)), (7, slice(None))):
        with EmbeddingStore([table], num_shards=num_shards) as store:
            rows = store.lookup("t", ids[order]).result()
            results.append(rows[order])  # back to the original id order
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])
    values = results[0]
    if kind == "uniform":
        assert values.min() >= -0.01 and values.max() < 0.01
        assert abs(values.mean()) < 1e-3
    else:
        assert abs(values.std() - 0.01) < 5e-4
    assert len(np.unique(values[:, 0])) == len(ids)  # different ids, different rows


def test_seed_changes_values():
    ids = _ids(10)
    rows = []
    for seed in (0, 1):
        table = TableConfig(name="t", dim=4, capacity=100, initializer=InitializerConfig(seed=seed))
        with EmbeddingStore([table]) as store:
            rows.append(store.lookup("t", ids).result())
    assert not np.allclose(rows[0], rows[1])


def test_routing_balanced_and_independent_of_slots():
    ids = _ids(100_000)
    counts = np.bincount(shard_of(ids, 4), minlength=4)
    assert counts.min() > 0.95 * len(ids) / 4
    order, bounds = partition(ids, 4)
    assert np.all(np.diff(shard_of(ids[order], 4)) >= 0)
    assert bounds[-1] == len(ids)
    # Sequential ids (as hashed feature ids often are not) still spread evenly.
    sequential = np.arange(100_000, dtype=np.uint64)
    assert np.bincount(shard_of(sequential, 3)).min() > 0.95 * 100_000 / 3


@pytest.fixture(params=["native", "numpy"])
def kernels(request, monkeypatch):
    """Runs a slot-map test with each kind of probe kernel."""
    if request.param == "numpy":
        monkeypatch.setattr(_slot_map, "native", None)
    return request.param


def test_native_kernels_are_built():
    """The install builds the C kernels; a missing build would silently run the numpy ones."""
    assert _slot_map.native is not None, "embedding_store._native is not built: pip install -e ."


def test_native_and_numpy_kernels_read_each_others_tables(monkeypatch):
    ids = np.unique(_ids(20_000, seed=11))
    slots = np.arange(len(ids), dtype=np.int64)
    native = SlotMap(16)
    native.insert(ids[:10_000], slots[:10_000])
    native.remove(ids[:10_000:4])
    with monkeypatch.context() as patch:
        patch.setattr(_slot_map, "native", None)
        found = native.find(ids[:10_000])  # numpy probes over the native table
        native.insert(ids[10_000:], slots[10_000:])
    expected = slots.copy()
    expected[:10_000:4] = -1
    np.testing.assert_array_equal(found, expected[:10_000])
    np.testing.assert_array_equal(native.find(ids), expected)  # native over numpy's inserts


def test_a_large_native_lookup_in_parts_over_threads_finds_what_small_ones_do():
    ids = np.unique(_ids(150_000, seed=12))
    slot_map = SlotMap(16)
    slot_map.insert(ids[::2], np.arange(len(ids[::2]), dtype=np.int64))
    query = ids[np.random.default_rng(4).permutation(len(ids))]
    assert len(query) >= 4 * _slot_map.FIND_PART  # in parts, wherever there are 4 cores
    small = np.concatenate([slot_map.find(query[i : i + 1000]) for i in range(0, len(query), 1000)])
    np.testing.assert_array_equal(slot_map.find(query), small)
    assert (small >= 0).sum() == len(ids[::2])


def test_slot_map_insert_find_remove_grow(kernels):
    slot_map = SlotMap(16)
    ids = np.unique(_ids(50_000))
    ids = np.concatenate([ids, np.array([2**64 - 1, 2**64 - 2, 0], np.uint64)])  # extremes
    ids = np.unique(ids)
    slots = np.arange(len(ids), dtype=np.int64)
    for start in range(0, len(ids), 7000):  # growth across several rebuilds
        slot_map.insert(ids[start : start + 7000], slots[start : start + 7000])
    assert len(slot_map) == len(ids)
    np.testing.assert_array_equal(slot_map.find(ids), slots)
    absent = _ids(1000, seed=5)
    absent = absent[~np.isin(absent, ids)]
    assert (slot_map.find(absent) == -1).all()
    removed = ids[::3]
    slot_map.remove(removed)
    found = slot_map.find(ids)
    assert (found[::3] == -1).all()
    kept = np.ones(len(ids), bool)
    kept[::3] = False
    np.testing.assert_array_equal(found[kept], slots[kept])
    # Re-inserting removed ids (after tombstones) finds the new slots.
    slot_map.insert(removed, slots[::3] + 10**9)
    np.testing.assert_array_equal(slot_map.find(removed), slots[::3] + 10**9)
    live_ids, live_slots = slot_map.items()
    assert len(live_ids) == len(ids)


def test_slot_map_matches_a_dict_while_it_grows_in_the_background(kernels):
    """Inserts and removals keep landing while the next table is built on another thread."""
    rng = np.random.default_rng(3)
    slot_map, reference = SlotMap(16), {}
    universe = np.concatenate([np.array([0, 2**64 - 1], np.uint64), _ids(60_000, seed=7)])
    universe = np.unique(universe)
    next_slot = 0
    for round_index in range(60):
        absent = np.array(
            [i for i in universe[rng.permutation(len(universe))[:3000]] if int(i) not in reference][
                :1500
            ],
            np.uint64,
        )
        if round_index % 5 == 0 and 0 not in reference and 0 not in absent.tolist():
            absent = np.concatenate([absent, np.zeros(1, np.uint64)])
        slots = np.arange(next_slot, next_slot + len(absent), dtype=np.int64)
        next_slot += len(absent)
        slot_map.insert(absent, slots)
        reference.update(zip(absent.tolist(), slots.tolist(), strict=True))
        present = np.array(list(reference), np.uint64)
        gone = present[rng.random(len(present)) < 0.15]
        slot_map.remove(gone)
        for key in gone.tolist():
            del reference[key]
        assert len(slot_map) == len(reference)
    keys = np.array(list(reference), np.uint64)
    np.testing.assert_array_equal(slot_map.find(keys), np.array(list(reference.values())))
    others = universe[~np.isin(universe, keys)]
    assert (slot_map.find(others) == -1).all()
    live_ids, live_slots = slot_map.items()
    assert dict(zip(live_ids.tolist(), live_slots.tolist(), strict=True)) == reference
