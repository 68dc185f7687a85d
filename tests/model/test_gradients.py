"""Embedding gradients of the step against central finite differences of the mean loss."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hybridrec.model import (
    create_train_state,
    local_rows,
    make_global_batch,
    make_train_step,
)
from hybridrec.model.step import loss_fn

ROWS = 32  # the shared test batch shape (compilation cache)


@pytest.mark.parametrize("tower", ["dlrm", "dcnv2"])
def test_embedding_grads_match_finite_differences(
    data_model_mesh, tower, tiny_config, dims, batch_factory, optimizer
):
    config = tiny_config(tower)
    if tower == "dcnv2":
        config = dataclasses.replace(
            config, dcnv2=dataclasses.replace(config.dcnv2, low_rank=4, structure="parallel")
        )
    mesh = data_model_mesh
    state = create_train_state(config, optimizer, mesh, 11, **dims)
    graphdef = state.graphdef
    params = jax.tree.map(np.asarray, jax.device_get(state.params))  # before donation
    host = batch_factory(4, ROWS)
    _, metrics, grads = make_train_step(mesh)(state, make_global_batch(host, mesh))
    grads = local_rows(grads)
    assert grads.shape == host["embeddings"].shape and grads.dtype == np.float32

    # Same loss in float64 (params and inputs promoted), differentiated numerically.
    with jax.enable_x64(True):
        params64 = jax.tree.map(lambda a: a.astype(np.float64), params)
        batch64 = {key: value.astype(np.float64) for key, value in host.items()}

        @jax.jit
        def losses(embeddings):  # [K, B, F, D] -> [K]
            return jax.vmap(lambda e: loss_fn(graphdef, params64, {**batch64, "embeddings": e}))(
                embeddings
            )

        base = batch64["embeddings"]
        epsilon = 1e-6
        eye = np.eye(base.size).reshape(base.size, *base.shape) * epsilon
        numeric = (np.asarray(losses(base + eye)) - np.asarray(losses(base - eye))) / (2 * epsilon)
        loss64 = float(losses(base[None])[0])
    np.testing.assert_allclose(float(metrics["loss"]), loss64, rtol=1e-5)
    np.testing.assert_allclose(grads, numeric.reshape(base.shape), rtol=2e-4, atol=1e-6)
    # the mean over the batch: scaling is 1/B per row, not 1
    assert np.abs(grads).max() < 1.0
