"""Synthetic click logs in the raw Criteo TSV layout (what `hybridrec generate` writes).

Rows are `label, I1..I13, C1..C26`, tab separated, an empty field is a missing
value, categoricals are 8 hex digits: byte for byte the format of Criteo's
`train.txt` / `day_N`. The data is built to look like Criteo and to be learnable:

- categorical cardinalities from 3 to 3M, Zipf-like id frequencies (power law
  over ranks, per-feature exponent), per-column missing rates up to ~45%; the
  long-tail features' cardinalities (100k and more) scale with `cardinality_scale`
  (10 gives ~10M distinct ids over those features in 10M rows, where 1 gives ~5M);
- integer features are heavy-tailed counts with missing values; I2 is sometimes
  negative (as in Criteo);
- the click probability is a logistic function of a few per-id effects, a dense
  feature, pairwise *interactions* between five categorical features (dot products of
  fixed per-id latent vectors, the structure DLRM's interaction layer models) and a
  categorical x dense cross (C2 x bucket of I3); an additive model (logistic
  regression) cannot represent the interactions, so DLRM/DCN should beat it. About 25%
  clicks.

Rows are produced in blocks of 65,536 seeded by (seed, block index), so memory
is constant, the output depends only on the seed, and the first N rows are the
same whatever the total row count.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gzip
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hybridrec.common.errors import UserError
from hybridrec.common.progress import Progress
from hybridrec.pipeline import hashing

BLOCK_ROWS = 65_536
NUM_DENSE = 13
NUM_CATEGORICAL = 26

# Per categorical feature: (cardinality, Zipf exponent, missing rate).
CATEGORICAL_PROFILE = (
    (1_400, 1.1, 0.0), (550, 1.2, 0.0), (2_000_000, 1.05, 0.03), (800_000, 1.05, 0.03),
    (300, 1.3, 0.0), (24, 1.3, 0.12), (12_000, 1.1, 0.0), (600, 1.2, 0.0),
    (3, 1.5, 0.0), (90_000, 1.1, 0.0), (5_000, 1.1, 0.0), (3_000_000, 1.05, 0.03),
    (3_100, 1.1, 0.0), (27, 1.3, 0.0), (14_000, 1.1, 0.0), (1_500_000, 1.05, 0.03),
    (10, 1.4, 0.0), (5_600, 1.1, 0.0), (2_100, 1.1, 0.44), (4, 1.5, 0.44),
    (2_500_000, 1.05, 0.03), (18, 1.3, 0.76), (15, 1.3, 0.0), (280_000, 1.05, 0.03),
    (105, 1.2, 0.44), (140_000, 1.05, 0.44),
)  # fmt: skip
# Per integer feature: (log-normal mean, log-normal sigma, missing rate).
DENSE_PROFILE = (
    (0.5, 1.2, 0.45), (1.5, 1.8, 0.0), (1.8, 1.3, 0.21), (1.5, 1.0, 0.22), (7.0, 2.5, 0.03),
    (3.5, 1.6, 0.22), (1.5, 1.5, 0.04), (2.5, 1.0, 0.0), (3.5, 1.4, 0.04), (0.3, 0.5, 0.45),
    (0.8, 1.0, 0.04), (0.2, 1.0, 0.77), (1.6, 1.2, 0.22),
)  # fmt: skip
LONG_TAIL = 100_000  # features of at least this many values scale with cardinality_scale
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
# For each byte value, its two hex digits as they lie in memory (a little-endian uint16).
_HEX_PAIRS = _HEX[np.arange(256) >> 4].astype(np.uint16) | (
    _HEX[np.arange(256) & 15].astype(np.uint16) << 8
)
# Features whose ids interact pairwise through latent vectors: C2, C5, C6, C14, C17.
INTERACTING = (1, 4, 5, 13, 16)
LATENT_DIM = 4
INTERACTION_SCALE = 0.3
LABEL_BIAS = -1.15


def zipf_ranks(rng, size, cardinality, exponent):
    """Ranks in [0, cardinality) with P(rank r) ~ (r+1)^-exponent (continuous inverse CDF)."""
    u = rng.random(size)
    a = 1.0 - exponent
    top = (cardinality + 1.0) ** a
    ranks = (u * (top - 1.0) + 1.0) ** (1.0 / a) - 1.0
    return np.minimum(ranks.astype(np.int64), cardinality - 1)


def _effect(feature: int, ranks: np.ndarray, scale: float) -> np.ndarray:
    """A fixed pseudo-random effect in [-scale, scale] per (feature, rank)."""
    mixed = hashing.splitmix64(ranks.astype(np.uint64) ^ np.uint64(0x5EED0000 + feature))
    return ((mixed >> np.uint64(11)).astype(np.float64) / 2.0**53 * 2.0 - 1.0) * scale


def _latent(feature: int, ranks: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random vector [n, LATENT_DIM] of unit variance per (feature, rank)."""
    columns = []
    for d in range(LATENT_DIM):
        salt = np.uint64((0x1A7E << 32) + (feature << 8) + d)
        mixed = hashing.splitmix64(ranks.astype(np.uint64) ^ salt)
        uniform = (mixed >> np.uint64(11)).astype(np.float64) / 2.0**53
        columns.append((uniform * 2.0 - 1.0) * np.sqrt(3.0))
    return np.stack(columns, axis=1)


