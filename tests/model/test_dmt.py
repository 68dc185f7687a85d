"""DMT: Tower Modules before the global tower, grouping errors, and the Tower Partitioner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hybridrec.common import config as config_lib
from hybridrec.common.errors import ConfigError
from hybridrec.model import DLRMConfig, ModelConfig, build_tower
from hybridrec.model.dmt import interaction_strength, propose_towers
from hybridrec.model.towers import DLRM, forward_flops_per_example

B, F, D, N = 4, 5, 4, 3
TOWERS = ((0, 3), (1, 2, 4))


def _config(**overrides):
    settings = {"towers": TOWERS, "tower_outputs": 2, "tower_mlp": (5,), **overrides}
    return ModelConfig(tower="dlrm", dlrm=DLRMConfig(bottom_mlp=(D,), top_mlp=(6,)), **settings)


def _build(config, num_features=F):
    return build_tower(
        config, num_dense=N, num_features=num_features, embedding_dim=D, rngs=nnx.Rngs(0)
    )


def _tower_module(params, x):
    rows, cols = np.tril_indices(x.shape[1], k=-1)
    pairs = np.einsum("bid,bjd->bij", x, x)[:, rows, cols]
    hidden = np.concatenate([x.reshape(len(x), -1), pairs], axis=-1)
    layer = params["hidden"]["layer_0"]
    hidden = np.maximum(hidden @ layer["kernel"] + layer["bias"], 0)
    return (hidden @ params["out"]["kernel"] + params["out"]["bias"]).reshape(len(x), -1, D)


def test_towers_compress_before_the_global_interaction():
    tower = _build(_config())
    assert isinstance(tower.global_tower, DLRM)
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(B, F, D)).astype(np.float32)
    dense = rng.normal(size=(B, N)).astype(np.float32)
    graphdef, state = nnx.split(tower, nnx.Param)
    logits = jax.jit(lambda e, d: nnx.merge(graphdef, state)(e, d))(embeddings, dense)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    compressed = np.concatenate(
        [
            _tower_module(params[f"tower_{index}"], embeddings[:, list(group)])
            for index, group in enumerate(TOWERS)
        ],
        axis=1,
    )  # [B, 2 towers x 2 outputs, D]
    assert compressed.shape == (B, 4, D)
    want = tower.global_tower(jnp.asarray(compressed), jnp.asarray(dense))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-4, atol=1e-5)
    # the global DLRM interacts 4 compressed vectors + the dense one, not 5 + 1
    flat = _config(towers=())
    dims = {"num_dense": N, "num_features": F, "embedding_dim": D}
    assert forward_flops_per_example(_config(), **dims) != forward_flops_per_example(flat, **dims)


@pytest.mark.parametrize(
    ("towers", "message"),
    [
        (((0, 1), (2, 3)), r"^model.towers: feature position\(s\) \[4\] are in no tower$"),
        (((0, 1, 2, 3, 4, 7),), r"^model.towers: feature position\(s\) \[7\] do not exist"),
    ],
)
def test_a_grouping_that_misses_a_feature_is_one_line_error(towers, message):
    with pytest.raises(ConfigError, match=message):
        _build(_config(towers=towers))


def test_a_repeated_feature_names_the_key():
    data = {"tower": "dlrm", "towers": [[0, 1], [1, 2, 3, 4]]}
    with pytest.raises(ConfigError) as error:
        config_lib.from_dict(ModelConfig, data, where="model")
    assert str(error.value) == "model: towers: feature position(s) [1] are in several towers"


def test_partitioner_groups_interacting_features_and_balances_load():
    # features {0, 2, 4} interact with each other, {1, 3, 5} too; pooled embeddings
    # where each cluster shares a direction (plus noise)
    rng = np.random.default_rng(0)
    directions = rng.normal(size=(2, 8))
    pooled = np.stack(
        [directions[index % 2] + 0.1 * rng.normal(size=(200, 8)) for index in range(6)],
        axis=1,
    )  # [200, 6, 8]
    strength = interaction_strength(pooled)
    assert strength[0, 2] > 0.9 and strength[0, 1] < strength[0, 2]
    assert propose_towers(strength, [1.0] * 6, 2) == [[0, 2, 4], [1, 3, 5]]
    # feature 0 weighs as much as the rest: it gets a tower of its own, load stays balanced
    loads = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    towers = propose_towers(strength, loads, 2)
    assert towers[0] == [0] and sorted(towers[1]) == [1, 2, 3, 4, 5]
    three = propose_towers(strength, [1.0] * 6, 3, tolerance=0.0)
    assert sorted(len(tower) for tower in three) == [2, 2, 2]
    assert sorted(index for tower in three for index in tower) == list(range(6))
