"""The native kernels give the numpy kernels' results, bit for bit, and the store agrees."""

import numpy as np
import pytest
from hybridrec.embedding_store import (
    EmbeddingStore,
    InitializerConfig,
    RaggedIds,
    SparseOptimizerConfig,
    TableConfig,
    _arrays,
    _initializers,
    _native,
    _optimizers,
    _slot_map,
)

DIM = 8


def _numpy_kernels(patch):
    for module in (_arrays, _initializers, _optimizers, _slot_map):
        patch.setattr(module, "native", None)


def _both(monkeypatch, run):
    """run() with the native kernels, then with the numpy ones."""
    native = run()
    with monkeypatch.context() as patch:
        _numpy_kernels(patch)
        numpy = run()
    return native, numpy


def test_dedupe_and_sums_match_numpy(monkeypatch):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 500, 4000).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    rows = rng.normal(size=(4000, DIM)).astype(np.float32)
    (u_native, inv_native), (u_numpy, inv_numpy) = _both(
        monkeypatch, lambda: _arrays.unique_inverse(ids)
    )
    np.testing.assert_array_equal(u_native[inv_native], ids)
    np.testing.assert_array_equal(np.sort(u_native), u_numpy)
    np.testing.assert_array_equal(u_numpy[inv_numpy], ids)
    sums = _both(monkeypatch, lambda: _arrays.sum_by_inverse(rows, inv_native, len(u_native)))
    np.testing.assert_array_equal(sums[0], sums[1])  # same order of additions: same bits
    keys, summed = _arrays.sum_duplicates(ids, rows)
    order = np.argsort(keys)
    np.testing.assert_array_equal(summed[order], sums[0][np.argsort(u_native)])
    unique = np.arange(10, dtype=np.int64)
    np.testing.assert_array_equal(_arrays.sum_duplicates(unique, rows[:10])[1], rows[:10])


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_in_place_step_matches_numpy_and_skips_nonfinite_rows(monkeypatch, name):
    config = SparseOptimizerConfig(name=name, learning_rate=0.3)
    rng = np.random.default_rng(1)
    values = rng.normal(size=(50, DIM)).astype(np.float32)
    state = np.full((50, config.state_width(DIM)), 0.1, np.float32)
    state[:5] = 0.0  # a zero accumulator takes the zero-scale branch
    lines = rng.permutation(50)[:30].astype(np.int64)
    grads = rng.normal(size=(30, DIM)).astype(np.float32)
    grads[:3] = 0.0
    grads[7, 2], grads[11, 0] = np.nan, np.inf

    def step():
        v, s = values.copy(), state.copy()
        skipped = _optimizers.apply_in_place(config, v, s, lines, grads)
        return v, s, skipped

    (v1, s1, k1), (v2, s2, k2) = _both(monkeypatch, step)
    assert k1 == k2 == 2
    np.testing.assert_array_equal(v1, v2)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(v1[lines[[7, 11]]], values[lines[[7, 11]]])  # untouched


