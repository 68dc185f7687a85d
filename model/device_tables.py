"""Embedding tables held on the devices: looked up and updated inside the jitted step.

A device table is `values` [rows + 1, dim] and `state` [rows + 1, state_width] f32 in
the train state (`TrainState.tables[name]`), replicated on every device or split by
rows over all of them. Its last row is scratch: padding entries of a batch point there.
The host maps ids to rows (`training.device.held_rows`); what the step receives per table:

    slots    [U] i32     the batch's distinct rows (padded with the scratch row), replicated
    new      [U] i32     for the rows the batch creates, where their values are among the
                         batch's new rows; -1 for the rows the table holds
    inverse  [B, F, L]   per example and feature of the table, up to L indices into `slots`
    weights  [B, F, L]   the pooling weight of each (0 for padding)

and once per batch, `NEW_ROWS` [N, dim]: the initial values of every table's new rows (N
a power of two), so a batch carries only those values. A table with `new_rows` set maps
its ids itself instead (`model.device_ids`): the batch carries its raw ids, `ids`
[B, F, 2] uint32 (each process's block holding its [F, b, 2] ids laid end to end,
`device_ids.batch_major`), and the step makes these arrays from them and its hash table.

The step gathers the U rows once, pools them into the features' embeddings, and after
the backward pass applies the sparse optimizer to the same U rows (their gradients
summed over the global batch, a reduction XLA inserts like the dense one) and writes
them back. A fresh row's optimizer state starts from the rule's initial state, the
same for every row (`SparseRule.initial_state`), set in the step. A row without a
gradient in a step is left as it is: the same lazy, per-row math as the host store's
optimizers (`common.sparse_rules`, one function for both), in float32.

A hot-row cache (`DeviceTable.cache`) is a device table in front of a host table: it
holds the table's most used rows, and its features are also looked up by the host
store, for the ids the cache does not hold. A cached feature's embedding is the sum of
both parts: the cache's rows pooled with the whole bag's weights (0 for the ids it
does not hold), and the host's pooling of the other ids, rescaled to the whole bag
(`host_scale`, 1 for sum pooling). Rows the cache admits come with the batch (as new
rows, their values and optimizer state read from the host store); the rows they replace
(`evict`) leave the step as outputs, read before the update, for the host store:

    state       [U, width]  the admitted rows' optimizer state (zeros elsewhere)
    evict       [E] i32     rows evicted this step (padded with the scratch row), replicated
    host_scale  [B, F_t]    per example and feature: the host part's factor
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hybridrec.common import sparse_rules
from hybridrec.model import device_ids
from hybridrec.model import sharding as sharding_lib
from hybridrec.model import step as step_lib
from hybridrec.model.sharding import batch_sharding, replicated

P = jax.sharding.PartitionSpec

ARRAYS = ("slots", "new", "inverse", "weights")  # per table, in the batch
NEW_ROWS = "table/new_rows"  # and the new rows of them all
CACHE_ARRAYS = ("state", "evict", "host_scale")  # and per cache
PER_EXAMPLE = ("inverse", "weights", "host_scale", "ids")  # split over the batch axis


@dataclasses.dataclass(frozen=True)
class SparseRule:
    """A per-row sparse optimizer (the fields of `embedding_store.SparseOptimizerConfig`)."""

    name: str  # "sgd" | "adagrad" | "rowwise_adagrad" | "adam"
    learning_rate: float
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator: float = 0.0

    def state_width(self, dim: int) -> int:
        return sparse_rules.state_width(self.name, dim)

    def initial_state(self, dim: int) -> np.ndarray:
        """[state_width] float32: a new row's optimizer state (the store's, every row alike)."""
        return sparse_rules.initial_state(self, 1, dim)[0]


@dataclasses.dataclass(frozen=True)
class DeviceTable:
    """One table on the devices.

    Args:
        name: the table's name (the features' spec table).
        positions: positions of its features among the tower's F features.
        rows: rows it holds (the scratch row comes on top).
        dim: values per row.
        rule: its sparse optimizer.
        sharded: split its rows over all devices; False: a replica on every device.
        cache: a hot-row cache of a host table (`rows` its capacity): the host store
            looks up the ids it does not hold.
        new_rows: the step maps the batch's ids to rows itself, in a hash table on the
            devices, and gives new ids these initial values (`model.device_ids`); None:
            the host maps them (`training.device.held_rows`).
    """

    name: str
    positions: tuple[int, ...]
    rows: int
    dim: int
    rule: SparseRule
    sharded: bool = False
    cache: bool = False
    new_rows: device_ids.NewRows | None = None

    @property
    def arrays(self) -> tuple[str, ...]:
        """The batch arrays of this table (`array_key(name, ...)`)."""
        if self.new_rows is not None:
            return ("ids",)
        return ARRAYS + CACHE_ARRAYS if self.cache else ARRAYS

    @property
    def scratch(self) -> int:
        return self.rows

    def padded_rows(self, num_devices: int) -> int:
        """Rows allocated: rows + scratch, rounded up to split evenly over the devices."""
        total = self.rows + 1
        return -(-total // num_devices) * num_devices if self.sharded else total

    def bytes_per_device(self, num_devices: int) -> int:
        width = self.dim + self.rule.state_width(self.dim)
        total = self.padded_rows(num_devices) * width * 4
        total = total // num_devices if self.sharded else total
        if self.new_rows is not None:  # its hash table, on every device
            total += device_ids.table_bytes(self.rows)
        return total


@dataclasses.dataclass(frozen=True)
class DeviceTableLayout:
    """Which of the tower's F features come from device tables; the rest come looked up
    by the host, in `host_positions` order, as the batch's `embeddings` [B, F_host, D]."""

    tables: tuple[DeviceTable, ...]
    num_features: int

    def __post_init__(self):
        mapped = {table.new_rows is not None for table in self.tables}
        if len(mapped) > 1:
            raise ValueError("device tables: the step maps every table's ids or none")

    @property
    def host_positions(self) -> tuple[int, ...]:
        """Features the host looks up: those of no device table, and the cached ones."""
        on_devices = {p for table in self.whole for p in table.positions}
        return tuple(p for p in range(self.num_features) if p not in on_devices)

    @property
    def whole(self) -> tuple[DeviceTable, ...]:
        """The tables held whole on the devices (not caches)."""
        return tuple(table for table in self.tables if not table.cache)

    @property
    def caches(self) -> tuple[DeviceTable, ...]:
        return tuple(table for table in self.tables if table.cache)

    def order(self) -> np.ndarray:
        """Feature position -> column of [host features..., each whole table's features...]."""
        sources = [*self.host_positions, *(p for t in self.whole for p in t.positions)]
        order = np.empty(self.num_features, np.int32)
        order[np.asarray(sources, np.int64)] = np.arange(self.num_features)
        return order


