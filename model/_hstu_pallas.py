"""Pallas kernels of HSTU's pointwise attention over packed rows (Triton on GPUs).

One forward kernel and one fused backward kernel, both over a grid of (row, head, block).
A row packs several histories one after another, each a contiguous run of one segment id
(negative ids are padding: they attend to nothing and nothing attends to them). Pair
(i, j) of a row is live when i and j share a segment and j <= i; its score is

    s_ij = alpha * q_i . k_j + bias[h, bucket(i - j)]
    out_i = inv_norm * sum_j silu(s_ij) v_j

There is no softmax, so nothing is carried between key blocks but the sum, and the
backward pass recomputes the scores from q and k alone (no statistics saved). A block
visits only the blocks its segments reach: a query block starts at the key block holding
the start of its first row's segment, a key block stops at the query block holding the
end of its last row's segment, so a row of many short histories costs the sum of their
triangles, not the triangle of the row.

The relative bias enters through two small per-row tables indexed by distance: the bias of
each distance (gathered from the learned [heads, buckets] table outside the kernel) and
the bucket of each distance. The bias gradient is reduced per bucket inside the backward
kernel: each query block sums its pairs' score gradients for the buckets its tiles reach
(one bucket for far tiles, a few near the diagonal) into a partial vector, and the partial
vectors of the blocks are added up outside.

`hstu_attention.py` holds the jax.numpy reference these kernels are tested against and the
custom gradient that joins them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _live(q_segments, k_segments, q_positions, k_positions):
    """[block_q, block_k] bool: same segment, causal, not padding."""
    return (
        (q_segments[:, None] == k_segments[None, :])
        & (q_positions[:, None] >= k_positions[None, :])
        & (q_segments[:, None] >= 0)
    )


def _tile(q, k, distance_bias_ref, q_positions, k_positions, alpha):
    """Scores of a tile (float32) and the clipped distances of its pairs."""
    distance = jnp.maximum(q_positions[:, None] - k_positions[None, :], 0)
    scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * alpha
    return scores + distance_bias_ref[distance], distance


def _forward_kernel(
    kv_lo_ref,
    kv_hi_ref,
    segments_ref,
    distance_bias_ref,
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    *,
    block_q: int,
    block_k: int,
    alpha: float,
    inv_norm: float,
):
    q_block = pl.program_id(2)
    q_rows = pl.ds(q_block * block_q, block_q)
    q = q_ref[...]
    q_segments = segments_ref[q_rows]
    q_positions = q_block * block_q + jnp.arange(block_q)

    def visit(k_block, total):
        k_rows = pl.ds(k_block * block_k, block_k)
        k, v = k_ref[k_rows, :], v_ref[k_rows, :]
        k_positions = k_block * block_k + jnp.arange(block_k)
        scores, _ = _tile(q, k, distance_bias_ref, q_positions, k_positions, alpha)
        live = _live(q_segments, segments_ref[k_rows], q_positions, k_positions)
        weights = jnp.where(live, scores * jax.nn.sigmoid(scores), 0.0)
        return total + jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)

    total = jnp.zeros(out_ref.shape, jnp.float32)
    total = lax.fori_loop(kv_lo_ref[q_block], kv_hi_ref[q_block], visit, total)
    out_ref[...] = (total * inv_norm).astype(out_ref.dtype)


def _backward_kernel(
    kv_lo_ref,
    kv_hi_ref,
    q_lo_ref,
    q_hi_ref,
    segments_ref,
    distance_bias_ref,
    distance_bucket_ref,
    q_ref,
    k_ref,
    v_ref,
    dout_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dbias_ref,
    *,
    block: int,
    alpha: float,
    inv_norm: float,
    buckets: int,
):
    """Program j: dk, dv of key block j (over the query blocks that reach it), dq and the
    bias gradient's partial sums of query block j (over the key blocks it reaches)."""
    j = pl.program_id(2)
    rows = pl.ds(j * block, block)
    positions = j * block + jnp.arange(block)
    segments = segments_ref[rows]

    def score_gradient(scores, live, q_dout, v):
        """d loss / d scores of a tile, and its attention weights."""
        sigmoid = jax.nn.sigmoid(scores)
        weights = jnp.where(live, scores * sigmoid, 0.0) * inv_norm
        dweights = jnp.dot(q_dout, v.T, preferred_element_type=jnp.float32)
        dscores = dweights * (sigmoid * (1.0 + scores * (1.0 - sigmoid))) * inv_norm
        return jnp.where(live, dscores, 0.0), weights

    # dk, dv of key block j
    k, v = k_ref[rows, :], v_ref[rows, :]

    def visit_queries(q_block, carry):
        dk, dv = carry
        q_rows = pl.ds(q_block * block, block)
        q, q_dout = q_ref[q_rows, :], dout_ref[q_rows, :]
        q_positions = q_block * block + jnp.arange(block)
        scores, _ = _tile(q, k, distance_bias_ref, q_positions, positions, alpha)
        live = _live(segments_ref[q_rows], segments, q_positions, positions)
        dscores, weights = score_gradient(scores, live, q_dout, v)
        dv = dv + jnp.dot(
            weights.T.astype(q_dout.dtype), q_dout, preferred_element_type=jnp.float32
        )
        dk = dk + jnp.dot(dscores.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros(dk_ref.shape, jnp.float32)
    dk, dv = lax.fori_loop(q_lo_ref[j], q_hi_ref[j], visit_queries, (zeros, zeros))
    dk_ref[...] = (dk * alpha).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

    # dq and the bias gradient of query block j
    q, q_dout = q_ref[rows, :], dout_ref[rows, :]
    bucket_ids = jnp.arange(dbias_ref.shape[-1])

    def add_bucket(bucket, carry):
        dbias, dscores, tile_buckets = carry
        total = jnp.sum(jnp.sum(jnp.where(tile_buckets == bucket, dscores, 0.0), axis=1), axis=0)
        return dbias + jnp.where(bucket_ids == bucket, total, 0.0), dscores, tile_buckets

    def visit_keys(k_block, carry):
        dq, dbias = carry
        k_rows = pl.ds(k_block * block, block)
        k, v = k_ref[k_rows, :], v_ref[k_rows, :]
        k_positions = k_block * block + jnp.arange(block)
        scores, distance = _tile(q, k, distance_bias_ref, positions, k_positions, alpha)
        live = _live(segments, segments_ref[k_rows], positions, k_positions)
        dscores, _ = score_gradient(scores, live, q_dout, v)
        dq = dq + jnp.dot(dscores.astype(k.dtype), k, preferred_element_type=jnp.float32)
        # the tile's live pairs reach buckets [first, last]: one for far tiles
        tile_buckets = distance_bucket_ref[distance]
        first = jnp.min(jnp.min(jnp.where(live, tile_buckets, buckets), axis=1), axis=0)
        last = jnp.max(jnp.max(jnp.where(live, tile_buckets, -1), axis=1), axis=0)
        dbias, _, _ = lax.fori_loop(first, last + 1, add_bucket, (dbias, dscores, tile_buckets))
        return dq, dbias

    dq = jnp.zeros(dq_ref.shape, jnp.float32)
    dbias = jnp.zeros(dbias_ref.shape, jnp.float32)
    dq, dbias = lax.fori_loop(kv_lo_ref[j], kv_hi_ref[j], visit_keys, (dq, dbias))
    dq_ref[...] = (dq * alpha).astype(dq_ref.dtype)
    dbias_ref[...] = dbias


def _row_spec(length, width):
    """A whole row of one head: [batch, length, heads, width] -> [length, width]."""
    return pl.BlockSpec((None, length, None, width), lambda b, h, i: (b, 0, h, 0))


def _per_row(length):
    """[batch, length] -> that row's [length]."""
    return pl.BlockSpec((None, length), lambda b, h, i: (b, 0))


def _per_head(length):
    """[heads, length] -> that head's [length]."""
    return pl.BlockSpec((None, length), lambda b, h, i: (h, 0))


def _compiler_params(block_q, block_k, head_dim):
    warps = 4 if block_q * block_k <= 64 * 64 and head_dim <= 64 else 8
    return plgpu.CompilerParams(num_warps=warps, num_stages=2)


def forward(
    q, k, v, segments, distance_bias, kv_bounds, *, block_q, block_k, alpha, inv_norm, interpret
):
    """q, k, v: [batch, length, heads, dim] (dim a power of two); segments: [batch, length]
    int32; distance_bias: [heads, length] float32; kv_bounds: ([batch, q_blocks] int32) x 2,
    the key blocks each query block visits. Returns [batch, length, heads, dim]."""
    batch, length, heads, dim = q.shape
    kv_lo, kv_hi = kv_bounds
    blocks = kv_lo.shape[1]
    kernel = functools.partial(
        _forward_kernel, block_q=block_q, block_k=block_k, alpha=alpha, inv_norm=inv_norm
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, length // block_q),
        in_specs=[
            _per_row(blocks),
            _per_row(blocks),
            _per_row(length),
            _per_head(length),
            pl.BlockSpec((None, block_q, None, dim), lambda b, h, i: (b, i, h, 0)),
            _row_spec(length, dim),
            _row_spec(length, dim),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, dim), lambda b, h, i: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(block_q, block_k, dim),
        interpret=interpret,
        name="hstu_attention_forward",
    )(kv_lo, kv_hi, segments, distance_bias, q, k, v)


def backward(
    q,
    k,
    v,
    dout,
    segments,
    distance_bias,
    distance_bucket,
    kv_bounds,
    q_bounds,
    *,
    block,
    buckets,
    alpha,
    inv_norm,
    interpret,
):
    """The gradients of `forward` (square blocks of `block` rows): dq, dk, dv like q and
    the bias gradient's partial sums, [batch, heads, blocks, buckets rounded up to a power
    of two] float32 (summed over batch and blocks by the caller)."""
    batch, length, heads, dim = q.shape
    blocks = length // block
    padded_buckets = pl.next_power_of_2(buckets)
    kernel = functools.partial(
        _backward_kernel, block=block, alpha=alpha, inv_norm=inv_norm, buckets=buckets
    )
    block_spec = pl.BlockSpec((None, block, None, dim), lambda b, h, i: (b, i, h, 0))
    bounds_width = kv_bounds[0].shape[1]
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, blocks),
        in_specs=[
            *[_per_row(bounds_width)] * 4,
            _per_row(length),
            _per_head(length),
            pl.BlockSpec((length,), lambda b, h, i: (0,)),
            *[_row_spec(length, dim)] * 4,
        ],
        out_specs=[
            block_spec,
            block_spec,
            block_spec,
            pl.BlockSpec((None, None, None, padded_buckets), lambda b, h, i: (b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((batch, heads, blocks, padded_buckets), jnp.float32),
        ],
        compiler_params=_compiler_params(block, block, dim),
        interpret=interpret,
        name="hstu_attention_backward",
    )(*kv_bounds, *q_bounds, segments, distance_bias, distance_bucket, q, k, v, dout)
