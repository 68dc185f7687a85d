"""What an export of a sequence run holds besides its item table.

    model.stablehlo    the encoder: queries [b, D] = f(rows [b, L, D], lengths [b]), each
                       history right-padded to L = max_length positions; a query is the
                       tower's output at the history's last event, as the scores compare it
                       (L2-normalized for cosine similarity)
    extend.stablehlo   towers with `extend` (SASRec, HSTU): (queries [b, D], keys, values)
                       = f(rows [b, n, D] of new events, prefix [b], count [b], keys,
                       values [blocks, b, L, heads, head_dim] of the earlier events): a
                       kept history's query from its cached keys and values, computing
                       only its new events (`model.sequence.extend_history`)
    ranking.stablehlo  with the ranking objective: logits [b, C, A] = f(rows, lengths,
                       candidates [b, C, D]), the head's score of each candidate for each
                       action type
    catalogue.npy      [C] uint64 ascending: the items retrieval ranks (the training
                       split's, as `hybridrec evaluate` ranks)
    item_names.parquet item (uint64 ascending) -> name (the raw id, binary): a response's
                       items are raw ids, as the requests' are
    item_sides.parquet with item side features as inputs: item (uint64 ascending) -> the
                       id of each (uint64), whose rows the item table holds

Both modules take the history as the training tower reads an evaluation history: its
most recent `max_length` items at positions 0, 1, ...; the parameters are constants of the
module and `b` (and `C`) are symbolic. A tower that reads more of each event than its item
(features.json "context": "times" for HSTU's time-gap bias, "actions" for action types as
inputs) takes one more argument a name, last, in that order: [b, L] int32 each, every
position's time in seconds since the history's first event, its action type id. With side
features (features.json "side_features", "side_scale") the rows a module takes are each
event's item row plus side_scale times its side features' rows, as training adds them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from flax import nnx
from hybridrec.model.config import SequenceConfig
from hybridrec.model.sequence import extend_history
from hybridrec.model.sequence_step import scored
from hybridrec.pipeline.events.event_spec import REQUEST_INPUTS, recorded_prefixes
from hybridrec.pipeline.metadata import EventMetadata
from hybridrec.serving._format import (
    CATALOGUE_FILE,
    EXTEND_FILE,
    ITEM_NAMES_FILE,
    ITEM_SIDES_FILE,
    MODEL_FILE,
    RANKING_FILE,
)
from hybridrec.training.defaults import check_request_names
from hybridrec.training.sequences.batches import Catalogue


def with_reference_attention(config: Any) -> Any:
    """The run's config with its attention in jax.numpy: an export runs on CPU and CUDA hosts
    alike, whatever kernel the run trained with (the parameters are the same)."""
    sequence = dataclasses.replace(config.model.sequence, attention="reference")
    return dataclasses.replace(config, model=dataclasses.replace(config.model, sequence=sequence))


def _last_outputs(model: nnx.Module, rows: jax.Array, lengths: jax.Array, context: dict) -> jax.Array:  # fmt: skip
    """The tower's output at each history's last event, [b, D] (unscored)."""
    length = rows.shape[1]
    positions = jnp.zeros(rows.shape[:2], jnp.int32) + jnp.arange(length, dtype=jnp.int32)
    segments = jnp.where(positions < lengths[:, None], 0, -1).astype(jnp.int32)
    outputs = model(rows, segments, positions, None, **context)
    last = jnp.clip(lengths - 1, 0, length - 1)[:, None, None]
    return jnp.take_along_axis(outputs, last, axis=1)[:, 0]


def _context(config: SequenceConfig, batch, length) -> tuple:
    """The context arguments of a module (what the tower reads of each event besides its
    item, `SequenceConfig.context`): one [b, length] int32 array each, in that order."""
    return tuple(jax.ShapeDtypeStruct((batch, length), jnp.int32) for _ in config.context)


def _named(config: SequenceConfig, values: tuple) -> dict:
    return dict(zip(config.context, values, strict=True))


def export_encoder(model: nnx.Module, config: SequenceConfig, dim: int) -> bytes:
    """Serialized StableHLO: queries [b, D] float32 = f(rows [b, L, D], lengths [b] int32,
    *context [b, L] int32)."""

    def queries(rows, lengths, *context):
        return scored(_last_outputs(model, rows, lengths, _named(config, context)), config)

    (batch,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(queries), platforms=("cpu", "cuda"))(
        jax.ShapeDtypeStruct((batch, config.max_length, dim), jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        *_context(config, batch, config.max_length),
    )
    return bytes(exported.serialize())


def export_extend(model: nnx.Module, config: SequenceConfig, dim: int) -> bytes:
    """Serialized StableHLO: (queries [b, D], keys, values) = f(rows [b, n, D], prefix [b],
    count [b], keys, values [blocks, b, L, heads, head_dim]); the query is the output at
    each row's last new event (position prefix + count - 1)."""
    blocks, heads, head_dim = model.cache_shape()

    def extend(rows, prefix, count, keys, values, *context):
        positions = prefix[:, None] + jnp.arange(rows.shape[1], dtype=jnp.int32)[None, :]
        positions = jnp.minimum(positions, config.max_length - 1)  # padding past the end
        outputs, keys, values = extend_history(
            model, rows, positions, count, keys, values, **_named(config, context)
        )
        last = jnp.clip(count - 1, 0, rows.shape[1] - 1)[:, None, None]
        query = jnp.take_along_axis(outputs, last, axis=1)[:, 0]
        return scored(query, config), keys, values

    batch, new = jax.export.symbolic_shape("b, n")
    cache = jax.ShapeDtypeStruct((blocks, batch, config.max_length, heads, head_dim), jnp.float32)
    exported = jax.export.export(jax.jit(extend), platforms=("cpu", "cuda"))(
        jax.ShapeDtypeStruct((batch, new, dim), jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        cache,
        cache,
        *_context(config, batch, config.max_length),
    )
    return bytes(exported.serialize())


def export_ranker(model: nnx.Module, config: SequenceConfig, dim: int) -> bytes:
    """Serialized StableHLO: logits [b, C, A] = f(rows [b, L, D], lengths [b], candidates
    [b, C, D]): the ranking head's score of each candidate after the history."""

    def logits(rows, lengths, candidates, *context):
        outputs = _last_outputs(model, rows, lengths, _named(config, context))
        outputs = jnp.broadcast_to(outputs[:, None], candidates.shape)
        return model.rank(outputs, candidates)

    batch, count = jax.export.symbolic_shape("b, c")
    exported = jax.export.export(jax.jit(logits), platforms=("cpu", "cuda"))(
        jax.ShapeDtypeStruct((batch, config.max_length, dim), jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, count, dim), jnp.float32),
        *_context(config, batch, config.max_length),
    )
    return bytes(exported.serialize())


