"""How the dense step is laid out on devices: the mesh and the partition specs.

Sharding is data: layers name logical axes (see `model/towers.py`), and
`ModelConfig.partition_rules` maps those names to mesh axes. Batches are always
split over the "data" axis on their leading (example) dimension and replicated
over the "model" axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from hybridrec.common.errors import ConfigError
from hybridrec.model.config import DATA_AXIS, MeshConfig, ModelConfig
from hybridrec.model.layers import LOGICAL_AXES
from jax.sharding import AxisType, Mesh, NamedSharding

P = jax.sharding.PartitionSpec


def resolve_mesh_shape(config: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """Replaces a -1 entry by the remaining device count; checks the product."""
    known = math.prod(size for size in config.shape if size != -1)
    if -1 in config.shape:
        if num_devices % known:
            raise ConfigError(
                f"mesh.shape {list(config.shape)}: {num_devices} devices do not divide by {known}"
            )
        shape = tuple(num_devices // known if size == -1 else size for size in config.shape)
    else:
        shape = tuple(config.shape)
    if math.prod(shape) != num_devices:
        raise ConfigError(
            f"mesh.shape {list(config.shape)} needs {math.prod(shape)} devices, "
            f"but {num_devices} are available"
        )
    return shape


def make_mesh(config: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """Builds the mesh over all devices of all processes (or `devices`).

    Axes are `AxisType.Auto` so that logical partition rules, not explicit-sharding
    types, decide the layout.
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    shape = resolve_mesh_shape(config, len(devices))
    return jax.make_mesh(
        shape,
        config.axis_names,
        axis_types=(AxisType.Auto,) * len(shape),
        devices=devices,
    )


def logical_to_spec(
    logical_axes: tuple[str | None, ...] | None,
    shape: tuple[int, ...],
    config: ModelConfig,
    mesh: Mesh,
) -> P:
    """The PartitionSpec of one parameter from its logical axis names and shape.

    A dimension is sharded over the mesh axis its rule names only if the mesh has that
    axis, the dimension has at least `config.min_sharded_width` entries and divides
    evenly by the axis size; otherwise it is replicated.
    """
    if not logical_axes:
        return P()
    rules = dict(config.partition_rules)
    spec = []
    used: set[str] = set()
    for name, size in zip(logical_axes, shape, strict=True):
        axis = rules.get(name) if name is not None else None
        if (
            axis is None
            or axis not in mesh.shape
            or axis in used
            or size < config.min_sharded_width
            or size % mesh.shape[axis]
        ):
            spec.append(None)
        else:
            spec.append(axis)
            used.add(axis)
    return P(*spec)


def param_specs(abstract_params: nnx.State, config: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """PartitionSpecs for a tower's Param state, as a pure dict (same keys as `to_pure_dict`)."""

    def walk(node):
        if isinstance(node, nnx.Variable):
            metadata = node.get_metadata()
            return logical_to_spec(metadata.get(LOGICAL_AXES), node.get_value().shape, config, mesh)
        return {key: walk(child) for key, child in node.items()}

    return walk(abstract_params)


def named(mesh: Mesh, specs: Any) -> Any:
    """Maps a tree of PartitionSpecs to NamedShardings on `mesh`."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )


def batch_spec(ndim: int) -> P:
    """Examples (leading dim) split over the data axis, other dims whole."""
    return P(DATA_AXIS, *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """The sharding of one batch array: leading (example) dim over "data", the rest whole.

    Args:
        mesh: the device mesh.
        ndim: rank of the array, e.g. 3 for embeddings [batch, features, dim] float32,
            2 for dense [batch, num_dense] float32, 1 for labels [batch] float32.

    Returns:
        `NamedSharding(mesh, P("data", None, ...))` with `ndim` entries; replicated
        over every other mesh axis.
    """
    return NamedSharding(mesh, batch_spec(ndim))


# The step's batch layout: embeddings [B, F, D], dense [B, n_dense], labels [B].
BATCH_NDIMS: Mapping[str, int] = {"embeddings": 3, "dense": 2, "labels": 1}


def train_batch_sharding(mesh: Mesh) -> dict[str, NamedSharding]:
    """The shardings of the train step's batch dict, one per key of `BATCH_NDIMS`.

    Args:
        mesh: the device mesh.

    Returns:
        {"embeddings": for [batch, features, dim] float32, "dense": for
        [batch, num_dense] float32, "labels": for [batch] float32}, each split over
        "data" on the batch dim (see `batch_sharding`).
    """
    return {key: batch_sharding(mesh, ndim) for key, ndim in BATCH_NDIMS.items()}


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that places a full copy of the array on every device of `mesh`."""
    return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh) -> int:
    """The size of the mesh's "data" axis: how many ways each batch is split."""
    return int(mesh.shape[DATA_AXIS])


def describe(tree: Any) -> dict[str, str]:
    """`{path: "shape dtype spec"}` for logging how a state is laid out."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, leaf in flat:
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        out[jax.tree_util.keystr(path)] = f"{tuple(leaf.shape)} {np.dtype(leaf.dtype)} {spec}"
    return out
