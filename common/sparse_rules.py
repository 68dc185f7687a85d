"""The sparse per-row optimizers' math, written once for both places rows are trained: the
host store steps rows with numpy (`embedding_store`), the device tables inside the jitted
step with `jax.numpy` (`model.device_tables`). The float32 math follows optax's dense
versions; a row's state advances only on steps where it has a gradient (lazy).

State is one float32 array [rows, state_width] per table:
  sgd: none; adagrad: accumulator [dim]; rowwise_adagrad: accumulator [1];
  adam: mu [dim], nu [dim], count [1] (per row: a row's moments and bias correction
  advance only on steps where it receives a gradient).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def state_width(name: str, dim: int) -> int:
    """Float32 optimizer-state columns per row."""
    return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim + 1}[name]


def initial_state(rule: Any, rows: int, dim: int) -> np.ndarray:
    """[rows, state_width] float32: new rows' optimizer state, every row alike (Adagrad's
    accumulators start at `rule.initial_accumulator`, the rest at 0)."""
    adagrad = rule.name in ("adagrad", "rowwise_adagrad")
    fill = rule.initial_accumulator if adagrad else 0.0
    return np.full((rows, state_width(rule.name, dim)), fill, np.float32)


def sparse_step(
    xp: Any,
    rule: Any,
    weights: Any,
    state: Any,
    grads: Any,
) -> tuple[Any, Any]:
    """One optimizer step on gathered rows, in the array namespace `xp` (numpy or
    jax.numpy).

    Args:
        rule: has `name`, `learning_rate`, `eps`, `beta1` and `beta2`.
        weights: [m, dim] float32 current values.
        state: [m, state_width] float32 optimizer state.
        grads: [m, dim] float32 gradients, duplicates already summed.

    Returns:
        (new weights [m, dim], new state [m, state_width]), float32.
    """
    lr = xp.float32(rule.learning_rate)
    eps = xp.float32(rule.eps)
    if rule.name == "sgd":
        return weights - lr * grads, state
    if rule.name in ("adagrad", "rowwise_adagrad"):
        squares = grads * grads
        if rule.name == "rowwise_adagrad":
            squares = xp.mean(squares, axis=1, keepdims=True, dtype=xp.float32)
        accumulator = state + squares
        scale = xp.where(accumulator > 0, 1.0 / xp.sqrt(accumulator + eps), xp.float32(0.0))
        return weights - lr * (scale * grads), accumulator
    # adam, as optax.scale_by_adam with eps_root = 0
    dim = weights.shape[1]
    b1, b2 = xp.float32(rule.beta1), xp.float32(rule.beta2)
    # 1 - beta in float64 first, as optax does with Python-float betas (1 - f32(0.999) is
    # off by 1e-5)
    mu = xp.float32(1 - rule.beta1) * grads + b1 * state[:, :dim]
    nu = xp.float32(1 - rule.beta2) * (grads * grads) + b2 * state[:, dim : 2 * dim]
    count = state[:, 2 * dim :] + xp.float32(1)
    mu_hat = mu / (1 - b1**count)
    nu_hat = nu / (1 - b2**count)
    updates = mu_hat / (xp.sqrt(nu_hat) + eps)
    return weights - lr * updates, xp.concatenate([mu, nu, count], axis=1)
