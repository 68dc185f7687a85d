"""Tower shapes, the DLRM/DCN-V2 formulas against numpy, precision and FLOP counts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hybridrec.common.errors import ConfigError
from hybridrec.model import DCNv2Config, DLRMConfig, MLPConfig, ModelConfig, build_tower
from hybridrec.model.layers import LOGICAL_AXES
from hybridrec.model.towers import forward_flops_per_example

B, F, D, N = 6, 4, 8, 5


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(B, F, D)).astype(np.float32),
        rng.normal(size=(B, N)).astype(np.float32),
    )


def _tower(config):
    return build_tower(config, num_dense=N, num_features=F, embedding_dim=D, rngs=nnx.Rngs(0))


def _abstract_tower(config):
    return nnx.eval_shape(lambda: _tower(config))


def _params(tower):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(tower, nnx.Param)))


def _mlp(params, x):
    for index in range(len(params)):
        layer = params[f"layer_{index}"]
        x = np.maximum(x @ layer["kernel"] + layer["bias"], 0)
    return x


VARIANTS = {
    "dlrm": ModelConfig(tower="dlrm", dlrm=DLRMConfig(bottom_mlp=(16, D), top_mlp=(12,))),
    "dlrm_self": ModelConfig(
        tower="dlrm", dlrm=DLRMConfig(bottom_mlp=(D,), top_mlp=(), self_interaction=True)
    ),
    "dcnv2_stacked_full": ModelConfig(tower="dcnv2", dcnv2=DCNv2Config(deep_mlp=(16,))),
    "dcnv2_stacked_lowrank": ModelConfig(tower="dcnv2", dcnv2=DCNv2Config(low_rank=3)),
    "dcnv2_parallel_full": ModelConfig(tower="dcnv2", dcnv2=DCNv2Config(structure="parallel")),
    "dcnv2_parallel_lowrank_cross_only": ModelConfig(
        tower="dcnv2", dcnv2=DCNv2Config(structure="parallel", low_rank=2, deep_mlp=())
    ),
    "mlp": ModelConfig(tower="mlp", mlp=MLPConfig(hidden=(32, 16))),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_towers_give_one_logit_per_example(name):
    config = VARIANTS[name]
    embeddings, dense = map(jnp.asarray, _inputs())
    logits = nnx.eval_shape(lambda: _tower(config)(embeddings, dense))
    assert logits.shape == (B,) and logits.dtype == jnp.float32
    tower = _abstract_tower(config)
    for leaf in jax.tree.leaves(nnx.state(tower, nnx.Param)):
        assert leaf.dtype == jnp.float32


def test_dlrm_matches_numpy():
    config = VARIANTS["dlrm"]
    tower = _tower(config)
    embeddings, dense = _inputs(1)
    params = _params(tower)
    bottom = _mlp(params["bottom"], dense)  # [B, D]
    vectors = np.concatenate([bottom[:, None], embeddings], axis=1)
    pairs = [np.sum(vectors[:, i] * vectors[:, j], axis=-1) for i in range(F + 1) for j in range(i)]
    features = np.concatenate([bottom, np.stack(pairs, axis=1)], axis=1)
    assert features.shape[1] == D + F * (F + 1) // 2
    hidden = _mlp(params["top"], features)
    expected = (hidden @ params["logit"]["kernel"] + params["logit"]["bias"])[:, 0]
    np.testing.assert_allclose(np.asarray(tower(embeddings, dense)), expected, rtol=1e-5, atol=1e-5)


def test_dlrm_self_interaction_adds_the_diagonal():
    tower = _abstract_tower(VARIANTS["dlrm_self"])
    kernel = tower.logit.kernel.get_value()
    assert kernel.shape == (D + (F + 1) * (F + 2) // 2, 1)


@pytest.mark.parametrize("structure", ["stacked", "parallel"])
@pytest.mark.parametrize("low_rank", [0, 3])
def test_dcnv2_matches_numpy(structure, low_rank):
    config = ModelConfig(
        tower="dcnv2",
        dcnv2=DCNv2Config(
            num_cross_layers=2, low_rank=low_rank, structure=structure, deep_mlp=(16,)
        ),
    )
    tower = _tower(config)
    embeddings, dense = _inputs(2)
    params = _params(tower)
    x0 = np.concatenate([dense, embeddings.reshape(B, -1)], axis=1)
    x = x0
    for index in range(2):
        layer = params[f"cross_{index}"]
        projected = x @ layer["down"]["kernel"] if low_rank else x
        if low_rank:
            assert layer["down"]["kernel"].shape == (N + F * D, low_rank)
        x = x0 * (projected @ layer["up"]["kernel"] + layer["up"]["bias"]) + x
    if structure == "parallel":
        hidden = np.concatenate([x, _mlp(params["deep"], x0)], axis=1)
    else:
        hidden = _mlp(params["deep"], x)
    expected = (hidden @ params["logit"]["kernel"] + params["logit"]["bias"])[:, 0]
    np.testing.assert_allclose(np.asarray(tower(embeddings, dense)), expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_compute_keeps_float32_params_and_tracks_float32():
    config = VARIANTS["dlrm"]
    tower32 = _tower(config)
    tower16 = _tower(dataclasses.replace(config, compute_dtype="bfloat16"))
    embeddings, dense = _inputs(3)
    logits32 = np.asarray(tower32(embeddings, dense))
    logits16 = tower16(embeddings, dense)
    assert logits16.dtype == jnp.bfloat16
    for leaf in jax.tree.leaves(nnx.state(tower16, nnx.Param)):
        assert leaf.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits16, np.float32), logits32, rtol=0.05, atol=0.05)


def test_mlp_layers_alternate_column_and_row_parallel():
    tower = _abstract_tower(VARIANTS["mlp"])
    state = nnx.state(tower, nnx.Param)
    first = state["hidden"]["layer_0"]["kernel"].get_metadata()[LOGICAL_AXES]
    second = state["hidden"]["layer_1"]["kernel"].get_metadata()[LOGICAL_AXES]
    logit = state["logit"]["kernel"].get_metadata()[LOGICAL_AXES]
    assert (first, second, logit) == ((None, "mlp"), ("mlp", None), (None, None))


def test_dlrm_bottom_must_end_at_embedding_dim():
    config = ModelConfig(tower="dlrm", dlrm=DLRMConfig(bottom_mlp=(16, D + 1)))
    with pytest.raises(ConfigError, match="bottom_mlp"):
        _tower(config)


def test_flops_criteo_dlrm_shape():
    config = ModelConfig(tower="dlrm")  # defaults: bottom 512-256-64-16, top 512-256-1
    flops = forward_flops_per_example(config, num_dense=13, num_features=26, embedding_dim=16)
    linear = 13 * 512 + 512 * 256 + 256 * 64 + 64 * 16 + (16 + 351) * 512 + 512 * 256 + 256
    assert flops == 2 * linear + 2 * 27 * 27 * 16


def test_flops_persia_mlp_shape():
    config = ModelConfig(tower="mlp")  # 4096-2048-1024-512-256
    flops = forward_flops_per_example(config, num_dense=13, num_features=26, embedding_dim=16)
    widths = [13 + 26 * 16, 4096, 2048, 1024, 512, 256, 1]
    assert flops == 2 * sum(a * b for a, b in zip(widths, widths[1:], strict=False))