def sparse_update(
    rule: SparseRule, weights: jax.Array, state: jax.Array, grads: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One optimizer step on gathered rows [m, dim] (duplicates summed), the host store's
    math (`common.sparse_rules`); rows whose gradient is not finite keep their values and
    state."""
    new_weights, new_state = sparse_rules.sparse_step(jnp, rule, weights, state, grads)
    finite = jnp.all(jnp.isfinite(grads), axis=1, keepdims=True)
    return jnp.where(finite, new_weights, weights), jnp.where(finite, new_state, state)


def table_specs(layout: DeviceTableLayout, mesh: jax.sharding.Mesh) -> dict[str, dict[str, P]]:
    """The partition specs of `TrainState.tables`: rows over every mesh axis, or none."""
    rows = P(tuple(mesh.axis_names))
    specs = {}
    for table in layout.tables:
        specs[table.name] = {
            "values": rows if table.sharded else P(),
            "state": rows if table.sharded else P(),
        }
        if table.new_rows is not None:  # the hash table, replicated
            specs[table.name].update(dict.fromkeys(device_ids.KEYS, P()))
    return specs


def init_tables(
    layout: DeviceTableLayout, mesh: jax.sharding.Mesh
) -> dict[str, dict[str, jax.Array]]:
    """Zeroed tables in their layout on `mesh` (rows are filled as the batches create them)."""
    specs = table_specs(layout, mesh)
    tables = {}
    for table in layout.tables:
        rows = table.padded_rows(mesh.devices.size)
        shapes = {
            "values": (rows, table.dim),
            "state": (rows, table.rule.state_width(table.dim)),
        }
        tables[table.name] = {
            key: jax.jit(
                lambda shape=shape: jnp.zeros(shape, jnp.float32),
                out_shardings=jax.sharding.NamedSharding(mesh, specs[table.name][key]),
            )()
            for key, shape in shapes.items()
        }
        if table.new_rows is not None:
            tables[table.name].update(replicated_table(device_ids.empty_table(table.rows), mesh))
    return tables


def replicated_table(arrays: Mapping[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict:
    """Host arrays (a device table's hash table) as arrays replicated over `mesh`."""
    sharding = replicated(mesh)
    return {
        key: jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
        for key, a in arrays.items()
    }


def batch_shardings(layout: DeviceTableLayout, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Shardings of a batch's device-table arrays: per-row ones split over the data axis,
    the distinct rows and their initial values replicated."""
    out = {}
    for table in layout.tables:
        for key in table.arrays:
            per_example = key in PER_EXAMPLE
            sharding = batch_sharding(mesh, 2 + (key != "host_scale")) if per_example else None
            out[array_key(table.name, key)] = sharding or replicated(mesh)
    if _host_mapped(layout):
        out[NEW_ROWS] = replicated(mesh)
    return out


def _host_mapped(layout: DeviceTableLayout) -> bool:
    """Whether the host maps some device table's ids (the batch then carries `NEW_ROWS`)."""
    return any(table.new_rows is None for table in layout.tables)


def array_key(table: str, key: str) -> str:
    return f"table/{table}/{key}"


def gather_rows(
    layout: DeviceTableLayout, tables: Mapping[str, Mapping[str, jax.Array]], batch: Mapping
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Per table, (values [U, dim], state [U, width]) of the batch's distinct rows, fresh
    rows taking their initial values from the batch (a cache's admitted rows their state
    too; a whole table's new rows start from the rule's initial state)."""
    out = {}
    for table in layout.tables:
        slots = batch[array_key(table.name, "slots")]
        new = batch[array_key(table.name, "new")]
        fresh = (new >= 0)[:, None]
        arriving = batch[NEW_ROWS][jnp.maximum(new, 0)]
        values = jnp.where(fresh, arriving, tables[table.name]["values"][slots])
        initial = (
            batch[array_key(table.name, "state")]
            if table.cache
            else jnp.asarray(table.rule.initial_state(table.dim))[None, :]
        )
        state = jnp.where(fresh, initial, tables[table.name]["state"][slots])
        out[table.name] = (values, state)
    return out


def assemble(
    layout: DeviceTableLayout, host: jax.Array, rows: Mapping[str, jax.Array], batch: Mapping
) -> jax.Array:
    """[B, F, D] embeddings in the tower's feature order, from the host's features
    [B, F_host, D] and each table's gathered rows [U, D], pooled per feature (a cache's
    added to the host's part of its features)."""

    def pooled(table):
        inverse = batch[array_key(table.name, "inverse")]
        weights = batch[array_key(table.name, "weights")]
        picked = rows[table.name][inverse]  # [B, F_t, L, D]
        return jnp.sum(picked * weights[..., None], axis=2)

    columns = {p: i for i, p in enumerate(layout.host_positions)}
    for table in layout.caches:
        at = np.asarray([columns[p] for p in table.positions])
        host = host.at[:, at].multiply(batch[array_key(table.name, "host_scale")][..., None])
    parts = [host, *(pooled(table) for table in layout.whole)]
    embeddings = jnp.concatenate(parts, axis=1)[:, layout.order()]
    for table in layout.caches:
        embeddings = embeddings.at[:, np.asarray(table.positions)].add(pooled(table))
    return embeddings


def update_tables(
    layout: DeviceTableLayout,
    tables: Mapping[str, Mapping[str, jax.Array]],
    gathered: Mapping[str, tuple[jax.Array, jax.Array]],
    grads: Mapping[str, jax.Array],
    batch: Mapping,
) -> tuple[dict[str, dict[str, jax.Array]], dict[str, tuple[jax.Array, jax.Array]]]:
    """(the tables after the sparse optimizer stepped the batch's rows, per cache the
    (values, state) of the rows it evicts, as they were before this step)."""
    out, evicted = {}, {}
    for table in layout.tables:
        values, state = gathered[table.name]
        new_values, new_state = sparse_update(table.rule, values, state, grads[table.name])
        slots = batch[array_key(table.name, "slots")]
        held = tables[table.name]
        if table.cache:
            evict = batch[array_key(table.name, "evict")]
            evicted[table.name] = (held["values"][evict], held["state"][evict])
        out[table.name] = {
            **held,
            "values": held["values"].at[slots].set(new_values),
            "state": held["state"].at[slots].set(new_state),
        }
    return out, evicted


def map_batch(
    layout: DeviceTableLayout, tables: Mapping[str, Mapping[str, jax.Array]], batch: Mapping
) -> tuple[dict[str, dict[str, jax.Array]], dict[str, jax.Array]]:
    """(the tables with their hash tables after the batch, the batch with the arrays the
    host would have made), for a layout whose tables all map their ids in the step
    (`model.device_ids`)."""
    tables, mapped, fresh_rows, offset = dict(tables), dict(batch), [], 0
    for table in layout.tables:  # every one maps its ids (`DeviceTableLayout`)
        held = tables[table.name]
        hashed = {key: held[key] for key in device_ids.KEYS}
        ids = device_ids.batch_major(batch[array_key(table.name, "ids")], jax.process_count())
        hashed, arrays, fresh, distinct = device_ids.map_ids(hashed, ids, table.rows)
        tables[table.name] = {**held, **hashed}
        arrays["new"] = jnp.where(fresh, offset + jnp.arange(fresh.shape[0]), -1)
        fresh_rows.append(device_ids.initial_rows(table.new_rows, *distinct, table.dim))
        offset += fresh.shape[0]
        mapped.update({array_key(table.name, key): value for key, value in arrays.items()})
    mapped[NEW_ROWS] = jnp.concatenate(fresh_rows)
    return tables, mapped


def sequence_keys(layout: DeviceTableLayout) -> tuple[str, ...]:
    """The batch keys a sequence step reads of its item table on the devices: the batch's
    distinct rows index themselves (no bags), new rows come with the batch (a cache's
    with their optimizer state, and the rows it evicts)."""

    def keys(table):
        return ("slots", "new", "state", "evict") if table.cache else ("slots", "new")

    return (*(array_key(table.name, key) for table in layout.tables for key in keys(table)), NEW_ROWS)  # fmt: skip


def split_names(layout: DeviceTableLayout) -> tuple[str, ...]:
    """The batch keys a step with `layout`'s device tables reads."""
    names = tuple(array_key(table.name, key) for table in layout.tables for key in table.arrays)
    return (*names, NEW_ROWS) if _host_mapped(layout) else names


def train_step(
    layout: DeviceTableLayout, state: Any, batch: Mapping[str, jax.Array]
) -> tuple[Any, dict[str, jax.Array], jax.Array]:
    """`model.step.train_step` with some features' rows on the devices.

    `batch["embeddings"]` [B, F_host, D] holds the host's features (`layout.host_positions`);
    the device tables' arrays come under `array_key(table, ...)`. Returns the new state
    (dense parameters and device tables updated), the metrics, and the embedding
    gradients of the host's features only; with caches, the last is (those gradients,
    {cache: (values, state) of its evicted rows}).
    """
    if layout.tables and not _host_mapped(layout):  # the step maps the ids itself
        tables, batch = map_batch(layout, state.tables, batch)
        state = state.replace(tables=tables)
    gathered = gather_rows(layout, state.tables, batch)

    def objective(params, host, rows):
        embeddings = assemble(layout, host, rows, batch)
        return step_lib.loss_fn(state.graphdef, params, {**batch, "embeddings": embeddings})

    rows = {name: values for name, (values, _) in gathered.items()}
    loss, (param_grads, host_grads, row_grads) = jax.value_and_grad(objective, argnums=(0, 1, 2))(
        state.params, batch["embeddings"], rows
    )
    new_state, metrics = step_lib.apply_dense_gradients(state, loss, param_grads)
    tables, evicted = update_tables(layout, state.tables, gathered, row_grads, batch)
    out = (host_grads, evicted) if layout.caches else host_grads
    return new_state.replace(tables=tables), metrics, out


def make_train_step(
    mesh: jax.sharding.Mesh, layout: DeviceTableLayout, *, state_shardings: Any = None
) -> step_lib.ShardedStep:
    """Jits `train_step` with `layout`'s device tables once for `mesh` (see
    `model.step.make_train_step`; the state, device tables included, is donated)."""
    in_batch = {**sharding_lib.train_batch_sharding(mesh), **batch_shardings(layout, mesh)}
    function = functools.partial(train_step, layout)

    grads = sharding_lib.batch_sharding(mesh, 3)
    if layout.caches:
        grads = (grads, sharding_lib.replicated(mesh))

    def make_jitted(shardings):
        return jax.jit(
            function,
            in_shardings=(shardings, in_batch),
            out_shardings=(shardings, sharding_lib.replicated(mesh), grads),
            donate_argnums=(0,),
        )

    keys = ("embeddings", "dense", "labels", *split_names(layout))
    return step_lib.ShardedStep(function, mesh, keys, make_jitted, state_shardings)
