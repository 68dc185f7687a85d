"""Sequence towers over packed user histories: SASRec and HSTU.

A packed row holds several users' histories one after the other (docs/training.md,
"Sequences"); with R rows of L positions:

    x          [R, L, D]  the items' embedding rows (gathered from the batch's unique rows;
                          with side features, their rows times `side_scale` added)
    segments   [R, L]     int32: which history a position belongs to; negative: padding
    positions  [R, L]     int32: the position within its history, from 0

A tower maps them to one output vector per position, `[R, L, D]`, which the retrieval
objective (`model.sequence_step`) compares with item rows. Attention never crosses a
segment and never looks ahead: the mask is block-diagonal and causal.

    SASRec   (Kang & McAuley 2018) learned absolute positions, pre-norm blocks of causal
             softmax self-attention and a two-layer feed-forward network (or eSASRec's
             gated blocks with a SwiGLU feed-forward, `sequence.block = "ligr"`)
    HSTU     (Zhai et al. 2024) learned absolute positions, then HSTU blocks (pointwise SiLU
             attention with a relative-position bias, a time-gap bias when
             `sequence.time_buckets` > 0, and a gated output, `model.hstu`)

A tower is also given, as keywords, what it reads of each event besides its item
(`SequenceConfig.context`): `times=` [R, L] int32, each position's event time in seconds
(any origin within a history: only gaps count), and `actions=` [R, L] int32, its action
type (1..A, 0: none), a learned row a type added to the item's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from hybridrec.model.config import SequenceConfig
from hybridrec.model.hstu import HSTUEncoder
from hybridrec.model.hstu_attention import live_pairs
from hybridrec.model.layers import dropout, linear, place_positions


def _norm(dim: int, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


class _Positions(nnx.Module):
    """Learned absolute positions (and, with action types, a learned row per type),
    added to the scaled item rows, then dropout."""

    def __init__(self, dim: int, max_length: int, *, rngs: nnx.Rngs, action_types: int = 0):
        init = nnx.initializers.normal(stddev=0.02)
        self.table = nnx.Param(init(rngs.params(), (max_length, dim), jnp.float32))
        self.scale = dim**0.5
        shape = (action_types + 1, dim)  # row 0: no action
        self.actions = nnx.Param(init(rngs.params(), shape, jnp.float32)) if action_types else None

    def __call__(self, x, positions, rate: float, rng, actions=None) -> jax.Array:
        x = x * self.scale + self.table[...][positions].astype(x.dtype)
        if actions is not None:  # each event's action type, a learned row each
            x = x + self.actions[...][actions].astype(x.dtype)
        return dropout(x, rate, rng)


def cached_live(positions: jax.Array, key_count: jax.Array, length: int) -> jax.Array:
    """[b, n, L] bool: new position i sees key j when j <= positions[i] and j < key_count."""
    keys = jnp.arange(length)[None, None, :]
    return (keys <= positions[:, :, None]) & (keys < key_count[:, None, None])


def _at(values, positions):
    """[b, L] per-position values (None: none) at `positions` [b, n]."""
    return None if values is None else jnp.take_along_axis(values, positions, axis=1)


def extend_history(tower, x, positions, count, cache_k, cache_v, **context):
    """A tower's outputs at a history's new events, its earlier ones cached.

    Args:
        tower: a sequence tower with `extend` (SASRec, HSTU).
        x: [b, n, D] the new events' item rows, at `positions` [b, n] = prefix + 0..n-1
            (prefix [b]: the events cached).
        count: [b] how many of the n are events (the rest padding).
        cache_k, cache_v: [blocks, b, L, heads, head_dim], the keys and values of each
            block at positions 0..prefix-1 (`tower.cache_shape()`); L the longest history.
        context: what the tower reads of each event (`SequenceConfig.context`), each
            [b, L]: every position's (cached and new), e.g. `times=`, `actions=`.
    Returns:
        (outputs [b, n, D], the caches with the new events' keys and values): the outputs
        equal the full forward pass's over the whole history at those positions.
    """
    return tower.extend(x, positions, count, cache_k, cache_v, **context)


class SASRecBlock(nnx.Module):
    """x + attention(norm(x)); then x + ffn(norm(x)), with dropout after each."""

    def __init__(self, dim: int, *, heads: int, head_dim: int, dtype, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, head_dim
        width = heads * head_dim
        self.norm_attention = _norm(dim, dtype, rngs)
        self.qkv = linear(dim, 3 * width, (None, "mlp"), dtype=dtype, rngs=rngs)
        self.out = linear(width, dim, ("mlp", None), dtype=dtype, rngs=rngs)
        self.norm_ffn = _norm(dim, dtype, rngs)
        self.ffn_in = linear(dim, dim, (None, "mlp"), dtype=dtype, rngs=rngs)
        self.ffn_out = linear(dim, dim, ("mlp", None), dtype=dtype, rngs=rngs)

    def __call__(self, x, live, rate: float, rng) -> jax.Array:
        q, k, v = self._qkv(x)
        return self._attend(x, q, k, v, live, rate, rng)

    def extend(self, x, live, cache_k, cache_v, prefix):
        """The block at a history's new positions (x [b, n, D]) over the cached keys and
        values of its first `prefix` [b] positions (cache_k, cache_v [b, L, heads, dim]);
        `live` [b, 1, n, L]. Returns (x, the caches with the new positions written)."""
        q, k, v = self._qkv(x)
        cache_k = place_positions(cache_k, k, prefix)
        cache_v = place_positions(cache_v, v, prefix)
        return self._attend(x, q, cache_k, cache_v, live, 0.0, None), cache_k, cache_v

    def _qkv(self, x):
        rows, length, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.norm_attention(x)), 3, axis=-1)
        return (t.reshape(rows, length, self.heads, self.head_dim) for t in (q, k, v))

    def _attend(self, x, q, k, v, live, rate: float, rng) -> jax.Array:
        rows, length, _ = x.shape
        # head-major products (as hstu_attention_reference: the faster layout on the CPU)
        q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
        scores = jnp.einsum("bhid,bhjd->bhij", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(live, scores * self.head_dim**-0.5, -1e9)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        attended = jnp.swapaxes(jnp.einsum("bhij,bhjd->bhid", weights, v), 1, 2)
        attended = attended.reshape(rows, length, -1)
        keys = (None, None) if rng is None else jax.random.split(rng)
        return self._residuals(x, self.out(attended), rate, keys)

    def _residuals(self, x, attended, rate: float, keys) -> jax.Array:
        """The attention's output and then the feed-forward's, each added to x."""
        x = x + dropout(attended, rate, keys[0])
        hidden = jax.nn.relu(self.ffn_in(self.norm_ffn(x)))
        return x + dropout(self.ffn_out(hidden), rate, keys[1])


class LiGRBlock(SASRecBlock):
    """eSASRec's block (LinkedIn's LiGR layer): pre-norm attention and a SwiGLU
    feed-forward, each residual gated by a sigmoid of its normalized input:
    x + sigmoid(g(norm(x))) * attention(norm(x)); then the same with the feed-forward."""

    def __init__(self, dim: int, *, heads: int, head_dim: int, multiplier: int, dtype, rngs):
        super().__init__(dim, heads=heads, head_dim=head_dim, dtype=dtype, rngs=rngs)
        hidden = multiplier * dim
        self.ffn_in = linear(dim, 2 * hidden, (None, "mlp"), dtype=dtype, rngs=rngs)
        self.ffn_out = linear(hidden, dim, ("mlp", None), dtype=dtype, rngs=rngs)
        self.gate_attention = linear(dim, dim, (None, "mlp"), dtype=dtype, rngs=rngs)
        self.gate_ffn = linear(dim, dim, (None, "mlp"), dtype=dtype, rngs=rngs)

    def _residuals(self, x, attended, rate: float, keys) -> jax.Array:
        gate = jax.nn.sigmoid(self.gate_attention(self.norm_attention(x)))
        x = x + gate * dropout(attended, rate, keys[0])
        normed = self.norm_ffn(x)
        value, gate_in = jnp.split(self.ffn_in(normed), 2, axis=-1)
        hidden = jax.nn.silu(gate_in) * value
        gate = jax.nn.sigmoid(self.gate_ffn(normed))
        return x + gate * dropout(self.ffn_out(hidden), rate, keys[1])


class SASRec(nnx.Module):
    """SASRec over packed rows: `tower(x, segments, positions, rng=None) -> [R, L, D]`."""

    def __init__(self, config: SequenceConfig, *, dim: int, dtype, rngs: nnx.Rngs):
        if config.reads_times:
            raise ValueError("sequence.time_buckets is HSTU's time-gap bias; SASRec reads no times (set it to 0)")  # fmt: skip
        self.rate, self.num_blocks = config.dropout, config.blocks
        self.block_rate = config.block_rate("sasrec")
        head_dim = config.head_dim or max(dim // config.heads, 1)
        self.positions = _Positions(
            dim, config.max_length, rngs=rngs, action_types=max(config.action_inputs, 0)
        )
        for index in range(config.blocks):
            if config.block == "ligr":
                block = LiGRBlock(
                    dim, heads=config.heads, head_dim=head_dim, multiplier=config.ffn_multiplier,
                    dtype=dtype, rngs=rngs,
                )  # fmt: skip
            else:
                block = SASRecBlock(
                    dim, heads=config.heads, head_dim=head_dim, dtype=dtype, rngs=rngs
                )
            setattr(self, f"block_{index}", block)
        self.norm_out = _norm(dim, dtype, rngs)

    def __call__(self, x, segments, positions, rng=None, *, actions=None) -> jax.Array:
        keys = [None] * (self.num_blocks + 1)
        if rng is not None:
            keys = list(jax.random.split(rng, self.num_blocks + 1))
        x = self.positions(x, positions, self.rate, keys[0], actions)
        live = live_pairs(segments)[:, None]  # [R, 1, L, L]
        for index in range(self.num_blocks):
            x = getattr(self, f"block_{index}")(x, live, self.block_rate, keys[index + 1])
        return self.norm_out(x)

    def cache_shape(self) -> tuple[int, int, int]:
        """(blocks, heads, head dim) of the keys and values `extend` caches per position."""
        return self.num_blocks, self.block_0.heads, self.block_0.head_dim

    def extend(self, x, positions, count, cache_k, cache_v, *, actions=None):
        """The outputs at a history's new events from the cached keys and values of its
        earlier ones (`extend_history`'s arguments)."""
        prefix = positions[:, 0]
        x = self.positions(x, positions, 0.0, None, _at(actions, positions))
        live = cached_live(positions, prefix + count, cache_k.shape[2])[:, None]
        keys, values = [], []
        for index in range(self.num_blocks):
            block = getattr(self, f"block_{index}")
            x, k, v = block.extend(x, live, cache_k[index], cache_v[index], prefix)
            keys.append(k)
            values.append(v)
        return self.norm_out(x), jnp.stack(keys), jnp.stack(values)


class HSTU(nnx.Module):
    """HSTU over packed rows: `tower(x, segments, positions, rng=None) -> [R, L, D]`."""

    def __init__(self, config: SequenceConfig, *, dim: int, dtype, rngs: nnx.Rngs):
        self.rate, self.block_rate = config.dropout, config.block_rate("hstu")
        self.positions = _Positions(
            dim, config.max_length, rngs=rngs, action_types=max(config.action_inputs, 0)
        )
        self.encoder = HSTUEncoder(
            dim,
            blocks=config.blocks,
            heads=config.heads,
            head_dim=config.head_dim or max(dim // config.heads, 1),
            buckets=config.buckets,
            max_distance=config.max_distance or config.max_length,
            dtype=dtype if dtype is not None else jnp.float32,
            rngs=rngs,
            implementation=config.attention,
            time_buckets=max(config.time_buckets, 0),
        )

    def __call__(self, x, segments, positions, rng=None, *, times=None, actions=None) -> jax.Array:  # fmt: skip
        keys = (None, None) if rng is None else jax.random.split(rng)
        x = self.positions(x, positions, self.rate, keys[0], actions)
        segments = jnp.where(segments >= 0, segments, -1)
        return self.encoder(x, segments, times, rate=self.block_rate, rng=keys[1])

    def cache_shape(self) -> tuple[int, int, int]:
        block = self.encoder.block_0
        return self.encoder.num_blocks, block.heads, block.head_dim

    def extend(self, x, positions, count, cache_k, cache_v, *, times=None, actions=None):
        prefix = positions[:, 0]
        x = self.positions(x, positions, 0.0, None, _at(actions, positions))
        return self.encoder.extend(x, positions, prefix + count, cache_k, cache_v, prefix, times)


class RankingHead(nnx.Module):
    """The ranking objective's head: logits [.., actions] of a candidate item at a position,
    from [output, item row, output * item row] through an MLP (DLRMv3's form)."""

    def __init__(self, dim: int, actions: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.hidden = linear(3 * dim, hidden, (None, "mlp"), dtype=dtype, rngs=rngs)
        self.out = linear(hidden, actions, ("mlp", None), dtype=dtype, rngs=rngs)

    def __call__(self, outputs: jax.Array, items: jax.Array) -> jax.Array:
        x = jnp.concatenate([outputs, items.astype(outputs.dtype), outputs * items], axis=-1)
        return self.out(jax.nn.relu(self.hidden(x))).astype(jnp.float32)


class Ranked(nnx.Module):
    """A sequence tower with the ranking head: called as the tower, `rank(outputs, items)`
    the head."""

    def __init__(self, tower: nnx.Module, head: RankingHead):
        self.tower, self.head = tower, head

    def __call__(self, x, segments, positions, rng=None, **context) -> jax.Array:
        return self.tower(x, segments, positions, rng, **context)

    def rank(self, outputs: jax.Array, items: jax.Array) -> jax.Array:
        return self.head(outputs, items)

    def __getattr__(self, name: str):
        if name in ("extend", "cache_shape"):  # the tower's, where it has them
            return getattr(self.tower, name)
        raise AttributeError(name)


def with_ranking_head(tower: nnx.Module, config: SequenceConfig, *, dim: int, dtype, rngs):
    """The tower as the objective needs it: with the ranking head when it ranks."""
    if not config.ranking:
        return tower
    if config.actions < 1:
        raise ValueError("sequence.actions must be set (the dataset's action types) to rank")
    head = RankingHead(dim, config.actions, config.ranking_hidden, dtype=dtype, rngs=rngs)
    return Ranked(tower, head)


SEQUENCE_TOWERS = {"sasrec": SASRec, "hstu": HSTU}


def build_sequence_tower(
    name: str, config: SequenceConfig, *, dim: int, dtype, rngs: nnx.Rngs
) -> nnx.Module:
    """The sequence tower `name` ("sasrec" or "hstu") of width `dim` (with the ranking head
    when `config.objective` ranks)."""
    tower = SEQUENCE_TOWERS[name](config, dim=dim, dtype=dtype, rngs=rngs)
    return with_ranking_head(tower, config, dim=dim, dtype=dtype, rngs=rngs)
