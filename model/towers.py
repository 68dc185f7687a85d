"""The dense towers (flax.nnx): DLRM, DCN-V2, a plain MLP and DHEN (model/dhen.py).

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hybridrec.common.errors import ConfigError
from hybridrec.model.config import (
    SEQUENCE_TOWERS,
    DCNv2Config,
    DLRMConfig,
    MLPConfig,
    ModelConfig,
    choose_tower,
)
from hybridrec.model.custom import build_custom_tower, check_tower, is_import_path, tower_kind
from hybridrec.model.dhen import DHEN
from hybridrec.model.dmt import DMT, TowerModule, check_towers
from hybridrec.model.layers import MLP, CrossLayer, cast, flat_input, linear
from hybridrec.model.sequence import build_sequence_tower, with_ranking_head


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
        self.logit = linear(self.top.out_features, 1, (None, None), dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
        embeddings, dense = cast(self.dtype, embeddings, dense)
        bottom = self.bottom(dense)  # [B, D]
        vectors = jnp.concatenate([bottom[:, None, :], embeddings], axis=1)  # [B, F+1, D]
        dots = jnp.einsum("bid,bjd->bij", vectors, vectors)  # [B, F+1, F+1]
        pairs = dots[:, np.asarray(self.pair_rows), np.asarray(self.pair_cols)]  # [B, P]
        hidden = self.top(jnp.concatenate([bottom, pairs], axis=-1))
        return self.logit(hidden)[:, 0]


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
        self.logit = linear(logit_in, 1, (None, None), dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
        x0 = flat_input(self.dtype, embeddings, dense)
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
        self.logit = linear(self.hidden.out_features, 1, (None, None), dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
        return self.logit(self.hidden(flat_input(self.dtype, embeddings, dense)))[:, 0]


def compute_dtype(config: ModelConfig):
    """The activation dtype; None keeps the f32 inputs' dtype (and lets f64 tests run in f64)."""
    return jnp.bfloat16 if config.compute_dtype == "bfloat16" else None


def _no_head(tower: nnx.Module, sequence, **_) -> nnx.Module:
    return tower


# a user's tower's kind -> what wraps it: a sequence tower gets the ranking head its
# `model.sequence` objective asks for (`model.sequence.with_ranking_head`)
HEADS = {"pooled": _no_head, "sequence": with_ranking_head}


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
    if is_import_path(config.tower):  # a user's tower (model/custom.py)
        tower = build_custom_tower(
            config.tower,
            dict(config.tower_config),
            num_dense=num_dense,
            num_features=num_features,
            embedding_dim=embedding_dim,
            max_length=config.sequence.max_length,
            dtype=compute_dtype(config),
            rngs=rngs,
        )
        head = HEADS[tower_kind(config.tower)]  # a sequence tower's ranking head, if any
        dtype = compute_dtype(config)
        return head(tower, config.sequence, dim=embedding_dim, dtype=dtype, rngs=rngs)
    if config.tower in SEQUENCE_TOWERS:  # over packed histories: `model.sequence`
        return build_sequence_tower(
            config.tower, config.sequence, dim=embedding_dim, dtype=compute_dtype(config), rngs=rngs
        )
    towers = {
        "dlrm": (DLRM, config.dlrm),
        "dcnv2": (DCNv2, config.dcnv2),
        "mlp": (MLPTower, config.mlp),
        "dhen": (DHEN, config.dhen),
    }
    name, _ = choose_tower(config.tower, num_dense, num_features)
    cls, tower_config = towers[name]
    if not config.towers:
        return cls(
            tower_config,
            num_dense=num_dense,
            num_features=num_features,
            embedding_dim=embedding_dim,
            dtype=compute_dtype(config),
            rngs=rngs,
        )
    check_towers(config.towers, num_features)
    global_tower = cls(
        tower_config,
        num_dense=num_dense,
        num_features=len(config.towers) * config.tower_outputs,
        embedding_dim=embedding_dim,
        dtype=compute_dtype(config),
        rngs=rngs,
    )
    return DMT(
        config.towers,
        outputs=config.tower_outputs,
        hidden=config.tower_mlp,
        global_tower=global_tower,
        embedding_dim=embedding_dim,
        dtype=compute_dtype(config),
        rngs=rngs,
    )


def check_user_tower(
    config: ModelConfig, *, num_dense: int, num_features: int, embedding_dim: int
) -> None:
    """A user's tower (`model.tower = "module:Class"`) built and called on abstract inputs
    at start-up: a one-line ConfigError when it does not meet the contract (model/custom.py)."""
    if not is_import_path(config.tower):
        return
    dims = {"num_dense": num_dense, "num_features": num_features, "embedding_dim": embedding_dim}
    check_tower(
        lambda rngs: build_tower(config, **dims, rngs=rngs),
        kind=tower_kind(config.tower),
        path=config.tower,
        dims=dims,
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
    interaction = tower
    if isinstance(tower, DMT):
        num_features = len(config.towers) * config.tower_outputs
        interaction = tower.global_tower
        for _, module in nnx.iter_modules(tower):
            if isinstance(module, TowerModule):
                flops += 2 * module.num_features**2 * embedding_dim  # its group's Gram matrix
    for _, module in nnx.iter_modules(tower):
        if isinstance(module, nnx.Linear):
            flops += 2 * int(np.prod(module.kernel.get_value().shape))
    if isinstance(interaction, DLRM):
        flops += 2 * (num_features + 1) ** 2 * embedding_dim  # the full Gram matrix
    if isinstance(interaction, DCNv2):
        flops += 2 * (num_dense + num_features * embedding_dim) * interaction.num_cross_layers
    if isinstance(interaction, DHEN):
        flops += interaction.interaction_flops(
            num_features + (1 if num_dense else 0), embedding_dim
        )
    return flops