def _hex_column(values: np.ndarray, missing: np.ndarray) -> pa.Array:
    """8-hex-digit strings of the low 32 bits of `values`; null where missing."""
    big_endian_bytes = values.astype(np.uint32).astype(">u4").view(np.uint8)
    data = _HEX_PAIRS[big_endian_bytes].view(np.uint8)  # two ASCII digits per byte
    offsets = np.arange(0, 8 * len(values) + 1, 8, dtype=np.int32)
    validity = pa.array(~missing).buffers()[1]
    return pa.Array.from_buffers(
        pa.string(), len(values), [validity, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def scaled_cardinality(card: int, scale: float) -> int:
    """A profile cardinality with the long tail (`LONG_TAIL` values and more) scaled."""
    return int(card * scale) if card >= LONG_TAIL else card


def generate_block(
    seed: int, block_index: int, rows: int, cardinality_scale: float = 1.0
) -> tuple[bytes, int]:
    """One block of raw TSV rows.

    Returns:
        (text, clicks): `rows` newline-terminated lines and how many have label 1.
    """
    rng = np.random.default_rng([seed, block_index])
    ranks = np.stack(
        [
            zipf_ranks(rng, rows, scaled_cardinality(card, cardinality_scale), exp)
            for card, exp, _ in CATEGORICAL_PROFILE
        ],
        axis=1,
    )
    cat_missing = rng.random((rows, NUM_CATEGORICAL)) < np.array(
        [m for _, _, m in CATEGORICAL_PROFILE]
    )
    means = np.array([m for m, _, _ in DENSE_PROFILE])
    sigmas = np.array([s for _, s, _ in DENSE_PROFILE])
    dense = np.floor(np.expm1(rng.normal(means, sigmas, (rows, NUM_DENSE)).clip(0, 25)))
    dense = dense.astype(np.int64)
    negative = rng.random(rows) < 0.03
    dense[negative, 1] = -rng.integers(1, 4, int(negative.sum()))
    dense_missing = rng.random((rows, NUM_DENSE)) < np.array([m for _, _, m in DENSE_PROFILE])

    # The label: per-id effects of popular features, a dense effect, and interactions.
    logit = np.full(rows, LABEL_BIAS)
    for feature, scale in ((0, 0.8), (1, 0.6), (5, 0.5), (13, 0.6), (16, 0.5)):
        logit += np.where(cat_missing[:, feature], 0.0, _effect(feature, ranks[:, feature], scale))
    i1 = np.where(dense_missing[:, 0], 0.0, np.log1p(np.maximum(dense[:, 0], 0)))
    logit += 0.35 * (i1 - 0.6)
    # Pairwise interactions of low-rank latent vectors (what DLRM's dot products model and
    # an additive model cannot): sum over pairs <v_a, v_b> = (|sum v|^2 - sum |v|^2) / 2.
    latent = [np.where(cat_missing[:, f, None], 0.0, _latent(f, ranks[:, f])) for f in INTERACTING]
    total = np.sum(latent, axis=0)
    pairs = 0.5 * ((total**2).sum(axis=1) - sum((v**2).sum(axis=1) for v in latent))
    logit += INTERACTION_SCALE * pairs
    bucket = np.minimum(np.log1p(np.maximum(dense[:, 2], 0)).astype(np.int64), 7)
    logit += _effect(200, (ranks[:, 1] % 128) * 8 + bucket, 0.8)  # C2 x I3 (dense) cross
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)

    columns = [pc.cast(pa.array(labels), pa.string())]
    for j in range(NUM_DENSE):
        columns.append(pc.cast(pa.array(dense[:, j], mask=dense_missing[:, j]), pa.string()))
    for j in range(NUM_CATEGORICAL):
        raw = hashing.splitmix64(ranks[:, j].astype(np.uint64) ^ np.uint64(j << 40))
        columns.append(_hex_column(raw & np.uint64(0xFFFFFFFF), cat_missing[:, j]))
    columns = [column.fill_null("") for column in columns]
    columns[-1] = pc.binary_join_element_wise(columns[-1], "\n", "")
    lines = pc.binary_join_element_wise(*columns, "\t")
    offsets = lines.buffers()[1]
    first, last = np.frombuffer(offsets, np.int32)[[0, rows]]
    return lines.buffers()[2].to_pybytes()[first:last], int(labels.sum())


def generate(
    path: str | Path,
    rows: int,
    *,
    seed: int = 0,
    compress: bool | None = None,
    workers: int | None = None,
    cardinality_scale: float = 1.0,
) -> dict:
    """Writes `rows` synthetic rows to `path` (gzip when it ends with .gz or `compress`).

    `workers` processes build blocks in parallel (default: one per core); the output does
    not depend on it. `cardinality_scale` multiplies the long-tail features' cardinalities
    (those of at least `LONG_TAIL` values): more distinct ids for the same rows.

    Returns:
        {"path", "rows", "clicks", "bytes", "seconds"}.
    """
    if rows < 0:
        raise UserError(f"--rows must be >= 0, got {rows}")
    if not cardinality_scale > 0:
        raise UserError(f"--cardinality-scale must be > 0, got {cardinality_scale}")
    path = Path(path)
    compress = path.suffix == ".gz" if compress is None else compress
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.open("wb").close()
    except OSError as error:
        raise UserError(f"--output {path}: cannot write: {error.strerror}") from None
    workers = (os.cpu_count() or 1) if workers is None else workers
    progress = Progress("generate", total=rows, unit="rows")
    try:
        clicks = _write_rows(path, rows, seed, compress, progress, workers, cardinality_scale)
    except OSError as error:  # disk full, file removed underneath, ...
        raise UserError(f"--output {path}: write failed: {error}") from None
    progress.close()
    return {
        "path": str(path),
        "rows": rows,
        "clicks": clicks,
        "bytes": path.stat().st_size,
        "seconds": progress.elapsed,
    }


def _blocks(rows: int, seed: int, workers: int, scale: float):
    """Yields (text, clicks) of every block in order; blocks are built `workers` at a time."""
    starts = range(0, rows, BLOCK_ROWS)
    if workers <= 1 or len(starts) <= 1:
        for block_index, _ in enumerate(starts):
            yield generate_block(seed, block_index, BLOCK_ROWS, scale)
        return
    # Blocks are independent (seeded by their index): build them in worker processes,
    # at most 2 per worker in flight so memory stays bounded, and write them in order.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending: collections.deque = collections.deque()
        for block_index, _ in enumerate(starts):
            pending.append(pool.submit(generate_block, seed, block_index, BLOCK_ROWS, scale))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _write_rows(
    path, rows: int, seed: int, compress: bool, progress, workers: int, scale: float
) -> int:
    clicks = 0
    with contextlib.ExitStack() as stack:
        handle = stack.enter_context(open(path, "wb"))
        if compress:
            handle = stack.enter_context(gzip.GzipFile(fileobj=handle, mode="wb", compresslevel=1))
        for start, (text, block_clicks) in zip(
            range(0, rows, BLOCK_ROWS), _blocks(rows, seed, workers, scale), strict=True
        ):
            count = min(BLOCK_ROWS, rows - start)
            if count < BLOCK_ROWS:
                text = text[: _nth_newline(text, count) + 1]
                block_clicks = text.count(b"\n1\t") + text.startswith(b"1\t")
            handle.write(text)
            clicks += block_clicks
            progress.update(count)
    return clicks


def _nth_newline(text: bytes, n: int) -> int:
    positions = np.flatnonzero(np.frombuffer(text, np.uint8) == ord("\n"))
    return int(positions[n - 1]) if n else -1
