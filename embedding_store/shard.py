"""The shard backend protocol and the in-process shard.

A shard hosts the rows routed to it (`routing.shard_of(id, num_shards) == index`)
of every table of the store. Every call is batched over tables, so a client sends
one request per shard per step. A remote shard implements the same protocol by
forwarding these calls to a `LocalShard` in a server process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from hybridrec.embedding_store import checkpoint as _checkpoint
from hybridrec.embedding_store._kvstore import context
from hybridrec.embedding_store._table import ShardTable
from hybridrec.embedding_store.config import TableConfig
from hybridrec.embedding_store.errors import UnknownTableError
from hybridrec.embedding_store.routing import shard_of, table_offset


@runtime_checkable
class Shard(Protocol):
    """What the store needs from a shard, local or remote.

    Ids are [n] uint64 arrays; rows and gradients are [n, dim] float32 arrays.
    """

    def lookup(
        self, requests: Mapping[str, np.ndarray], *, train: bool = True
    ) -> dict[str, np.ndarray]:
        """{table: ids [n]} -> {table: rows [n, dim] float32}.

        With `train`, unseen ids count towards admission and admitted ids get rows;
        otherwise nothing changes. Unadmitted ids read as zeros.
        """
        ...

    def apply_gradients(self, updates: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """{table: (ids [n], grads [n, dim])}: duplicates summed, non-finite rows skipped."""
        ...

    def write_rows(self, updates: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """{table: (unique ids [n], values [n, dim], optimizer state [n, width])}: sets the
        rows, creating those not held."""
        ...

    def take_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values [n, dim], state [n, width]) of unique ids [n] of `table`, creating the
        rows not held."""
        ...

    def read_rows(
        self, table: str, prefixes: Sequence[int] | None = None, prefix_bits: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, values, state) of the held rows of `table`: every row, or with `prefixes`
        those whose id's top `prefix_bits` bits are one of them (one feature's rows)."""
        ...

    def set_step(self, step: int) -> None:
        """The training step: last-access time for LRU/TTL eviction."""
        ...

    def stats(self) -> dict[str, dict[str, int]]:
        """{table: counters} (rows, hits, misses, admitted, evictions, bytes, ...)."""
        ...

    def write_checkpoint(
        self,
        url: str,
        step: int,
        shard_index: int,
        *,
        num_shards: int,
        full: bool,
        precision: str = "fp32",
    ) -> dict[str, dict[str, Any]]:
        """Writes this shard's part of snapshot `step` under `url`: {table: manifest entry}.

        `full=False` writes only rows changed (and ids deleted) since the last
        committed snapshot; `precision` (fp32 | fp16 | int8 | int4) is how rows and
        optimizer state are stored. Nothing counts as saved until `commit_checkpoint(step)`.
        """
        ...

    def commit_checkpoint(self, step: int) -> None:
        """Called after the manifest of `step` is committed; later deltas start from it."""
        ...

    def load_checkpoint(
        self, url: str, manifest: Mapping[str, Any], shard_index: int, num_shards: int
    ) -> dict[str, int]:
        """Loads the rows of `manifest` that route to `shard_index` of `num_shards`: {table: rows}."""
        ...

    def close(self) -> None:
        """Releases the shard's resources; the shard is not used afterwards."""
        ...


