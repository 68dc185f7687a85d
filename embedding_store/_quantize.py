"""Row-wise quantization of checkpoint rows (Check-N-Run, arXiv 2010.08679).

Each row is quantized on its own, asymmetrically: `bits`-bit codes `q` with a
per-row scale and bias, `row ≈ q * scale + bias`. The bias is the row's minimum
rounded down and the scale covers the row's range rounded up, both to float16 (2 + 2
bytes per row), and the codes are computed from the rounded pair, so the error per
value stays within half a step: `|row - decoded| <= scale / 2`. A part whose scale or
bias would overflow float16 keeps them in float32 (the stored dtype says which).

Optimizer state (see `state_fields`): Check-N-Run's models train with row-wise
Adagrad, whose state is one accumulator per row, and that state is kept exact.
hybridrec does the same for every per-row scalar (the row-wise accumulator, Adam's
step count). Adagrad's per-value accumulators are as large as the rows themselves, so
they are quantized at the checkpoint's precision like the rows, as their square roots
(the quantity the update divides by; never below the initial accumulator, so the
relative error stays bounded). Adam's moments are stored as bfloat16 below fp32: its
update is the ratio of one to the other's square root per value, so a small moment
next to large ones in the same row needs relative precision, which a row-wise integer
grid does not give (int8 moments moved some values by more than the learning rate after
a restore), and a second moment of a small gradient (1e-7 and below) needs float32's
range, which float16 does not have.
"""

from __future__ import annotations

from typing import Literal

import ml_dtypes
import numpy as np

Precision = Literal["fp32", "fp16", "int8", "int4"]
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")
BITS = {"int8": 8, "int4": 4}

# How a block of optimizer-state columns is stored at reduced precision.
SQUARED, BFLOAT16, EXACT = "squared", "bfloat16", "exact"


def state_fields(optimizer: str, dim: int) -> list[tuple[str, int, int, str]]:
    """The optimizer state's column blocks: [(name, start, stop, kind)].

    kind: "squared" (non-negative accumulators, quantized as square roots at the
    checkpoint's precision), "bfloat16" (Adam's moments, below fp32) or "exact"
    (per-row scalars, kept float32).
    """
    return {
        "sgd": [],
        "adagrad": [("accumulator", 0, dim, SQUARED)],
        "rowwise_adagrad": [("accumulator", 0, 1, EXACT)],
        "adam": [
            ("mu", 0, dim, BFLOAT16),
            ("nu", dim, 2 * dim, BFLOAT16),
            ("count", 2 * dim, 2 * dim + 1, EXACT),
        ],
    }[optimizer]


def _round_float16(values: np.ndarray, toward: float) -> np.ndarray:
    """float32 [n] -> float16 [n] rounded toward -inf or +inf (never past `values`)."""
    with np.errstate(over="ignore"):  # overflow is checked by the caller
        rounded = values.astype(np.float16)
    wrong = (
        rounded.astype(np.float32) > values if toward < 0 else rounded.astype(np.float32) < values
    )
    rounded[wrong] = np.nextafter(rounded[wrong], np.float16(toward))
    return rounded


