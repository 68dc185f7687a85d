"""Learned id -> bucket mappings ("learning to collide"), and the hashing trick they replace.

A table too small for every id must let ids share rows. The hashing trick picks the
sharing at random (`bucket = hash(id) % buckets`), so a frequent id may share its row
with anything. A learned mapping chooses it from a previous run: per feature, the most
frequent ids keep rows of their own, and the long tail is grouped by where the previous
run's training put their embeddings (their two principal components), so that ids
sharing a row are ids the model already treated alike. Ids the previous run never saw
are hashed into the tail's buckets.

Per feature with n distinct ids in the previous run's training split and a budget of
`buckets = ceil(fraction * n)` rows:
  * the `ceil(exclusive_share * buckets)` most frequent ids get one bucket each;
  * the other ids are sorted into the remaining buckets on a grid over their
    embeddings' first two principal components, with cells of equal access mass
    (strips along the first component, then cells along the second within a strip).

A mapped id keeps its feature's prefix in the high bits (so fused tables stay
collision-free across features) and carries `bucket + 1` below it.

    hybridrec learn-hash --run runs/criteo --out runs/criteo_map --fraction 0.25
    hybridrec train ... --set embedding.id_map='"runs/criteo_map"'          # learned
    hybridrec train ... --set embedding.id_map='"runs/criteo_map"' \\
        --set embedding.id_map_kind='"hashing_trick"'                        # same budget
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
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


def _tail_buckets(vectors: np.ndarray, counts: np.ndarray, num_buckets: int) -> np.ndarray:
    """[n] buckets in [0, num_buckets) grouping rows of similar `vectors` ([n, dim]),
    cells of about equal total `counts`, on a grid over the first two principal components."""
    n = len(vectors)
    if n == 0:
        return np.zeros(0, np.int64)
    if num_buckets >= n:
        return np.arange(n, dtype=np.int64)
    centered = vectors - vectors.mean(axis=0)
    if np.any(centered):
        _, _, components = np.linalg.svd(centered, full_matrices=False)
        coordinates = centered @ components[:2].T
    else:
        coordinates = np.zeros((n, 2))
    if coordinates.shape[1] < 2:
        coordinates = np.pad(coordinates, ((0, 0), (0, 2 - coordinates.shape[1])))
    strips = max(1, min(num_buckets, math.ceil(math.sqrt(num_buckets))))  # PC1 first
    cells = np.full(strips, num_buckets // strips)
    cells[: num_buckets % strips] += 1
    first = np.cumsum(cells) - cells  # first bucket of each strip
    weights = counts.astype(np.float64)
    buckets = np.empty(n, np.int64)
    order = np.lexsort((np.arange(n), coordinates[:, 0]))
    mass = np.cumsum(weights[order]) - weights[order] / 2
    strip_of = np.minimum((mass / weights.sum() * strips).astype(np.int64), strips - 1)
    for strip in range(strips):
        members = order[strip_of == strip]
        if not len(members):
            continue
        inner = members[np.lexsort((members, coordinates[members, 1]))]
        inner_mass = np.cumsum(weights[inner]) - weights[inner] / 2
        cell = (inner_mass / weights[inner].sum() * cells[strip]).astype(np.int64)
        buckets[inner] = first[strip] + np.minimum(cell, cells[strip] - 1)
    return buckets


def build_feature_map(
    ids: np.ndarray,
    counts: np.ndarray,
    vectors: np.ndarray,
    *,
    fraction: float,
    exclusive_share: float = 0.5,
) -> FeatureMap:
    """One feature's learned mapping.

    Args:
        ids: [n] uint64 ids seen in the previous run's training split, most frequent first.
        counts: [n] their occurrence counts.
        vectors: [n, dim] float32 the previous run's embeddings of them (zeros where the run
            holds no row for an id).
        fraction: bucket budget as a fraction of n.
        exclusive_share: share of the budget given one frequent id per bucket.
    """
    n = len(ids)
    num_buckets = max(1, math.ceil(fraction * n))
    if num_buckets >= n:  # no collisions needed: every id its own bucket
        buckets = np.arange(n, dtype=np.int64)
        exclusive = n
        num_buckets = max(n, 1)
    else:
        exclusive = min(math.ceil(exclusive_share * num_buckets), num_buckets - 1)
        buckets = np.empty(n, np.int64)
        buckets[:exclusive] = np.arange(exclusive)
        buckets[exclusive:] = exclusive + _tail_buckets(
            vectors[exclusive:], counts[exclusive:], num_buckets - exclusive
        )
    order = np.argsort(ids, kind="stable")
    return FeatureMap(
        ids=ids[order].astype(np.uint64),
        buckets=buckets[order],
        num_buckets=num_buckets,
        exclusive=exclusive,
    )


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