def write_sequence_parts(
    directory: Path, model: nnx.Module, config: Any, metadata, shards: int | None = None
) -> dict:
    """Writes the modules of the restored tower `model`, the catalogue and the item names
    into `directory`; returns the features.json entries of a sequence export. A stream
    run's catalogue holds its reference's items and those of the `shards` it trained."""
    sequence = config.model.sequence
    (directory / MODEL_FILE).write_bytes(export_encoder(model, sequence, config.embedding.dim))
    cached = hasattr(getattr(model, "tower", model), "extend")
    if cached:
        (directory / EXTEND_FILE).write_bytes(export_extend(model, sequence, config.embedding.dim))
    if sequence.ranking:
        (directory / RANKING_FILE).write_bytes(export_ranker(model, sequence, config.embedding.dim))
    catalogue = Catalogue.of_run(metadata, config.data.train_split, shards)
    np.save(directory / CATALOGUE_FILE, catalogue.items)
    ids, names = metadata.item_names()
    pq.write_table(pa.table({"item": ids, "name": names}), directory / ITEM_NAMES_FILE)
    features = sequence_features(config, metadata)
    item_sides = tuple(s["name"] for s in features["side_features"] if s["of"] == "item")
    if item_sides:
        sides = Catalogue.item_sides(metadata, item_sides, shards)
        pq.write_table(pa.table(sides), directory / ITEM_SIDES_FILE)
    if cached:
        features["cache_shape"] = list(model.cache_shape())
    return features


def sequence_features(config: Any, metadata: EventMetadata) -> dict[str, Any]:
    sequence = config.model.sequence
    return {
        "kind": "sequences",
        "max_length": sequence.max_length,
        "similarity": sequence.similarity,
        "objective": sequence.objective,
        "action_types": list(metadata.raw["spec"].get("action_types") or []),
        "exclude_history": config.eval.exclude_history,
        # what the modules take of each event after their other arguments, in this order:
        # "times" (seconds since the history's first event), "actions" (type ids)
        "context": list(sequence.context),
        # side features added to each event's item row (times side_scale), their ids in
        # the item table:
        # an event's (given with each event, hashed with `prefix`) or its item's
        # (item_sides.parquet)
        "side_features": side_features(sequence, metadata),
        "side_scale": sequence.side_scale,
        # every event feature of the dataset -> its prefix: what a request may send with
        # its events, whether this model reads it or not (kept histories keep it for a
        # later version that does)
        "event_features": event_features(metadata),
    }


def event_features(metadata: EventMetadata) -> dict[str, int]:
    """{name: prefix} of the dataset's event features (but one named like a request's own
    input, which no request can send)."""
    prefixes, tables = recorded_prefixes(metadata.raw["spec"]), metadata.side_tables
    names = metadata.event_features
    return {name: prefixes[tables[name]] for name in names if name not in REQUEST_INPUTS}


def side_features(sequence: SequenceConfig, metadata: EventMetadata) -> list[dict]:
    """[{"name", "of": "event" | "item", "prefix"}] of the features the tower reads."""
    check_request_names(sequence, metadata)
    prefixes, tables = recorded_prefixes(metadata.raw["spec"]), metadata.side_tables
    return [
        {
            "name": name,
            "of": "event" if name in metadata.event_features else "item",
            "prefix": prefixes[tables[name]],
        }  # fmt: skip
        for name in sequence.side_features
    ]
