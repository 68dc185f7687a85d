"""How a step's rows and features are laid out over the devices: the one way from a batch
and its looked-up embeddings to what the step reads, and from the step's embedding
gradients back to the rows the store updates.

    FlatLayout    data-parallel (`model.layout = "flat"`): every device runs the whole
                  model on its rows; a process looks up every feature of its rows
    TowerLayout   tower-parallel DMT (`model.layout = "towers"`, `model/tower_parallel.py`):
                  tower t's devices hold tower t's features for the whole global batch and
                  run its Tower Module; a process looks up only its towers' features
    SequenceLayout  packed user histories (`training.sequences.batches`): the batch's distinct
                  items' rows replicated, the packed rows split over the data axis

The training loop (`training.hybrid.HybridLoop`), evaluation and the placement runs all go
through these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from hybridrec.common.errors import ConfigError
from hybridrec.model import local_rows, make_global_batch, tower_parallel
from hybridrec.model.sequence_step import CONTEXT_KEYS
from hybridrec.model.sharding import data_parallel_size
from hybridrec.pipeline.metadata import ITEM_FEATURE
from hybridrec.training.data.input import Batch
from hybridrec.training.sequences.batches import SequenceBatch


def feature_ids(
    batch: Batch, rows: slice | None = None, features: Sequence[str] | None = None
) -> Mapping[str, Any]:
    """The batch's ids (of `features`, default all), optionally restricted to a slice of
    rows (single-valued or ragged)."""
    selected = batch.ids if features is None else {name: batch.ids[name] for name in features}
    if rows is None or rows == slice(None):
        return selected
    out = {}
    for name, ids in selected.items():
        if hasattr(ids, "offsets"):
            start, stop = rows.start, rows.stop
            offsets = ids.offsets[start : stop + 1]
            out[name] = type(ids)(
                values=ids.values[offsets[0] : offsets[-1]], offsets=offsets - offsets[0]
            )
        else:
            out[name] = ids[rows]
    return out


class FlatLayout:
    """Data-parallel: this process's `rows` of each batch, every feature.

    Args:
        mesh: the step's mesh.
        rows: the rows of each global batch this process trains on.
        features: the features it looks up (None: all of the batch's).
    """

    def __init__(self, mesh: Any, rows: slice = slice(None), features: Sequence[str] | None = None):
        self.mesh = mesh
        self.rows = rows
        self.features = list(features) if features is not None else None

    @classmethod
    def of_process(cls, mesh: Any, batch_size: int, features: Sequence[str] | None = None):
        """Process p's share of a global batch every process reads: rows [p b, (p + 1) b)."""
        per_process = batch_size // jax.process_count()
        start = jax.process_index() * per_process
        return cls(mesh, slice(start, start + per_process), features)

    def device_batch(
        self, batch: Batch, embeddings: np.ndarray, *, train: bool = True, extra=None
    ) -> dict:
        """embeddings: [rows, features, dim] of this process's rows -> the step's batch;
        `extra`: the device tables' (per-example, whole) host arrays, copied with it."""
        arrays = {"embeddings": embeddings, "dense": batch.dense[self.rows]}
        if train:
            arrays["labels"] = batch.labels[self.rows]
        per_example, whole = extra or ({}, {})
        return make_global_batch({**arrays, **per_example}, self.mesh, replicated=whole)

    def gradients(self, embedding_grads: jax.Array) -> np.ndarray:
        """[rows, features, dim] host copy of this process's embedding gradients."""
        return local_rows(embedding_grads)


class TowerLayout:
    """Tower-parallel DMT: the features of the towers this process's devices serve, for
    those towers' rows of the global batch (every process reads the whole global batch).

    Args:
        mesh: from `model.tower_parallel.make_tower_mesh`.
        towers: `model.towers` (feature positions per tower).
        features: the feature names by position.
        batch_size: the global batch.
    """

    def __init__(
        self, mesh: Any, towers: Sequence[Sequence[int]], features: Sequence[str], batch_size: int
    ):
        self.mesh = mesh
        self.towers = [list(tower) for tower in towers]
        tower_parallel.check_layout(mesh, towers, batch_size)
        held = tower_parallel.local_towers(mesh, batch_size)
        if len({(rows.start, rows.stop) for rows in held.values()}) != 1:
            raise ConfigError(
                f"this process's devices serve towers {sorted(held)} for different rows; the "
                "tower-parallel layout needs each process in one tower, or one process"
            )
        self.held = sorted(held)
        self.tower = self.held[0] if len(self.held) == 1 else None
        self.rows = held[self.held[0]]
        self.features = [features[position] for tower in self.held for position in towers[tower]]
        self._columns, start = {}, 0
        for tower in self.held:
            self._columns[tower] = slice(start, start + len(towers[tower]))
            start += len(towers[tower])

    def device_batch(
        self, batch: Batch, embeddings: np.ndarray, *, train: bool = True, extra=None
    ) -> dict:
        """embeddings: [rows, features of the held towers, dim] -> the step's batch;
        `extra`: the device tables' (per-example, whole) host arrays."""
        arrays = {}
        if extra is not None:
            arrays = make_global_batch(extra[0], self.mesh, replicated=extra[1])
        return arrays | tower_parallel.make_tower_batch(
            self.mesh,
            self.towers,
            {tower: embeddings[:, columns] for tower, columns in self._columns.items()},
            batch.dense,
            batch.labels if train else None,
        )

    def gradients(self, embedding_grads: jax.Array) -> np.ndarray:
        """[rows, features of the held towers, dim], in `features` order."""
        per_tower = tower_parallel.local_tower_grads(embedding_grads, self.towers)
        return np.concatenate([per_tower[tower] for tower in self.held], axis=1)


def padded_rows(count: int) -> int:
    """Distinct rows a batch's step takes: the next power of two (at least 256), so that a
    run compiles a handful of shapes, not one per batch."""
    return max(256, 1 << max(count - 1, 0).bit_length())


class SequenceLayout:
    """The flat layout of a sequence batch: every process reads and looks up the whole
    global batch, the rows of its distinct items replicated on every device, and each
    process puts its share of the packed rows on its devices (the positions are split over
    the data axis). The step's row gradients are summed over every device of every
    process, so each process's store (a replica, or shared servers) gets the whole
    batch's update from it: nothing is gathered (the `FlatLayout` above
    for histories).

    Trainer processes sharing embedding servers (`from_chief`): the chief alone looks up
    a training batch's rows and applies their update; every process hands the step
    [data devices, U, D] rows split over the data axis, the chief's in its first part,
    zeros elsewhere, and the step sums them (`make_sequence_train_step`'s
    `rows_from_chief`): one copy of each update reaches the servers, and every process
    trains on the same rows.

    With the item table on the devices (`on_devices`) the store looks up nothing: the
    batch carries the table's arrays (`DeviceRows`) in place of the rows; with a hot-row
    cache of it, the store looks up the items the cache does not hold."""

    rows = slice(None)  # the ids looked up: the whole batch's

    def __init__(
        self,
        mesh: Any,
        *,
        ranking: bool = False,
        from_chief: bool = False,
        dim: int = 0,
        on_devices: bool = False,
        cached: bool = False,
    ):
        self.mesh = mesh
        self.ranking = ranking  # the step reads the next events' actions
        self.from_chief = from_chief
        self.dim = dim  # of a row (the rows another process looks up)
        self.on_devices = on_devices
        # the store looks up nothing when the table holds every item, and the items a
        # cache does not hold (`cached`)
        self.features = [] if on_devices and not cached else [ITEM_FEATURE.name]

    def own(self, array: np.ndarray) -> np.ndarray:
        """This process's rows of a [rows, ...] batch array."""
        share = array.shape[0] // jax.process_count()
        return array[jax.process_index() * share : (jax.process_index() + 1) * share]

    def device_batch(
        self, batch: SequenceBatch, embeddings: np.ndarray, *, train: bool = True, extra=None
    ) -> dict:
        """embeddings: [U, 1, D] rows of `batch.ids` (None: the chief's, `from_chief`, or
        the devices' table's) -> the step's batch (rows padded to `padded_rows(U)` with
        zeros, which no index points at). With the item table on the devices, `extra`
        holds its arrays; with a cache of it, `embeddings` are the rows of the items it
        does not hold, placed at their positions (`extra`'s "host_at")."""
        count = len(batch.ids[ITEM_FEATURE.name])
        dim = self.dim if embeddings is None else embeddings.shape[2]
        whole = dict(extra[1]) if train and self.on_devices else {}
        host_at = whole.pop("host_at", None)
        if host_at is not None:  # a cache: [its rows, D], the host's rows where it has none
            rows = np.zeros((len(whole[next(k for k in whole if k.endswith("/slots"))]), dim), np.float32)  # fmt: skip
            rows[host_at] = embeddings[:, 0]
        else:
            rows = np.zeros((padded_rows(count), dim), np.float32)
            if embeddings is not None:
                rows[:count] = embeddings[:, 0]
        shared = {"rows": rows} | whole
        if train:
            shared |= {"negatives": batch.negatives, "negative_logq": batch.negative_logq}
            keys = [key for key in batch.arrays if key != "actions" or self.ranking]
        else:
            keys = ["inputs", "segments", "positions", "targets"]
            keys += [key for key in (*CONTEXT_KEYS, "sides") if key in batch.arrays]
        arrays = {key: self.own(batch.arrays[key]) for key in keys}
        if train and self.from_chief:  # this process's parts of [data devices, U, D]
            parts = np.zeros((data_parallel_size(self.mesh) // jax.process_count(), *rows.shape), np.float32)  # fmt: skip
            if embeddings is not None:
                parts[0] = rows
            arrays["rows"] = parts
            del shared["rows"]
        if whole and host_at is None:  # the whole table on the devices: no rows handed in
            del shared["rows"]
        return make_global_batch(arrays, self.mesh, replicated=shared)

    def gradients(self, row_grads: jax.Array) -> np.ndarray:
        """[U_padded, D] replicated -> host [U_padded, 1, D] (the loop applies the first U,
        the rows its lookup holds; the padding's are zero)."""
        return np.asarray(jax.device_get(row_grads))[:, None, :]
