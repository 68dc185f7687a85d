"""Sparse optimizers match the same optimizer applied densely (optax, or numpy)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hybridrec.embedding_store import EmbeddingStore, SparseOptimizerConfig, TableConfig

VOCAB, DIM, STEPS = 40, 8, 6


def _batches(seed=0):
    """Ids with repeats within a batch, and new ids appearing over time."""
    rng = np.random.default_rng(seed)
    for step in range(STEPS):
        ids = rng.integers(0, 10 + 5 * step, size=24).astype(np.uint64)
        grads = rng.normal(size=(24, DIM)).astype(np.float32)
        yield ids, grads


def _run_store(optimizer, num_shards, storage_dtype="float32"):
    table = TableConfig(
        name="t", dim=DIM, capacity=1000, optimizer=optimizer, storage_dtype=storage_dtype
    )
    with EmbeddingStore([table], num_shards=num_shards) as store:
        everything = np.arange(VOCAB, dtype=np.uint64)
        initial = store.lookup("t", everything, train=False).result()
        for ids, grads in _batches():
            store.lookup("t", ids).result()
            store.apply_gradients("t", ids, grads)
        final = store.lookup("t", everything, train=False).result()
    return initial, final


def _dense_grad(ids, grads):
    dense = np.zeros((VOCAB, DIM), np.float32)
    np.add.at(dense, ids.astype(np.int64), grads)
    return dense


def _optax_dense(transform, initial):
    params = jnp.asarray(initial)
    state = transform.init(params)
    update = jax.jit(transform.update)
    for ids, grads in _batches():
        updates, state = update(jnp.asarray(_dense_grad(ids, grads)), state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params)


def _optax_lazy_adam(transform, initial):
    """Adam whose state advances only for rows that receive a gradient (per-row count)."""
    params = jnp.asarray(initial)
    states = jax.vmap(transform.init)(params)
    update = jax.jit(jax.vmap(transform.update))
    for ids, grads in _batches():
        rows = np.unique(ids).astype(np.int64)
        row_grads = jnp.asarray(_dense_grad(ids, grads)[rows])
        row_states = jax.tree.map(lambda x, rows=rows: x[rows], states)
        updates, new_states = update(row_grads, row_states, params[rows])
        params = params.at[rows].add(updates)
        states = jax.tree.map(lambda x, y, rows=rows: x.at[rows].set(y), states, new_states)
    return np.asarray(params)


def _numpy_rowwise_adagrad(config, initial):
    params = initial.copy()
    accumulator = np.full((VOCAB, 1), config.initial_accumulator, np.float32)
    for ids, grads in _batches():
        rows = np.unique(ids).astype(np.int64)
        g = _dense_grad(ids, grads)[rows]
        accumulator[rows] += np.mean(g * g, axis=1, keepdims=True)
        params[rows] -= config.learning_rate * g / np.sqrt(accumulator[rows] + config.eps)
    return params


CASES = {
    "sgd": (SparseOptimizerConfig(name="sgd", learning_rate=0.1), lambda c: optax.sgd(0.1)),
    "adagrad": (
        SparseOptimizerConfig(name="adagrad", learning_rate=0.1),
        lambda c: optax.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-7),
    ),
    "adam": (
        SparseOptimizerConfig(name="adam", learning_rate=0.01),
        lambda c: optax.adam(0.01, b1=0.9, b2=0.999, eps=1e-8),
    ),
}


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "rowwise_adagrad"])
def test_matches_dense_reference(name, num_shards):
    if name == "rowwise_adagrad":
        config = SparseOptimizerConfig(name="rowwise_adagrad", learning_rate=0.1)
        initial, final = _run_store(config, num_shards)
        expected = _numpy_rowwise_adagrad(config, initial)
    else:
        config, make = CASES[name]
        initial, final = _run_store(config, num_shards)
        reference = _optax_lazy_adam if name == "adam" else _optax_dense
        expected = reference(make(config), initial)
    assert not np.allclose(final, initial)  # the updates did something
    np.testing.assert_allclose(final, expected, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float16"])
def test_low_precision_storage_tracks_reference(storage_dtype):
    config, make = CASES["adagrad"]
    initial, final = _run_store(config, 2, storage_dtype=storage_dtype)
    expected = _optax_dense(make(config), initial.astype(np.float32))
    tolerance = 1e-2 if storage_dtype == "bfloat16" else 2e-3
    np.testing.assert_allclose(final, expected, atol=tolerance * np.abs(expected).max())
