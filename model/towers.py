"""The dense towers (flax.nnx): DLRM, DCN-V2 and a plain MLP.

Every tower maps pooled embeddings `[batch, features, dim]` and dense features
`[batch, num_dense]` to one logit per example `[batch]`. Layers only *name* the
logical axes of their parameters (metadata key `logical_axes`); which mesh axis a
name maps to is decided by `ModelConfig.partition_rules` in `model/sharding.py`.

Logical axis names:
  "mlp"    a hidden MLP width. Consecutive layers alternate between sharding their
           output ("column parallel") and their input ("row parallel"), so a pair
           of layers needs one all-reduce on a model axis.
  "cross"  the output width of a DCN-V2 cross layer.
  None     never sharded (inputs whose size depends on the data, logit layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common.errors import ConfigError
from model.config import DCNv2Config, DLRMConfig, MLPConfig, ModelConfig, choose_tower

LOGICAL_AXES = "logical_axes"  # Param metadata key holding one logical name per dimension


def _linear(
    in_features: int,
    out_features: int,
    axes: tuple[str | None, str | None],
    *,
    dtype,
    rngs: nnx.Rngs,
    use_bias: bool = True,
) -> nnx.Linear:
    """An f32-parameter linear layer computing in `dtype` (None = the inputs' dtype)."""
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_metadata={LOGICAL_AXES: axes},
        bias_metadata={LOGICAL_AXES: (axes[1],)},
        rngs=rngs,
    )


class MLP(nnx.Module):
    """Linear + ReLU layers; hidden widths named "mlp", alternately column/row parallel."""

    def __init__(self, in_features: int, widths: Sequence[int], *, dtype, rngs: nnx.Rngs):
        previous = in_features
        # Attributes named layer_0, layer_1, ... keep parameter paths string-keyed
        # (checkpoint friendly) rather than list-indexed.
        for index, width in enumerate(widths):
            axes = (None, "mlp") if index % 2 == 0 else ("mlp", None)
            setattr(self, f"layer_{index}", _linear(previous, width, axes, dtype=dtype, rngs=rngs))
            previous = width
        self.num_layers = len(widths)
        self.out_features = previous

    def __call__(self, x: jax.Array) -> jax.Array:
        for index in range(self.num_layers):
            x = jax.nn.relu(getattr(self, f"layer_{index}")(x))
        return x


