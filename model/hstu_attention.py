"""HSTU's pointwise attention over packed rows: a jax.numpy reference that runs everywhere
and a Pallas kernel for GPUs, with one entry point that picks between them.

HSTU ("Actions Speak Louder than Words", Zhai et al. 2024) replaces softmax attention with
a pointwise one: each live pair's weight is SiLU of its score, divided by a fixed norm,
and the scores carry a learned bias per head and relative-distance bucket. Rows are packed:
several users' histories one after another, each a contiguous run of one segment id, so a
pair (i, j) is live when both positions share a segment and j <= i. Negative segment ids
mark padding, which attends to nothing and outputs zeros.

    out[b, i, h] = inv_norm * sum_{j live} silu(alpha * q[b,i,h] . k[b,j,h]
                                             + bias[h, bucket(i - j)]) * v[b, j, h]

`hstu_attention(..., implementation="auto")` uses the kernel on a GPU when it compiles for
the shapes and dtype at hand (a small probe compiles it once per dtype and width), and the
reference otherwise, with one line saying why. Tests run the kernel in Pallas interpret mode
on the CPU against the reference (tests/model/test_hstu_attention.py).
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from hybridrec.model import _hstu_pallas
from hybridrec.model._hstu_pallas import time_bucket
from jax.experimental import pallas as pl

IMPLEMENTATIONS = ("auto", "pallas", "reference")


def relative_bucket(distance, buckets: int, max_distance: int):
    """The bias bucket of each distance i - j >= 0: distances below buckets // 2 each have
    their own, farther ones share logarithmically wider buckets up to max_distance, and the
    last bucket holds everything beyond (T5's scheme, one-sided).

    distance: int array; returns int32 of its shape, in [0, buckets).
    """
    exact = max(buckets // 2, 1)
    distance = jnp.asarray(distance, jnp.int32)
    if buckets <= exact or max_distance <= exact:
        return jnp.minimum(distance, buckets - 1)
    scaled = jnp.log(jnp.maximum(distance, exact).astype(jnp.float32) / exact)
    scaled = scaled / math.log(max_distance / exact) * (buckets - exact)
    far = exact + scaled.astype(jnp.int32)
    return jnp.minimum(jnp.where(distance < exact, distance, far), buckets - 1)


def _time_bias(time_bias, query_times, key_times):
    """[batch, heads, n, L] the bias of each (query, key) pair's gap, from time_bias
    [heads, time buckets], query_times [batch, n] and key_times [batch, L]."""
    gap = query_times[:, :, None] - key_times[:, None, :]
    buckets = time_bucket(gap, time_bias.shape[1])  # [batch, n, L]
    # a gather per head, stacked head-major: no [heads, batch] -> [batch, heads] transpose
    # of the pairs forward, nor of their gradient backward
    return jnp.stack(
        [table.at[buckets].get(mode="promise_in_bounds") for table in time_bias], axis=1
    ).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def every_row(matrix, rows: int):
    """`matrix` repeated for each of `rows` rows: [rows, *matrix.shape]. Its gradient sums
    the rows' as a matrix-vector product: XLA's CPU reduction over a leading axis of
    [40, 4, 200, 200] takes 18 ms, the product 0.3 ms."""
    return jnp.broadcast_to(matrix[None], (rows, *matrix.shape))


def _every_row_forward(matrix, rows):
    return every_row(matrix, rows), None


def _every_row_backward(rows, _, grad):
    flat = grad.reshape(rows, -1)
    ones = jnp.ones((rows,), flat.dtype)
    total = jnp.dot(ones, flat, precision=jax.lax.Precision.HIGHEST)
    return (total.reshape(grad.shape[1:]),)


every_row.defvjp(_every_row_forward, _every_row_backward)


def live_pairs(segments):
    """[batch, length, length] bool: pair (i, j) shares a segment, j <= i, not padding."""
    length = segments.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    same = segments[:, :, None] == segments[:, None, :]
    return same & causal[None] & (segments[:, :, None] >= 0)


def hstu_attention_reference(
    q, k, v, segments, bias, *, alpha: float, inv_norm: float, max_distance: int,
    times=None, time_bias=None,
):  # fmt: skip
    """The attention in plain jax.numpy (it holds the [batch, heads, length, length] scores).

    Args:
        q, k, v: [batch, length, heads, dim].
        segments: [batch, length] int32, each segment one contiguous run, negative: padding.
        bias: [heads, buckets] float32, the relative bias per head and distance bucket.
        alpha: scale of q . k.
        inv_norm: scale of the weighted sum (HSTU: 1 / the longest history).
        max_distance: the distance the last bias bucket starts at (`relative_bucket`).
        times: [batch, length] int32 each position's event time in seconds, with
            time_bias [heads, time buckets]: the bias of the gap t_i - t_j (`time_bucket`)
            is added to each pair's score; None: no time bias.
    Returns:
        [batch, length, heads, dim] in q's dtype.
    """
    batch, length = q.shape[:2]
    positions = jnp.arange(length)
    distance = jnp.maximum(positions[:, None] - positions[None, :], 0)
    buckets = relative_bucket(distance, bias.shape[1], max_distance)
    # head-major [batch, heads, length, dim] for both products: on the CPU, XLA's batched
    # products in this layout take a quarter of the time of the [batch, length, heads] ones
    qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    scores = jnp.einsum("bhid,bhjd->bhij", qh, kh, preferred_element_type=jnp.float32)
    scores = scores * alpha + every_row(bias[:, buckets].astype(jnp.float32), batch)
    if time_bias is not None:
        scores = scores + _time_bias(time_bias, times, times)
    live = live_pairs(segments)[:, None]
    weights = jnp.where(live, jax.nn.silu(scores), 0.0) * inv_norm
    out = jnp.einsum(
        "bhij,bhjd->bhid", weights.astype(v.dtype), vh, preferred_element_type=jnp.float32
    )
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def hstu_attention_cached(
    q, k, v, q_positions, key_count, bias, *, alpha: float, inv_norm: float, max_distance: int,
    q_times=None, k_times=None, time_bias=None,
):  # fmt: skip
    """The attention of a history's new positions over all of its keys (a served history
    extended by its new events, the earlier keys and values cached).

    Args:
        q: [batch, n, heads, dim] the new positions' queries, at `q_positions` [batch, n].
        k, v: [batch, L, heads, dim] the keys and values of positions 0..L-1, of which the
            first `key_count` [batch] exist.
        bias, alpha, inv_norm, max_distance: as `hstu_attention_reference`.
        q_times [batch, n], k_times [batch, L], time_bias: the time bias, if any.
    Returns:
        [batch, n, heads, dim]: what the reference computes at those positions for one
        history of `key_count` events.
    """
    keys = jnp.arange(k.shape[1])[None, None, :]
    distance = jnp.maximum(q_positions[:, :, None] - keys, 0)  # [batch, n, L]
    buckets = relative_bucket(distance, bias.shape[1], max_distance)
    scores = jnp.einsum("bihd,bjhd->bhij", q, k, preferred_element_type=jnp.float32)
    scores = scores * alpha + jnp.moveaxis(bias[:, buckets], 0, 1).astype(jnp.float32)
    if time_bias is not None:
        scores = scores + _time_bias(time_bias, q_times, k_times)
    live = (keys <= q_positions[:, :, None]) & (keys < key_count[:, None, None])
    weights = jnp.where(live[:, None], jax.nn.silu(scores), 0.0) * inv_norm
    out = jnp.einsum(
        "bhij,bjhd->bihd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.astype(q.dtype)


def block_bounds(segments, block_q: int, block_k: int):
    """The blocks a tile loop visits, from the segments' runs.

    Returns ((kv_lo, kv_hi), (q_lo, q_hi)), each [batch, blocks padded to a power of two]
    int32: query block i visits key blocks [kv_lo, kv_hi) (from the one holding its first
    row's segment start to its diagonal), key block j is visited by query blocks
    [q_lo, q_hi) (from its diagonal to the one holding its last row's segment end); a block
    of padding alone visits nothing.
    """
    batch, length = segments.shape
    positions = jnp.arange(length, dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones((batch, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1
    )
    ends = jnp.concatenate([segments[:, 1:] != segments[:, :-1], jnp.ones((batch, 1), bool)], 1)
    segment_start = jax.lax.cummax(jnp.where(starts, positions, 0), axis=1)
    segment_end = jax.lax.cummin(jnp.where(ends, positions, length - 1), axis=1, reverse=True)

    def padded(bounds):
        width = pl.next_power_of_2(bounds.shape[1])
        return jnp.pad(bounds, ((0, 0), (0, width - bounds.shape[1]))).astype(jnp.int32)

    q_first = jnp.arange(0, length, block_q)
    q_last = q_first + block_q - 1
    any_live_q = jnp.any((segments >= 0).reshape(batch, -1, block_q), axis=2)
    kv_lo = segment_start[:, q_first] // block_k
    kv_hi = jnp.where(any_live_q, q_last // block_k + 1, kv_lo)
    k_first = jnp.arange(0, length, block_k)
    k_last = k_first + block_k - 1
    any_live_k = jnp.any((segments >= 0).reshape(batch, -1, block_k), axis=2)
    q_lo = jnp.broadcast_to(k_first // block_q, (batch, k_first.size))
    q_hi = jnp.where(any_live_k, segment_end[:, k_last] // block_q + 1, q_lo)
    return (padded(kv_lo), padded(kv_hi)), (padded(q_lo), padded(q_hi))


def _fitting_block(length: int, block: int) -> int | None:
    """The largest power of two >= 16, at most `block`, dividing `length`; None if none."""
    while block >= 16 and length % block:
        block //= 2
    return block if block >= 16 else None


def _check_blocks(length: int, *blocks: int) -> None:
    for block in blocks:
        if block < 16 or block & (block - 1):
            raise ValueError(f"attention block size {block}: must be a power of two >= 16")
        if length % block:
            raise ValueError(
                f"attention block size {block} does not divide the row length {length}: "
                "rows must be a multiple of the block"
            )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12, 13))
def _kernel_attention(
    q, k, v, segments, bias, times, time_bias, alpha, inv_norm, max_distance, block_q,
    block_k, block, interpret,
):  # fmt: skip
    out, _ = _kernel_forward(
        q, k, v, segments, bias, times, time_bias, alpha, inv_norm, max_distance, block_q,
        block_k, block, interpret,
    )  # fmt: skip
    return out


def _distance_tables(bias, length, max_distance):
    buckets = relative_bucket(jnp.arange(length), bias.shape[1], max_distance)
    return bias[:, buckets].astype(jnp.float32), buckets


def _kernel_forward(
    q, k, v, segments, bias, times, time_bias, alpha, inv_norm, max_distance, block_q,
    block_k, block, interpret,
):  # fmt: skip
    distance_bias, _ = _distance_tables(bias, q.shape[1], max_distance)
    kv_bounds, _ = block_bounds(segments, block_q, block_k)
    out = _hstu_pallas.forward(
        q,
        k,
        v,
        segments,
        distance_bias,
        kv_bounds,
        block_q=block_q,
        block_k=block_k,
        alpha=alpha,
        inv_norm=inv_norm,
        interpret=interpret,
        times=times,
        time_bias=time_bias,
    )
    return out, (q, k, v, segments, bias, times, time_bias)


def _kernel_backward(alpha, inv_norm, max_distance, block_q, block_k, block, interpret, res, dout):
    q, k, v, segments, bias, times, time_bias = res
    distance_bias, distance_bucket = _distance_tables(bias, q.shape[1], max_distance)
    kv_bounds, q_bounds = block_bounds(segments, block, block)
    dq, dk, dv, dbias, *dtime = _hstu_pallas.backward(
        q,
        k,
        v,
        dout.astype(q.dtype),
        segments,
        distance_bias,
        distance_bucket,
        kv_bounds,
        q_bounds,
        block=block,
        buckets=bias.shape[1],
        alpha=alpha,
        inv_norm=inv_norm,
        interpret=interpret,
        times=times,
        time_bias=time_bias,
    )
    dbias = dbias.sum(axis=(0, 2))[:, : bias.shape[1]].astype(bias.dtype)
    dsegments = np.zeros(segments.shape, jax.dtypes.float0)
    if time_bias is None:
        return dq, dk, dv, dsegments, dbias, None, None
    dtime_bias = dtime[0].sum(axis=(0, 2))[:, : time_bias.shape[1]].astype(time_bias.dtype)
    return dq, dk, dv, dsegments, dbias, np.zeros(times.shape, jax.dtypes.float0), dtime_bias


_kernel_attention.defvjp(_kernel_forward, _kernel_backward)


def hstu_attention_pallas(
    q,
    k,
    v,
    segments,
    bias,
    *,
    alpha: float,
    inv_norm: float,
    max_distance: int,
    block_q: int = 64,
    block_k: int = 64,
    block_backward: int = 64,
    interpret: bool = False,
    times=None,
    time_bias=None,
):
    """The Pallas kernel (forward and backward) of `hstu_attention_reference`, same
    arguments; block_q / block_k tile the forward pass, block_backward (square) the
    backward one. Each must be a power of two >= 16 dividing the row length. A width that
    is no power of two >= 16 is zero-padded to one (the scores and outputs are unchanged)."""
    length, dim = q.shape[1], q.shape[3]
    _check_blocks(length, block_q, block_k, block_backward)
    if time_bias is None:
        times = None  # read only with a time bias
    elif times is None:
        raise ValueError("a time bias needs each position's times")
    else:
        times = jnp.asarray(times, jnp.int32)
    width = max(16, pl.next_power_of_2(dim))
    if width != dim:
        pad = ((0, 0), (0, 0), (0, 0), (0, width - dim))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    segments = segments.astype(jnp.int32)
    out = _kernel_attention(
        q,
        k,
        v,
        segments,
        bias,
        times,
        time_bias,
        float(alpha),
        float(inv_norm),
        int(max_distance),
        block_q,
        block_k,
        block_backward,
        interpret,
    )
    return out[..., :dim]


_probed: dict[tuple, str | None] = {}
_said: set[str] = set()


def kernel_problem(
    dtype, dim: int, backend: str | None = None, time_buckets: int = 0
) -> str | None:
    """Why the kernel cannot run on `backend` (default: JAX's) for this dtype and width,
    with a time bias of `time_buckets` if any (None: it compiles): a small forward and
    backward pass compiled once per (backend, dtype, width, time bias or not)."""
    backend = backend or jax.default_backend()
    key = (backend, jnp.dtype(dtype).name, dim, time_buckets > 0)
    if key not in _probed:
        if backend != "gpu":
            _probed[key] = f"the kernel is for GPUs, the backend is {backend}"
        else:
            _probed[key] = _probe(dtype, dim, time_buckets)
    return _probed[key]


def _probe(dtype, dim: int, time_buckets: int) -> str | None:
    shape = (1, 128, 1, dim)
    q = jnp.ones(shape, dtype)
    segments = jnp.zeros((1, 128), jnp.int32)
    bias = jnp.zeros((1, 8), jnp.float32)
    times = jnp.arange(128, dtype=jnp.int32)[None] * 60 if time_buckets else None
    time_bias = jnp.zeros((1, time_buckets), jnp.float32) if time_buckets else None

    def loss(q, bias, time_bias):
        out = hstu_attention_pallas(
            q, q, q, segments, bias, alpha=1.0, inv_norm=1.0, max_distance=64,
            times=times, time_bias=time_bias,
        )  # fmt: skip
        return out.astype(jnp.float32).sum()

    try:
        jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(q, bias, time_bias))
    except Exception as error:  # any compile or launch failure: fall back, saying why
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def resolve_implementation(
    implementation: str, dtype, dim: int, backend: str | None = None, time_buckets: int = 0
) -> str:
    """'pallas' or 'reference' for `implementation` ('auto' picks the kernel on a GPU when
    it compiles, with a time bias of `time_buckets` if any, saying so in one line when it
    does not); backend: default JAX's."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r}: expected one of {IMPLEMENTATIONS}"
        )
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    if backend != "gpu":
        return "reference"
    problem = kernel_problem(dtype, dim, backend, time_buckets)
    if problem is None:
        return "pallas"
    if problem not in _said:  # one line per reason, not one per call
        _said.add(problem)
        print(
            "HSTU attention: the Pallas kernel does not compile here "
            f"({problem}); using the jax.numpy reference",
            file=sys.stderr,
            flush=True,
        )
    return "reference"


def hstu_attention(
    q,
    k,
    v,
    segments,
    bias,
    *,
    alpha: float,
    inv_norm: float,
    max_distance: int,
    implementation: str = "auto",
    block_q: int = 64,
    block_k: int = 64,
    block_backward: int = 64,
    times=None,
    time_bias=None,
):
    """HSTU attention by `implementation` ('auto', 'pallas' or 'reference'); the
    arguments are `hstu_attention_reference`'s."""
    time_buckets = 0 if time_bias is None else time_bias.shape[1]
    chosen = resolve_implementation(implementation, q.dtype, q.shape[-1], None, time_buckets)
    if chosen == "pallas" and implementation == "auto":
        # rows shorter than a block, or no multiple of one: the largest blocks that divide
        # them, or the reference where none of at least 16 does
        fitted = [_fitting_block(q.shape[1], b) for b in (block_q, block_k, block_backward)]
        if None in fitted:
            chosen = "reference"
        else:
            block_q, block_k, block_backward = fitted
    if chosen == "reference":
        return hstu_attention_reference(
            q, k, v, segments, bias, alpha=alpha, inv_norm=inv_norm, max_distance=max_distance,
            times=times, time_bias=time_bias,
        )  # fmt: skip
    return hstu_attention_pallas(
        q,
        k,
        v,
        segments,
        bias,
        alpha=alpha,
        inv_norm=inv_norm,
        max_distance=max_distance,
        block_q=block_q,
        block_k=block_k,
        block_backward=block_backward,
        interpret=jax.default_backend() != "gpu",
        times=times,
        time_bias=time_bias,
    )
