"""The sharded step computes what a single device computes, compiles once, and guards transfers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hybridrec.model import (
    DenseOptimizerConfig,
    MeshConfig,
    create_train_state,
    local_rows,
    make_eval_step,
    make_global_batch,
    make_mesh,
    make_train_step,
    train_step,
)

STEPS = 4
BATCH = 32
# f32 on CPU: sharded matmuls sum in a different order than one device. Losses and
# embedding gradients stay within RTOL/ATOL; parameters within PARAM_ATOL, because Adam
# divides by sqrt(second moment): a weight whose gradient is ~0 turns rounding noise into
# up to ~1e-3 of a step (learning rate 1e-2 -> ~1e-5 absolute).
RTOL, ATOL = 2e-5, 2e-6
PARAM_ATOL = 2e-5
# DHEN's attention and LayerNorm leave more weights with a near-zero gradient (softmax
# and normalization cancel most of a shift), so a few move by rounding noise of ~1e-4.
PARAM_ATOL_BY_TOWER = {"dhen": 1e-4}

MESHES = {
    "1": (MeshConfig(shape=(1,), axis_names=("data",)), 1),
    "8": (MeshConfig(shape=(8,), axis_names=("data",)), 8),
    "4x2": (MeshConfig(shape=(4, 2), axis_names=("data", "model")), 8),
}
TOWERS = {
    "dlrm": {},
    "dcnv2_lowrank_parallel": {"low_rank": 4, "structure": "parallel"},
    "mlp": {},
    "dhen": {},
}
OPTIMIZER = DenseOptimizerConfig(  # as the `optimizer` fixture
    name="adam", learning_rate=1e-2, warmup_steps=2, decay="cosine", decay_steps=10
)


def _config(tiny_config, tower_name: str):
    import dataclasses

    config = tiny_config(tower_name.split("_")[0])
    if tower_name.startswith("dcnv2"):
        extra = TOWERS[tower_name]
        config = dataclasses.replace(config, dcnv2=dataclasses.replace(config.dcnv2, **extra))
    return config


def _run(config, mesh, dims, batch_factory, steps=STEPS):
    state = create_train_state(config, OPTIMIZER, mesh, 7, **dims)
    step = make_train_step(mesh)
    losses, grads = [], []
    for index in range(steps):
        batch = make_global_batch(batch_factory(index % 2, BATCH), mesh)
        state, metrics, embedding_grads = step(state, batch)
        losses.append(float(jax.device_get(metrics["loss"])))
        grads.append(local_rows(embedding_grads))
    params = jax.tree.map(np.asarray, jax.device_get(state.params))
    return np.array(losses), np.stack(grads), params, state, step


def _reference(config, dims, batch_factory):
    """Plain jit of the pure step on one device: no mesh shardings, no donation."""
    device = jax.devices()[0]
    mesh = make_mesh(MeshConfig(shape=(1,)), devices=[device])
    state = create_train_state(config, OPTIMIZER, mesh, 7, **dims)
    step = jax.jit(train_step)
    losses, grads = [], []
    for index in range(STEPS):
        batch = jax.device_put(batch_factory(index % 2, BATCH), device)
        state, metrics, embedding_grads = step(state, batch)
        losses.append(float(metrics["loss"]))
        grads.append(np.asarray(embedding_grads))
    return np.array(losses), np.stack(grads), jax.tree.map(np.asarray, state.params)


_REFERENCES: dict[str, tuple] = {}

# DLRM on all three meshes; DCN-V2 (its cross layers split too) and the MLP on the
# model-parallel mesh; DHEN (all four modules)
# there too (DMT towers with Shampoo train on 8 devices in tests/training). Full-rank DCN-V2
# and DHEN are checked against numpy in test_towers.py and test_dhen.py.
CASES = [
    ("dlrm", "1"),
    ("dlrm", "8"),
    ("dlrm", "4x2"),
    ("dcnv2_lowrank_parallel", "4x2"),
    ("mlp", "4x2"),
    ("dhen", "4x2"),
]


@pytest.mark.devices(8)
@pytest.mark.parametrize(("tower_name", "mesh_name"), CASES)
def test_mesh_matches_single_device(tower_name, mesh_name, tiny_config, dims, batch_factory):
    config = _config(tiny_config, tower_name)
    if tower_name not in _REFERENCES:
        _REFERENCES[tower_name] = _reference(config, dims, batch_factory)
    ref_losses, ref_grads, ref_params = _REFERENCES[tower_name]
    # it learns (two batches, alternating), so matching it means something
    assert ref_losses[2] < ref_losses[0] and ref_losses[3] < ref_losses[1]
    mesh_config, devices = MESHES[mesh_name]
    mesh = make_mesh(mesh_config, devices=jax.devices()[:devices])
    losses, grads, params, state, _ = _run(config, mesh, dims, batch_factory)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grads, ref_grads, rtol=RTOL, atol=ATOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            a, b, rtol=RTOL, atol=PARAM_ATOL_BY_TOWER.get(tower_name, PARAM_ATOL)
        ),
        params,
        ref_params,
    )
    if mesh_name == "4x2":  # the model axis really splits the wide layers
        specs = [leaf.sharding.spec for leaf in jax.tree.leaves(state.params)]
        assert any("model" in spec for spec in specs), specs
        if tower_name.startswith("dcnv2"):
            cross = state.params["cross_0"]["up"]["kernel"].sharding.spec
            assert cross == jax.sharding.PartitionSpec(None, "model")


def test_step_compiles_once(data_model_mesh, tiny_config, dims, batch_factory):
    mesh = data_model_mesh
    config = tiny_config("dlrm")
    compiles = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    state = create_train_state(config, OPTIMIZER, mesh, 0, **dims)
    step = make_train_step(mesh)
    evaluate = make_eval_step(mesh)
    batch = make_global_batch(batch_factory(0, BATCH), mesh)
    state, metrics, grads = step(state, batch)  # the one compile of each function
    probabilities = evaluate(state, batch)
    executables, eval_executables = step.num_compilations(), evaluate.num_compilations()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for index in range(1, 12):
            batch = make_global_batch(batch_factory(index % 3, BATCH), mesh)
            state, metrics, grads = step(state, batch)
            probabilities = evaluate(state, batch)
        jax.block_until_ready((state, metrics, grads, probabilities))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [], f"{len(compiles)} recompilations after the first call"
    assert step.num_compilations() == executables
    assert evaluate.num_compilations() == eval_executables
    # the guard does see a recompile: a new batch shape compiles a second executable (the
    # batch made first: on one device its copy is a jitted identity, compiled per shape)
    bigger = make_global_batch(batch_factory(0, 2 * BATCH), mesh)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        step(state, bigger)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 1 and step.num_compilations() == executables + 1


def test_state_is_donated_and_host_batches_are_refused(
    data_model_mesh, tiny_config, dims, batch_factory
):
    mesh = data_model_mesh
    config = tiny_config("dlrm")
    state = create_train_state(config, OPTIMIZER, mesh, 0, **dims)
    step = make_train_step(mesh)
    old_state = state
    state, _, _ = step(state, make_global_batch(batch_factory(0, BATCH), mesh))
    assert old_state.params["logit"]["kernel"].is_deleted()  # updated in place
    with pytest.raises(ValueError, match="donated"):
        step(old_state, make_global_batch(batch_factory(1, BATCH), mesh))
    with pytest.raises(Exception, match="(?i)transfer"):
        step(state, batch_factory(1, BATCH))  # numpy: would be an implicit host->device copy


def test_eval_probabilities_match_logits(data_model_mesh, tiny_config, dims, batch_factory):
    mesh = data_model_mesh
    config = tiny_config("dlrm")
    state = create_train_state(config, OPTIMIZER, mesh, 3, **dims)
    host = batch_factory(5, BATCH)
    probabilities = local_rows(make_eval_step(mesh)(state, make_global_batch(host, mesh)))
    assert probabilities.shape == (BATCH,) and probabilities.dtype == np.float32
    # loss of the same batch from the train step equals the logloss of these probabilities
    _, metrics, _ = make_train_step(mesh)(state, make_global_batch(host, mesh))
    p = probabilities.astype(np.float64)
    y = host["labels"]
    expected = -np.mean(y * np.log(p) + (1 - y) * np.log1p(-p))
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)


def test_orbax_restores_into_the_abstract_state(
    data_model_mesh, tmp_path, tiny_config, dims, batch_factory, optimizer
):
    import orbax.checkpoint as ocp
    from hybridrec.model import abstract_train_state

    mesh = data_model_mesh
    config = tiny_config("dlrm")
    state = create_train_state(config, optimizer, mesh, 0, **dims)
    step = make_train_step(mesh)
    state, _, _ = step(state, make_global_batch(batch_factory(0, BATCH), mesh))
    executables = step.num_compilations()
    saved = jax.device_get(state)
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        target = abstract_train_state(config, optimizer, mesh, **dims)
        restored = manager.restore(1, args=ocp.args.StandardRestore(target))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)
    assert jax.tree.map(lambda a: a.sharding, restored) == jax.tree.map(lambda a: a.sharding, state)
    state, _, _ = step(restored, make_global_batch(batch_factory(1, BATCH), mesh))
    assert step.num_compilations() == executables  # the restored state reuses the executable
    # a step given the target layout up front accepts the state as well
    fixed = make_train_step(mesh, state_shardings=jax.tree.map(lambda a: a.sharding, target))
    _, metrics, _ = fixed(state, make_global_batch(batch_factory(2, BATCH), mesh))
    assert np.isfinite(float(metrics["loss"]))
