"""Tables of rows in memory, as the Parquet reader and the stream's reader hold them: a
dict with label [n], dense [n, d] and ids (feature name -> [n] array, or RaggedIds for a
multi-valued feature); a reader's rows keep their single-valued ids in one block
(`blocked`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from hybridrec.embedding_store import FeatureIds, RaggedIds

Rows = dict[str, Any]


def ragged_take(values: np.ndarray, offsets: np.ndarray, index: np.ndarray) -> RaggedIds:
    """Rows `index` of the bags (values, offsets)."""
    lengths = (offsets[1:] - offsets[:-1])[index]
    new_offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    starts = offsets[:-1][index]
    # position of every output value in `values`: start of its row + rank inside the row
    gather = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    return RaggedIds(values=values[gather], offsets=new_offsets)


def _ragged_concat(parts: Sequence[RaggedIds]) -> RaggedIds:
    values = np.concatenate([p.values for p in parts])
    offsets = [np.zeros(1, dtype=np.int64)]
    base = 0
    for part in parts:
        offsets.append(part.offsets[1:] + base)
        base += int(part.offsets[-1])
    return RaggedIds(values=values, offsets=np.concatenate(offsets))


def blocked(rows: Rows) -> Rows:
    """`rows` with its single-valued ids in one [k, n] block, a feature a row
    (`rows["single"]`, the features' names in `rows["names"]`): a shuffle gathers each
    feature's ids as one contiguous array, a batch's slice of them stays contiguous, and
    `ids_of` gives the features back as views."""
    names = tuple(name for name, ids in rows["ids"].items() if isinstance(ids, np.ndarray))
    if not names or "single" in rows:
        return rows
    single = np.stack([rows["ids"][name] for name in names]).astype(np.uint64, copy=False)
    ids = {name: v for name, v in rows["ids"].items() if name not in names}
    return {**rows, "ids": ids, "single": single, "names": names}


def ids_of(rows: Rows, order: Sequence[str]) -> dict[str, FeatureIds]:
    """Every feature's ids of `rows` in `order` (a block's rows as views)."""
    columns = dict(rows["ids"])
    for row, name in enumerate(rows.get("names", ())):
        columns[name] = rows["single"][row]
    return {name: columns[name] for name in order}


def _with_block(out: Rows, rows: Rows, single: np.ndarray | None) -> Rows:
    if single is not None:
        out["single"], out["names"] = single, rows["names"]
    return out


def take_rows(rows: Rows, index: np.ndarray) -> Rows:
    out: Rows = {"label": rows["label"][index], "dense": rows["dense"][index], "ids": {}}
    _with_block(out, rows, np.take(rows["single"], index, axis=1) if "single" in rows else None)
    for name, ids in rows["ids"].items():
        out["ids"][name] = (
            ids[index]
            if isinstance(ids, np.ndarray)
            else ragged_take(ids.values, ids.offsets, index)
        )
    return out


def slice_rows(rows: Rows, start: int, stop: int) -> Rows:
    """Rows [start, stop) as views (no copy), where `_take` of a range would copy."""
    out: Rows = {"label": rows["label"][start:stop], "dense": rows["dense"][start:stop], "ids": {}}
    _with_block(out, rows, rows["single"][:, start:stop] if "single" in rows else None)
    for name, ids in rows["ids"].items():
        if isinstance(ids, np.ndarray):
            out["ids"][name] = ids[start:stop]
        else:
            offsets = ids.offsets[start : stop + 1]
            values = ids.values[offsets[0] : offsets[-1]]
            out["ids"][name] = RaggedIds(values=values, offsets=offsets - offsets[0])
    return out


def concat_rows(parts: Sequence[Rows]) -> Rows:
    if len(parts) == 1:
        return parts[0]
    out: Rows = {
        "label": np.concatenate([p["label"] for p in parts]),
        "dense": np.concatenate([p["dense"] for p in parts]),
        "ids": {},
    }
    if "single" in parts[0]:
        _with_block(out, parts[0], np.concatenate([p["single"] for p in parts], axis=1))
    for name, first in parts[0]["ids"].items():
        chunks = [p["ids"][name] for p in parts]
        out["ids"][name] = (
            np.concatenate(chunks) if isinstance(first, np.ndarray) else _ragged_concat(chunks)
        )
    return out
