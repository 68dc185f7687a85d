"""HSTU blocks (Zhai et al. 2024, "Actions Speak Louder than Words") over packed rows.

One block, with x: [batch, length, dim] and a row packing several histories (segment ids):

    u, v, q, k = split(silu(linear(layer_norm(x))))          # per head
    attended   = hstu_attention(q, k, v, segments, relative bias)
    x          = x + linear(dropout(layer_norm(attended) * u))  # the gated output

The attention is pointwise (SiLU of each score over a fixed norm, no softmax) with a learned
bias per head and distance bucket and, with `time_buckets`, per head and bucket of the
time gap between the two events (`hstu_attention.py`), causal within each history.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from hybridrec.model.hstu_attention import hstu_attention, hstu_attention_cached
from hybridrec.model.layers import dropout, linear, place_positions


class HSTUBlock(nnx.Module):
    """One HSTU layer; the attention's implementation ('auto', 'pallas', 'reference') is
    chosen per call of the block (`hstu_attention`)."""

    def __init__(
        self,
        dim: int,
        *,
        heads: int,
        head_dim: int,
        buckets: int,
        max_distance: int,
        dtype,
        rngs: nnx.Rngs,
        implementation: str = "auto",
        time_buckets: int = 0,
    ):
        self.heads, self.head_dim = heads, head_dim
        self.max_distance, self.implementation = max_distance, implementation
        width = 4 * heads * head_dim  # u, v, q and k: one width, as the attention takes
        self.norm_in = nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.uvqk = linear(dim, width, (None, "mlp"), dtype=dtype, rngs=rngs)
        self.norm_attended = nnx.LayerNorm(
            heads * head_dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
        )
        self.out = linear(heads * head_dim, dim, ("mlp", None), dtype=dtype, rngs=rngs)
        self.relative_bias = nnx.Param(jnp.zeros((heads, buckets), jnp.float32))
        self.time_bias = nnx.Param(jnp.zeros((heads, time_buckets), jnp.float32)) if time_buckets else None  # fmt: skip

    def _time_bias(self):
        return None if self.time_bias is None else self.time_bias[...]

    def __call__(
        self, x: jax.Array, segments: jax.Array, times=None, *, rate: float = 0.0, rng=None
    ) -> jax.Array:
        """x: [batch, length, dim]; segments: [batch, length] int32 (negative: padding);
        times: [batch, length] int32 event times in seconds (with the time bias); `rate`:
        dropout on the gated attention output (with an `rng`, in training)."""
        u, v, q, k = self._uvqk(x)
        attended = hstu_attention(
            q,
            k,
            v,
            segments,
            self.relative_bias[...],
            alpha=self.head_dim**-0.5,
            inv_norm=1.0 / self.max_distance,
            max_distance=self.max_distance,
            implementation=self.implementation,
            times=times,
            time_bias=self._time_bias(),
        )
        return self._gated(x, attended, u, rate, rng)

    def extend(self, x, positions, key_count, cache_k, cache_v, prefix, times=None):
        """The block at a history's new positions, over its cached keys and values.

        x: [batch, n, dim] at `positions` [batch, n] = prefix + 0..n-1; cache_k, cache_v:
        [batch, L, heads, head_dim] of the first `prefix` [batch] positions; key_count
        [batch]: positions that exist after this step; times [batch, L]: every position's
        event time (with the time bias). Returns (x, the caches with the new positions'
        keys and values)."""
        u, v, q, k = self._uvqk(x)
        cache_k = place_positions(cache_k, k, prefix)
        cache_v = place_positions(cache_v, v, prefix)
        attended = hstu_attention_cached(
            q,
            cache_k,
            cache_v,
            positions,
            key_count,
            self.relative_bias[...],
            alpha=self.head_dim**-0.5,
            inv_norm=1.0 / self.max_distance,
            max_distance=self.max_distance,
            q_times=None if times is None else jnp.take_along_axis(times, positions, axis=1),
            k_times=times,
            time_bias=self._time_bias(),
        )
        return self._gated(x, attended, u), cache_k, cache_v

    def _uvqk(self, x):
        batch, length, _ = x.shape
        uvqk = jax.nn.silu(self.uvqk(self.norm_in(x)))
        u, v, q, k = jnp.split(uvqk, 4, axis=-1)
        shape = (batch, length, self.heads, self.head_dim)
        return u, v.reshape(shape), q.reshape(shape), k.reshape(shape)

    def _gated(self, x, attended, u, rate: float = 0.0, rng=None):
        batch, length = x.shape[:2]
        attended = self.norm_attended(attended.reshape(batch, length, -1))
        return x + self.out(dropout(attended * u, rate, rng))


class HSTUEncoder(nnx.Module):
    """A stack of HSTU blocks and a final layer norm: [batch, length, dim] -> same."""

    def __init__(
        self,
        dim: int,
        *,
        blocks: int,
        heads: int,
        head_dim: int,
        buckets: int = 32,
        max_distance: int = 256,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
        implementation: str = "auto",
        time_buckets: int = 0,
    ):
        self.num_blocks = blocks
        for index in range(blocks):
            block = HSTUBlock(
                dim,
                heads=heads,
                head_dim=head_dim,
                buckets=buckets,
                max_distance=max_distance,
                dtype=dtype,
                rngs=rngs,
                implementation=implementation,
                time_buckets=time_buckets,
            )
            setattr(self, f"block_{index}", block)
        self.norm_out = nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(
        self, x: jax.Array, segments: jax.Array, times=None, *, rate: float = 0.0, rng=None
    ) -> jax.Array:
        keys = [None] * self.num_blocks if rng is None else jax.random.split(rng, self.num_blocks)
        for index in range(self.num_blocks):
            x = getattr(self, f"block_{index}")(x, segments, times, rate=rate, rng=keys[index])
        return self.norm_out(x)

    def extend(self, x, positions, key_count, cache_k, cache_v, prefix, times=None):
        """`HSTUBlock.extend` through every block; caches [blocks, batch, L, heads, dim]."""
        keys, values = [], []
        for index in range(self.num_blocks):
            block = getattr(self, f"block_{index}")
            x, k, v = block.extend(
                x, positions, key_count, cache_k[index], cache_v[index], prefix, times
            )
            keys.append(k)
            values.append(v)
        return self.norm_out(x), jnp.stack(keys), jnp.stack(values)


def hstu_flops_per_token(
    dim: int, blocks: int, heads: int, head_dim: int, attended: float
) -> float:
    """Training FLOPs per token of an HSTUEncoder (forward and backward, 3x the forward's
    matrix products; the attention's backward recomputes its scores: 3.5x): `attended`
    is the mean number of positions a token attends to."""
    linear = 2 * dim * heads * 4 * head_dim + 2 * heads * head_dim * dim
    attention = 2 * 2 * attended * heads * head_dim
    return blocks * (3 * linear + 3.5 * attention)
