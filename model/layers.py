"""Building blocks shared by the towers: f32-parameter linear layers and MLPs.

Layers only *name* the logical axes of their parameters (metadata key `logical_axes`);
which mesh axis a name maps to is decided by `ModelConfig.partition_rules` in
`model/sharding.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

LOGICAL_AXES = "logical_axes"  # Param metadata key holding one logical name per dimension


def linear(
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
            setattr(self, f"layer_{index}", linear(previous, width, axes, dtype=dtype, rngs=rngs))
            previous = width
        self.num_layers = len(widths)
        self.out_features = previous

    def __call__(self, x: jax.Array) -> jax.Array:
        for index in range(self.num_layers):
            x = jax.nn.relu(getattr(self, f"layer_{index}")(x))
        return x


class CrossLayer(nnx.Module):
    """One DCN-V2 cross layer: x0 * (W x + b) + x, with W full rank or U V (rank r)."""

    def __init__(self, width: int, low_rank: int, *, dtype, rngs: nnx.Rngs):
        if low_rank:
            self.down = linear(
                width, low_rank, (None, None), dtype=dtype, rngs=rngs, use_bias=False
            )
            self.up = linear(low_rank, width, (None, "cross"), dtype=dtype, rngs=rngs)
        else:
            self.down = None
            self.up = linear(width, width, (None, "cross"), dtype=dtype, rngs=rngs)

    def __call__(self, x0: jax.Array, x: jax.Array) -> jax.Array:
        projected = self.up(self.down(x) if self.down is not None else x)
        return x0 * projected + x


def cast(dtype, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """The arrays in `dtype` (None leaves them as they are)."""
    if dtype is None:
        return arrays
    return tuple(array.astype(dtype) for array in arrays)


def flat_input(dtype, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
    """`[dense, flattened embeddings]`: [B, n] and [B, F, D] -> [B, n + F*D]."""
    embeddings, dense = cast(dtype, embeddings, dense)
    flat = embeddings.reshape(embeddings.shape[0], -1)  # [B, F*D]
    return jnp.concatenate([dense, flat], axis=-1)


def place_positions(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """`cache` [b, L, ...] with `new` [b, n, ...] written at positions start[b] ..
    start[b] + n - 1 of each row (what falls beyond L is dropped)."""
    length, count = cache.shape[1], new.shape[1]
    index = jnp.arange(length)[None, :] - start[:, None]  # [b, L]: which new row lands there
    inside = (index >= 0) & (index < count)
    trailing = (1,) * (cache.ndim - 2)
    gathered = jnp.take_along_axis(
        new, jnp.clip(index, 0, count - 1).reshape(*index.shape, *trailing), axis=1
    )
    return jnp.where(inside.reshape(*inside.shape, *trailing), gathered, cache)


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout of `x` at `rate`; the identity without an `rng` (evaluation)."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
