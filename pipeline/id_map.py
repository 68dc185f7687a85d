"""Id -> bucket maps: which row of a small table each id of a feature trains.

A table too small for every id must let ids share rows. The hashing trick picks the
sharing at random (`bucket = hash(id) % buckets`); a learned map (`hybridrec learn-hash`,
`training.learned.hash_map`) chooses it from a previous run. This module holds the map, its
on-disk format (a directory with `id_map.json` and `id_map.npz`) and how a batch's ids
are mapped: what training, the embedding servers and the served model all apply.

A mapped id keeps its feature's prefix in the high bits (so fused tables stay
collision-free across features) and carries `bucket + 1` below it. Ids the previous run
never saw are hashed into the tail's buckets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.common.files import atomic_write_text
from hybridrec.pipeline.hashing import splitmix64

MAP_FILE = "id_map.json"
ARRAYS_FILE = "id_map.npz"
FORMAT_VERSION = 1
KINDS = ("learned", "hashing_trick")


def find_sorted(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where `ids` stand in `sorted_ids` (ascending): (position [m] int64, found [m] bool);
    a position is only meaningful where found."""
    if not len(sorted_ids):
        return np.zeros(len(ids), np.int64), np.zeros(len(ids), bool)
    position = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return position, sorted_ids[position] == ids


@dataclasses.dataclass(frozen=True)
class FeatureMap:
    """One feature's mapping: `ids` (ascending) -> `buckets`, and its bucket budget."""

    ids: np.ndarray  # [n] uint64 ascending: the ids the previous run saw
    buckets: np.ndarray  # [n] int64: their buckets in [0, num_buckets)
    num_buckets: int
    exclusive: int  # buckets [0, exclusive) each hold one frequent id; the tail the rest

    def bucket_of(self, ids: np.ndarray, kind: str) -> np.ndarray:
        """[m] buckets of `ids` under the learned mapping or the hashing trick."""
        if kind == "hashing_trick":
            return (splitmix64(ids) % np.uint64(self.num_buckets)).astype(np.int64)
        position, known = find_sorted(self.ids, ids)
        tail = max(self.num_buckets - self.exclusive, 1)
        unseen = self.exclusive + (splitmix64(ids) % np.uint64(tail)).astype(np.int64)
        unseen = np.minimum(unseen, self.num_buckets - 1)
        return np.where(known, self.buckets[position] if len(self.ids) else 0, unseen)


class IdMap:
    """The id -> bucket mappings of a dataset's features (a directory `learn_id_map` wrote).

    Args:
        features: feature name -> its map.
        prefix_bits: high bits of an id that hold its feature's prefix (the dataset's
            hash scheme).
        kind: "learned" (the mapping) or "hashing_trick" (same budgets, random sharing).
    """

    def __init__(self, features: Mapping[str, FeatureMap], prefix_bits: int, kind: str):
        if kind not in KINDS:
            raise UserError(f"embedding.id_map_kind = {kind!r} is not one of {', '.join(KINDS)}")
        self.features = dict(features)
        self.prefix_bits = prefix_bits
        self.kind = kind

    def map_ids(self, feature: str, ids: np.ndarray) -> np.ndarray:
        """[m] uint64 ids of `feature` -> the ids of their buckets (prefix kept)."""
        feature_map = self.features.get(feature)
        if feature_map is None or not len(ids):
            return ids
        shift = np.uint64(64 - self.prefix_bits)
        prefix = (ids >> shift) << shift
        return prefix | (feature_map.bucket_of(ids, self.kind) + 1).astype(np.uint64)

    def apply(self, batch_ids: Mapping[str, Any]) -> dict[str, Any]:
        """A batch's {feature: ids or ragged ids} with every mapped feature's ids mapped."""
        out = {}
        for feature, ids in batch_ids.items():
            if hasattr(ids, "offsets"):
                out[feature] = type(ids)(
                    values=self.map_ids(feature, ids.values), offsets=ids.offsets
                )
            else:
                out[feature] = self.map_ids(feature, ids)
        return out

    def total_buckets(self) -> int:
        return sum(feature.num_buckets for feature in self.features.values())


def write_id_map(
    directory: str | Path,
    features: Mapping[str, FeatureMap],
    *,
    prefix_bits: int,
    source: Mapping[str, Any],
) -> Path:
    """Writes the mappings to `directory` (arrays, then the JSON that names their checksum)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for index, feature in enumerate(features.values()):
        arrays[f"ids_{index}"] = feature.ids
        arrays[f"buckets_{index}"] = feature.buckets
    temporary = directory / (ARRAYS_FILE + ".partial")
    with open(temporary, "wb") as handle:
        np.savez(handle, **arrays)
    temporary.replace(directory / ARRAYS_FILE)
    digest = hashlib.sha256((directory / ARRAYS_FILE).read_bytes()).hexdigest()
    description = {
        "format_version": FORMAT_VERSION,
        "prefix_bits": prefix_bits,
        "sha256": digest,
        "source": dict(source),
        "features": [
            {
                "name": name,
                "ids": len(feature.ids),
                "buckets": feature.num_buckets,
                "exclusive": feature.exclusive,
            }
            for name, feature in features.items()
        ],
    }
    atomic_write_text(directory / MAP_FILE, json.dumps(description, indent=1) + "\n")
    return directory


def read_id_map(directory: str | Path, kind: str = "learned") -> IdMap:
    """The IdMap in `directory` (written by `write_id_map`), checked against its checksum."""
    directory = Path(directory)
    description_path = directory / MAP_FILE
    if not description_path.exists():
        raise UserError(
            f"embedding.id_map: {directory} holds no {MAP_FILE}; write one with "
            f"`hybridrec learn-hash --run RUN_DIR --out {directory}`"
        )
    try:
        description = json.loads(description_path.read_text())
        data = (directory / ARRAYS_FILE).read_bytes()
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{description_path}: unreadable id map ({error})") from None
    if description.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{description_path}: unknown format_version {description.get('format_version')}"
        )
    if hashlib.sha256(data).hexdigest() != description["sha256"]:
        raise UserError(f"{directory / ARRAYS_FILE}: checksum mismatch (corrupt or replaced)")
    with np.load(directory / ARRAYS_FILE) as arrays:
        features = {
            entry["name"]: FeatureMap(
                ids=arrays[f"ids_{index}"],
                buckets=arrays[f"buckets_{index}"],
                num_buckets=int(entry["buckets"]),
                exclusive=int(entry["exclusive"]),
            )
            for index, entry in enumerate(description["features"])
        }
    return IdMap(features, int(description["prefix_bits"]), kind)