class DLRM(nnx.Module):
    """DLRM (Naumov et al. 2019) with the pairwise-dot interaction."""

    def __init__(
        self,
        config: DLRMConfig,
        *,
        num_dense: int,
        num_features: int,
        embedding_dim: int,
        dtype,
        rngs: nnx.Rngs,
    ):
        if num_dense < 1:
            raise ConfigError("model.tower = 'dlrm' needs at least one dense feature")
        if config.bottom_mlp[-1] != embedding_dim:
            raise ConfigError(
                f"model.dlrm.bottom_mlp ends with {config.bottom_mlp[-1]} but the embedding "
                f"dim is {embedding_dim}; the bottom MLP output is dotted with the embeddings"
            )
        self.bottom = MLP(num_dense, config.bottom_mlp, dtype=dtype, rngs=rngs)
        num_vectors = num_features + 1
        rows, cols = np.tril_indices(num_vectors, k=0 if config.self_interaction else -1)
        # Static python ints: the index pattern is part of the program, not a parameter.
        self.pair_rows = tuple(int(i) for i in rows)
        self.pair_cols = tuple(int(i) for i in cols)
        self.top = MLP(embedding_dim + len(rows), config.top_mlp, dtype=dtype, rngs=rngs)
        self.logit = _linear(self.top.out_features, 1, (None, None), dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
        embeddings, dense = _cast(self.dtype, embeddings, dense)
        bottom = self.bottom(dense)  # [B, D]
        vectors = jnp.concatenate([bottom[:, None, :], embeddings], axis=1)  # [B, F+1, D]
        dots = jnp.einsum("bid,bjd->bij", vectors, vectors)  # [B, F+1, F+1]
        pairs = dots[:, np.asarray(self.pair_rows), np.asarray(self.pair_cols)]  # [B, P]
        hidden = self.top(jnp.concatenate([bottom, pairs], axis=-1))
        return self.logit(hidden)[:, 0]


class CrossLayer(nnx.Module):
    """One DCN-V2 cross layer: x0 * (W x + b) + x, with W full rank or U V (rank r)."""

    def __init__(self, width: int, low_rank: int, *, dtype, rngs: nnx.Rngs):
        if low_rank:
            self.down = _linear(
                width, low_rank, (None, None), dtype=dtype, rngs=rngs, use_bias=False
            )
            self.up = _linear(low_rank, width, (None, "cross"), dtype=dtype, rngs=rngs)
        else:
            self.down = None
            self.up = _linear(width, width, (None, "cross"), dtype=dtype, rngs=rngs)

    def __call__(self, x0: jax.Array, x: jax.Array) -> jax.Array:
        projected = self.up(self.down(x) if self.down is not None else x)
        return x0 * projected + x


class DCNv2(nnx.Module):
    """DCN-V2 (Wang et al. 2021): cross network stacked before, or parallel to, a deep MLP."""

    def __init__(
        self,
        config: DCNv2Config,
        *,
        num_dense: int,
        num_features: int,
        embedding_dim: int,
        dtype,
        rngs: nnx.Rngs,
    ):
        width = num_dense + num_features * embedding_dim
        for index in range(config.num_cross_layers):
            setattr(
                self, f"cross_{index}", CrossLayer(width, config.low_rank, dtype=dtype, rngs=rngs)
            )
        self.num_cross_layers = config.num_cross_layers
        self.parallel = config.structure == "parallel"
        self.deep = MLP(width, config.deep_mlp, dtype=dtype, rngs=rngs)
        logit_in = self.deep.out_features + (width if self.parallel else 0)
        self.logit = _linear(logit_in, 1, (None, None), dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
        x0 = _flat_input(self.dtype, embeddings, dense)
        crossed = x0
        for index in range(self.num_cross_layers):
            crossed = getattr(self, f"cross_{index}")(x0, crossed)
        if self.parallel:
            hidden = jnp.concatenate([crossed, self.deep(x0)], axis=-1)
        else:
            hidden = self.deep(crossed)
        return self.logit(hidden)[:, 0]


class MLPTower(nnx.Module):
    """A plain MLP over [dense, flattened embeddings] (PERSIA's 4096-2048-1024-512-256)."""

    def __init__(
        self,
        config: MLPConfig,
        *,
        num_dense: int,
        num_features: int,
        embedding_dim: int,
        dtype,
        rngs: nnx.Rngs,
    ):
        width = num_dense + num_features * embedding_dim
        self.hidden = MLP(width, config.hidden, dtype=dtype, rngs=rngs)
        self.logit = _linear(self.hidden.out_features, 1, (None, None), dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
        return self.logit(self.hidden(_flat_input(self.dtype, embeddings, dense)))[:, 0]


def _cast(dtype, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    if dtype is None:
        return arrays
    return tuple(array.astype(dtype) for array in arrays)


def _flat_input(dtype, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
    embeddings, dense = _cast(dtype, embeddings, dense)
    flat = embeddings.reshape(embeddings.shape[0], -1)  # [B, F*D]
    return jnp.concatenate([dense, flat], axis=-1)


def compute_dtype(config: ModelConfig):
    """The activation dtype; None keeps the f32 inputs' dtype (and lets f64 tests run in f64)."""
    return jnp.bfloat16 if config.compute_dtype == "bfloat16" else None


def build_tower(
    config: ModelConfig,
    *,
    num_dense: int,
    num_features: int,
    embedding_dim: int,
    rngs: nnx.Rngs,
) -> nnx.Module:
    """Builds the tower named by `config.tower`; `tower(embeddings, dense) -> logits [B]`.

    Args:
        config: the model config.
        num_dense: number of dense input features.
        num_features: number of pooled embedding features F.
        embedding_dim: embedding dimension D (shared by all features).
        rngs: parameter initialization randomness.

    Raises:
        ConfigError: sizes that cannot work with these inputs.
    """
    if num_features < 1 or embedding_dim < 1 or num_dense < 0:
        raise ConfigError(
            f"bad tower inputs: num_features={num_features}, embedding_dim={embedding_dim}, "
            f"num_dense={num_dense}"
        )
    towers = {
        "dlrm": (DLRM, config.dlrm),
        "dcnv2": (DCNv2, config.dcnv2),
        "mlp": (MLPTower, config.mlp),
    }
    name, _ = choose_tower(config.tower, num_dense, num_features)
    cls, tower_config = towers[name]
    return cls(
        tower_config,
        num_dense=num_dense,
        num_features=num_features,
        embedding_dim=embedding_dim,
        dtype=compute_dtype(config),
        rngs=rngs,
    )


def forward_flops_per_example(
    config: ModelConfig, *, num_dense: int, num_features: int, embedding_dim: int
) -> int:
    """Analytic forward-pass FLOPs per example (2 per multiply-add; elementwise ops ignored).

    A training step costs about 3x this (forward, gradient w.r.t. activations, gradient
    w.r.t. weights).
    """
    tower = nnx.eval_shape(
        lambda: build_tower(
            config,
            num_dense=num_dense,
            num_features=num_features,
            embedding_dim=embedding_dim,
            rngs=nnx.Rngs(0),
        )
    )
    flops = 0
    for _, module in nnx.iter_modules(tower):
        if isinstance(module, nnx.Linear):
            flops += 2 * int(np.prod(module.kernel.get_value().shape))
    if isinstance(tower, DLRM):
        flops += 2 * (num_features + 1) ** 2 * embedding_dim  # the full Gram matrix
    if isinstance(tower, DCNv2):
        flops += 2 * (num_dense + num_features * embedding_dim) * tower.num_cross_layers
    return flops
