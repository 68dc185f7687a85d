"""How snapshots are stored: tensorstore zarr3 parts per shard, committed by a manifest.

Layout under a checkpoint URL (any tensorstore kvstore: local path, file://, memory://,
gs://, s3://):

    manifest-000000000042.json                 written last: the commit point
    step-000000000042/<table>/shard-00001-of-00004/{ids,values,state,last_step,
        deleted,counter_ids,counter_counts}/   zarr3 arrays of one shard's part

A manifest lists, per table, the chain of snapshot groups needed to rebuild the
table: the last full snapshot followed by the incremental ones (rows changed and ids
deleted since the previous group). Parts are keyed by id, so any number of shards
can restore them by routing each id again. A crash before the manifest is written
leaves the previous manifest, and every part it names, untouched.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import numpy as np
import tensorstore as ts

from embedding_store._table import RowBlock
from embedding_store.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
)

FORMAT_VERSION = 1
_MANIFEST_PREFIX = "manifest-"
_ARRAYS = ("ids", "values", "state", "last_step", "deleted", "counter_ids", "counter_counts")

_CONTEXT = ts.Context()  # shared so that memory:// stores are visible to every reader


def context() -> ts.Context:
    """The tensorstore context all store I/O uses (one memory:// namespace per process)."""
    return _CONTEXT


def kvstore_spec(location: str, *parts: str) -> dict[str, Any]:
    """A kvstore JSON spec for a URL or local path, with `parts` appended as a directory."""
    if "://" not in location:
        location = "file://" + os.path.abspath(location)
    try:
        spec = ts.KvStore.Spec(location if location.endswith("/") else location + "/").to_json()
    except ValueError as error:
        raise CheckpointError(f"{location}: not a tensorstore kvstore URL ({error})") from None
    suffix = "/".join(p.strip("/") for p in parts if p)
    base = spec.get("path", "")
    spec["path"] = (base.rstrip("/") + "/" if base else "") + (suffix + "/" if suffix else "")
    return spec


def _open_kvstore(url: str) -> ts.KvStore:
    try:
        return ts.KvStore.open(kvstore_spec(url), context=_CONTEXT).result()
    except ValueError as error:
        raise CheckpointError(f"{url}: cannot open ({error})") from None


def manifest_key(step: int) -> str:
    return f"{_MANIFEST_PREFIX}{step:012d}.json"


def committed_steps(url: str) -> list[int]:
    """Steps with a committed manifest at `url`, ascending (empty if nothing is there)."""
    if "://" not in url and not os.path.exists(url):
        return []
    try:
        keys = _open_kvstore(url).list().result()
    except ValueError:
        return []
    steps = []
    for key in keys:
        name = key.decode()
        if name.startswith(_MANIFEST_PREFIX) and name.endswith(".json") and "/" not in name:
            digits = name[len(_MANIFEST_PREFIX) : -len(".json")]
            if digits.isdigit():
                steps.append(int(digits))
    return sorted(steps)


def latest_checkpoint_step(url: str) -> int | None:
    """The newest committed step at `url`, or None if there is no committed checkpoint."""
    steps = committed_steps(url)
    return steps[-1] if steps else None


def read_manifest(url: str, step: int | None = None) -> dict[str, Any]:
    """Reads the manifest of `step` (default: the latest). Raises CheckpointNotFoundError."""
    steps = committed_steps(url)
    if not steps:
        raise CheckpointNotFoundError(f"{url}: no committed embedding checkpoint there")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointNotFoundError(
            f"{url}: no committed checkpoint for step {step} (committed: {steps})"
        )
    data = _open_kvstore(url).read(manifest_key(step)).result().value
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointCorruptedError(
            f"{url}/{manifest_key(step)}: unreadable ({error})"
        ) from None
    if manifest.get("format_version") != FORMAT_VERSION or "tables" not in manifest:
        raise CheckpointCorruptedError(
            f"{url}/{manifest_key(step)}: not a format-{FORMAT_VERSION} embedding manifest"
        )
    return manifest


def write_manifest(url: str, step: int, manifest: dict[str, Any]) -> None:
    """The commit point: a single-key write (atomic on every kvstore tensorstore supports)."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _open_kvstore(url).write(manifest_key(step), data).result()


def part_path(step: int, table: str, shard_index: int, num_shards: int) -> str:
    return f"step-{step:012d}/{table}/shard-{shard_index:05d}-of-{num_shards:05d}"


def _checksum(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def write_part(url: str, path: str, block: RowBlock) -> dict[str, Any]:
    """Writes one shard's part of one table; returns its manifest entry."""
    arrays = {name: getattr(block, name) for name in _ARRAYS}
    opened = []
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        # zarr chunk extents must be >= 1 even where the array's is 0 (SGD keeps no state).
        chunk = [max(1, min(len(array), 1 << 18)), *(max(1, d) for d in array.shape[1:])]
        spec = {
            "driver": "zarr3",
            "kvstore": kvstore_spec(url, path, name),
            "metadata": {
                "shape": list(array.shape),
                "data_type": array.dtype.name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            },
        }
        opened.append((ts.open(spec, create=True, delete_existing=True, context=_CONTEXT), array))
    writes = [store.result().write(array) for store, array in opened]
    for write in writes:
        write.result()
    return {
        "path": path,
        "rows": len(block.ids),
        "deleted": len(block.deleted),
        "counters": len(block.counter_ids),
        "bytes": int(sum(a.nbytes for a in arrays.values())),
        "checksums": {name: _checksum(a) for name, a in arrays.items()},
        "shapes": {name: list(a.shape) for name, a in arrays.items()},
    }


def read_part(url: str, entry: dict[str, Any]) -> RowBlock:
    """Reads and verifies one part named by a manifest entry."""
    path = entry["path"]
    arrays = {}
    for name in _ARRAYS:
        where = f"{url.rstrip('/')}/{path}/{name}"
        try:
            store = ts.open(
                {"driver": "zarr3", "kvstore": kvstore_spec(url, path, name)},
                open=True,
                context=_CONTEXT,
            ).result()
            array = store.read().result()
        except ValueError as error:
            raise CheckpointCorruptedError(f"{where}: missing or unreadable ({error})") from None
        if list(array.shape) != entry["shapes"][name]:
            raise CheckpointCorruptedError(
                f"{where}: shape {list(array.shape)}, manifest says {entry['shapes'][name]}"
            )
        if _checksum(array) != entry["checksums"][name]:
            raise CheckpointCorruptedError(f"{where}: checksum mismatch (corrupted data)")
        arrays[name] = array
    return RowBlock(**arrays)
