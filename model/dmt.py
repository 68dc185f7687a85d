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

import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hybridrec.common.errors import ConfigError, UserError
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


def propose_towers_from_run(
    run_dir: str | Path,
    data_dir: str | Path,
    num_towers: int,
    *,
    batch_size: int = 512,
    rows: int = 8192,
    tolerance: float = 0.25,
) -> tuple[list[list[int]], list[str]]:
    """The Tower Partitioner on a finished run: `model.towers` for a next run.

    The run's embedding checkpoint gives the learned embeddings of the first `rows`
    examples of the dataset's eval split (train if it has none), hence the interaction
    strengths; distinct ids per batch of `batch_size` give each feature's lookup load.

    Args:
        run_dir: a `hybridrec train` run directory with a committed checkpoint.
        data_dir: its preprocessed dataset (metadata.json and Parquet splits).
        num_towers: towers wanted.
        batch_size: examples per step, for the loads.
        rows: examples read.
        tolerance: allowed excess of a tower's load over the mean.

    Returns:
        (towers as lists of feature positions, the categorical feature names by position).

    Raises:
        UserError: no checkpoint, no data, or multi-valued features (not supported).
    """
    import pyarrow.parquet as pq
    from hybridrec.embedding_store.checkpoint import (
        latest_checkpoint_step,
        read_manifest,
        read_table_rows,
    )

    run_dir, data_dir = Path(run_dir), Path(data_dir)
    metadata_path = data_dir / "metadata.json"
    if not metadata_path.is_file():
        raise UserError(f"{data_dir}: no metadata.json (not a preprocessed dataset)")
    categorical = json.loads(metadata_path.read_text())["spec"]["categorical"]
    bags = [feature["name"] for feature in categorical if feature.get("multi_valued")]
    if bags:
        raise UserError(f"the Tower Partitioner reads single-valued features; {bags} are bags")
    features = [feature["name"] for feature in categorical]
    url = str(run_dir / "checkpoints" / "embeddings")
    step = latest_checkpoint_step(url)
    if step is None:
        raise UserError(f"{run_dir}: no committed embedding checkpoint")
    files = sorted((data_dir / "eval").glob("*.parquet")) or sorted(
        (data_dir / "train").glob("*.parquet")
    )
    if not files:
        raise UserError(f"{data_dir}: no Parquet shards under eval/ or train/")
    table = pq.read_table(files[0], columns=features).slice(0, rows)
    feature_ids = np.stack([table[name].to_numpy() for name in features], axis=1)
    pooled = None
    # ids carry their feature's prefix, so no id is in two tables: the rows add up
    for name in sorted(read_manifest(url, step)["tables"]):
        ids, values = read_table_rows(url, step, name)
        found = pooled_from_rows(ids, values, feature_ids)
        pooled = found if pooled is None else pooled + found
    strength = interaction_strength(pooled)
    towers = propose_towers(
        strength, lookup_loads(feature_ids, batch_size), num_towers, tolerance=tolerance
    )
    return towers, features
