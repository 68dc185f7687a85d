"""DHEN (Zhang et al. 2022, "DHEN: A Deep and Hierarchical Ensemble Network for Large-Scale
Click-Through Rate Prediction"): a stack of layers, each an ensemble of heterogeneous
interaction modules over the feature vectors, combined with a residual.

The tower works on V = F (+1 with dense features) vectors of the embedding dim D:

    X0      = [bottom_mlp(dense), e_1, ..., e_F]                       [B, V, D]
    Y_m     = module_m(X_l)  for m in config.modules                   [B, V, D] each
    X_{l+1} = LayerNorm(X_l + concat_m(Y_m) @ W_l)   (W_l: [M*D, D])    [B, V, D]
    logit   = top_mlp(flatten(X_L))

Modules (each maps [B, V, D] -> [B, V, D]):
    "dot"        pairwise dot products of the V vectors (V(V-1)/2), linearly mapped to V*D
    "cross"      one DCN-V2 cross layer on the flattened vectors: x * (W x + b) + x
    "attention"  multi-head self-attention across the V vectors
    "mlp"        an MLP on the flattened vectors, back to V*D

Stacking layers makes interactions of interactions (the "hierarchy"): the second layer's
dot module sees vectors that already mix features through attention and cross terms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hybridrec.common.errors import ConfigError
from hybridrec.model.config import DHENConfig
from hybridrec.model.layers import MLP, CrossLayer, cast, linear


class DotModule(nnx.Module):
    """Pairwise dot products of the vectors, mapped back to V vectors of dim D."""

    def __init__(self, num_vectors: int, dim: int, *, dtype, rngs: nnx.Rngs):
        rows, cols = np.tril_indices(num_vectors, k=-1)
        self.pair_rows = tuple(int(i) for i in rows)
        self.pair_cols = tuple(int(i) for i in cols)
        self.out = linear(
            max(len(rows), 1), num_vectors * dim, (None, None), dtype=dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, num_vectors, dim = x.shape
        if not self.pair_rows:  # one vector: no pairs, a constant input
            pairs = jnp.ones((batch, 1), x.dtype)
        else:
            dots = jnp.einsum("bid,bjd->bij", x, x)  # [B, V, V]
            pairs = dots[:, np.asarray(self.pair_rows), np.asarray(self.pair_cols)]  # [B, P]
        return self.out(pairs).reshape(batch, num_vectors, dim)


class CrossModule(nnx.Module):
    """One DCN-V2 cross layer on the flattened vectors, its own input as x0."""

    def __init__(self, num_vectors: int, dim: int, low_rank: int, *, dtype, rngs: nnx.Rngs):
        self.cross = CrossLayer(num_vectors * dim, low_rank, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(x.shape[0], -1)  # [B, V*D]
        return self.cross(flat, flat).reshape(x.shape)


class AttentionModule(nnx.Module):
    """Multi-head scaled dot-product self-attention across the V vectors."""

    def __init__(self, dim: int, heads: int, *, dtype, rngs: nnx.Rngs):
        self.heads = heads
        for name in ("query", "key", "value", "output"):
            # A key bias adds the same q.b to every score of a query, which the softmax
            # cancels: its gradient is zero, so it is left out.
            bias = name != "key"
            layer = linear(dim, dim, (None, None), dtype=dtype, rngs=rngs, use_bias=bias)
            setattr(self, name, layer)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, num_vectors, dim = x.shape
        head_dim = dim // self.heads

        def split(projection):  # [B, V, D] -> [B, V, H, D/H], no transpose (faster on CPU)
            return projection(x).reshape(batch, num_vectors, self.heads, head_dim)

        query, key, value = split(self.query), split(self.key), split(self.value)
        scores = jnp.einsum("bihd,bjhd->bhij", query, key) / np.sqrt(head_dim)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(value.dtype)
        mixed = jnp.einsum("bhij,bjhd->bihd", weights, value)  # [B, V, H, D/H]
        return self.output(mixed.reshape(batch, num_vectors, dim))


class MLPModule(nnx.Module):
    """An MLP on the flattened vectors, linearly mapped back to V*D."""

    def __init__(self, num_vectors: int, dim: int, hidden, *, dtype, rngs: nnx.Rngs):
        self.hidden = MLP(num_vectors * dim, hidden, dtype=dtype, rngs=rngs)
        self.out = linear(
            self.hidden.out_features, num_vectors * dim, (None, None), dtype=dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.hidden(x.reshape(x.shape[0], -1))).reshape(x.shape)


class DHENLayer(nnx.Module):
    """One ensemble layer: every module on the same input, concatenated, projected, residual."""

    def __init__(self, config: DHENConfig, num_vectors: int, dim: int, *, dtype, rngs: nnx.Rngs):
        builders = {
            "dot": lambda: DotModule(num_vectors, dim, dtype=dtype, rngs=rngs),
            "cross": lambda: CrossModule(
                num_vectors, dim, config.cross_low_rank, dtype=dtype, rngs=rngs
            ),
            "attention": lambda: AttentionModule(
                dim, config.attention_heads, dtype=dtype, rngs=rngs
            ),
            "mlp": lambda: MLPModule(num_vectors, dim, config.module_mlp, dtype=dtype, rngs=rngs),
        }
        self.module_names = tuple(config.modules)
        for name in self.module_names:
            setattr(self, f"{name}_module", builders[name]())
        self.project = linear(
            len(self.module_names) * dim, dim, (None, None), dtype=dtype, rngs=rngs
        )
        self.norm = (
            nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
            if config.layer_norm
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        outputs = [getattr(self, f"{name}_module")(x) for name in self.module_names]
        mixed = self.project(jnp.concatenate(outputs, axis=-1))  # [B, V, D]
        x = x + mixed
        return self.norm(x) if self.norm is not None else x


class DHEN(nnx.Module):
    """The DHEN tower: bottom MLP, `num_layers` ensemble layers, top MLP, logit."""

    def __init__(
        self,
        config: DHENConfig,
        *,
        num_dense: int,
        num_features: int,
        embedding_dim: int,
        dtype,
        rngs: nnx.Rngs,
    ):
        if num_dense and config.bottom_mlp[-1] != embedding_dim:
            raise ConfigError(
                f"model.dhen.bottom_mlp ends with {config.bottom_mlp[-1]} but the embedding dim "
                f"is {embedding_dim}; the bottom MLP output is one more feature vector"
            )
        if "attention" in config.modules and embedding_dim % config.attention_heads:
            raise ConfigError(
                f"model.dhen.attention_heads = {config.attention_heads} does not divide the "
                f"embedding dim {embedding_dim}"
            )
        self.bottom = (
            MLP(num_dense, config.bottom_mlp, dtype=dtype, rngs=rngs) if num_dense else None
        )
        num_vectors = num_features + (1 if num_dense else 0)
        for index in range(config.num_layers):
            layer = DHENLayer(config, num_vectors, embedding_dim, dtype=dtype, rngs=rngs)
            setattr(self, f"layer_{index}", layer)
        self.num_layers = config.num_layers
        self.module_names = tuple(config.modules)
        self.top = MLP(num_vectors * embedding_dim, config.top_mlp, dtype=dtype, rngs=rngs)
        self.logit = linear(self.top.out_features, 1, (None, None), dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
        embeddings, dense = cast(self.dtype, embeddings, dense)
        x = embeddings  # [B, F, D]
        if self.bottom is not None:
            x = jnp.concatenate([self.bottom(dense)[:, None, :], embeddings], axis=1)
        for index in range(self.num_layers):
            x = getattr(self, f"layer_{index}")(x)  # [B, V, D]
        hidden = self.top(x.reshape(x.shape[0], -1))
        return self.logit(hidden)[:, 0]

    def interaction_flops(self, num_vectors: int, dim: int) -> int:
        """Forward FLOPs per example outside linear layers (dot and attention products)."""
        per_layer = 0
        names = self.module_names
        if "dot" in names:
            per_layer += 2 * num_vectors * num_vectors * dim
        if "attention" in names:
            per_layer += 4 * num_vectors * num_vectors * dim  # scores and weighted sum
        if "cross" in names:
            per_layer += 2 * num_vectors * dim
        return per_layer * self.num_layers
