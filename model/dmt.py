"""Disaggregated Multi-Tower (Luo et al. 2024): feature towers before the global interaction.

The F pooled embeddings are split into towers (`model.towers`, groups of feature positions).
Each tower's Tower Module interacts its own features (pairwise dots within the group plus
the group's embeddings, through a small MLP) and compresses them into `tower_outputs`
vectors of the same dim D. The global tower (`model.tower`: DLRM, DCN-V2, DHEN or MLP)
then sees T * tower_outputs vectors instead of F: the semantic-preserving tower transform,
which keeps the global interaction's form while shrinking its input and the dense work
that depends on F^2.

`propose_towers` is the Tower Partitioner: it groups features whose learned embeddings
interact strongly, so that most interactions stay inside a tower, while keeping every
tower's load (e.g. lookup bytes per example) within a tolerance of the mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hybridrec.common.errors import ConfigError
from hybridrec.model.layers import MLP, cast, linear


def check_towers(towers: Sequence[Sequence[int]], num_features: int) -> None:
    """Raises a one-line ConfigError unless `towers` covers features 0..F-1 exactly once."""
    seen = [index for tower in towers for index in tower]
    outside = sorted({index for index in seen if not 0 <= index < num_features})
    if outside:
        raise ConfigError(
            f"model.towers: feature position(s) {outside} do not exist (the data has "
            f"{num_features} categorical features, positions 0..{num_features - 1})"
        )
    repeated = sorted({index for index in seen if seen.count(index) > 1})
    if repeated:
        raise ConfigError(f"model.towers: feature position(s) {repeated} are in several towers")
    missing = sorted(set(range(num_features)) - set(seen))
    if missing:
        raise ConfigError(f"model.towers: feature position(s) {missing} are in no tower")


class TowerModule(nnx.Module):
    """One tower: [B, n, D] -> [B, outputs, D] from its features' dots and embeddings."""

    def __init__(self, num_features: int, dim: int, outputs: int, hidden, *, dtype, rngs: nnx.Rngs):
        rows, cols = np.tril_indices(num_features, k=-1)
        self.pair_rows = tuple(int(i) for i in rows)
        self.pair_cols = tuple(int(i) for i in cols)
        self.hidden = MLP(len(rows) + num_features * dim, hidden, dtype=dtype, rngs=rngs)
        self.out = linear(
            self.hidden.out_features, outputs * dim, (None, None), dtype=dtype, rngs=rngs
        )
        self.outputs = outputs
        self.num_features = num_features

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, _, dim = x.shape
        inputs = [x.reshape(batch, -1)]  # [B, n*D]
        if self.pair_rows:
            dots = jnp.einsum("bid,bjd->bij", x, x)
            inputs.append(dots[:, np.asarray(self.pair_rows), np.asarray(self.pair_cols)])
        compressed = self.out(self.hidden(jnp.concatenate(inputs, axis=-1)))
        return compressed.reshape(batch, self.outputs, dim)