@pytest.mark.parametrize(
    "config",
    [
        InitializerConfig(),
        InitializerConfig(kind="uniform", low=-0.3, high=0.7, seed=5),
        InitializerConfig(kind="normal", mean=0.1, stddev=0.5, seed=2),
    ],
    ids=["uniform", "uniform-seeded", "normal"],
)
def test_initial_rows_match_numpy_whole_and_into_rows_of_an_array(monkeypatch, config):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True)
    native, numpy = _both(monkeypatch, lambda: _initializers.initial_rows(config, ids, 24, 40))
    if config.kind == "uniform":
        np.testing.assert_array_equal(native, numpy)
    else:  # libm's log and cos against numpy's: at most a rare last bit
        np.testing.assert_allclose(native, numpy, rtol=1e-6, atol=1e-7)
        assert np.mean(native == numpy) > 0.999
    spread = (config.high - config.low) / 12**0.5 if config.kind == "uniform" else config.stddev
    assert abs(native.std() / spread - 1) < 0.05  # the distribution's spread, not zeros
    # columns 40.. of a row are columns 40.. of the whole row: any column slicing agrees
    whole = _initializers.initial_rows(config, ids[:10], 64)
    np.testing.assert_array_equal(whole[:, 40:], native[:10])
    # written into chosen rows of a larger array, the others left alone
    at = rng.permutation(5000)[: len(ids)]
    out = np.full((5000, 24), 7.0, np.float32)
    placed = _initializers.initial_rows(config, ids, 24, 40, out=out, at=at)
    assert placed is out
    np.testing.assert_array_equal(out[at], native)
    left = np.setdiff1d(np.arange(5000), at)
    assert (out[left] == 7.0).all()
    with monkeypatch.context() as patch:
        _numpy_kernels(patch)
        out_numpy = np.full((5000, 24), 7.0, np.float32)
        _initializers.initial_rows(config, ids, 24, 40, out=out_numpy, at=at)
    np.testing.assert_array_equal(out_numpy[at], numpy)
    # split over threads (a large initialization), the same rows
    with monkeypatch.context() as patch:
        patch.setattr(_initializers, "PART_VALUES", 24 * 500)
        split = np.full((5000, 24), 7.0, np.float32)
        _initializers.initial_rows(config, ids, 24, 40, out=split, at=at)
        np.testing.assert_array_equal(split, out)
        with pytest.raises(IndexError, match="out of range"):
            _initializers.initial_rows(config, ids, 24, out=split, at=np.r_[at[:-1], 5000])
    with pytest.raises(IndexError, match="out of range"):
        _initializers.initial_rows(config, ids[:2], 24, out=out, at=np.array([0, 5000]))
    with pytest.raises(ValueError, match=r"must be \[rows, 12\]"):
        _initializers.initial_rows(config, ids[:2], 12, out=out, at=np.array([0, 1]))


def test_sparse_step_rejects_rows_outside_the_table():
    values = np.zeros((4, DIM), np.float32)
    with pytest.raises(IndexError, match="out of range"):
        _native.sparse_step(
            1,
            values,
            values.copy(),
            np.array([9]),
            np.ones((1, DIM), np.float32),
            DIM,
            DIM,
            0.1,
            1e-7,
        )


def _train(features_of):
    """A store trained on pooled lookups (single- and multi-valued): its rows and stats."""
    table = TableConfig(
        name="t",
        dim=DIM,
        capacity=5000,
        optimizer=SparseOptimizerConfig(name="adagrad", learning_rate=0.2),
    )
    rng = np.random.default_rng(2)
    with EmbeddingStore([table], num_shards=2) as store:
        for _ in range(6):
            features = features_of(rng)
            lookup = store.lookup_features(
                features, feature_tables=dict.fromkeys(features, "t"), pooling="mean"
            ).result()
            grads = rng.normal(size=lookup.embeddings.shape).astype(np.float32)
            store.apply_pooled_gradients(lookup, grads).result()
        everything = np.arange(300, dtype=np.uint64)
        return lookup.embeddings, store.lookup("t", everything, train=False).result()


def _single(rng):
    return {f"f{i}": rng.integers(0, 300, 64).astype(np.uint64) for i in range(3)}


def _mixed(rng):
    counts = rng.integers(0, 4, 64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    bag = RaggedIds(rng.integers(0, 300, offsets[-1]).astype(np.uint64), offsets)
    return {"a": rng.integers(0, 300, 64).astype(np.uint64), "bag": bag}


@pytest.mark.parametrize("features_of", [_single, _mixed], ids=["single", "multi-valued"])
def test_store_trains_to_the_same_bits_with_either_kernels(monkeypatch, features_of):
    (pooled_native, rows_native), (pooled_numpy, rows_numpy) = _both(
        monkeypatch, lambda: _train(features_of)
    )
    np.testing.assert_array_equal(pooled_native, pooled_numpy)
    np.testing.assert_array_equal(rows_native, rows_numpy)
