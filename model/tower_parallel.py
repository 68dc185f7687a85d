"""Tower-parallel DMT: each Tower Module runs on its own devices, next to its tables.

In the flat layout every device runs the whole DMT model for its rows, so it needs every
tower's embeddings for those rows. In the tower-parallel layout (DMT's semantic-preserving
tower transform, executed as the paper places it) the mesh has a "tower" axis of size T:

    tower t's devices   hold tower t's features for the *global* batch, split over "data";
                        run Tower Module t on them: [rows, n_t, D] -> [rows, k, D]
    exchange            one all-to-all over "tower": each device sends 1/T of its rows'
                        compressed outputs to each tower's device of the same data index
    every device        runs the global tower on all T towers' outputs for its 1/T of
                        those rows (with their dense features and labels)

Only the compressed outputs ([rows, k, D], k per tower) cross the tower axis, forward and
backward; a tower's embeddings and their gradients stay with its devices, so a process
of tower t looks up and updates only tower t's tables (placed on its own server group).
The model, its parameters and the function computed are the flat DMT model's: a state
trained here evaluates, checkpoints and exports like any other.

Batch layout (global arrays), with T towers, n devices per tower and global batch B:

    tower_embeddings  [T, B, F_max, D]  P("tower", "data"): tower t's features, zero-padded
                                        to the largest tower's F_max
    dense             [B, n_dense]      P(("data", "tower")): rows in global order
    labels            [B]               P(("data", "tower"))

B must divide by n * T. Device (t, j) holds tower t's rows [j B/n, (j+1) B/n) and the
dense rows of block j T + t of B / (n T) rows: the rows it receives outputs for.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.model.config import DATA_AXIS
from hybridrec.model.distributed import owned
from hybridrec.model.step import ShardedStep, TrainState, apply_dense_gradients, mean_cross_entropy
from jax.sharding import AxisType, Mesh, NamedSharding

P = jax.sharding.PartitionSpec

TOWER_AXIS = "tower"
TOWER_BATCH_KEYS = ("tower_embeddings", "dense", "labels")


def make_tower_mesh(num_towers: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("tower", "data") mesh: tower t gets the t-th contiguous block of `devices`.

    `jax.devices()` lists each process's devices together, so with P processes and T
    towers, tower t runs on processes [t P/T, (t+1) P/T): a tower is a group of hosts.
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    if num_towers < 1 or len(devices) % num_towers:
        raise ConfigError(
            f"model.towers: {num_towers} towers cannot split {len(devices)} devices evenly; "
            "the tower-parallel layout needs a device count that divides by the tower count"
        )
    # Mesh, not jax.make_mesh: the device order must stay as given (towers = process groups)
    grid = np.asarray(devices, dtype=object).reshape(num_towers, len(devices) // num_towers)
    return Mesh(grid, (TOWER_AXIS, DATA_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def batch_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
    """The shardings of the tower-parallel batch (see the module docstring)."""
    rows = (DATA_AXIS, TOWER_AXIS)
    return {
        "tower_embeddings": NamedSharding(mesh, P(TOWER_AXIS, DATA_AXIS, None, None)),
        "dense": NamedSharding(mesh, P(rows, None)),
        "labels": NamedSharding(mesh, P(rows)),
    }


def _checked_towers(mesh: Mesh, towers: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """`towers` as a hashable tuple; a one-line error unless the mesh has one row per tower."""
    if int(mesh.shape[TOWER_AXIS]) != len(towers):
        raise ConfigError(
            f"model.towers has {len(towers)} towers but the mesh's tower axis has "
            f"{int(mesh.shape[TOWER_AXIS])}"
        )
    return tuple(tuple(int(i) for i in tower) for tower in towers)


def check_layout(mesh: Mesh, towers: Sequence[Sequence[int]], batch_size: int) -> None:
    """One-line errors for a mesh or batch the tower-parallel layout cannot use."""
    _checked_towers(mesh, towers)
    split = int(mesh.shape[TOWER_AXIS]) * int(mesh.shape[DATA_AXIS])
    if batch_size % split:
        raise UserError(
            f"the tower-parallel step splits each batch over {split} devices (towers x data); "
            f"batch {batch_size} does not divide by it"
        )


def local_towers(mesh: Mesh, batch_size: int) -> dict[int, slice]:
    """{tower: global rows} of the tower embeddings this process's devices hold.

    Every process holds one contiguous block of rows per tower it serves (with meshes
    from `make_tower_mesh`, one tower).
    """
    per_device = batch_size // int(mesh.shape[DATA_AXIS])
    rows: dict[int, list[int]] = {}
    process = jax.process_index()
    for (tower, data), device in np.ndenumerate(mesh.devices):
        if device.process_index == process:
            rows.setdefault(int(tower), []).append(int(data))
    out = {}
    for tower, chunks in rows.items():
        chunks.sort()
        if chunks != list(range(chunks[0], chunks[-1] + 1)):
            raise ConfigError(f"tower {tower}'s devices of this process are not contiguous")
        out[tower] = slice(chunks[0] * per_device, (chunks[-1] + 1) * per_device)
    return out


def make_tower_batch(
    mesh: Mesh,
    towers: Sequence[Sequence[int]],
    tower_embeddings: Mapping[int, np.ndarray],
    dense: np.ndarray,
    labels: np.ndarray | None = None,
) -> dict[str, jax.Array]:
    """The global batch from what this process holds.

    Args:
        mesh: from `make_tower_mesh`.
        towers: `model.towers`.
        tower_embeddings: {tower: [rows, n_t, D] float32} for each tower of
            `local_towers(mesh, B)`, its rows in that order.
        dense: [B, n_dense] float32 of the whole global batch (each process copies the
            rows its devices run the global tower on).
        labels: [B] float32 of the whole global batch; None for evaluation.

    Raises:
        ValueError: embeddings for other towers or rows than this process holds.
    """
    batch_size = len(dense)
    check_layout(mesh, towers, batch_size)
    width = max(len(tower) for tower in towers)
    held = local_towers(mesh, batch_size)
    if set(held) != set(tower_embeddings):
        raise ValueError(
            f"this process holds towers {sorted(held)}, got {sorted(tower_embeddings)}"
        )
    dim = None
    for tower, rows in held.items():
        array = tower_embeddings[tower]
        want = (rows.stop - rows.start, len(towers[tower]))
        if array.ndim != 3 or array.shape[:2] != want:
            raise ValueError(
                f"tower {tower}: embeddings must be [{want[0]}, {want[1]}, D] (its rows of "
                f"the batch, its features), got {list(array.shape)}"
            )
        dim = array.shape[2]

    def embeddings_at(index):
        tower = index[0].start or 0
        first, last, _ = index[1].indices(batch_size)
        start = held[tower].start
        part = tower_embeddings[tower][first - start : last - start]
        out = np.zeros((1, len(part), width, dim), np.float32)
        out[0, :, : part.shape[1]] = part
        return out

    shardings = batch_shardings(mesh)
    dense = owned(dense, shardings["dense"])  # the caller may change its arrays afterwards
    batch = {
        "tower_embeddings": jax.make_array_from_callback(
            (len(towers), batch_size, width, dim), shardings["tower_embeddings"], embeddings_at
        ),
        "dense": jax.make_array_from_callback(
            dense.shape, shardings["dense"], lambda index: dense[index]
        ),
    }
    if labels is not None:
        labels = owned(labels, shardings["labels"])
        batch["labels"] = jax.make_array_from_callback(
            labels.shape, shardings["labels"], lambda index: labels[index]
        )
    return batch


def local_tower_grads(
    embedding_grads: jax.Array, towers: Sequence[Sequence[int]]
) -> dict[int, np.ndarray]:
    """{tower: [rows, n_t, D]} host copies of this process's embedding gradients.

    `embedding_grads` is the step's [T, B, F_max, D] output; rows come in the order of
    `local_towers` (what `make_tower_batch` was given).
    """
    parts: dict[int, dict[int, np.ndarray]] = {}
    for shard in embedding_grads.addressable_shards:
        tower = shard.index[0].start or 0
        start = shard.index[1].start or 0
        parts.setdefault(tower, {}).setdefault(start, shard)
    return {
        tower: np.concatenate(
            [np.asarray(shards[start].data)[0, :, : len(towers[tower])] for start in sorted(shards)]
        )
        for tower, shards in parts.items()
    }


def _logits(graphdef, towers, params, tower_embeddings, dense):
    """Per device: its tower's module, the all-to-all, the global tower on its rows."""
    num_towers = len(towers)
    local = tower_embeddings[0]  # [rows, F_max, D]

    def run_tower(index, params, x):
        return nnx.merge(graphdef, params).tower(index, x[:, : len(towers[index])])

    # The parameters enter the branch as per-device values: their gradient's sum over
    # devices then happens after the branch, on every device, not inside one branch.
    varying = jax.tree.map(
        lambda x: jax.lax.pcast(x, (TOWER_AXIS, DATA_AXIS), to="varying"), params
    )
    branches = [functools.partial(run_tower, index) for index in range(num_towers)]
    compressed = jax.lax.switch(
        jax.lax.axis_index(TOWER_AXIS), branches, varying, local
    )  # [rows, k, D]: only this device's tower runs
    rows, outputs, dim = compressed.shape  # rows divide by T (check_layout)
    # piece s of my rows goes to tower s; I receive every tower's outputs for my piece
    pieces = compressed.reshape(num_towers, rows // num_towers, outputs, dim)
    received = jax.lax.all_to_all(pieces, TOWER_AXIS, 0, 0)  # [from tower, rows / T, k, D]
    gathered = jnp.moveaxis(received, 0, 1).reshape(rows // num_towers, num_towers * outputs, dim)
    return nnx.merge(graphdef, params).interact(gathered, dense)


def _sharded_logits(mesh: Mesh, towers, graphdef):
    rows = P((DATA_AXIS, TOWER_AXIS))
    return jax.shard_map(
        functools.partial(_logits, graphdef, towers),
        mesh=mesh,
        in_specs=(P(), P(TOWER_AXIS, DATA_AXIS), P((DATA_AXIS, TOWER_AXIS))),
        out_specs=rows,
    )


def tower_parallel_train_step(
    state: TrainState, batch: Mapping[str, jax.Array], *, mesh: Mesh, towers
) -> tuple[TrainState, dict[str, jax.Array], jax.Array]:
    """`train_step` in the tower-parallel layout: the same update of the same model.

    Returns the new state, the metrics of `train_step` and the embedding gradients
    [T, B, F_max, D] laid out like `tower_embeddings`.
    """
    logits_of = _sharded_logits(mesh, towers, state.graphdef)

    def objective(params, tower_embeddings):
        return mean_cross_entropy(
            logits_of(params, tower_embeddings, batch["dense"]), batch["labels"]
        )

    loss, (param_grads, embedding_grads) = jax.value_and_grad(objective, argnums=(0, 1))(
        state.params, batch["tower_embeddings"]
    )
    new_state, metrics = apply_dense_gradients(state, loss, param_grads)
    return new_state, metrics, embedding_grads


def tower_parallel_eval_step(
    state: TrainState, batch: Mapping[str, jax.Array], *, mesh: Mesh, towers
) -> jax.Array:
    """Click probabilities [B] in global row order."""
    logits = _sharded_logits(mesh, towers, state.graphdef)(
        state.params, batch["tower_embeddings"], batch["dense"]
    )
    return jax.nn.sigmoid(logits.astype(jnp.float32))


def make_tower_parallel_train_step(
    mesh: Mesh, towers: Sequence[Sequence[int]], *, state_shardings: TrainState | None = None
) -> ShardedStep:
    """Jits `tower_parallel_train_step` for `mesh` (from `make_tower_mesh`) and `towers`."""
    towers = _checked_towers(mesh, towers)
    function = functools.partial(tower_parallel_train_step, mesh=mesh, towers=towers)
    shardings = batch_shardings(mesh)

    def make_jitted(state_shardings: TrainState):
        return jax.jit(
            function,
            in_shardings=(state_shardings, shardings),
            out_shardings=(
                state_shardings,
                NamedSharding(mesh, P()),  # metrics
                shardings["tower_embeddings"],  # embedding grads: with their tower
            ),
            donate_argnums=(0,),
        )

    return ShardedStep(function, mesh, TOWER_BATCH_KEYS, make_jitted, state_shardings)


def make_tower_parallel_eval_step(
    mesh: Mesh, towers: Sequence[Sequence[int]], *, state_shardings: TrainState | None = None
) -> ShardedStep:
    """Jits `tower_parallel_eval_step`: probabilities [B] = step(state, batch)."""
    towers = _checked_towers(mesh, towers)
    function = functools.partial(tower_parallel_eval_step, mesh=mesh, towers=towers)
    shardings = batch_shardings(mesh)

    def make_jitted(state_shardings: TrainState):
        return jax.jit(
            function,
            in_shardings=(
                state_shardings,
                {key: shardings[key] for key in ("tower_embeddings", "dense")},
            ),
            out_shardings=shardings["labels"],
        )

    return ShardedStep(function, mesh, ("tower_embeddings", "dense"), make_jitted, state_shardings)