class DMT(nnx.Module):
    """Tower Modules over feature groups, then the global tower on their outputs."""

    def __init__(
        self,
        towers: Sequence[Sequence[int]],
        *,
        outputs: int,
        hidden: Sequence[int],
        global_tower: nnx.Module,
        embedding_dim: int,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.groups = tuple(tuple(int(i) for i in tower) for tower in towers)
        for index, group in enumerate(self.groups):
            module = TowerModule(len(group), embedding_dim, outputs, hidden, dtype=dtype, rngs=rngs)
            setattr(self, f"tower_{index}", module)
        self.global_tower = global_tower
        self.dtype = dtype

    def __call__(self, embeddings: jax.Array, dense: jax.Array) -> jax.Array:
        compressed = [
            self.tower(index, embeddings[:, np.asarray(group)])
            for index, group in enumerate(self.groups)
        ]
        return self.interact(jnp.concatenate(compressed, axis=1), dense)

    def tower(self, index: int, embeddings: jax.Array) -> jax.Array:
        """Tower `index` alone: its features' embeddings [B, n_t, D] -> [B, outputs, D].

        The tower-parallel step (`model/tower_parallel.py`) runs each tower on its own devices
        with this, then exchanges the outputs; `__call__` runs them all in place.
        """
        (embeddings,) = cast(self.dtype, embeddings)
        return getattr(self, f"tower_{index}")(embeddings)

    def interact(self, compressed: jax.Array, dense: jax.Array) -> jax.Array:
        """The global tower on every tower's outputs [B, T * outputs, D] (tower order)."""
        return self.global_tower(compressed, dense)


def pooled_from_rows(ids: np.ndarray, values: np.ndarray, feature_ids: np.ndarray) -> np.ndarray:
    """Embeddings of single-valued features from a table's rows (e.g. a checkpoint's).

    Args:
        ids: [rows] uint64 sorted row ids (as `read_table_rows` returns them).
        values: [rows, D] float32 row values in the same order.
        feature_ids: [examples, F] uint64 ids of each example's features.

    Returns:
        [examples, F, D] float32; ids the table lacks get zeros.
    """
    positions = np.clip(np.searchsorted(ids, feature_ids), 0, max(len(ids) - 1, 0))
    found = (ids[positions] == feature_ids) if len(ids) else np.zeros(feature_ids.shape, bool)
    return np.where(found[..., None], values[positions], 0.0).astype(np.float32)


def lookup_loads(feature_ids: np.ndarray, batch_size: int) -> np.ndarray:
    """[F] distinct ids per batch of each feature, the rows a deduplicated lookup moves.

    Args:
        feature_ids: [examples, F] ids of consecutive examples.
        batch_size: examples per step.
    """
    batches = [
        feature_ids[start : start + batch_size]
        for start in range(0, len(feature_ids) - batch_size + 1, batch_size)
    ] or [feature_ids]
    counts = [[len(np.unique(batch[:, f])) for f in range(batch.shape[1])] for batch in batches]
    return np.mean(counts, axis=0)


def interaction_strength(pooled: np.ndarray) -> np.ndarray:
    """How strongly each pair of features interacts in a trained model.

    Args:
        pooled: [examples, F, D] pooled embeddings of real examples (a trained store).

    Returns:
        [F, F] float64: the mean over examples of |cos(e_i, e_j)|, the normalized size of
        the dot product DLRM-style interactions feed on; the diagonal is 0.
    """
    norms = np.linalg.norm(pooled, axis=-1, keepdims=True)
    unit = pooled / np.maximum(norms, 1e-12)
    strength = np.abs(np.einsum("nid,njd->ij", unit, unit)) / len(pooled)
    np.fill_diagonal(strength, 0.0)
    return strength


def propose_towers(
    strength: np.ndarray, loads: Sequence[float], num_towers: int, *, tolerance: float = 0.25
) -> list[list[int]]:
    """The Tower Partitioner: `num_towers` groups of strongly interacting, balanced features.

    Greedy average-linkage clustering: starting from one group per feature, merge the pair
    of groups with the strongest mean interaction whose combined load stays within
    (1 + tolerance) x the mean tower load; when no pair fits, merge the two lightest.

    Args:
        strength: [F, F] symmetric interaction strengths (`interaction_strength`).
        loads: [F] cost of each feature (lookup bytes per example, rows, ...).
        num_towers: towers wanted, 1 <= num_towers <= F.
        tolerance: allowed excess of a tower's load over the mean.

    Returns:
        The towers, each a sorted list of feature positions, heaviest first.
    """
    loads = np.asarray(loads, np.float64)
    num_features = len(loads)
    if not 1 <= num_towers <= num_features:
        raise ConfigError(f"num_towers must be within 1..{num_features}, got {num_towers}")
    capacity = loads.sum() / num_towers * (1 + tolerance)
    groups = [[index] for index in range(num_features)]
    while len(groups) > num_towers:
        best, best_score = None, -np.inf
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                if loads[groups[a]].sum() + loads[groups[b]].sum() > capacity:
                    continue
                score = strength[np.ix_(groups[a], groups[b])].mean()
                if score > best_score:
                    best, best_score = (a, b), score
        if best is None:  # nothing fits: the two lightest groups
            order = np.argsort([loads[group].sum() for group in groups])
            best = tuple(sorted(int(i) for i in order[:2]))
        a, b = best
        groups[a] = sorted(groups[a] + groups[b])
        del groups[b]
    return sorted(groups, key=lambda group: (-loads[group].sum(), group))
