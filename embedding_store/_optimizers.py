"""Sparse per-row optimizers on a table's rows in host memory: the math of
`common.sparse_rules` (the same float32 math as optax's dense versions, shared with the
device tables), stepped in place by the native kernel where it has the optimizer.
"""

from __future__ import annotations

import numpy as np
from hybridrec.common.sparse_rules import sparse_step
from hybridrec.embedding_store._arrays import native, put_rows, take_rows
from hybridrec.embedding_store.config import SparseOptimizerConfig

# Optimizers the native kernel steps (the same float32 bits as `sparse_step`); others use numpy.
_NATIVE_KINDS = {"sgd": 0, "adagrad": 1}


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
    weights, new_state = sparse_step(
        np,
        config,
        take_rows(values, lines).astype(np.float32, copy=False),
        take_rows(state, lines),
        grads,
    )
    put_rows(values, lines, weights)
    put_rows(state, lines, new_state)
    return skipped
