"""Blocked Shampoo: against a full-matrix numpy computation, blocking, the sharded step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hybridrec.common import config as config_lib
from hybridrec.common.errors import ConfigError
from hybridrec.model import (
    DenseOptimizerConfig,
    MeshConfig,
    abstract_train_state,
    create_train_state,
    local_rows,
    make_global_batch,
    make_mesh,
    make_train_step,
    train_step,
)
from hybridrec.model.shampoo import scale_by_shampoo

MATRIX_EPSILON = 1e-4


def _root(statistics):
    values, vectors = np.linalg.eigh(statistics)
    values = np.maximum(values, 0) + MATRIX_EPSILON * values.max()
    return (vectors * values**-0.25) @ vectors.T


def _reference(gradients, grafting, beta1, beta2, epsilon=1e-8):
    """Full-matrix Shampoo on one [m, n] matrix, grafted per matrix, in float64."""
    left = np.zeros((gradients[0].shape[0],) * 2)
    right = np.zeros((gradients[0].shape[1],) * 2)
    momentum = np.zeros_like(gradients[0])
    second = np.zeros_like(gradients[0])
    steps = []
    for count, gradient in enumerate(gradients, start=1):
        momentum = beta1 * momentum + (1 - beta1) * gradient if beta1 else gradient
        if grafting == "adam":
            second = beta2 * second + (1 - beta2) * gradient**2
            graft = (momentum / (1 - beta1**count)) / (
                np.sqrt(second / (1 - beta2**count)) + epsilon
            )
        else:
            second = second + gradient**2
            graft = momentum / (np.sqrt(second) + epsilon)
        keep, add = (beta2, 1 - beta2) if beta2 < 1 else (1.0, 1.0)
        left = keep * left + add * gradient @ gradient.T
        right = keep * right + add * gradient.T @ gradient
        direction = _root(left) @ momentum @ _root(right)
        steps.append(direction * np.linalg.norm(graft) / np.linalg.norm(direction))
    return steps


def _run(transformation, gradients):
    params = {"w": jnp.zeros(gradients[0].shape, jnp.float32)}
    state = transformation.init(params)
    update = jax.jit(transformation.update)
    steps = []
    for gradient in gradients:
        step, state = update({"w": jnp.asarray(gradient, jnp.float32)}, state)
        steps.append(np.asarray(step["w"], np.float64))
    return steps


@pytest.mark.parametrize(
    ("grafting", "beta1", "beta2"), [("adagrad", 0.0, 1.0), ("adam", 0.9, 0.99)]
)
def test_one_block_matches_full_matrix_shampoo(grafting, beta1, beta2):
    rng = np.random.default_rng(0)
    gradients = [rng.normal(size=(5, 3)) for _ in range(3)]
    transformation = scale_by_shampoo(
        block_size=5,  # the whole [5, 3] matrix is one block
        precondition_every=1,
        grafting=grafting,
        beta1=beta1,
        beta2=beta2,
        epsilon=1e-8,
        matrix_epsilon=MATRIX_EPSILON,
    )
    got = _run(transformation, gradients)
    want = _reference(gradients, grafting, beta1, beta2)
    for got_step, want_step in zip(got, want, strict=True):
        np.testing.assert_allclose(got_step, want_step, rtol=2e-3, atol=1e-5)
    # not the diagonal method: Shampoo's direction differs from the graft's
    graft = gradients[-1] / np.sqrt(sum(g**2 for g in gradients))
    assert not np.allclose(got[-1], graft * np.linalg.norm(got[-1]) / np.linalg.norm(graft))


def test_blocks_are_independent_full_matrix_problems():
    """A [6, 5] matrix in 3x3 blocks = four small Shampoos (the last column block padded)."""
    rng = np.random.default_rng(1)
    gradients = [rng.normal(size=(6, 5)) for _ in range(2)]
    transformation = scale_by_shampoo(
        block_size=3,
        precondition_every=1,
        grafting="adagrad",
        beta1=0.0,
        beta2=1.0,
        epsilon=1e-8,
        matrix_epsilon=MATRIX_EPSILON,
    )
    got = _run(transformation, gradients)[-1]
    for rows in (slice(0, 3), slice(3, 6)):
        for cols in (slice(0, 3), slice(3, 5)):
            want = _reference([g[rows, cols] for g in gradients], "adagrad", 0.0, 1.0)[-1]
            np.testing.assert_allclose(got[rows, cols], want, rtol=2e-3, atol=1e-5)


def test_grafting_alone_until_the_first_preconditioner():
    rng = np.random.default_rng(2)
    gradients = [rng.normal(size=(4, 4)) for _ in range(3)]
    transformation = scale_by_shampoo(
        block_size=4,
        precondition_every=3,
        grafting="adagrad",
        beta1=0.0,
        beta2=1.0,
        epsilon=1e-8,
        matrix_epsilon=MATRIX_EPSILON,
    )
    got = _run(transformation, gradients)
    for count in (1, 2):  # AdaGrad's step, element by element
        second = sum(g**2 for g in gradients[:count])
        np.testing.assert_allclose(
            got[count - 1], gradients[count - 1] / np.sqrt(second), rtol=1e-5
        )
    want = _reference(gradients, "adagrad", 0.0, 1.0)[-1]
    np.testing.assert_allclose(got[2], want, rtol=2e-3, atol=1e-5)


SHAMPOO = DenseOptimizerConfig(
    name="shampoo",
    learning_rate=1e-2,
    shampoo_block_size=8,
    shampoo_precondition_every=2,
    shampoo_epsilon=MATRIX_EPSILON,
)


@pytest.mark.devices(8)
def test_sharded_step_matches_one_device_and_spreads_blocks(
    tmp_path, tiny_config, dims, batch_factory
):
    config = tiny_config("dlrm")
    single = make_mesh(MeshConfig(shape=(1,)), devices=jax.devices()[:1])
    reference = create_train_state(config, SHAMPOO, single, 7, **dims)
    mesh = make_mesh(MeshConfig(shape=(4, 2), axis_names=("data", "model")))
    state = create_train_state(config, SHAMPOO, mesh, 7, **dims)
    blocks = state.opt_state[0].blocks["top"]["layer_0"]["kernel"]  # [8, 8, 8]: 32x16 kernel
    assert blocks.left.shape == (8, 8, 8)
    assert blocks.left.sharding.spec == jax.sharding.PartitionSpec(("data", "model"))
    assert state.opt_state[0].blocks["top"]["layer_0"]["bias"] is None
    step, reference_step = make_train_step(mesh), jax.jit(train_step)
    losses = []
    for index in range(4):  # preconditioners refreshed at steps 2 and 4
        host = batch_factory(index % 2, 32)
        reference, reference_metrics, reference_grads = reference_step(
            reference, jax.device_put(host, jax.devices()[0])
        )
        state, metrics, grads = step(state, make_global_batch(host, mesh))
        losses.append(float(reference_metrics["loss"]))
        np.testing.assert_allclose(float(metrics["loss"]), losses[-1], rtol=2e-5)
        np.testing.assert_allclose(local_rows(grads), np.asarray(reference_grads), atol=2e-6)
    assert losses[2] < losses[0] and losses[3] < losses[1]  # it learns
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4),
        jax.device_get(state.params),
        jax.device_get(reference.params),
    )
    # the state, with its sharded block statistics and None for vectors, round-trips Orbax
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(4, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        target = abstract_train_state(config, SHAMPOO, mesh, **dims)
        restored = manager.restore(4, args=ocp.args.StandardRestore(target))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))
    restored_blocks = restored.opt_state[0].blocks["top"]["layer_0"]["kernel"]
    assert restored_blocks.left.sharding == blocks.left.sharding


def test_block_size_larger_than_every_layer_names_the_key(tiny_config, dims):
    mesh = make_mesh(MeshConfig(shape=(1,)), devices=jax.devices()[:1])
    too_large = DenseOptimizerConfig(name="shampoo", shampoo_block_size=4096)
    with pytest.raises(ConfigError, match=r"^optimizer.shampoo_block_size = 4096 is larger"):
        create_train_state(tiny_config("dlrm"), too_large, mesh, 0, **dims)
    with pytest.raises(ConfigError, match=r"optimizer: shampoo_epsilon must be within \[1e-7"):
        config_lib.from_dict(DenseOptimizerConfig, {"shampoo_epsilon": 1e-9}, where="optimizer")
    with pytest.raises(ConfigError, match="shampoo_grafting: 'sgd' is not one of"):
        config_lib.from_dict(DenseOptimizerConfig, {"shampoo_grafting": "sgd"}, where="optimizer")
