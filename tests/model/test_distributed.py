"""Single-process behaviour of the multi-process helpers and of the loud failure paths."""

from __future__ import annotations

import argparse

import jax
import numpy as np
import pytest
from hybridrec.common.errors import UserError
from hybridrec.model import (
    MeshConfig,
    NonFiniteLossError,
    create_train_state,
    fetch_metrics,
    local_rows,
    make_global_batch,
    make_mesh,
    make_train_step,
    maybe_initialize_distributed,
)
from hybridrec.model import distributed as distributed_lib

from hybridrec.cli import _flags


def test_initialize_is_a_noop_without_a_layout(monkeypatch):
    monkeypatch.setattr(distributed_lib, "_initialized", False)
    assert maybe_initialize_distributed() is False
    assert maybe_initialize_distributed() is False  # idempotent
    assert jax.process_count() == 1


def test_initialize_rejects_a_partial_layout(monkeypatch):
    monkeypatch.setattr(distributed_lib, "_initialized", False)
    with pytest.raises(UserError, match="together"):
        maybe_initialize_distributed(num_processes=2)
    with pytest.raises(UserError, match="process_id 5"):
        maybe_initialize_distributed("127.0.0.1:1", 2, 5)


def test_the_command_line_reads_the_layout_from_flags_then_environment(monkeypatch):
    for name in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HYBRIDREC_COORDINATOR", "127.0.0.1:9")
    monkeypatch.setenv("HYBRIDREC_NUM_PROCESSES", "2")
    monkeypatch.setenv("HYBRIDREC_PROCESS_ID", "1")
    flags = argparse.Namespace(coordinator=None, num_processes=None, process_id=0)
    assert _flags.distributed_options(flags) == {
        "coordinator": "127.0.0.1:9",
        "num_processes": 2,
        "process_id": 0,
        "cluster": None,
    }
    monkeypatch.setenv("HYBRIDREC_NUM_PROCESSES", "two")
    with pytest.raises(UserError, match="HYBRIDREC_NUM_PROCESSES='two'"):
        _flags.distributed_options(flags)


@pytest.mark.devices(8)
def test_mesh_shape_is_checked():
    with pytest.raises(UserError, match="needs 6 devices"):
        make_mesh(MeshConfig(shape=(3, 2), axis_names=("data", "model")))
    with pytest.raises(UserError, match="do not divide"):
        make_mesh(MeshConfig(shape=(-1, 3), axis_names=("data", "model")))
    mesh = make_mesh(MeshConfig(shape=(-1, 2), axis_names=("data", "model")))
    assert dict(mesh.shape) == {"data": 4, "model": 2}


@pytest.mark.devices(8)
def test_global_batch_round_trips_and_checks_divisibility(batch_factory):
    mesh = make_mesh(MeshConfig(shape=(4, 2), axis_names=("data", "model")))
    host = batch_factory(0, 32)
    batch = make_global_batch(host, mesh)
    assert batch["embeddings"].sharding.spec == jax.sharding.PartitionSpec("data", None, None)
    for key, value in host.items():
        np.testing.assert_array_equal(local_rows(batch[key]), value)
    with pytest.raises(UserError, match="does not divide"):
        make_global_batch(batch_factory(0, 6), mesh)


@pytest.mark.parametrize("devices", [1, 8])
def test_global_batch_copies_replicated_arrays_with_the_rows(devices, batch_factory):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
    host = batch_factory(0, 16)
    whole = {"slots": np.arange(10, dtype=np.int32), "rows": np.ones((4, 3), np.float32)}
    batch = make_global_batch(host, mesh, replicated=whole)
    assert set(batch) == set(host) | set(whole)
    for key, value in host.items():
        assert batch[key].sharding.spec[0] == "data"
        np.testing.assert_array_equal(local_rows(batch[key]), value)
    for key, value in whole.items():
        assert batch[key].sharding.is_fully_replicated
        assert batch[key].dtype == value.dtype
        for shard in batch[key].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value)
    # a later batch with other shapes is copied as given, not as the first one was
    bigger = make_global_batch(batch_factory(1, 32), mesh, replicated={"slots": whole["rows"]})
    assert bigger["slots"].shape == (4, 3) and bigger["dense"].shape[0] == 32


@pytest.mark.parametrize("devices", [1, 8])
def test_global_batch_owns_its_copies(devices, batch_factory, aligned):
    """The copy donates the buffers it fills, never the caller's arrays: host arrays
    changed or reused after the copy leave the batch on the devices as it was (on 8 CPU
    devices `jax.device_put` alone shares aligned host memory)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
    host = {key: aligned(value) for key, value in batch_factory(0, 16).items()}
    whole = {"slots": aligned(np.arange(10, dtype=np.int32))}
    expected = {key: value.copy() for key, value in {**host, **whole}.items()}
    batch = make_global_batch(host, mesh, replicated=whole)
    again = make_global_batch(host, mesh, replicated=whole)  # the same host arrays, twice
    for value in (*host.values(), *whole.values()):
        value[...] = 7
    for copied in (batch, again):
        for key, value in expected.items():
            assert not copied[key].is_deleted()
            for shard in copied[key].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_non_finite_loss_fails_loudly(data_model_mesh, tiny_config, dims, batch_factory, optimizer):
    mesh = data_model_mesh
    config = tiny_config("dlrm")
    state = create_train_state(config, optimizer, mesh, 0, **dims)
    step = make_train_step(mesh)
    host = batch_factory(0, 32)
    state, metrics, _ = step(state, make_global_batch(host, mesh))
    assert np.isfinite(fetch_metrics(metrics, step=1)["loss"])
    host["dense"][3, 0] = np.inf
    _, metrics, _ = step(state, make_global_batch(host, mesh))
    with pytest.raises(NonFiniteLossError, match="step 2"):
        fetch_metrics(metrics, step=2)


@pytest.mark.parametrize(
    "make", [lambda a: a[..., None], lambda a: a.T, lambda a: a[:, ::2], lambda a: a]
)
def test_dense_gives_the_strides_the_shape_implies(make):
    """A copy to a device reads arrays with their shape's own strides (a stride-0 axis
    from `[..., None]` or a transposed view is copied element by element on a GPU)."""
    array = make(np.arange(24 * 6, dtype=np.int32).reshape(24, 6))
    out = distributed_lib.dense(array)
    np.testing.assert_array_equal(out, array)
    assert out.strides == np.empty(array.shape, array.dtype).strides
