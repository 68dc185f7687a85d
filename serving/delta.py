"""Delta exports: a version holding only the embedding rows changed since its base version.

A delta version has the same layout as a full one (`serving._format`): the whole dense
tower, features.json, and per table `ids.npy` / `values.npy` (/ `scale_bias.npy`) of
the rows changed since the base, plus `deleted.npy`, the ids removed since the base
(evicted rows). Its manifest names `base_version` (in the same export directory) and
`chain_length` (versions down to the last full one, itself included).

The changed rows come from the run's incremental embedding checkpoints: the groups of
the checkpoint chain written after the base's step (`changed_rows`). When the chain
was restarted by a full snapshot after the base's step, no delta can be computed and
the export is full.

Serving a delta reads its chain newest first (`LayeredTable`): an id takes its row from
the newest version that changed it; an id deleted in a newer version than the one
holding its row is unseen.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hybridrec.embedding_store import checkpoint as store_checkpoint
from hybridrec.serving import _format


def changed_rows(
    url: str, base_step: int, step: int, table: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows of `table` changed between the embedding checkpoints `base_step` and `step`.

    Returns:
        (ids [m] uint64 sorted, values [m, dim] float32, deleted [k] uint64 sorted: ids
        removed since `base_step` and not written again), or None when the chain of
        `step` does not extend `base_step` incrementally.
    """
    chain = store_checkpoint.read_manifest(url, step)["tables"][table]["chain"]
    steps = [group["step"] for group in chain]
    if base_step not in steps:  # a full snapshot restarted the chain after the base
        return None
    ids = np.zeros(0, np.uint64)
    values = None
    deleted = np.zeros(0, np.uint64)
    for group in chain[steps.index(base_step) + 1 :]:
        blocks = [store_checkpoint.read_part(url, entry) for entry in group["parts"]]
        new_ids = np.concatenate([b.ids for b in blocks]).astype(np.uint64)
        new_values = np.concatenate([b.values for b in blocks]).astype(np.float32)
        removed = np.concatenate([b.deleted for b in blocks]).astype(np.uint64)
        if values is None:
            values = np.zeros((0, new_values.shape[1]), np.float32)
        keep = ~np.isin(ids, np.concatenate([removed, new_ids]))
        ids, values = np.concatenate([ids[keep], new_ids]), np.concatenate([values[keep], new_values])  # fmt: skip
        deleted = np.union1d(deleted[~np.isin(deleted, new_ids)], removed[~np.isin(removed, new_ids)])  # fmt: skip
    order = np.argsort(ids, kind="stable")
    values = values if values is not None else np.zeros((0, 0), np.float32)
    return ids[order], values[order], np.sort(deleted).astype(np.uint64)


def version_chain(version_dir: Path) -> list[Path]:
    """The version directories a version is read from, newest first (itself first)."""
    chain = [version_dir]
    while True:
        manifest = json.loads((chain[-1] / _format.MANIFEST_FILE).read_text())
        base = manifest.get("base_version")
        if base is None:
            return chain
        base_dir = version_dir.parent / str(base)
        if not (base_dir / _format.MANIFEST_FILE).exists():
            raise _format.ExportError(
                f"{chain[-1]}: a delta of version {base}, which is missing from {version_dir.parent}"
            )
        chain.append(base_dir)


class LayeredTable:
    """One table of a delta chain, read newest version first.

    Args:
        layers: the table in each version of the chain (`ServedTable`s), newest first.
        deleted: per layer, ids [k] uint64 sorted removed in it (the full base: empty).
    """

    def __init__(self, layers: list, deleted: list[np.ndarray]):
        self.layers = layers
        self.deleted = deleted
        self.name = layers[0].name
        self.dim = layers[-1].dim
        self.offsets = np.cumsum([0] + [len(layer.ids) for layer in layers])

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids [n] uint64 -> (row index [n] int64 over all layers, found [n] bool)."""
        index = np.zeros(len(ids), np.int64)
        found = np.zeros(len(ids), bool)
        pending = np.arange(len(ids))
        for layer, deleted, offset in zip(self.layers, self.deleted, self.offsets, strict=False):
            if not len(pending):
                break
            rows, hit = layer.find(ids[pending])
            index[pending[hit]] = rows[hit] + offset
            found[pending[hit]] = True
            resolved = hit
            if len(deleted):
                resolved = hit | np.isin(ids[pending], deleted)
            pending = pending[~resolved]
        return index, found

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Row index [m] (from `find`) -> values [m, dim] float32."""
        out = np.empty((len(index), self.dim), np.float32)
        for layer, start, stop in zip(
            self.layers, self.offsets[:-1], self.offsets[1:], strict=True
        ):
            mask = (index >= start) & (index < stop)
            if mask.any():
                out[mask] = layer.rows(index[mask] - start)
        return out


def delta_base(export_dir: str | Path, full_every: int) -> int | None:
    """The version the next export of `export_dir` is a delta of: the newest, unless its
    chain already holds `full_every` versions (then the next one is full; 1: always full)."""
    export_dir = Path(export_dir)
    found = _format.versions(export_dir)
    if not found or full_every <= 1:
        return None
    manifest = json.loads((export_dir / str(found[-1]) / _format.MANIFEST_FILE).read_text())
    return found[-1] if manifest.get("chain_length", 1) < full_every else None


def prune_versions(export_dir: str | Path, keep: int) -> list[int]:
    """Removes versions older than the newest `keep` (0: none), except those the newest
    reads through; returns the versions removed."""
    import shutil

    export_dir = Path(export_dir)
    found = _format.versions(export_dir)
    if not found or keep < 1:
        return []
    needed = {int(path.name) for path in version_chain(export_dir / str(found[-1]))}
    removed = [version for version in found[:-keep] if version not in needed]
    for version in removed:
        shutil.rmtree(export_dir / str(version), ignore_errors=True)
    return removed
