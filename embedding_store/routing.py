"""How ids are spread over shards: a hash independent of the in-shard slot hash.

Every client (in-process or remote) routes with these functions, so a row lives on
the same shard whoever asks, and a checkpoint written by N shards can be restored
onto M shards by routing each id again.
"""

from __future__ import annotations

import numpy as np
from hybridrec.embedding_store._hashing import SALT_ROUTE, mix64
from hybridrec.embedding_store.config import TableConfig


def route_hash(ids: np.ndarray) -> np.ndarray:
    """ids: [n] uint64 -> [n] uint64 routing hash."""
    return mix64(ids, SALT_ROUTE)


def shard_of(ids: np.ndarray, num_shards: int, offset: int = 0) -> np.ndarray:
    """ids: [n] uint64 -> [n] int64 shard index in [0, num_shards).

    `offset` shifts every id by that many shards: column slice i of a table uses
    offset i, so the slices of one row sit on different shards.
    """
    if num_shards == 1:
        return np.zeros(len(ids), np.int64)
    shards = route_hash(ids) % np.uint64(num_shards)
    if offset % num_shards:
        shards = (shards + np.uint64(offset % num_shards)) % np.uint64(num_shards)
    return shards.astype(np.int64)


def table_offset(table: TableConfig) -> int:
    """The routing offset of a table: its column slice's index (0 for whole rows)."""
    return table.first_column // table.dim


def partition(ids: np.ndarray, num_shards: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Groups ids by shard, keeping their relative order within each shard.

    Args:
        ids: [n] uint64.
        num_shards: number of shards.
        offset: routing offset (`table_offset`).

    Returns:
        order: [n] int64 permutation; `ids[order]` lists shard 0's ids, then shard 1's, ...
        bounds: [num_shards + 1] int64; shard s owns `order[bounds[s]:bounds[s + 1]]`.
    """
    shards = shard_of(ids, num_shards, offset)
    # Small integer keys: numpy's stable sort is a radix sort for 16-bit types.
    order = np.argsort(shards.astype(np.uint16) if num_shards <= 65536 else shards, kind="stable")
    bounds = np.zeros(num_shards + 1, np.int64)
    np.cumsum(np.bincount(shards, minlength=num_shards), out=bounds[1:])
    return order, bounds
