"""How snapshots are stored: tensorstore zarr3 parts per shard, committed by a manifest.

Layout under a checkpoint URL (any tensorstore kvstore: local path, file://, memory://,
gs://, s3://):

    manifest-000000000042.json                 written last: the commit point
    step-000000000042/<table>/shard-00001-of-00004/{ids,values,state,last_step,
        deleted,counter_ids,counter_counts}/   zarr3 arrays of one shard's part

A part's rows and optimizer state are stored at the precision the snapshot was taken
with (`precision`: fp32, fp16, or row-wise quantized int8 / int4, see `_quantize`);
below fp32, `values` and `state` are replaced by `values`, `values_scale_bias` and one
array (plus scale and bias) per optimizer-state field. Ids are always exact. The part's
manifest entry records its precision, so a restore decodes it whatever precision the
reader would write, and a CRC32 per stored array, so a corrupt array is named.

A manifest lists, per table, the chain of snapshot groups needed to rebuild the
table: the last full snapshot followed by the incremental ones (rows changed and ids
deleted since the previous group). Parts are keyed by id, so any number of shards
can restore them by routing each id again. A crash before the manifest is written
leaves the previous manifest, and every part it names, untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts
from hybridrec.common import config as _config
from hybridrec.embedding_store import _quantize
from hybridrec.embedding_store._kvstore import context, kvstore_spec
from hybridrec.embedding_store.config import TableConfig
from hybridrec.embedding_store.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
)

FORMAT_VERSION = 1
MAX_CHAIN = 16  # snapshot groups in one manifest chain before a full snapshot is forced
_MANIFEST_PREFIX = "manifest-"
_ROW_ARRAYS = ("ids", "last_step", "deleted", "counter_ids", "counter_counts")
PRECISIONS = _quantize.PRECISIONS


@dataclasses.dataclass
class RowBlock:
    """Rows of one table on one shard, in id order of capture: what a part holds."""

    ids: np.ndarray  # [n] uint64
    values: np.ndarray  # [n, dim] float32
    state: np.ndarray  # [n, state_width] float32
    last_step: np.ndarray  # [n] int64
    deleted: np.ndarray  # [m] uint64 ids removed since the previous snapshot
    counter_ids: np.ndarray  # [c] uint64 ids seen but not admitted yet
    counter_counts: np.ndarray  # [c] int64 their sightings


def _open_kvstore(url: str) -> ts.KvStore:
    try:
        return ts.KvStore.open(kvstore_spec(url), context=context()).result()
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


def _snapshot_prefix(step: int) -> str:
    return f"step-{step:012d}/"


def part_path(step: int, table: str, shard_index: int, num_shards: int) -> str:
    return f"{_snapshot_prefix(step)}{table}/shard-{shard_index:05d}-of-{num_shards:05d}"


def snapshot_groups(url: str) -> list[int]:
    """Steps with snapshot parts at `url`, committed or not, ascending."""
    if "://" not in url and not os.path.exists(url):
        return []
    steps = set()
    for key in _open_kvstore(url).list().result():
        head = key.decode().partition("/")[0]
        if head.startswith("step-") and head[5:].isdigit():
            steps.add(int(head[5:]))
    return sorted(steps)


def _delete(url: str, manifests: Sequence[int], groups: Sequence[int]) -> None:
    """Removes manifests first (what makes a snapshot visible), then the parts of groups."""
    store = _open_kvstore(url)
    for step in manifests:
        store.delete_range(
            ts.KvStore.KeyRange(manifest_key(step), manifest_key(step) + "\0")
        ).result()
    for step in groups:
        prefix = _snapshot_prefix(step)
        store.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()


def discard_after(url: str, step: int) -> list[int]:
    """Removes every snapshot after `step`, committed or not; returns the steps removed.

    For a run restarting from `step`: snapshots a killed run wrote later would otherwise
    be taken for its own by the next checkpoint of the same step number. Every manifest
    key after `step` goes, a manifest that was never committed too: a writer killed
    inside a write leaves the key's lock file (`KEY.__lock`) with what it had written,
    and tensorstore's file kvstore (0.1.86) writes the next value of that key over it
    without truncating it, so a shorter manifest would end in the killed one's bytes.
    """
    committed = [s for s in committed_steps(url) if s > step]
    groups = [s for s in snapshot_groups(url) if s > step]
    _delete(url, [], groups)
    # manifest keys sort by step (zero-padded); "." sorts after "-": every later manifest
    after = ts.KvStore.KeyRange(manifest_key(step + 1), _MANIFEST_PREFIX[:-1] + ".")
    _open_kvstore(url).delete_range(after).result()
    return sorted(set(committed) | set(groups))


def prune(url: str, keep: int, protect: tuple[int, ...] = ()) -> list[int]:
    """Keeps the newest `keep` committed snapshots (0: all), those in `protect`, and the
    groups they read.

    Incremental snapshots are rebuilt from a chain of groups (a full one at least every
    `MAX_CHAIN`), so what stays is those chains; everything older goes, on any kvstore
    the checkpoints are written to. Uncommitted groups newer than the newest committed
    snapshot (one being written) are left alone. Returns the committed steps removed.
    """
    steps = committed_steps(url)
    if keep < 1 or len(steps) <= keep:
        return []
    kept = sorted(set(steps[-keep:]) | (set(protect) & set(steps)))
    needed = set()
    for step in kept:
        for table in read_manifest(url, step)["tables"].values():
            needed.update(group["step"] for group in table["chain"])
    removed = [step for step in steps if step not in kept]
    groups = [s for s in snapshot_groups(url) if s < kept[-1] and s not in needed]
    _delete(url, removed, groups)
    return removed


def _checksum(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def check_precision(precision: object) -> str:
    """`precision` if it names a checkpoint precision; CheckpointError otherwise."""
    if precision not in PRECISIONS:
        raise CheckpointError(
            f"checkpoint precision {precision!r} is not one of {', '.join(PRECISIONS)}"
        )
    return str(precision)


def write_part(
    url: str, path: str, block: RowBlock, *, optimizer: str = "sgd", precision: str = "fp32"
) -> dict[str, Any]:
    """Writes one shard's part of one table; returns its manifest entry.

    Args:
        url: the checkpoint URL.
        path: the part's path under `url` (`part_path`).
        block: the rows (float32 values and state).
        optimizer: the table's optimizer name (how its state columns are stored).
        precision: fp32 | fp16 | int8 | int4, for values and optimizer state.
    """
    check_precision(precision)
    arrays = {name: getattr(block, name) for name in _ROW_ARRAYS}
    if len(block.last_step) and block.last_step.max() < 2**31 and block.last_step.min() >= 0:
        arrays["last_step"] = block.last_step.astype(np.int32)
    arrays.update(_quantize.encode_block(block.values, block.state, optimizer, precision))
    opened = []
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        # zarr chunk extents must be >= 1 even where the array's is 0 (SGD keeps no state).
        # Equal chunks of at most 2^18 rows: a last chunk is stored whole, so it must not
        # be mostly padding.
        chunks = max(1, -(-len(array) // (1 << 18)))
        rows = max(1, -(-len(array) // chunks))
        chunk = [rows, *(max(1, d) for d in array.shape[1:])]
        spec = {
            "driver": "zarr3",
            "kvstore": kvstore_spec(url, path, name),
            "metadata": {
                "shape": list(array.shape),
                "data_type": array.dtype.name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            },
        }
        opened.append((ts.open(spec, create=True, delete_existing=True, context=context()), array))
    writes = [store.result().write(array) for store, array in opened]
    for write in writes:
        write.result()
    return {
        "path": path,
        "precision": precision,
        "optimizer": optimizer,
        "dim": int(block.values.shape[1]),
        "rows": len(block.ids),
        "deleted": len(block.deleted),
        "counters": len(block.counter_ids),
        "bytes": int(sum(a.nbytes for a in arrays.values())),
        "checksums": {name: _checksum(a) for name, a in arrays.items()},
        "shapes": {name: list(a.shape) for name, a in arrays.items()},
    }


def read_part(url: str, entry: dict[str, Any]) -> RowBlock:
    """Reads and verifies one part named by a manifest entry; rows decoded to float32.

    The entry's own precision decides the decoding (entries without one are fp32).
    """
    path = entry["path"]
    arrays = {}
    for name in entry["shapes"]:
        where = f"{url.rstrip('/')}/{path}/{name}"
        try:
            store = ts.open(
                {"driver": "zarr3", "kvstore": kvstore_spec(url, path, name)},
                open=True,
                context=context(),
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
    precision = entry.get("precision", "fp32")
    if precision not in PRECISIONS or not set(_ROW_ARRAYS) <= set(arrays):
        raise CheckpointCorruptedError(
            f"{url.rstrip('/')}/{path}: not a part this version reads "
            f"(precision {precision!r}, arrays {sorted(arrays)})"
        )
    dim = entry.get("dim", arrays["values"].shape[1] if "values" in arrays else 0)
    try:
        values, state = _quantize.decode_block(
            arrays, entry.get("optimizer", "sgd"), precision, dim
        )
    except (KeyError, ValueError) as error:
        raise CheckpointCorruptedError(
            f"{url.rstrip('/')}/{path}: {precision} arrays incomplete ({error})"
        ) from None
    rows = {name: arrays[name] for name in _ROW_ARRAYS}
    rows["last_step"] = rows["last_step"].astype(np.int64)
    return RowBlock(values=values, state=state, **rows)


def check_compatible(url: str, manifest: Mapping[str, Any], tables: Sequence[TableConfig]) -> None:
    """Raises IncompatibleCheckpointError unless `tables` can load the rows of `manifest`.

    Hyperparameters (learning rate, admission, eviction, capacity) may differ; what the
    stored rows depend on (the table set, dim, optimizer) must match.
    """
    stored = manifest["tables"]
    names = {t.name for t in tables}
    if names != set(stored):
        split = any(".col" in name for name in set(stored) ^ names)
        raise IncompatibleCheckpointError(
            f"{url}: checkpoint has tables {sorted(stored)}, the store was given {sorted(names)}"
            + (
                "; column slices (<table>.col<i>) need the column_shards they were written with"
                if split
                else ""
            )
        )
    for table in tables:
        saved = stored[table.name]["config"]
        if saved["dim"] != table.dim:
            raise IncompatibleCheckpointError(
                f"{url}: table {table.name!r} was saved with dim {saved['dim']}, "
                f"the config says dim {table.dim}"
            )
        if saved["optimizer"]["name"] != table.optimizer.name:
            raise IncompatibleCheckpointError(
                f"{url}: table {table.name!r} was saved with optimizer "
                f"{saved['optimizer']['name']!r}, the config says {table.optimizer.name!r} "
                "(optimizer state is not convertible)"
            )


def snapshot_base(
    url: str, step: int, tables: Sequence[TableConfig], extends: int | None
) -> dict[str, Any] | None:
    """The committed manifest a snapshot of `step` can extend incrementally, or None.

    Args:
        url: the checkpoint URL.
        step: the step about to be written; must be after the latest committed one.
        tables: the store's tables.
        extends: the step at `url` whose rows the store holds plus its changes since
            (the checkpoint it last wrote or was restored from), or None.

    Returns:
        The latest manifest when it is `extends`, names the same tables and none of its
        chains is `MAX_CHAIN` long; None when the snapshot must be full.
    """
    latest = latest_checkpoint_step(url)
    if latest is not None and step <= latest:
        raise CheckpointError(f"{url}: step {step} is not after the latest committed step {latest}")
    if latest is None or latest != extends:
        return None
    previous = read_manifest(url, latest)
    names = {table.name for table in tables}
    if set(previous["tables"]) != names:
        return None
    if any(len(previous["tables"][name]["chain"]) >= MAX_CHAIN for name in names):
        return None
    return previous


def new_manifest(
    step: int,
    tables: Sequence[TableConfig],
    parts: Sequence[Mapping[str, Any]],
    base: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The manifest of snapshot `step`: each table's chain, extended when `base` is given.

    Args:
        step: the snapshot's step.
        tables: the store's tables.
        parts: per shard, in shard order, {table: part entry} as `write_part` returned.
        base: the manifest this snapshot extends (incremental), or None (full).
    """
    chains = {}
    for table in tables:
        group = {
            "step": step,
            "full": base is None,
            "parts": [shard_parts[table.name] for shard_parts in parts],
        }
        earlier = base["tables"][table.name]["chain"] if base is not None else []
        chains[table.name] = {"config": _config.to_dict(table), "chain": [*earlier, group]}
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "num_shards": len(parts),
        "tables": chains,
    }


