"""Users' towers: `model.tower = "package.module:ClassName"`, its keyword arguments in
`model.tower_config` (docs/your_own_model.md).

The tower contract, which the built-in towers follow too:

* A tower is an `nnx.Module` holding only `nnx.Param` state (float32 parameters; the
  activations in `dtype`, None = the inputs'). Parameters name their logical axes in
  their metadata (`model.layers.linear(..., axes)`: "mlp" for widths that may be split
  over the mesh's model axis by `model.partition_rules`); unnamed ones are replicated.
* `kind = "pooled"` (the default) reads click logs:
      Tower(*, num_dense, num_features, embedding_dim, dtype, rngs, **tower_config)
      tower(embeddings [B, F, D], dense [B, num_dense]) -> logits [B]
  trained by sigmoid cross-entropy against the label.
* `kind = "sequence"` reads packed user histories:
      Tower(*, dim, max_length, dtype, rngs, **tower_config)
      tower(x [R, L, D], segments [R, L], positions [R, L], rng=None) -> [R, L, D]
  (x: each event's item row, plus its side features' rows when the run reads them)
  one output per position, compared with item rows by the retrieval objective
  (`model.sequence_step`); `segments` < 0 is padding, attention must stay within a
  segment and never look ahead; `rng` is a dropout key in training, None in evaluation.

`check_tower` builds the tower abstractly and calls it on abstract inputs at start-up,
so a wrong signature or output shape is one line before anything compiles.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from hybridrec.common.errors import ConfigError
from hybridrec.model.config import SEQUENCE_TOWERS


@dataclasses.dataclass(frozen=True)
class Contract:
    """What the contract gives a tower of one kind: the keyword arguments of its
    `__init__`, abstract inputs to call it on, and the output shape it must return."""

    arguments: tuple[str, ...]
    inputs: Callable[[int, int, dict[str, int]], tuple[Any, ...]]  # (batch, length, dims)
    output: Callable[[int, int, int], tuple[int, ...]]  # (batch, length, dim) -> shape
    what: str  # the output, in words


def _pooled_inputs(batch: int, length: int, dims: dict[str, int]) -> tuple[Any, ...]:
    embeddings = jnp.zeros((batch, dims["num_features"], dims["embedding_dim"]), jnp.float32)
    return embeddings, jnp.zeros((batch, dims["num_dense"]), jnp.float32)


def _sequence_inputs(batch: int, length: int, dims: dict[str, int]) -> tuple[Any, ...]:
    segments = jnp.zeros((batch, length), jnp.int32)
    x = jnp.zeros((batch, length, dims["embedding_dim"]), jnp.float32)
    return x, segments, segments, None


# a tower's `kind` -> its contract (the module's doc)
CONTRACTS = {
    "pooled": Contract(
        ("num_dense", "num_features", "embedding_dim", "dtype", "rngs"),
        _pooled_inputs,
        lambda batch, length, dim: (batch,),
        "logits [B]",
    ),
    "sequence": Contract(
        ("dim", "max_length", "dtype", "rngs"),
        _sequence_inputs,
        lambda batch, length, dim: (batch, length, dim),
        "[R, L, D] outputs",
    ),
}
KINDS = tuple(CONTRACTS)


def is_import_path(tower: str) -> bool:
    return ":" in tower


def import_tower(path: str) -> type:
    """The class `module:Class` names; a one-line ConfigError naming the key otherwise."""
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any failure to import is the user's module's
        raise ConfigError(
            f"model.tower = {path!r}: module {module_name!r} does not import "
            f"({type(error).__name__}: {error})"
        ) from None
    cls = getattr(module, class_name, None)
    if not inspect.isclass(cls):
        raise ConfigError(
            f"model.tower = {path!r}: module {module_name!r} has no class {class_name!r}"
        )
    if not issubclass(cls, nnx.Module):
        raise ConfigError(f"model.tower = {path!r}: {class_name} is not a flax.nnx.Module")
    kind = getattr(cls, "kind", "pooled")
    if kind not in KINDS:
        raise ConfigError(
            f"model.tower = {path!r}: {class_name}.kind = {kind!r}, not one of {KINDS}"
        )
    return cls


def tower_kind(tower: str) -> str:
    """'pooled' or 'sequence' of a tower name or import path."""
    if is_import_path(tower):
        return getattr(import_tower(tower), "kind", "pooled")
    return "sequence" if tower in SEQUENCE_TOWERS else "pooled"


def _arguments(path: str, cls: type, given: dict[str, Any], tower_config: dict[str, Any]) -> None:
    """A one-line error for keys the class does not take or arguments it lacks."""
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = sorted(set(tower_config) - set(parameters))
    if unknown and not takes_any:
        raise ConfigError(
            f"model.tower_config: {', '.join(unknown)} not taken by {path} (it takes "
            f"{', '.join(sorted(set(parameters) - {'self', *given})) or 'no keys'})"
        )
    missing = [
        name
        for name, p in parameters.items()
        if name != "self"
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and name not in given
        and name not in tower_config
    ]
    if missing:
        raise ConfigError(
            f"{path}: __init__ needs {', '.join(missing)}, which the tower contract does not "
            f"give (it gives {', '.join(given)}); set them in model.tower_config"
        )


def build_custom_tower(
    path: str,
    tower_config: dict[str, Any],
    *,
    num_dense: int,
    num_features: int,
    embedding_dim: int,
    max_length: int,
    dtype,
    rngs: nnx.Rngs,
) -> nnx.Module:
    cls = import_tower(path)
    offered = {
        "num_dense": num_dense,
        "num_features": num_features,
        "embedding_dim": embedding_dim,
        "dim": embedding_dim,
        "max_length": max_length,
        "dtype": dtype,
        "rngs": rngs,
    }
    given = {name: offered[name] for name in CONTRACTS[getattr(cls, "kind", "pooled")].arguments}
    _arguments(path, cls, given, tower_config)
    return cls(**given, **tower_config)


def check_tower(build, *, kind: str, path: str, dims: dict[str, int]) -> None:
    """Builds the tower (`build(rngs)`) and calls it on abstract inputs; a one-line
    ConfigError for an output of the wrong shape, or a call that fails."""
    tower = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(tower, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ConfigError(f"{path}: a tower holds only nnx.Param state (found other variables)")
    batch, length, dim = 4, 8, dims["embedding_dim"]
    contract = CONTRACTS[kind]

    def call(params):
        return nnx.merge(graphdef, params)(*contract.inputs(batch, length, dims))

    try:
        out = jax.eval_shape(call, params)
    except Exception as error:
        raise ConfigError(
            f"{path}: calling the tower as the contract does failed "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    expected = contract.output(batch, length, dim)
    shape = getattr(out, "shape", None)
    if shape != expected:
        what = contract.what
        raise ConfigError(
            f"{path}: returns shape {list(shape) if shape is not None else type(out).__name__} "
            f"for {what} {list(expected)}"
        )