class LocalShard:
    """An in-process shard: one `ShardTable` per table, each with its own lock.

    Args:
        tables: configs of every table of the store.
        shard_index: which shard this is; it hosts the ids that route to it.
        num_shards: how many shards the store has.
    """

    def __init__(self, tables: Sequence[TableConfig], *, shard_index: int = 0, num_shards: int = 1):
        self.shard_index = shard_index
        self.num_shards = num_shards
        self._tables = {
            config.name: ShardTable(
                config,
                shard_index=shard_index,
                num_shards=num_shards,
                context=context(),
            )
            for config in tables
        }
        self._captures: dict[int, dict[str, int]] = {}

    def _table(self, name: str) -> ShardTable:
        try:
            return self._tables[name]
        except KeyError:
            raise UnknownTableError(
                f"unknown embedding table {name!r}; tables: {', '.join(self._tables)}"
            ) from None

    def lookup(
        self, requests: Mapping[str, np.ndarray], *, train: bool = True
    ) -> dict[str, np.ndarray]:
        """See `Shard.lookup`: {table: ids [n] uint64} -> {table: rows [n, dim] float32}.

        Raises:
            UnknownTableError: a requested table is not hosted by this shard.
        """
        return {name: self._table(name).lookup(ids, train=train) for name, ids in requests.items()}

    def apply_gradients(self, updates: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """See `Shard.apply_gradients`: {table: (ids [n] uint64, grads [n, dim] float32)}.

        Raises:
            UnknownTableError: an updated table is not hosted by this shard.
        """
        for name, (ids, grads) in updates.items():
            self._table(name).apply_gradients(ids, grads)

    def write_rows(self, updates: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """See `Shard.write_rows`."""
        for name, (ids, values, state) in updates.items():
            self._table(name).write_rows(ids, values, state)

    def take_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See `Shard.take_rows`."""
        return self._table(table).take_rows(ids)

    def read_rows(
        self, table: str, prefixes: Sequence[int] | None = None, prefix_bits: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """See `Shard.read_rows`."""
        return self._table(table).read_rows(prefixes, prefix_bits)

    def set_step(self, step: int) -> None:
        """See `Shard.set_step`; sets the step of every table (may run a TTL sweep)."""
        for table in self._tables.values():
            table.set_step(step)

    def stats(self) -> dict[str, dict[str, int]]:
        """See `Shard.stats`: {table: counters} for every table of this shard."""
        return {name: table.stats() for name, table in self._tables.items()}

    def write_checkpoint(
        self,
        url: str,
        step: int,
        shard_index: int,
        *,
        num_shards: int,
        full: bool,
        precision: str = "fp32",
    ) -> dict[str, dict[str, Any]]:
        """See `Shard.write_checkpoint`: writes one part per table, returns their entries.

        The snapshot marks are kept until `commit_checkpoint(step)`.
        """
        entries, captures = {}, {}
        for name, table in self._tables.items():
            block, captures[name] = table.snapshot(full=full)
            path = _checkpoint.part_path(step, name, shard_index, num_shards)
            entries[name] = _checkpoint.write_part(
                url, path, block, optimizer=table.config.optimizer.name, precision=precision
            )
        self._captures[step] = captures
        return entries

    def commit_checkpoint(self, step: int) -> None:
        """See `Shard.commit_checkpoint`; also drops marks of older uncommitted writes."""
        for name, capture in self._captures.pop(step, {}).items():
            self._tables[name].commit_snapshot(capture)
        self._captures.clear()  # older uncommitted attempts are superseded

    def load_checkpoint(
        self, url: str, manifest: Mapping[str, Any], shard_index: int, num_shards: int
    ) -> dict[str, int]:
        """See `Shard.load_checkpoint`: applies each table's chain of parts in order.

        Keeps only rows, deletions and admission counters (taken from the newest
        snapshot of the chain) that route to `shard_index` of `num_shards`.

        Returns:
            {table: rows} the table holds after loading.
        """
        loaded = {}
        for name, table in self._tables.items():
            offset = table_offset(table.config)
            groups = manifest["tables"][name]["chain"]
            for position, group in enumerate(groups):
                counters = []
                for entry in group["parts"]:
                    block = _checkpoint.read_part(url, entry)
                    mine = shard_of(block.ids, num_shards, offset) == shard_index
                    if len(block.deleted):
                        block.deleted = block.deleted[
                            shard_of(block.deleted, num_shards, offset) == shard_index
                        ]
                    table.load(block, keep=mine)
                    if position == len(groups) - 1:
                        keep = shard_of(block.counter_ids, num_shards, offset) == shard_index
                        counters.append((block.counter_ids[keep], block.counter_counts[keep]))
                if position == len(groups) - 1 and counters:
                    table.load_counters(
                        np.concatenate([c[0] for c in counters]),
                        np.concatenate([c[1] for c in counters]),
                    )
            loaded[name] = table.stats()["rows"]
        return loaded

    def close(self) -> None:
        """See `Shard.close`: closes every table's row storage."""
        for table in self._tables.values():
            table.close()
