"""Row-wise embedding precision: fp32, fp16, or int8 with a per-row fp16 scale and bias.

int8 follows the FBGEMM / Check-N-Run row-wise scheme: each row's values are mapped
onto 256 levels between the row's minimum and maximum, stored as uint8 codes with
the row's `scale = (max - min) / 255` and `bias = min` as float16. At dimension 16
a row takes 16 + 4 = 20 bytes instead of 64.
"""

from __future__ import annotations

import numpy as np

_LEVELS = 255


def quantize_rows(values: np.ndarray, scale_dtype=np.float16) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise 8-bit codes of `values`.

    Args:
        values: [rows, dim] float32.
        scale_dtype: the scale and bias's type (float16 in exports; the serving scan's
            codes keep float32).

    Returns:
        codes [rows, dim] uint8 and scale_bias [rows, 2] of `scale_dtype`, such that
        `dequantize_rows(codes, scale_bias)` is within scale / 2 (+ the scale's rounding)
        of values.
    """
    values = np.asarray(values, np.float32)
    if not len(values):
        return np.zeros(values.shape, np.uint8), np.zeros((0, 2), scale_dtype)
    low, high = values.min(axis=1), values.max(axis=1)
    # the rounded scale and bias are the ones dequantization uses: quantize against them
    scale = ((high - low) / _LEVELS).astype(scale_dtype)
    scale[scale == 0] = 1.0  # a constant row: every code is 0, value = bias
    bias = low.astype(scale_dtype)
    scale32, bias32 = scale.astype(np.float32)[:, None], bias.astype(np.float32)[:, None]
    codes = np.clip(np.rint((values - bias32) / scale32), 0, _LEVELS).astype(np.uint8)
    return codes, np.stack([scale, bias], axis=1)


def dequantize_rows(codes: np.ndarray, scale_bias: np.ndarray) -> np.ndarray:
    """codes [n, dim] uint8, scale_bias [n, 2] float16 -> [n, dim] float32."""
    scale_bias = np.asarray(scale_bias, np.float32)
    return codes.astype(np.float32) * scale_bias[:, :1] + scale_bias[:, 1:]


def encode_table(values: np.ndarray, precision: str) -> dict[str, np.ndarray]:
    """The arrays one table is stored as: {"values"} or {"values", "scale_bias"}."""
    if precision == "fp32":
        return {"values": np.asarray(values, np.float32)}
    if precision == "fp16":
        return {"values": np.asarray(values, np.float32).astype(np.float16)}
    codes, scale_bias = quantize_rows(values)
    return {"values": codes, "scale_bias": scale_bias}
