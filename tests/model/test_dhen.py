"""DHEN: the stacked ensemble layers against numpy, module subsets, and its config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hybridrec.common import config as config_lib
from hybridrec.common.errors import ConfigError
from hybridrec.model import DHENConfig, ModelConfig, build_tower
from hybridrec.model.towers import forward_flops_per_example

B, F, D, N = 5, 3, 4, 2


def _tower(dhen: DHENConfig, num_dense: int = N):
    config = ModelConfig(tower="dhen", dhen=dhen)
    return build_tower(
        config, num_dense=num_dense, num_features=F, embedding_dim=D, rngs=nnx.Rngs(0)
    )


def _jitted(tower):
    """`logits(embeddings, dense)` of `tower`, compiled once (eager flax is slow per op)."""
    graphdef, params = nnx.split(tower, nnx.Param)
    return jax.jit(lambda embeddings, dense: nnx.merge(graphdef, params)(embeddings, dense))


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, F, D)), rng.normal(size=(B, N))


def _dense(layer, x):
    return x @ layer["kernel"] + layer["bias"]


def _mlp(params, x):
    for index in range(len(params)):
        x = np.maximum(_dense(params[f"layer_{index}"], x), 0)
    return x


def _layer_norm(params, x, epsilon=1e-6):
    mean = x.mean(-1, keepdims=True)
    variance = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + epsilon) * params["scale"] + params["bias"]


def _softmax(x):
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


def _numpy_layer(params, x, modules, heads):
    batch, vectors, dim = x.shape
    flat = x.reshape(batch, -1)
    outputs = []
    for name in modules:
        module = params[f"{name}_module"]
        if name == "dot":
            rows, cols = np.tril_indices(vectors, k=-1)
            pairs = np.einsum("bid,bjd->bij", x, x)[:, rows, cols]
            outputs.append(_dense(module["out"], pairs).reshape(x.shape))
        elif name == "cross":
            cross = module["cross"]
            projected = _dense(cross["up"], flat @ cross["down"]["kernel"])
            outputs.append((flat * projected + flat).reshape(x.shape))
        elif name == "attention":
            query, value = (
                _dense(module[name], x).reshape(batch, vectors, heads, -1)
                for name in ("query", "value")
            )
            key = (x @ module["key"]["kernel"]).reshape(batch, vectors, heads, -1)
            scores = np.einsum("bihd,bjhd->bhij", query, key) / np.sqrt(dim // heads)
            mixed = np.einsum("bhij,bjhd->bihd", _softmax(scores), value).reshape(x.shape)
            outputs.append(_dense(module["output"], mixed))
        else:
            outputs.append(_dense(module["out"], _mlp(module["hidden"], flat)).reshape(x.shape))
    mixed = _dense(params["project"], np.concatenate(outputs, axis=-1))
    return _layer_norm(params["norm"], x + mixed)


def test_dhen_matches_numpy():
    """Two layers of all four modules (low-rank cross), bottom MLP and top MLP."""
    dhen = DHENConfig(
        num_layers=2, bottom_mlp=(6, D), module_mlp=(7,), top_mlp=(5,), cross_low_rank=3
    )
    jax.config.update("jax_enable_x64", True)
    try:
        tower = _tower(dhen)
        embeddings, dense = _inputs(1)
        got = np.asarray(_jitted(tower)(jnp.asarray(embeddings), jnp.asarray(dense)))
        params = jax.tree.map(
            lambda a: np.asarray(a, np.float64),
            nnx.to_pure_dict(nnx.state(tower, nnx.Param)),
        )
    finally:
        jax.config.update("jax_enable_x64", False)
    x = np.concatenate([_mlp(params["bottom"], dense)[:, None], embeddings], axis=1)
    for index in range(2):
        x = _numpy_layer(params[f"layer_{index}"], x, dhen.modules, dhen.attention_heads)
    want = _dense(params["logit"], _mlp(params["top"], x.reshape(B, -1)))[:, 0]
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize(
    ("modules", "num_dense"),
    [(("attention", "mlp"), N), (("dot", "cross"), 0)],
)
def test_module_subsets_and_no_dense_features(modules, num_dense):
    dhen = DHENConfig(num_layers=3, modules=modules, bottom_mlp=(D,), module_mlp=(), top_mlp=())
    tower = _tower(dhen, num_dense)
    embeddings, dense = (jnp.asarray(a, jnp.float32) for a in _inputs())
    dense = dense[:, :num_dense]
    forward = _jitted(tower)
    logits = forward(embeddings, dense)
    assert logits.shape == (B,) and np.all(np.isfinite(np.asarray(logits)))
    params = nnx.to_pure_dict(nnx.state(tower, nnx.Param))
    assert sorted(params["layer_2"]) == sorted([f"{name}_module" for name in modules]) + [
        "norm",
        "project",
    ]
    assert ("bottom" in params) == bool(num_dense)
    # the logit depends on every feature through the stacked interactions
    gradient = jax.jit(jax.grad(lambda e: forward(e, dense).sum()))(embeddings)
    assert np.all(np.abs(np.asarray(gradient)).sum(axis=(0, 2)) > 0)


def test_flops_count_the_interactions():
    small = DHENConfig(num_layers=1, modules=("mlp",), bottom_mlp=(D,), top_mlp=())
    large = DHENConfig(num_layers=1, modules=("mlp", "dot"), bottom_mlp=(D,), top_mlp=())
    dims = {"num_dense": N, "num_features": F, "embedding_dim": D}
    flops = [
        forward_flops_per_example(ModelConfig(tower="dhen", dhen=dhen), **dims)
        for dhen in (small, large)
    ]
    pairs = (F + 1) * F // 2
    # the dot module: the Gram matrix, its pairs -> (F+1)*D map, and a wider projection
    extra = 2 * (F + 1) ** 2 * D + 2 * pairs * (F + 1) * D + 2 * D * D
    assert flops[1] - flops[0] == extra


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"modules": ["dot", "transformer"]}, "model.dhen: dhen.modules: unknown module(s)"),
        ({"modules": []}, "model.dhen: dhen.modules must name at least one"),
        ({"modules": ["dot", "dot"]}, "names a module twice"),
        ({"num_layers": 0}, "dhen.num_layers must be >= 1"),
    ],
)
def test_bad_dhen_config_is_one_line_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        config_lib.from_dict(ModelConfig, {"tower": "dhen", "dhen": overrides}, where="model")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_sizes_that_cannot_work_name_the_key():
    with pytest.raises(ConfigError, match="model.dhen.attention_heads = 3"):
        _tower(DHENConfig(attention_heads=3, bottom_mlp=(D,)))
    with pytest.raises(ConfigError, match="model.dhen.bottom_mlp ends with 5"):
        _tower(DHENConfig(bottom_mlp=(5,)))