def _row_min_max(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row minimum and maximum of [n, width] float32 (zeros when width is 0).

    Column by column: numpy's reduction along a short last axis is several times slower.
    """
    if not rows.shape[1]:
        return np.zeros(len(rows), np.float32), np.zeros(len(rows), np.float32)
    low, high = rows[:, 0].copy(), rows[:, 0].copy()
    for column in range(1, rows.shape[1]):
        np.minimum(low, rows[:, column], out=low)
        np.maximum(high, rows[:, column], out=high)
    return low, high


def quantize(rows: np.ndarray, precision: str) -> dict[str, np.ndarray]:
    """Encodes rows at `precision`.

    Args:
        rows: [n, width] float32, finite.
        precision: fp32 | fp16 | int8 | int4.

    Returns:
        {"": codes, "scale_bias": [n, 2]} for int8 ([n, width] uint8) and int4
        ([n, ceil(width / 2)] uint8, two codes per byte, low nibble first);
        {"": [n, width] float16 or float32} otherwise.
    """
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if precision == "fp32":
        return {"": rows}
    if precision == "fp16":
        with np.errstate(over="ignore"):
            half = rows.astype(np.float16)
        # A value past float16's range keeps the whole array in float32 (dtype says so).
        return {"": half if np.isfinite(half).all() else rows}
    bits = BITS[precision]
    levels = (1 << bits) - 1
    n, width = rows.shape
    low, high = _row_min_max(rows)
    bias16 = _round_float16(low, -np.inf)
    scale16 = _round_float16((high - bias16.astype(np.float32)) / np.float32(levels), np.inf)
    if np.isfinite(bias16).all() and np.isfinite(scale16).all():
        bias, scale, pair_dtype = bias16.astype(np.float32), scale16.astype(np.float32), np.float16
    else:
        bias = low
        scale = (high - low) / np.float32(levels)
        pair_dtype = np.float32
    inverse = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
    codes = rows - bias[:, None]
    codes *= inverse[:, None]
    np.rint(codes, out=codes)
    np.clip(codes, 0, levels, out=codes)
    codes = codes.astype(np.uint8)
    if bits == 4:
        if width % 2:
            codes = np.concatenate([codes, np.zeros((n, 1), np.uint8)], axis=1)
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale_bias = np.stack([scale, bias], axis=1).astype(pair_dtype)
    return {"": np.ascontiguousarray(codes), "scale_bias": scale_bias}


def dequantize(arrays: dict[str, np.ndarray], precision: str, width: int) -> np.ndarray:
    """Decodes what `quantize` returned: [n, width] float32."""
    codes = arrays[""]
    if codes.dtype.kind == "f" or codes.dtype == ml_dtypes.bfloat16:
        return codes.astype(np.float32)
    if precision not in BITS:
        raise ValueError(f"{codes.dtype} codes for precision {precision!r}")
    if BITS[precision] == 4:
        unpacked = np.empty((len(codes), 2 * codes.shape[1]), np.uint8)
        unpacked[:, 0::2] = codes & 0x0F
        unpacked[:, 1::2] = codes >> 4
        codes = unpacked[:, :width]
    scale_bias = arrays["scale_bias"].astype(np.float32)
    return codes.astype(np.float32) * scale_bias[:, :1] + scale_bias[:, 1:]


def encode_block(
    values: np.ndarray, state: np.ndarray, optimizer: str, precision: str
) -> dict[str, np.ndarray]:
    """A part's rows and optimizer state as named arrays at `precision`.

    Args:
        values: [n, dim] float32 rows.
        state: [n, state_width] float32 optimizer state.
        optimizer: the table's optimizer name (fixes the state's column blocks).
        precision: fp32 | fp16 | int8 | int4.

    Returns:
        {"values", "values_scale_bias"?, "state_<field>", "state_<field>_scale_bias"?};
        at fp32 just {"values", "state"}, the full-precision layout.
    """
    if precision == "fp32":
        return {"values": values, "state": state}
    arrays = _named("values", quantize(values, precision))
    for name, start, stop, kind in state_fields(optimizer, values.shape[1]):
        block = state[:, start:stop]
        if kind == EXACT:
            arrays[f"state_{name}"] = np.ascontiguousarray(block, dtype=np.float32)
            continue
        if kind == BFLOAT16:
            arrays[f"state_{name}"] = np.ascontiguousarray(block).astype(ml_dtypes.bfloat16)
            continue
        arrays.update(_named(f"state_{name}", quantize(np.sqrt(np.maximum(block, 0)), precision)))
    return arrays


def decode_block(
    arrays: dict[str, np.ndarray], optimizer: str, precision: str, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `encode_block`: (values [n, dim], state [n, state_width]) float32."""
    if precision == "fp32" or "state" in arrays:
        return arrays["values"].astype(np.float32), arrays["state"].astype(np.float32)
    values = dequantize(_field(arrays, "values"), precision, dim)
    blocks = []
    for name, start, stop, kind in state_fields(optimizer, dim):
        block = dequantize(_field(arrays, f"state_{name}"), precision, stop - start)
        blocks.append(block * block if kind == SQUARED else block)
    width = sum(stop - start for _, start, stop, _ in state_fields(optimizer, dim))
    state = np.concatenate(blocks, axis=1) if blocks else np.zeros((len(values), width))
    return values, state.astype(np.float32)


def _named(prefix: str, encoded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{prefix}_{key}" if key else prefix: array for key, array in encoded.items()}


def _field(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    found = {"": arrays[prefix]}
    if f"{prefix}_scale_bias" in arrays:
        found["scale_bias"] = arrays[f"{prefix}_scale_bias"]
    return found
