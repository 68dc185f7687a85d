"""The HSTU attention kernel against its jax.numpy reference: outputs and the gradients of
q, k, v and the relative bias, over row lengths, segment layouts (one history, many short
ones, padding, a history across block edges) and block sizes. On the CPU the kernel runs
in Pallas interpret mode; with JAX_PLATFORMS=cuda the same tests run it compiled."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hybridrec.model.hstu_attention import (
    block_bounds,
    every_row,
    hstu_attention,
    hstu_attention_pallas,
    hstu_attention_reference,
    live_pairs,
    relative_bucket,
    resolve_implementation,
    time_bucket,
)

ON_GPU = jax.default_backend() == "gpu"
# a GPU's float32 dots run in TF32 (kernel and reference alike, not in the same order)
TOLERANCE = 2e-2 if ON_GPU else 2e-5


def segments_of(layout: str, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """[batch, length] int32 segment ids: one contiguous run per history."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        if layout == "one":
            row = np.zeros(length, np.int32)
        elif layout == "short":  # many histories of 1 to 20 events
            lengths = rng.integers(1, 21, size=length)
            row = np.repeat(np.arange(length), lengths)[:length].astype(np.int32)
        elif layout == "padded":  # a few histories, then padding
            cuts = np.sort(rng.choice(np.arange(1, length * 3 // 4), size=3, replace=False))
            row = np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32)
            row[length * 3 // 4 + 5 :] = -1
        elif layout == "uneven":  # long histories crossing block edges at odd places
            cuts = np.sort(rng.choice(np.arange(1, length), size=2, replace=False))
            row = np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32) + 7
        else:
            raise AssertionError(layout)
        rows.append(row)
    return np.stack(rows)


def inputs(batch, length, heads, dim, layout, seed=0, buckets=12):
    rng = np.random.default_rng(seed)
    q, k, v, weights = (
        jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32) for _ in range(4)
    )
    bias = jnp.asarray(rng.normal(size=(heads, buckets)), jnp.float32)
    return q, k, v, jnp.asarray(segments_of(layout, batch, length, seed)), bias, weights


def assert_close(actual, expected, what):
    scale = float(jnp.abs(expected).max()) or 1.0
    error = float(jnp.abs(actual - expected).max())
    assert error <= TOLERANCE * scale, f"{what}: max error {error:.3g} against scale {scale:.3g}"


CASES = [
    # length, heads, dim, layout, block_q, block_k, block_backward
    (64, 1, 16, "one", 16, 16, 16),
    (128, 2, 32, "short", 32, 16, 32),
    (128, 2, 24, "padded", 16, 32, 16),  # width 24 is padded to 32 inside
    (192, 1, 16, "uneven", 64, 32, 32),
]


@pytest.mark.parametrize("length,heads,dim,layout,block_q,block_k,block_backward", CASES)
def test_kernel_matches_the_reference(length, heads, dim, layout, block_q, block_k, block_backward):
    q, k, v, segments, bias, weights = inputs(2, length, heads, dim, layout)
    settings = dict(alpha=0.25, inv_norm=1.0 / length, max_distance=length // 2)
    blocks = dict(block_q=block_q, block_k=block_k, block_backward=block_backward)

    def kernel(q, k, v, bias):
        return hstu_attention_pallas(
            q, k, v, segments, bias, **settings, **blocks, interpret=not ON_GPU
        )

    def reference(q, k, v, bias):
        return hstu_attention_reference(q, k, v, segments, bias, **settings)

    assert_close(kernel(q, k, v, bias), reference(q, k, v, bias), "output")
    loss = lambda f: lambda *args: jnp.sum(f(*args) * weights)  # noqa: E731
    expected = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(q, k, v, bias)
    actual = jax.grad(loss(kernel), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), actual, expected, strict=True):
        assert a.shape == e.shape
        assert_close(a, e, name)
    # every bucket that some live pair reaches receives gradient
    assert int((jnp.abs(actual[3]) > 0).sum()) >= 2


def test_padding_attends_to_nothing_and_is_not_attended():
    q, k, v, segments, bias, _ = inputs(1, 64, 1, 16, "padded")
    out = hstu_attention_pallas(
        q, k, v, segments, bias, alpha=1.0, inv_norm=1.0, max_distance=32, block_q=16,
        block_k=16, block_backward=16, interpret=not ON_GPU,
    )  # fmt: skip
    padding = np.asarray(segments[0] < 0)
    assert padding.any()
    assert float(jnp.abs(out[0, padding]).max()) == 0.0
    # changing what padding holds changes nothing else
    v2 = v.at[0, padding].set(100.0)
    out2 = hstu_attention_reference(
        q, k, v2, segments, bias, alpha=1.0, inv_norm=1.0, max_distance=32
    )
    assert_close(out2, out, "output with other padding values")


def test_a_history_sees_only_itself():
    """Two histories packed in one row give what each gives alone."""
    q, k, v, _, bias, _ = inputs(1, 64, 1, 16, "one")
    segments = jnp.asarray([[0] * 24 + [1] * 40], jnp.int32)
    settings = dict(alpha=0.5, inv_norm=0.1, max_distance=32)
    packed = hstu_attention_reference(q, k, v, segments, bias, **settings)
    alone = jnp.zeros((1, 64), jnp.int32)
    second = hstu_attention_reference(
        q[:, 24:], k[:, 24:], v[:, 24:], alone[:, :40], bias, **settings
    )
    assert_close(packed[:, 24:], second, "the second history")
    first = hstu_attention_reference(
        q[:, :24], k[:, :24], v[:, :24], alone[:, :24], bias, **settings
    )
    assert_close(packed[:, :24], first, "the first history")


def test_block_bounds_cover_every_live_pair():
    length = 256
    segments = jnp.asarray(segments_of("short", 2, length, seed=3))
    live = np.asarray(live_pairs(segments))
    kv_bounds, q_bounds = block_bounds(segments, 32, 16)
    (kv_lo, kv_hi), (q_lo, q_hi) = (
        tuple(np.asarray(b) for b in pair) for pair in (kv_bounds, q_bounds)
    )
    visited_q = np.zeros_like(live)
    visited_k = np.zeros_like(live)
    for b in range(2):
        for i in range(length // 32):
            visited_q[b, i * 32 : (i + 1) * 32, kv_lo[b, i] * 16 : kv_hi[b, i] * 16] = True
        for j in range(length // 16):
            visited_k[b, q_lo[b, j] * 32 : q_hi[b, j] * 32, j * 16 : (j + 1) * 16] = True
    assert not (live & ~visited_q).any() and not (live & ~visited_k).any()
    # histories of at most 20 events: well under the tiles of the row's causal triangle
    causal_tiles = 2 * sum(32 * 16 * ((i + 1) * 2) for i in range(length // 32))
    assert visited_q.sum() < 0.45 * causal_tiles


def test_relative_buckets():
    distance = jnp.arange(0, 1000)
    buckets = np.asarray(relative_bucket(distance, 32, 256))
    assert (buckets[:16] == np.arange(16)).all()  # near distances: one bucket each
    assert (np.diff(buckets) >= 0).all() and buckets.max() == 31 and buckets.min() == 0
    assert (buckets[256:] == 31).all()


@pytest.mark.parametrize(
    "length,block,message",
    [
        (96, 64, "attention block size 64 does not divide the row length 96"),
        (96, 24, "attention block size 24: must be a power of two >= 16"),
    ],
)
def test_bad_block_sizes_are_one_clear_error(length, block, message):
    q, k, v, segments, bias, _ = inputs(1, length, 1, 16, "one")
    with pytest.raises(ValueError, match=message):
        hstu_attention_pallas(
            q, k, v, segments, bias, alpha=1.0, inv_norm=1.0, max_distance=8, block_q=block,
            interpret=True,
        )  # fmt: skip


def test_auto_picks_by_platform():
    if ON_GPU:
        assert resolve_implementation("auto", jnp.bfloat16, 64) == "pallas"
    else:
        assert resolve_implementation("auto", jnp.float32, 64) == "reference"
    with pytest.raises(ValueError, match="attention implementation 'triton'"):
        resolve_implementation("triton", jnp.float32, 64)
    q, k, v, segments, bias, _ = inputs(1, 64, 1, 16, "short")
    settings = dict(alpha=1.0, inv_norm=0.5, max_distance=16)
    assert_close(
        hstu_attention(q, k, v, segments, bias, **settings),
        hstu_attention_reference(q, k, v, segments, bias, **settings),
        "auto",
    )


def test_a_kernel_that_does_not_compile_falls_back_in_one_line(monkeypatch, capsys):
    from hybridrec.model import hstu_attention as module

    monkeypatch.setattr(module, "_probed", {})
    monkeypatch.setattr(module, "_said", set())
    monkeypatch.setattr(module, "_probe", lambda dtype, dim, time_buckets: "CompileError: planted")
    for _ in range(3):
        assert resolve_implementation("auto", jnp.bfloat16, 48, backend="gpu") == "reference"
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "HSTU attention: the Pallas kernel does not compile here (CompileError: planted); "
        "using the jax.numpy reference"
    ]


def test_kernel_lowers_to_triton_for_a_hopper_gpu():
    """The kernels (forward and backward, bfloat16) lower to Triton for an H100 on any
    host: a primitive the Triton lowering lacks fails here, not on the GPU."""
    q = jnp.zeros((2, 1024, 2, 64), jnp.bfloat16)
    segments = jnp.zeros((2, 1024), jnp.int32)
    bias = jnp.zeros((2, 32), jnp.float32)
    times = jnp.zeros((2, 1024), jnp.int32)

    def loss(q, k, v, bias, time_bias):
        out = hstu_attention_pallas(
            q, k, v, segments, bias, alpha=0.1, inv_norm=1e-3, max_distance=512,
            times=times, time_bias=time_bias,
        )  # fmt: skip
        return out.astype(jnp.float32).sum()

    text = _cuda_text(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, q, q, bias, None))
    assert text.count("triton") >= 2  # the forward and the backward kernel
    # and with the time bias: its buckets (log2 of the gaps) and its table's gradient
    time_bias = jnp.zeros((2, 64), jnp.float32)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    assert _cuda_text(grad.trace(q, q, q, bias, time_bias)).count("triton") >= 2


def _cuda_text(traced) -> str:
    """The lowering of `traced` for CUDA, as an H100 would get it. Newer JAX asks the host
    for its GPU while lowering a Triton kernel (jax._src.gpu_info from 0.12.1, the Pallas
    Triton package before); on a host without one, the H100's description stands in."""
    import importlib

    from jax.experimental.pallas import triton as plgpu

    gpu_info = None
    for name in ("jax._src.gpu_info", "jax._src.pallas.triton.gpu_info"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # older JAX lowers without asking for a device
            continue
        if hasattr(module, "get_gpu_info"):
            gpu_info = module
            break
    if gpu_info is not None and hasattr(plgpu, "get_gpu_info_from_version") and not ON_GPU:
        original = gpu_info.get_gpu_info
        gpu_info.get_gpu_info = lambda: plgpu.get_gpu_info_from_version(plgpu.GpuVersion.H100)
        try:
            return traced.lower(lowering_platforms=("cuda",)).as_text()
        finally:
            gpu_info.get_gpu_info = original
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def test_time_bias_adds_each_pairs_gap_bucket_to_its_score():
    # a brute-force loop over the pairs against the reference, with times in seconds
    q, k, v, segments, bias, _ = inputs(2, 24, 2, 8, "short", seed=3)
    rng = np.random.default_rng(5)
    times = jnp.asarray(np.cumsum(rng.integers(0, 10_000, size=(2, 24)), axis=1), jnp.int32)
    time_bias = jnp.asarray(rng.normal(size=(2, 20)), jnp.float32)
    got = hstu_attention_reference(
        q, k, v, segments, bias, alpha=0.5, inv_norm=0.1, max_distance=16,
        times=times, time_bias=time_bias,
    )  # fmt: skip
    q, k, v, segments, bias, times, time_bias = map(
        np.asarray, (q, k, v, segments, bias, times, time_bias)
    )
    expected = np.zeros_like(q)
    for b in range(2):
        for i in range(24):
            for j in range(i + 1):
                if segments[b, i] < 0 or segments[b, i] != segments[b, j]:
                    continue
                bucket = min(int(2 * np.log2(1 + times[b, i] - times[b, j])), 19)
                distance = int(relative_bucket(i - j, bias.shape[1], 16))
                for h in range(2):
                    score = 0.5 * q[b, i, h] @ k[b, j, h] + bias[h, distance] + time_bias[h, bucket]
                    expected[b, i, h] += 0.1 * score / (1 + np.exp(-score)) * v[b, j, h]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
    assert int(time_bucket(jnp.asarray(0), 8)) == 0 and int(time_bucket(jnp.asarray(10**9), 8)) == 7


def test_time_buckets_are_exact_half_octaves():
    """floor(2 log2(1 + gap)) of the float32 number 1 + gap, exactly, at every bucket's
    edge too (where a float log2 rounds across it now and then)."""
    edges = np.floor(np.sqrt(2.0) ** np.arange(1, 62)).astype(np.int64) - 1
    gaps = np.concatenate([np.arange(1 << 16), (edges[:, None] + np.arange(-2, 3)).ravel()])
    gaps = np.clip(gaps, 0, 2**31 - 2).astype(np.int32)
    x = (np.float32(1) + gaps.astype(np.float32)).astype(np.float64)
    _, exponent = np.frexp(x * x)  # x * x is exact in float64: x has 24 significant bits
    expected = np.minimum(exponent - 1, 63)  # floor(log2(x ** 2))
    got = np.asarray(jax.jit(time_bucket, static_argnums=1)(jnp.asarray(gaps), 64))
    np.testing.assert_array_equal(got, expected)


def test_every_row_sums_its_gradient_over_the_rows():
    # the relative bias repeated for each row; its gradient is the rows' sum, taken as a
    # matrix-vector product in place of a reduction
    rng = np.random.default_rng(0)
    matrix = jnp.asarray(rng.normal(size=(3, 5, 5)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(7, 3, 5, 5)), jnp.float32)
    repeated = every_row(matrix, 7)
    assert repeated.shape == (7, 3, 5, 5) and bool(jnp.all(repeated == matrix[None]))
    grad = jax.grad(lambda m: jnp.sum(jnp.sin(every_row(m, 7)) * weights))(matrix)
    expected = np.sum(np.cos(np.asarray(matrix))[None] * np.asarray(weights), axis=0)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-6)


TIME_CASES = [
    # length, heads, dim, layout, block_q, block_k, block_backward
    (64, 1, 16, "one", 16, 32, 16),
    (128, 2, 32, "short", 32, 16, 32),
    (128, 1, 16, "padded", 64, 64, 64),
]


@pytest.mark.parametrize("length,heads,dim,layout,block_q,block_k,block_backward", TIME_CASES)
def test_kernel_with_a_time_bias_matches_the_reference(
    length, heads, dim, layout, block_q, block_k, block_backward
):
    """Times with gaps of seconds to months (every bucket of 40 reached, the last one
    holding the longest), equal times in a row, 40 buckets (padded to 64 inside)."""
    q, k, v, segments, bias, weights = inputs(2, length, heads, dim, layout, seed=4)
    rng = np.random.default_rng(9)
    gaps = np.exp(rng.uniform(0, 16, size=(2, length))).astype(np.int64)
    gaps[:, ::5] = 0  # events at the same second
    times = jnp.asarray(np.cumsum(gaps, axis=1) % 2**31, jnp.int32)
    time_bias = jnp.asarray(rng.normal(size=(heads, 40)), jnp.float32)
    settings = dict(alpha=0.25, inv_norm=1.0 / length, max_distance=length // 2, times=times)
    blocks = dict(block_q=block_q, block_k=block_k, block_backward=block_backward)

    def kernel(q, k, v, bias, time_bias):
        return hstu_attention_pallas(
            q, k, v, segments, bias, time_bias=time_bias, **settings, **blocks,
            interpret=not ON_GPU,
        )  # fmt: skip

    def reference(q, k, v, bias, time_bias):
        return hstu_attention_reference(q, k, v, segments, bias, time_bias=time_bias, **settings)

    args = (q, k, v, bias, time_bias)
    assert_close(kernel(*args), reference(*args), "output")
    loss = lambda f: lambda *args: jnp.sum(f(*args) * weights)  # noqa: E731
    expected = jax.grad(loss(reference), argnums=(0, 1, 2, 3, 4))(*args)
    actual = jax.grad(loss(kernel), argnums=(0, 1, 2, 3, 4))(*args)
    for name, a, e in zip(("dq", "dk", "dv", "dbias", "dtime_bias"), actual, expected, strict=True):  # fmt: skip
        assert a.shape == e.shape
        assert_close(a, e, name)
    assert int((jnp.abs(actual[4]) > 0).sum()) >= 10  # many gap buckets got gradient


@pytest.mark.parametrize("length", [16, 48, 40])
def test_auto_fits_the_blocks_to_short_rows(monkeypatch, length):
    """Where 'auto' picks the kernel (a GPU), rows shorter than the default blocks of 64,
    or no multiple of them, run with the largest blocks dividing them (16 for 48), or on
    the reference where none of at least 16 does (40): no error, the reference's values."""
    module = importlib.import_module("hybridrec.model.hstu_attention")
    monkeypatch.setattr(module, "resolve_implementation", lambda *args, **kwargs: "pallas")
    used = []
    kernel = module.hstu_attention_pallas

    def recorded(*args, **kwargs):
        used.append(kwargs["block_q"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, "hstu_attention_pallas", recorded)
    q, k, v, segments, bias, _ = inputs(1, length, 1, 8, "one")
    kwargs = dict(alpha=1.0, inv_norm=1.0, max_distance=16)
    auto = hstu_attention(q, k, v, segments, bias, implementation="auto", **kwargs)
    assert_close(auto, hstu_attention_reference(q, k, v, segments, bias, **kwargs), "auto")
    assert used == ({16: [16], 48: [16], 40: []}[length])


def test_auto_with_a_time_bias_equals_the_reference():
    q, k, v, segments, bias, _ = inputs(1, 32, 1, 8, "one")
    times, time_bias = jnp.arange(32)[None] * 60, jnp.ones((1, 8))
    kwargs = dict(alpha=1.0, inv_norm=1.0, max_distance=16, times=times, time_bias=time_bias)
    auto = hstu_attention(q, k, v, segments, bias, implementation="auto", **kwargs)
    assert_close(auto, hstu_attention_reference(q, k, v, segments, bias, **kwargs), "auto")
    with pytest.raises(ValueError, match="needs each position's times"):
        hstu_attention_pallas(
            q, k, v, segments, bias, alpha=1.0, inv_norm=1.0, max_distance=16,
            block_q=16, block_k=16, block_backward=16, time_bias=time_bias, interpret=True,
        )  # fmt: skip
