"""The requests of a served sequence run (Open Inference Protocol, KServe v2 REST).

    POST /v2/models/{name}/infer    retrieval, or ranking when `candidates` is given
    POST /v2/models/{name}/events   append users' new events (a server that keeps them)

An infer request names its users' histories as raw item ids, oldest first:

    history     BYTES [total]      every user's recent items, user after user
    lengths     INT64 [n]          items per user (absent: `history` is one user's)
    times       INT64 [total]      each event of `history`'s time in seconds, and its
    actions     BYTES [total]      action type: needed by a model that reads them (the
                                   metadata's parameter "context": HSTU's time-gap bias,
                                   action types as inputs), ignored by others
    users       BYTES [n]          users whose kept events come first (`--keep-histories`);
                                   with `history` and `lengths`, the request's events follow
                                   theirs (a length may then be 0)
    candidates  BYTES [n, C]       ranking: C items per user to score
    <feature>   BYTES [total]      each event's value of an event side feature: needed by
                                   a model that reads it (the metadata's parameter
                                   "side_features"); the dataset's others ("event_features")
                                   are ignored, or kept with the events of kept histories

and `parameters`: `k` (retrieval: how many items, default 10) and `exclude_history`
(leave the history's own items out of the top-K; default: as the run was evaluated).

A retrieval answer is `items` BYTES [n, k] (raw item ids, best first) and `scores` FP32
[n, k]; a ranking answer `scores` FP32 [n, C, A]: per candidate a probability per action
type (the ranking objective's head; `parameters.actions` names them), or without a head
one retrieval score (A = 1). `parameters.truncated` lists the users whose history was cut
to the model's `max_length` most recent items; `parameters.unseen_items` counts the items
never trained (scored from their initial rows).

An events request is `users` BYTES [m] and `items` BYTES [m] (and `times` INT64 [m],
`actions` BYTES [m], the event side features BYTES [m]): event i is user i's, in order. Every bad request is a 4xx with `{"error": ...}` naming the input or parameter.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from hybridrec.serving.kept_histories import MISSING, KeptHistories
from hybridrec.serving.protocol import ProtocolError, decode_inputs, parse_body
from hybridrec.serving.sequence_model import ServedSequenceModel
from hybridrec.serving.sequence_query import CONTEXT, SequenceQuery
from hybridrec.serving.sequence_sides import describe
from hybridrec.serving.service import Service
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

INPUTS = ("history", "lengths", "times", "actions", "users", "candidates")
DEFAULT_K = 10


def metadata(model: ServedSequenceModel, histories: KeptHistories | None) -> dict[str, Any]:
    """`GET /v2/models/{name}` of a sequence model."""
    return {
        "name": model.name,
        "versions": [str(model.version)],
        "platform": "hybridrec_jax_export",
        "inputs": [
            {"name": "history", "datatype": "BYTES", "shape": [-1]},
            {"name": "lengths", "datatype": "INT64", "shape": [-1]},
            {"name": "times", "datatype": "INT64", "shape": [-1]},
            {"name": "actions", "datatype": "BYTES", "shape": [-1]},
            {"name": "users", "datatype": "BYTES", "shape": [-1]},
            {"name": "candidates", "datatype": "BYTES", "shape": [-1, -1]},
            *({"name": name, "datatype": "BYTES", "shape": [-1]} for name in model.event_features),
        ],
        "outputs": [
            {"name": "items", "datatype": "BYTES", "shape": [-1, -1]},
            {"name": "scores", "datatype": "FP32", "shape": [-1, -1]},
        ],
        "parameters": {
            "kind": "sequences",
            "step": model.manifest["step"],
            "precision": model.precision,
            "max_length": model.max_length,
            "catalogue": len(model.catalogue),
            "similarity": model.similarity,
            "actions": model.action_types if model.outputs > 1 else [],
            "exclude_history": model.exclude_history,
            "context": list(model.context),
            "side_features": list(model.event_sides),  # read: needed with every event
            "event_features": list(model.event_features),  # accepted
            "keeps_histories": histories is not None,
        },
    }


def _bytes_input(inputs: dict, name: str, dims: int) -> tuple[list[int], list[bytes]]:
    datatype, shape, values = inputs[name]
    if datatype != "BYTES":
        raise ProtocolError(f"input {name!r} must be BYTES (raw ids or values), got {datatype}")
    if len(shape) != dims:
        raise ProtocolError(f"input {name!r} must have {dims} dimension(s), got shape {shape}")
    return shape, values


def _parameter(parsed: dict, name: str, default: Any) -> Any:
    parameters = parsed.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ProtocolError("'parameters' must be an object")
    return parameters.get(name, default)


def parse_query(
    model: ServedSequenceModel,
    parsed: dict,
    binary: bytes,
    histories: KeptHistories | None,
    max_rows: int,
) -> tuple[SequenceQuery, list[bytes]]:
    """An infer request -> (the histories (item ids) and what to do with them, the users it
    names)."""
    inputs = decode_inputs(parsed, binary)
    takes = (*INPUTS, *model.event_features)
    unknown = sorted(set(inputs) - set(takes))
    if unknown:
        raise ProtocolError(f"unknown input(s) {unknown}: a sequence model takes {', '.join(takes)}")  # fmt: skip
    if "history" not in inputs and "users" not in inputs:
        raise ProtocolError("send the users' events as 'history' (and 'lengths'), or 'users'")
    kept: list[np.ndarray] | None = None
    kept_context: list[dict] = []
    users: list[bytes] = []
    if "users" in inputs:
        shape, users = _bytes_input(inputs, "users", 1)
        kept, kept_context = _kept(users, histories, new_events="history" in inputs)
    new: list[np.ndarray] | None = None
    new_context = {}
    if "history" in inputs:
        _, items = _bytes_input(inputs, "history", 1)
        new = _split(model.item_ids(items), inputs.get("lengths"), len(items))
        new_context = {
            name: _split(values, inputs.get("lengths"), len(items))
            for name, values in event_context(
                model, inputs, len(items), "history", unread=False
            ).items()
        }
    elif given := sorted((set(CONTEXT) | set(model.event_features)) & set(inputs)):
        raise ProtocolError(f"input(s) {given} go with 'history': one per item")
    if kept is not None and new is not None and len(kept) != len(new):
        raise ProtocolError(f"'users' names {len(kept)} users but 'lengths' {len(new)}")
    if kept is None:
        user_histories = new
    elif new is None:
        user_histories = kept
    else:
        user_histories = [np.concatenate([k, n]) for k, n in zip(kept, new, strict=True)]
    context = _user_context(model, users, kept, kept_context, new, new_context)
    if len(user_histories) > max_rows:
        raise ProtocolError(f"{len(user_histories)} users exceed the limit of {max_rows}", 413)
    for row, history in enumerate(user_histories):
        if not len(history):
            raise ProtocolError(f"the history of user row {row} is empty: nothing to follow")
    exclude = _parameter(parsed, "exclude_history", model.exclude_history)
    if not isinstance(exclude, bool):
        raise ProtocolError(f"parameter 'exclude_history' must be true or false, got {exclude!r}")
    if "candidates" in inputs:
        shape, names = _bytes_input(inputs, "candidates", 2)
        if shape[0] != len(user_histories) or shape[1] < 1:
            raise ProtocolError(
                f"input 'candidates' must have shape [{len(user_histories)}, C >= 1] (one "
                f"list a user), got {shape}"
            )
        candidates = model.item_ids(names).reshape(shape)
        return SequenceQuery(user_histories, candidates=candidates, context=context), users
    k = _parameter(parsed, "k", DEFAULT_K)
    catalogue = len(model.catalogue)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= catalogue:
        raise ProtocolError(
            f"parameter 'k' = {k!r} must be an integer from 1 to the catalogue's {catalogue:,} "
            "items"
        )
    cached = [histories.cache(user) for user in users] if kept is not None else None
    query = SequenceQuery(
        user_histories, k=k, exclude_history=exclude, cached=cached, context=context
    )
    return query, users


def event_context(
    model: ServedSequenceModel, inputs: dict, count: int, what: str, *, unread: bool
) -> dict:
    """The request's `times` (INT64 seconds), `actions` (BYTES type names) and event side
    features (BYTES raw values, by the feature's name), one per item of input `what`, as
    int64 arrays: those given (a model ignores what it does not read). The dataset's event
    features the model does not read are checked, and their ids made only with `unread`
    (kept histories keep them)."""
    out = {}
    if "times" in inputs:
        datatype, shape, values = inputs["times"]
        if datatype not in ("INT64", "UINT64", "INT32") or list(shape) != [count]:
            raise ProtocolError(
                f"input 'times' must be INT64 [{count}] (seconds, one per item of {what!r}), "
                f"got {datatype} {shape}"
            )
        out["times"] = values.astype(np.int64)
    if "actions" in inputs:
        shape, names = _bytes_input(inputs, "actions", 1)
        if shape != [count]:
            raise ProtocolError(f"input 'actions' must be BYTES [{count}] (one per item of {what!r}), got {shape}")  # fmt: skip
        try:
            out["actions"] = model.action_ids(names) if model.action_types else np.zeros(count, np.int64)  # fmt: skip
        except ValueError as error:
            raise ProtocolError(f"input 'actions': {error}") from None
    for name in model.event_features:
        if name in inputs:
            shape, values = _bytes_input(inputs, name, 1)
            if shape != [count]:
                raise ProtocolError(f"input {name!r} must be BYTES [{count}] (one per item of {what!r}), got {shape}")  # fmt: skip
            if unread or name in model.event_sides:
                out[name] = model.sides.event_ids(name, values).view(np.int64)
    return out


def _user_context(model, users, kept, kept_context, new, new_context) -> dict | None:
    """Per name the model reads of each event (`model.reads`), each user's values, kept
    events first; a 400 naming what lacks them."""
    out = {}
    for name in model.reads:
        need = f"this model reads each event's {describe(name)}"
        if new is not None and name not in new_context:
            raise ProtocolError(f"input {name!r} is missing: {need}; send one per item of 'history'")  # fmt: skip
        values = []
        for row in range(len(kept if kept is not None else new)):
            parts = []
            if kept is not None:
                stored = kept_context[row].get(name, np.full(len(kept[row]), MISSING))
                if (stored == MISSING).any():  # as long as kept
                    shown = users[row].decode("utf-8", "backslashreplace")
                    raise ProtocolError(f"input 'users': user {shown!r} has kept events without {name}; {need} (append events with {name!r})")  # fmt: skip
                parts.append(stored)
            if new is not None:
                parts.append(new_context[name][row])
            values.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        out[name] = values
    return out or None


def _kept(users: list[bytes], histories: KeptHistories | None, *, new_events: bool):
    """(each user's kept item ids, {name: their values} of what else was kept)."""
    if histories is None:
        raise ProtocolError(
            "input 'users': this server keeps no histories (start it with `hybridrec serve "
            "--keep-histories N`); send the users' events as 'history' and 'lengths'"
        )
    out, kept_context = [], []
    for user in users:
        found = histories.events(user)
        if found is None and not new_events:
            shown = user.decode("utf-8", "backslashreplace")
            raise ProtocolError(
                f"input 'users': no kept events of user {shown!r} (append them with "
                "POST .../events, or send them as 'history')",
                404,
            )
        out.append(found[0] if found is not None else np.zeros(0, np.uint64))
        kept_context.append(found[1] if found is not None else {})
    return out, kept_context


def _split(ids: np.ndarray, lengths: Any, total: int) -> list[np.ndarray]:
    """`history` ids -> one array a user, by `lengths` (absent: all one user's)."""
    if lengths is None:
        return [ids]
    datatype, shape, values = lengths
    if datatype not in ("INT64", "UINT64") or len(shape) != 1:
        raise ProtocolError(f"input 'lengths' must be INT64 [n], got {datatype} {shape}")
    values = values.astype(np.int64)
    if (values < 0).any() or int(values.sum()) != total:
        raise ProtocolError(
            f"input 'lengths' must be non-negative and sum to the {total} items of 'history', "
            f"got a sum of {int(values.sum())}"
        )
    return np.split(ids, np.cumsum(values)[:-1])


async def infer(service: Service, request: Request, model: ServedSequenceModel) -> Response:
    body = await service.read_body(request)
    parsed, binary = parse_body(body, request.headers)
    query, users = parse_query(model, parsed, binary, service.histories, service.options.max_rows)
    answer = await service.batcher.submit(model, query, query.rows)
    for user, cache in zip(users, answer.caches or (), strict=False):
        service.histories.store_cache(user, cache)
    response: dict[str, Any] = {"model_name": model.name, "model_version": str(model.version)}
    if "id" in parsed:
        response["id"] = parsed["id"]
    response["parameters"] = {
        "truncated": answer.truncated,
        "unseen_items": answer.unseen,
        "computed_events": answer.computed_events,
    }
    scores = {
        "name": "scores",
        "datatype": "FP32",
        "shape": list(answer.scores.shape),
        "data": answer.scores.reshape(-1).tolist(),
    }
    if answer.items is None:
        if model.outputs > 1:
            response["parameters"]["actions"] = model.action_types
        response["outputs"] = [scores]
    else:
        short = np.flatnonzero(~np.isfinite(answer.scores).all(axis=1))
        if len(short):
            row = int(short[0])
            left = int(np.isfinite(answer.scores[row]).sum())
            raise ProtocolError(
                f"parameter 'k' = {answer.scores.shape[1]} exceeds the {left} items left for user "
                f"row {row} after leaving out its history (exclude_history)"
            )
        items = {
            "name": "items",
            "datatype": "BYTES",
            "shape": list(answer.items.shape),
            "data": model.item_names(answer.items),
        }
        response["outputs"] = [items, scores]
    return Response(json.dumps(response).encode(), media_type="application/json")


async def append_events(service: Service, request: Request, model: ServedSequenceModel) -> Response:
    if service.histories is None:
        raise ProtocolError(
            "this server keeps no histories: start it with `hybridrec serve --keep-histories N`"
        )
    body = await service.read_body(request)
    parsed, binary = parse_body(body, request.headers)
    inputs = decode_inputs(parsed, binary)
    if not {"users", "items"} <= set(inputs) <= {"users", "items", *CONTEXT, *model.event_features}:
        more = ", ".join(repr(name) for name in (*CONTEXT, *model.event_features))
        raise ProtocolError(f"inputs {sorted(inputs)}: an events request is 'users' and 'items' (and {more})")  # fmt: skip
    (count,), users = _bytes_input(inputs, "users", 1)
    shape, items = _bytes_input(inputs, "items", 1)
    if shape[0] != count:
        raise ProtocolError(f"'users' has {count} events but 'items' {shape[0]}")
    for name, values in (("users", users), ("items", items)):
        if any(not value for value in values):
            raise ProtocolError(f"input {name!r}: an event has an empty id")
    context = event_context(model, inputs, count, "items", unread=True)
    touched = service.histories.append(users, model.item_ids(items), context)
    return JSONResponse({"events": count, "users": touched, **service.histories.stats()})
