"""Infer request tensors -> model inputs, checked against the served model.

A request carries either raw rows, one BYTES tensor `rows` [n], or hashed inputs:

    ids           INT64/UINT64 [n, S]   the single-valued features' ids, in spec order
    X.ids         INT64/UINT64 [nnz]    per multi-valued feature X: every row's bag, row
                                        after row
    X.lengths     INT64/UINT64 [n]      per multi-valued feature X: each row's bag size
    dense         FP32 [n, num_dense]   transformed dense values

Without multi-valued features S = F and `ids` is all there is of ids. Every
mismatch raises `ProtocolError` (400) naming the tensor; too many rows, 413.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hybridrec.embedding_store import RaggedIds
from hybridrec.serving.model import ServedModel
from hybridrec.serving.protocol import ProtocolError


def model_inputs(model: ServedModel, inputs: dict, *, max_rows: int) -> tuple[Any, Any]:
    """(lines, None) for raw rows or (ids, dense [n, d] float32) for hashed inputs.

    ids is [n, F] uint64, or {feature: [n] uint64 | RaggedIds} when the model has
    multi-valued features (sent as `<feature>.ids` and `<feature>.lengths`).
    """
    names = set(inputs)
    if names == {"rows"}:
        datatype, shape, values = inputs["rows"]
        if datatype != "BYTES":
            raise ProtocolError(f"input 'rows' must be BYTES, got {datatype}")
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            raise ProtocolError(f"input 'rows' must have shape [n] or [n, 1], got {shape}")
        _check_rows(shape[0], max_rows)
        return values, None
    expected = hashed_input_names(model)
    if names != set(expected) and not (
        not model.single_features and names == set(expected) - {"ids"}
    ):
        raise ProtocolError(
            f"inputs {sorted(names)}: send either 'rows' (BYTES raw rows) or "
            + _hashed_inputs_text(model)
        )
    dense_type, dense_shape, dense = inputs["dense"]
    if dense_type != "FP32":
        raise ProtocolError(f"input 'dense' must be FP32, got {dense_type}")
    if len(dense_shape) != 2 or dense_shape[1] != model.num_dense:
        raise ProtocolError(
            f"input 'dense' must have shape [n, {model.num_dense}], got {dense_shape}"
        )
    rows = dense_shape[0]
    _check_rows(rows, max_rows)
    dense = dense.reshape(dense_shape)
    if not np.isfinite(dense).all():
        raise ProtocolError("input 'dense' holds NaN or infinite values")
    singles = len(model.single_features)
    if "ids" in inputs:
        id_type, id_shape, ids = inputs["ids"]
        _check_id_type("ids", id_type)
        if len(id_shape) != 2 or id_shape[1] != singles:
            what = "single-valued feature" if model.bag_features else "feature"
            raise ProtocolError(
                f"input 'ids' must have shape [n, {singles}] (one column per {what}), "
                f"got {id_shape}"
            )
        if id_shape[0] != rows:
            raise ProtocolError(f"'ids' has {id_shape[0]} rows but 'dense' has {rows}")
        # INT64 ids carry the same 64 bits (ids >= 2**63 arrive negative)
        ids = ids.reshape(id_shape).view(np.uint64)
    else:
        ids = np.zeros((rows, 0), np.uint64)
    if not model.bag_features:
        return ids, dense
    features, column = {}, 0
    for name in model.feature_names:
        if name in model.bag_features:
            features[name] = _bag_input(name, inputs, rows)
        else:
            features[name] = np.ascontiguousarray(ids[:, column])
            column += 1
    return features, dense


def _check_rows(rows: int, max_rows: int) -> None:
    if rows < 1:
        raise ProtocolError("a request needs at least one row")
    if rows > max_rows:
        raise ProtocolError(f"{rows} rows exceed the limit of {max_rows}", 413)


def input_metadata(model: ServedModel) -> list[dict[str, Any]]:
    """The model's inputs as `GET /v2/models/{name}` lists them."""
    inputs = [
        {"name": "rows", "datatype": "BYTES", "shape": [-1]},
        {"name": "ids", "datatype": "UINT64", "shape": [-1, len(model.single_features)]},
    ]
    for name in model.bag_features:
        inputs += [
            {"name": f"{name}.ids", "datatype": "UINT64", "shape": [-1]},
            {"name": f"{name}.lengths", "datatype": "INT64", "shape": [-1]},
        ]
    return [*inputs, {"name": "dense", "datatype": "FP32", "shape": [-1, model.num_dense]}]


def hashed_input_names(model: ServedModel) -> list[str]:
    """The tensors of a hashed request: ids, <feature>.ids and .lengths per bag, dense."""
    names = ["ids"]
    for name in model.bag_features:
        names += [f"{name}.ids", f"{name}.lengths"]
    return [*names, "dense"]


def _hashed_inputs_text(model: ServedModel) -> str:
    if not model.bag_features:
        return "'ids' (INT64/UINT64 [n, features]) and 'dense' (FP32 [n, dense])"
    bags = ", ".join(f"'{n}.ids' [nnz] and '{n}.lengths' [n]" for n in model.bag_features)
    return (
        f"'ids' (INT64/UINT64 [n, {len(model.single_features)}], the single-valued "
        f"features), per multi-valued feature {bags} (INT64/UINT64), and 'dense' (FP32 [n, dense])"
    )


def _check_id_type(name: str, datatype: str) -> None:
    if datatype not in ("INT64", "UINT64"):
        raise ProtocolError(f"input {name!r} must be INT64 or UINT64, got {datatype}")


def _bag_input(feature: str, inputs: dict, rows: int) -> RaggedIds:
    """The bags of one multi-valued feature from `<feature>.ids` and `<feature>.lengths`."""
    ids_name, lengths_name = f"{feature}.ids", f"{feature}.lengths"
    id_type, id_shape, values = inputs[ids_name]
    length_type, length_shape, lengths = inputs[lengths_name]
    _check_id_type(ids_name, id_type)
    _check_id_type(lengths_name, length_type)
    if len(id_shape) != 1:
        raise ProtocolError(
            f"input {ids_name!r} must have shape [nnz] (every bag's ids, bag after bag), "
            f"got {id_shape}"
        )
    if length_shape != [rows]:
        raise ProtocolError(
            f"input {lengths_name!r} must have shape [{rows}] (one bag size per row), "
            f"got {length_shape}"
        )
    lengths = lengths.view(np.int64) if lengths.dtype == np.uint64 else lengths
    if np.any(lengths < 0):
        raise ProtocolError(f"input {lengths_name!r} holds a negative bag size")
    if len(lengths) and int(lengths.max()) > id_shape[0]:  # also: the sum cannot overflow
        raise ProtocolError(
            f"input {lengths_name!r} has a bag of {int(lengths.max())} ids but "
            f"{ids_name!r} holds {id_shape[0]}"
        )
    total = int(lengths.sum())
    if total != id_shape[0]:
        raise ProtocolError(
            f"input {lengths_name!r} sums to {total} but {ids_name!r} holds {id_shape[0]} ids"
        )
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return RaggedIds(values=np.ascontiguousarray(values.view(np.uint64)), offsets=offsets)
