"""A served history extended by its new events: the towers' `extend` from cached keys and
values gives what the full forward pass gives at the same positions (SASRec and HSTU,
with and without the ranking head's wrapper), from an empty cache or a cached prefix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hybridrec.model.config import SequenceConfig
from hybridrec.model.sequence import build_sequence_tower, extend_history

LENGTH, DIM = 16, 32


def tower(name: str, objective: str = "retrieval"):
    name, _, block = name.partition("+")  # sasrec+ligr: eSASRec's gated blocks
    config = SequenceConfig(
        max_length=LENGTH, blocks=2, heads=2, dropout=0.0, attention="reference",
        objective=objective, actions=3 if objective != "retrieval" else 0,
        block=block or "sasrec", ffn_multiplier=2,
    )  # fmt: skip
    return build_sequence_tower(name, config, dim=DIM, dtype=None, rngs=nnx.Rngs(3))


def full(model, x, length):
    """The training forward pass over one history of `length` events (right-padded)."""
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (x.shape[0], LENGTH))
    segments = jnp.where(positions < length, 0, -1)
    return model(x, segments, positions)


def empty(model, batch):
    blocks, heads, head_dim = model.cache_shape()
    shape = (blocks, batch, LENGTH, heads, head_dim)
    return jnp.zeros(shape), jnp.zeros(shape)


@pytest.mark.parametrize("name", ["sasrec", "sasrec+ligr", "hstu"])
@pytest.mark.parametrize("objective", ["retrieval", "both"])
def test_extend_equals_the_full_forward_pass(name, objective):
    model = tower(name, objective)
    x = jax.random.normal(jax.random.key(0), (2, LENGTH, DIM))
    expected = full(model, x, 11)[:, :11]
    # the whole history from an empty cache
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    out, k, v = extend_history(model, x[:, :11], positions, jnp.array([11, 11]), *empty(model, 2))
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
    # 7 events cached, then 4 new ones (padded to 6: the last two are not events)
    first, k, v = extend_history(
        model, x[:, :7], positions[:, :7], jnp.array([7, 7]), *empty(model, 2)
    )
    new = jnp.concatenate([x[:, 7:11], jnp.ones((2, 2, DIM))], axis=1)
    later = 7 + jnp.broadcast_to(jnp.arange(6), (2, 6))
    second, k2, v2 = extend_history(model, new, later, jnp.array([4, 4]), k, v)
    np.testing.assert_allclose(second[:, :4], expected[:, 7:11], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(first, expected[:, :7], rtol=2e-5, atol=2e-5)
    # the caches after the step hold what a cache of all 11 events holds
    _, k_all, v_all = extend_history(
        model, x[:, :11], positions, jnp.array([11, 11]), *empty(model, 2)
    )
    np.testing.assert_allclose(k2[:, :, :11], k_all[:, :, :11], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(v2[:, :, :11], v_all[:, :, :11], rtol=2e-5, atol=2e-5)


def test_rows_with_different_prefixes_in_one_batch():
    model = tower("hstu")
    x = jax.random.normal(jax.random.key(1), (2, LENGTH, DIM))
    expected = [full(model, x[i : i + 1], n)[0, n - 1] for i, n in enumerate((5, 9))]
    # row 0: 3 cached + 2 new; row 1: 8 cached + 1 new
    caches = [
        extend_history(model, x[i : i + 1, :p], jnp.arange(p)[None], jnp.array([p]), *empty(model, 1))[1:]
        for i, p in enumerate((3, 8))
    ]  # fmt: skip
    k = jnp.concatenate([c[0] for c in caches], axis=1)
    v = jnp.concatenate([c[1] for c in caches], axis=1)
    new = jnp.stack([x[0, 3:5], jnp.stack([x[1, 8], jnp.zeros(DIM)])])
    positions = jnp.array([[3, 4], [8, 9]])
    out, _, _ = extend_history(model, new, positions, jnp.array([2, 1]), k, v)
    np.testing.assert_allclose(out[0, 1], expected[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out[1, 0], expected[1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["sasrec", "hstu"])
def test_extend_with_action_inputs_equals_the_full_forward_pass(name):
    config = SequenceConfig(
        max_length=LENGTH, blocks=2, heads=2, dropout=0.0, attention="reference", action_inputs=3
    )
    model = build_sequence_tower(name, config, dim=DIM, dtype=None, rngs=nnx.Rngs(4))
    x = jax.random.normal(jax.random.key(0), (1, LENGTH, DIM))
    actions = jnp.asarray(np.arange(LENGTH)[None] % 4, jnp.int32)  # 0: none, 1..3
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (1, LENGTH))
    segments = jnp.where(positions < 11, 0, -1)
    expected = model(x, segments, positions, actions=actions)[:, :11]
    other = model(x, segments, positions, actions=(actions + 1) % 4)[:, :11]
    assert float(jnp.abs(expected - other).max()) > 1e-3
    first, k, v = extend_history(
        model, x[:, :7], positions[:, :7], jnp.array([7]), *empty(model, 1), actions=actions
    )
    second, _, _ = extend_history(
        model, x[:, 7:11], 7 + positions[:, :4], jnp.array([4]), k, v, actions=actions
    )
    np.testing.assert_allclose(first, expected[:, :7], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(second, expected[:, 7:11], rtol=2e-5, atol=2e-5)


def test_extend_with_the_time_gap_bias_equals_the_full_forward_pass():
    config = SequenceConfig(
        max_length=LENGTH, blocks=2, heads=2, dropout=0.0, attention="reference", time_buckets=16
    )
    model = build_sequence_tower("hstu", config, dim=DIM, dtype=None, rngs=nnx.Rngs(4))
    # the time bias is not zero: the outputs depend on the times
    for block in (model.encoder.block_0, model.encoder.block_1):
        block.time_bias[...] = jax.random.normal(jax.random.key(2), block.time_bias.shape)
    x = jax.random.normal(jax.random.key(0), (1, LENGTH, DIM))
    times = jnp.asarray(np.cumsum(np.arange(LENGTH) ** 3)[None], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (1, LENGTH))
    segments = jnp.where(positions < 11, 0, -1)
    expected = model(x, segments, positions, times=times)[:, :11]
    other = model(x, segments, positions, times=times * 0)[:, :11]
    assert float(jnp.abs(expected - other).max()) > 1e-3
    first, k, v = extend_history(
        model, x[:, :7], positions[:, :7], jnp.array([7]), *empty(model, 1), times=times
    )
    second, _, _ = extend_history(
        model, x[:, 7:11], 7 + positions[:, :4], jnp.array([4]), k, v, times=times
    )
    np.testing.assert_allclose(first, expected[:, :7], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(second, expected[:, 7:11], rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="HSTU's time-gap bias"):
        build_sequence_tower("sasrec", config, dim=DIM, dtype=None, rngs=nnx.Rngs(4))