def read_table_rows(url: str, step: int, table: str) -> tuple[np.ndarray, np.ndarray]:
    """Every row of `table` in the embedding checkpoint of `step` under `url`.

    Replays the manifest's chain (the last full snapshot, then each incremental one:
    deletions, then upserts) the way a restore does.

    A table stored as column slices (`column_shards`, `<table>.col<i>`) is read slice by
    slice and its columns joined; an id a slice does not hold (slices admit and evict on
    their own shards) reads zeros in that slice's columns.

    Returns:
        ids [rows] uint64 sorted, values [rows, dim] float32 in the same order.
    """
    manifest = read_manifest(url, step)
    if table not in manifest["tables"] and f"{table}.col0" in manifest["tables"]:
        pieces = []
        while f"{table}.col{len(pieces)}" in manifest["tables"]:
            pieces.append(read_table_rows(url, step, f"{table}.col{len(pieces)}"))
        ids = np.unique(np.concatenate([piece_ids for piece_ids, _ in pieces]))
        values = np.zeros((len(ids), sum(v.shape[1] for _, v in pieces)), np.float32)
        column = 0
        for piece_ids, piece_values in pieces:
            width = piece_values.shape[1]
            values[np.searchsorted(ids, piece_ids), column : column + width] = piece_values
            column += width
        return ids, values
    if table not in manifest["tables"]:
        raise CheckpointNotFoundError(
            f"{url}: the checkpoint of step {step} has no table {table!r}"
        )
    ids = np.zeros(0, np.uint64)
    values = None
    for group in manifest["tables"][table]["chain"]:
        blocks = [read_part(url, entry) for entry in group["parts"]]
        new_ids = np.concatenate([b.ids for b in blocks]).astype(np.uint64)
        new_values = np.concatenate([b.values for b in blocks]).astype(np.float32)
        deleted = np.concatenate([b.deleted for b in blocks]).astype(np.uint64)
        if values is None:
            values = np.zeros((0, new_values.shape[1]), np.float32)
        keep = ~np.isin(ids, np.concatenate([deleted, new_ids]))
        ids = np.concatenate([ids[keep], new_ids])
        values = np.concatenate([values[keep], new_values])
    order = np.argsort(ids, kind="stable")
    return ids[order], (values if values is not None else np.zeros((0, 0), np.float32))[order]
