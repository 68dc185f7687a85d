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

With event times, each pair's score also gets a learned bias per head and bucket of its
time gap t_i - t_j (`time_bucket`): the kernels read each row's times, compute the buckets
of a tile's pairs and gather from the head's [time buckets] table; the backward kernel
reduces that table's gradient per bucket as it does the relative bias's.

`hstu_attention.py` holds the jax.numpy reference these kernels are tested against and the
custom gradient that joins them.
"""

from __future__ import annotations

import functools
import math

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


# the float32 mantissa bits at and above which a number of [1, 2) is at least sqrt(2)
_SQRT2_MANTISSA = math.ceil((math.sqrt(2.0) - 1.0) * (1 << 23))


def time_bucket(gap, buckets: int):
    """The time-bias bucket of each gap in seconds (>= 0): half an octave each,
    floor(2 log2(1 + gap)) of 1 + gap in float32, the last bucket holding every longer
    gap. Read off the float's bits (its exponent, and whether its mantissa is past
    sqrt(2)): exact, where a float log2 rounds across a bucket's edge now and then, and a
    fifth of its time on the CPU."""
    x = 1.0 + jnp.maximum(jnp.asarray(gap).astype(jnp.float32), 0.0)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    upper = (bits & 0x7FFFFF) >= _SQRT2_MANTISSA
    return jnp.minimum(2 * ((bits >> 23) - 127) + upper.astype(jnp.int32), buckets - 1)


def _tile(q, k, distance_bias_ref, q_positions, k_positions, alpha, time=None):
    """Scores of a tile (float32), the clipped distances of its pairs and, with `time`
    ((q_times, k_times, time_bias_ref, buckets)), their time buckets (else None)."""
    distance = jnp.maximum(q_positions[:, None] - k_positions[None, :], 0)
    scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * alpha
    scores = scores + distance_bias_ref[distance]
    if time is None:
        return scores, distance, None
    q_times, k_times, time_bias_ref, buckets = time
    gap_buckets = time_bucket(q_times[:, None] - k_times[None, :], buckets)
    return scores + time_bias_ref[gap_buckets], distance, gap_buckets


def _split_refs(refs, time_buckets: int):
    """(times_ref, time_bias_ref, the other refs): the time refs come first after the
    fixed ones when the kernel has a time bias (else None, None)."""
    if time_buckets:
        return refs[0], refs[1], refs[2:]
    return None, None, refs


def _add_buckets(dbias, dscores, tile_buckets, live, buckets: int):
    """dbias [padded buckets] plus each bucket's sum of the tile's score gradients, over
    the buckets [first, last] the tile's live pairs reach."""
    bucket_ids = jnp.arange(dbias.shape[-1])

    def add_bucket(bucket, dbias):
        total = jnp.sum(jnp.sum(jnp.where(tile_buckets == bucket, dscores, 0.0), axis=1), axis=0)
        return dbias + jnp.where(bucket_ids == bucket, total, 0.0)

    first = jnp.min(jnp.min(jnp.where(live, tile_buckets, buckets), axis=1), axis=0)
    last = jnp.max(jnp.max(jnp.where(live, tile_buckets, -1), axis=1), axis=0)
    return lax.fori_loop(first, last + 1, add_bucket, dbias)


def _forward_kernel(
    kv_lo_ref,
    kv_hi_ref,
    segments_ref,
    distance_bias_ref,
    *refs,
    block_q: int,
    block_k: int,
    alpha: float,
    inv_norm: float,
    time_buckets: int,
):
    """refs: [times_ref, time_bias_ref,] q_ref, k_ref, v_ref, out_ref."""
    times_ref, time_bias_ref, (q_ref, k_ref, v_ref, out_ref) = _split_refs(refs, time_buckets)
    q_block = pl.program_id(2)
    q_rows = pl.ds(q_block * block_q, block_q)
    q = q_ref[...]
    q_segments = segments_ref[q_rows]
    q_positions = q_block * block_q + jnp.arange(block_q)

    def visit(k_block, total):
        k_rows = pl.ds(k_block * block_k, block_k)
        k, v = k_ref[k_rows, :], v_ref[k_rows, :]
        k_positions = k_block * block_k + jnp.arange(block_k)
        time = None
        if time_buckets:
            time = (times_ref[q_rows], times_ref[k_rows], time_bias_ref, time_buckets)
        scores, _, _ = _tile(q, k, distance_bias_ref, q_positions, k_positions, alpha, time)
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
    *refs,
    block: int,
    alpha: float,
    inv_norm: float,
    buckets: int,
    time_buckets: int,
):
    """Program j: dk, dv of key block j (over the query blocks that reach it), dq and the
    biases' gradient partial sums of query block j (over the key blocks it reaches).
    refs: [times_ref, time_bias_ref,] q_ref, k_ref, v_ref, dout_ref, dq_ref, dk_ref,
    dv_ref, dbias_ref[, dtime_ref]."""
    times_ref, time_bias_ref, refs = _split_refs(refs, time_buckets)
    q_ref, k_ref, v_ref, dout_ref, dq_ref, dk_ref, dv_ref, dbias_ref = refs[:8]
    dtime_ref = refs[8] if time_buckets else None
    j = pl.program_id(2)
    rows = pl.ds(j * block, block)
    positions = j * block + jnp.arange(block)
    segments = segments_ref[rows]

    def time_of(q_rows, k_rows):
        if not time_buckets:
            return None
        return times_ref[q_rows], times_ref[k_rows], time_bias_ref, time_buckets

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
        time = time_of(q_rows, rows)
        scores, _, _ = _tile(q, k, distance_bias_ref, q_positions, positions, alpha, time)
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

    # dq and the biases' gradients of query block j
    q, q_dout = q_ref[rows, :], dout_ref[rows, :]

    def visit_keys(k_block, carry):
        dq, dbias, dtime = carry
        k_rows = pl.ds(k_block * block, block)
        k, v = k_ref[k_rows, :], v_ref[k_rows, :]
        k_positions = k_block * block + jnp.arange(block)
        time = time_of(rows, k_rows)
        scores, distance, gap_buckets = _tile(
            q, k, distance_bias_ref, positions, k_positions, alpha, time
        )
        live = _live(segments, segments_ref[k_rows], positions, k_positions)
        dscores, _ = score_gradient(scores, live, q_dout, v)
        dq = dq + jnp.dot(dscores.astype(k.dtype), k, preferred_element_type=jnp.float32)
        # the tile's live pairs reach a range of buckets: one for far tiles
        tile_buckets = distance_bucket_ref[distance]
        dbias = _add_buckets(dbias, dscores, tile_buckets, live, buckets)
        if time_buckets:
            dtime = _add_buckets(dtime, dscores, gap_buckets, live, time_buckets)
        return dq, dbias, dtime

    dq = jnp.zeros(dq_ref.shape, jnp.float32)
    dbias = jnp.zeros(dbias_ref.shape, jnp.float32)
    dtime = jnp.zeros(dtime_ref.shape if time_buckets else (1,), jnp.float32)
    dq, dbias, dtime = lax.fori_loop(kv_lo_ref[j], kv_hi_ref[j], visit_keys, (dq, dbias, dtime))
    dq_ref[...] = (dq * alpha).astype(dq_ref.dtype)
    dbias_ref[...] = dbias
    if time_buckets:
        dtime_ref[...] = dtime


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


