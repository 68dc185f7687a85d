"""Tower-parallel DMT on an 8-device CPU mesh: the flat DMT step's update, computed by towers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.model import (
    MeshConfig,
    create_train_state,
    make_eval_step,
    make_global_batch,
    make_mesh,
    make_train_step,
)
from hybridrec.model import tower_parallel as tp
from hybridrec.model.collectives import collective_bytes

NUM_FEATURES = 5
ROWS = 32
# uneven towers: the smaller ones run on zero-padded inputs
LAYOUTS = {
    "2 towers x 4": ((0, 3), (1, 2, 4)),
    "4 towers x 2": ((4,), (0, 2), (1,), (3,)),
}


def _state(tiny_config, towers, mesh, dims, optimizer):
    config = tiny_config("dlrm", towers=towers, tower_outputs=2, tower_mlp=(8,))
    return create_train_state(config, optimizer, mesh, 0, **{**dims, "num_features": NUM_FEATURES})


def _tower_batch(mesh, towers, batch):
    local = {
        tower: batch["embeddings"][rows][:, list(towers[tower])]
        for tower, rows in tp.local_towers(mesh, ROWS).items()
    }
    return tp.make_tower_batch(mesh, towers, local, batch["dense"], batch["labels"])


@pytest.mark.devices(8)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tower_parallel_steps_match_the_flat_dmt_step(
    name, tiny_config, dims, batch_factory, optimizer
):
    towers = LAYOUTS[name]
    flat_mesh = make_mesh(MeshConfig(shape=(-1,), axis_names=("data",)))
    mesh = tp.make_tower_mesh(len(towers))
    flat_state = _state(tiny_config, towers, flat_mesh, dims, optimizer)
    state = _state(tiny_config, towers, mesh, dims, optimizer)
    flat_step = make_train_step(flat_mesh)
    step = tp.make_tower_parallel_train_step(mesh, towers)
    for seed in range(3):
        batch = batch_factory(seed, ROWS, num_features=NUM_FEATURES)
        flat_state, flat_metrics, flat_grads = flat_step(
            flat_state, make_global_batch(batch, flat_mesh)
        )
        state, metrics, grads = step(state, _tower_batch(mesh, towers, batch))
        np.testing.assert_allclose(float(metrics["loss"]), float(flat_metrics["loss"]), rtol=1e-6)
        flat_grads = np.asarray(flat_grads)
        by_tower = tp.local_tower_grads(grads, towers)
        assert sorted(by_tower) == list(range(len(towers)))
        for index, tower in enumerate(towers):
            np.testing.assert_allclose(
                by_tower[index], flat_grads[:, list(tower)], rtol=1e-5, atol=1e-7
            )
        # padding columns never receive a gradient
        padded = np.asarray(grads)
        for index, tower in enumerate(towers):
            assert not padded[index, :, len(tower) :].any()
    jax.tree.map(
        # Adam amplifies rounding noise of ~0 gradients (as in test_sharded_step.py)
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5),
        flat_state.params,
        state.params,
    )
    batch = batch_factory(9, ROWS, num_features=NUM_FEATURES)
    flat_probabilities = make_eval_step(flat_mesh)(flat_state, make_global_batch(batch, flat_mesh))
    tower_batch = _tower_batch(mesh, towers, batch)
    probabilities = tp.make_tower_parallel_eval_step(mesh, towers)(state, tower_batch)
    np.testing.assert_allclose(
        np.asarray(probabilities), np.asarray(flat_probabilities), rtol=1e-5, atol=1e-7
    )


@pytest.mark.devices(8)
def test_only_compressed_outputs_cross_the_tower_axis(tiny_config, dims, batch_factory, optimizer):
    towers = LAYOUTS["2 towers x 4"]
    mesh = tp.make_tower_mesh(2)
    state = _state(tiny_config, towers, mesh, dims, optimizer)
    batch = _tower_batch(mesh, towers, batch_factory(0, ROWS, num_features=NUM_FEATURES))
    text = tp.make_tower_parallel_train_step(mesh, towers).lower(state, batch).compile().as_text()
    moved = collective_bytes(text, 8)
    exchanges = [op for op in moved["ops"] if op[0] == "all-to-all"]
    # forward and backward: each device's [8 rows, 2 outputs, 8 dims] f32 outputs
    assert [(group, size) for _, group, size in exchanges] == [(2, 8 * 2 * 8 * 4)] * 2
    assert moved["all-to-all"] == 2 * (8 * 2 * 8 * 4) // 2
    params = sum(leaf.size for leaf in jax.tree.leaves(state.params)) * 4
    assert moved["all-reduce"] >= 2 * 7 / 8 * params  # the dense gradients' all-reduce


@pytest.mark.devices(8)
def test_tower_batch_owns_its_copies(batch_factory, aligned):
    """Host arrays changed after the copy leave the tower batch as it was."""
    towers = LAYOUTS["2 towers x 4"]
    mesh = tp.make_tower_mesh(len(towers))
    batch = batch_factory(0, ROWS, num_features=NUM_FEATURES)
    batch = {key: aligned(value) for key, value in batch.items()}
    expected = {key: batch[key].copy() for key in ("dense", "labels")}
    copied = _tower_batch(mesh, towers, batch)
    for key in expected:
        batch[key][...] = 7
    for key, value in expected.items():
        for shard in copied[key].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


@pytest.mark.devices(8)
def test_layout_errors_name_the_problem(tiny_config, dims, optimizer):
    towers = LAYOUTS["2 towers x 4"]
    with pytest.raises(ConfigError, match="3 towers cannot split 8 devices"):
        tp.make_tower_mesh(3)
    mesh = tp.make_tower_mesh(4)
    with pytest.raises(ConfigError, match="2 towers but the mesh's tower axis has 4"):
        tp.make_tower_parallel_train_step(mesh, towers)
    mesh = tp.make_tower_mesh(2)
    with pytest.raises(UserError, match="batch 20 does not divide by it"):
        tp.check_layout(mesh, towers, 20)
    dense, labels = np.zeros((ROWS, 6), np.float32), np.zeros(ROWS, np.float32)
    # one process holds every tower's rows of the whole batch; half of them is an error
    half = {0: np.zeros((ROWS // 2, 2, 8), np.float32), 1: np.zeros((ROWS, 3, 8), np.float32)}
    with pytest.raises(ValueError, match=r"tower 0: embeddings must be \[32, 2, D\]"):
        tp.make_tower_batch(mesh, towers, half, dense, labels)


def test_collective_bytes_reads_each_hlo_spelling():
    hlo = """
  %a = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(f32[4,8]{1,0} %x), replica_groups={{0,1,2,3}}
  %b = f32[16,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[16,8]{1,0}) %a)
  %c = (f32[10]{0}, f32[10]{0}, u32[], u32[]) collective-permute-start(f32[10]{0} %y)
  %d = bf16[100]{0} all-reduce(bf16[100]{0} %z), replica_groups=[2,2]<=[4], to_apply=%add
  %e = f32[8]{0} all-reduce(f32[8]{0} %w), replica_groups=mesh['x'=2,'y'=2] {'y'}
  %f = (f32[2,3]{1,0}, f32[2,3]{1,0}) all-to-all(f32[2,3]{1,0} %p, f32[2,3]{1,0} %q), replica_groups={}
"""
    moved = collective_bytes(hlo, 4)
    assert [op[:2] for op in moved["ops"]] == [
        ("all-gather", 4), ("collective-permute", 4), ("all-reduce", 2), ("all-reduce", 2),
        ("all-to-all", 4),
    ]  # fmt: skip
    assert moved["all-gather"] == 3 * 16 * 8 * 4 // 4  # the output, 3/4 from the others
    assert moved["collective-permute"] == 40
    assert moved["all-reduce"] == 200 + 32  # 2 (n - 1) / n = 1 with n = 2
    assert moved["all-to-all"] == 3 * 48 // 4
