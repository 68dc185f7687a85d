"""Sparse per-row optimizers; the same float32 math as optax's dense versions.

State is one float32 array [rows, state_width] per table:
  sgd: none; adagrad: accumulator [dim]; rowwise_adagrad: accumulator [1];
  adam: mu [dim], nu [dim], count [1] (per row: lazy Adam, a row's moments and bias
  correction advance only on steps where it receives a gradient).
"""

from __future__ import annotations

import numpy as np
from hybridrec.embedding_store._arrays import native, put_rows, take_rows
from hybridrec.embedding_store.config import SparseOptimizerConfig

# Optimizers the native kernel steps (the same float32 bits as `apply`); others use numpy.
_NATIVE_KINDS = {"sgd": 0, "adagrad": 1}


def initial_state(config: SparseOptimizerConfig, rows: int, dim: int) -> np.ndarray:
    """[rows, state_width] float32 state of new rows."""
    state = np.zeros((rows, config.state_width(dim)), np.float32)
    if config.name in ("adagrad", "rowwise_adagrad"):
        state[:] = config.initial_accumulator
    return state


def apply(
    config: SparseOptimizerConfig, weights: np.ndarray, state: np.ndarray, grads: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One optimizer step on gathered rows.

    Args:
        weights: [m, dim] float32 current values.
        state: [m, state_width] float32 optimizer state.
        grads: [m, dim] float32 gradients, duplicates already summed, all finite.

    Returns:
        (new weights [m, dim] float32, new state [m, state_width] float32).
    """
    lr = np.float32(config.learning_rate)
    eps = np.float32(config.eps)
    if config.name == "sgd":
        return weights - lr * grads, state
    if config.name == "adagrad":
        accumulator = state + grads * grads
        scale = np.where(accumulator > 0, 1.0 / np.sqrt(accumulator + eps), np.float32(0.0))
        return weights - lr * (scale * grads), accumulator
    if config.name == "rowwise_adagrad":
        accumulator = state + np.mean(grads * grads, axis=1, keepdims=True, dtype=np.float32)
        scale = np.where(accumulator > 0, 1.0 / np.sqrt(accumulator + eps), np.float32(0.0))
        return weights - lr * (scale * grads), accumulator
    # adam, as optax.scale_by_adam with eps_root = 0
    dim = weights.shape[1]
    b1, b2 = np.float32(config.beta1), np.float32(config.beta2)
    # 1 - beta in float64 first, as optax does with Python-float betas (1 - f32(0.999) is off by 1e-5).
    mu = np.float32(1 - config.beta1) * grads + b1 * state[:, :dim]
    nu = np.float32(1 - config.beta2) * (grads * grads) + b2 * state[:, dim : 2 * dim]
    count = state[:, 2 * dim :] + np.float32(1)
    mu_hat = mu / (1 - b1**count)
    nu_hat = nu / (1 - b2**count)
    updates = mu_hat / (np.sqrt(nu_hat) + eps)
    return weights - lr * updates, np.concatenate([mu, nu, count], axis=1)


def apply_in_place(
    config: SparseOptimizerConfig,
    values: np.ndarray,
    state: np.ndarray,
    lines: np.ndarray,
    grads: np.ndarray,
) -> int:
    """One optimizer step on rows `lines` (unique) of a table's values and state, in place.

    Rows whose gradient is not finite are left as they are; returns how many.
    """
    kind = _NATIVE_KINDS.get(config.name)
    if (
        native is not None
        and kind is not None
        and values.dtype == np.float32
        and values.flags.c_contiguous
        and state.flags.c_contiguous
    ):
        return native.sparse_step(
            kind,
            values,
            state,
            np.ascontiguousarray(lines, np.int64),
            np.ascontiguousarray(grads, np.float32),
            values.shape[1],
            state.shape[1],
            config.learning_rate,
            config.eps,
        )
    finite = np.isfinite(grads).all(axis=1)
    skipped = len(grads) - int(np.count_nonzero(finite))
    if skipped:
        lines, grads = lines[finite], grads[finite]
    weights, new_state = apply(
        config,
        take_rows(values, lines).astype(np.float32, copy=False),
        take_rows(state, lines),
        grads,
    )
    put_rows(values, lines, weights)
    put_rows(state, lines, new_state)
    return skipped