def _time_inputs(times, time_bias, length):
    """([in specs], [arrays]) of the time bias (none without it): each row's times
    [batch, length] int32 and each head's table [heads, buckets rounded up to a power of
    two] float32."""
    if time_bias is None:
        return [], []
    padded = pl.next_power_of_2(time_bias.shape[1])
    table = jnp.pad(time_bias.astype(jnp.float32), ((0, 0), (0, padded - time_bias.shape[1])))
    return [_per_row(length), _per_head(padded)], [times.astype(jnp.int32), table]


def forward(
    q,
    k,
    v,
    segments,
    distance_bias,
    kv_bounds,
    *,
    block_q,
    block_k,
    alpha,
    inv_norm,
    interpret,
    times=None,
    time_bias=None,
):
    """q, k, v: [batch, length, heads, dim] (dim a power of two); segments: [batch, length]
    int32; distance_bias: [heads, length] float32; kv_bounds: ([batch, q_blocks] int32) x 2,
    the key blocks each query block visits; times [batch, length] and time_bias [heads,
    time buckets]: the time bias, if any. Returns [batch, length, heads, dim]."""
    batch, length, heads, dim = q.shape
    kv_lo, kv_hi = kv_bounds
    blocks = kv_lo.shape[1]
    time_specs, time_arrays = _time_inputs(times, time_bias, length)
    kernel = functools.partial(
        _forward_kernel,
        block_q=block_q,
        block_k=block_k,
        alpha=alpha,
        inv_norm=inv_norm,
        time_buckets=0 if time_bias is None else time_bias.shape[1],
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, length // block_q),
        in_specs=[
            _per_row(blocks),
            _per_row(blocks),
            _per_row(length),
            _per_head(length),
            *time_specs,
            pl.BlockSpec((None, block_q, None, dim), lambda b, h, i: (b, i, h, 0)),
            _row_spec(length, dim),
            _row_spec(length, dim),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, dim), lambda b, h, i: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(block_q, block_k, dim),
        interpret=interpret,
        name="hstu_attention_forward",
    )(kv_lo, kv_hi, segments, distance_bias, *time_arrays, q, k, v)


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
    times=None,
    time_bias=None,
):
    """The gradients of `forward` (square blocks of `block` rows): dq, dk, dv like q and
    the biases' gradient partial sums, [batch, heads, blocks, buckets rounded up to a
    power of two] float32 each (summed over batch and blocks by the caller): the relative
    bias's, then the time bias's when there is one."""
    batch, length, heads, dim = q.shape
    blocks = length // block
    time_specs, time_arrays = _time_inputs(times, time_bias, length)
    time_buckets = 0 if time_bias is None else time_bias.shape[1]
    kernel = functools.partial(
        _backward_kernel,
        block=block,
        alpha=alpha,
        inv_norm=inv_norm,
        buckets=buckets,
        time_buckets=time_buckets,
    )
    block_spec = pl.BlockSpec((None, block, None, dim), lambda b, h, i: (b, i, h, 0))
    bounds_width = kv_bounds[0].shape[1]
    partial_widths = [pl.next_power_of_2(buckets)]
    if time_buckets:
        partial_widths.append(pl.next_power_of_2(time_buckets))
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, blocks),
        in_specs=[
            *[_per_row(bounds_width)] * 4,
            _per_row(length),
            _per_head(length),
            pl.BlockSpec((length,), lambda b, h, i: (0,)),
            *time_specs,
            *[_row_spec(length, dim)] * 4,
        ],
        out_specs=[
            block_spec,
            block_spec,
            block_spec,
            *[
                pl.BlockSpec((None, None, None, width), lambda b, h, i: (b, h, i, 0))
                for width in partial_widths
            ],
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            *[
                jax.ShapeDtypeStruct((batch, heads, blocks, width), jnp.float32)
                for width in partial_widths
            ],
        ],
        compiler_params=_compiler_params(block, block, dim),
        interpret=interpret,
        name="hstu_attention_backward",
    )(
        *kv_bounds,
        *q_bounds,
        segments,
        distance_bias,
        distance_bucket,
        *time_arrays,
        q,
        k,
        v,
        dout,
    )
