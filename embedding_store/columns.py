"""Column-wise sharding: a table's columns split into slices on different shards, and a planner.

A table with `column_shards = C` is stored as C tables of `dim / C` columns,
`<name>.col<i>`, each a whole table to the shards (rows, optimizer state, admission,
eviction, checkpoints). Slice i routes id x to shard `(route_hash(x) + i) % num_shards`
(`routing.shard_of` with an offset), so the C slices of one row sit on C different
shards while every slice is still spread over all shards by id (row-wise sharding
combined with column-wise, as in ZionEX, arXiv 2104.05158). The store splits lookups and
gradients by column and joins the slices' rows again; optimizers that work per value
(sgd, adagrad, adam) give exactly the unsplit table's results, and initial values are a
function of the whole table's column index. `rowwise_adagrad` (one accumulator per row)
cannot be split.

Why: with ids hashed over shards and each batch deduplicated, a table with many distinct
rows per batch is already spread evenly. A wide table with few distinct rows per batch
(a handful of hot rows, or a low-cardinality feature with a large dim) is not: each of
its rows sends all its bytes to one shard, every step. Splitting its columns spreads each
row's bytes over C shards. `plan_column_shards` chooses C per table from its dim and a
sample of measured batches, simulating the routing itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
from hybridrec.embedding_store._arrays import put_rows
from hybridrec.embedding_store.config import TableConfig
from hybridrec.embedding_store.routing import shard_of

MIN_SLICE_DIM = 4  # no slice narrower than this many columns (per-row overheads dominate)


def column_slices(table: TableConfig) -> list[TableConfig]:
    """The tables a store keeps for `table`: itself, or its `column_shards` column slices."""
    if table.column_shards == 1:
        return [table]
    width = table.dim // table.column_shards
    return [
        dataclasses.replace(
            table, name=f"{table.name}.col{i}", dim=width, column_shards=1, first_column=i * width
        )
        for i in range(table.column_shards)
    ]


def stored_tables(tables: Sequence[TableConfig]) -> list[TableConfig]:
    """Every table the shards hold for `tables` (column slices expanded), in order."""
    stored = [piece for table in tables for piece in column_slices(table)]
    names = [piece.name for piece in stored]
    if len(set(names)) != len(names):
        raise ValueError(f"a column slice's name repeats a table's name: {sorted(names)}")
    return stored


Accesses = Mapping[str, Sequence[np.ndarray]]  # {table: [ids [n] uint64 of one batch, ...]}


def shard_loads(tables: Sequence[TableConfig], accesses: Accesses, num_shards: int) -> np.ndarray:
    """Float bytes each shard sends and receives for the sampled batches: [num_shards] float64.

    Each batch's ids are deduplicated first, as the store does: a row costs its shard
    one row and one gradient per batch however often the batch names it.

    Args:
        tables: the tables with their `column_shards`.
        accesses: {table: [ids of one batch, ...]}, measured batches.
        num_shards: shard count.
    """
    loads = np.zeros(num_shards)
    for table in tables:
        batches = accesses.get(table.name) or []
        if not len(batches):
            continue
        sent = np.concatenate([np.unique(batch) for batch in batches])
        unique, counts = np.unique(sent, return_counts=True)
        for position, piece in enumerate(column_slices(table)):
            shards = shard_of(unique, num_shards, position)
            weights = counts * 2 * 4.0 * piece.dim  # a float32 row out, a gradient back
            loads += np.bincount(shards, weights=weights, minlength=num_shards)
    return loads


def plan_column_shards(
    tables: Sequence[TableConfig],
    accesses: Accesses,
    num_shards: int,
    *,
    tolerance: float = 0.05,
) -> dict[str, int]:
    """A column split per table that evens out the shards' load: {table: column_shards}.

    Greedy, in the spirit of ZionEX's and TorchRec's planners: start from the tables'
    current splits, and while the busiest shard serves more than (1 + tolerance) times
    the mean, raise the split of one table to whichever split lowers the busiest shard's
    load most (by at least 1% of the mean), where its dim allows (equal slices of at
    least MIN_SLICE_DIM columns, at most `num_shards` slices, not rowwise_adagrad).
    Tables not in the sample keep their split.

    Args:
        tables: the tables (their current `column_shards` are the starting point).
        accesses: {table: [ids of one batch, ...]}: measured batches (a few suffice).
        num_shards: shard count.
        tolerance: acceptable busiest-over-mean load.
    """
    plan = {table.name: table.column_shards for table in tables}

    def with_plan(current):
        return [dataclasses.replace(t, column_shards=current[t.name]) for t in tables]

    loads = shard_loads(with_plan(plan), accesses, num_shards)
    while loads.max() > (1 + tolerance) * loads.mean():
        trials = []
        for table in tables:
            if table.name not in accesses or table.optimizer.name == "rowwise_adagrad":
                continue
            for split in range(plan[table.name] + 1, num_shards + 1):
                if table.dim % split or table.dim // split < MIN_SLICE_DIM:
                    continue
                trial = {**plan, table.name: split}
                loads_with = shard_loads(with_plan(trial), accesses, num_shards)
                trials.append((loads_with.max(), split, loads_with, trial))
        if not trials:
            break
        # The lowest busiest shard; among equals, the smallest split.
        _, _, best_loads, best = min(trials, key=lambda trial: trial[:2])
        # Only a clear gain: splitting an evenly spread table just reshuffles sampling noise.
        if loads.max() - best_loads.max() < 0.01 * loads.mean():
            break
        plan, loads = best, best_loads
    return plan


def describe_plan(
    tables: Sequence[TableConfig],
    plan: Mapping[str, int],
    accesses: Accesses,
    num_shards: int,
) -> str:
    """The plan as lines to print at start-up: per table, then busiest/mean before and after."""
    before = shard_loads(tables, accesses, num_shards)
    after = shard_loads(
        [dataclasses.replace(t, column_shards=plan[t.name]) for t in tables], accesses, num_shards
    )
    lines = [
        f"sharding plan over {num_shards} shards (rows by id hash; columns split where shown):"
    ]
    for table in tables:
        batches = accesses.get(table.name) or []
        rows = np.mean([len(np.unique(batch)) for batch in batches]) if len(batches) else 0
        lines.append(
            f"  {table.name}: dim {table.dim}, {rows:,.0f} distinct rows per batch, "
            f"column_shards {plan[table.name]}"
            + (f" ({table.dim // plan[table.name]} columns each)" if plan[table.name] > 1 else "")
        )
    lines.append(
        f"  busiest shard / mean: {before.max() / before.mean():.3f} whole rows -> "
        f"{after.max() / after.mean():.3f} with the plan"
    )
    return "\n".join(lines)


def piece_columns(rows: np.ndarray, piece: TableConfig) -> np.ndarray:
    """The columns of [n, dim] `rows` that column slice `piece` holds (all for a whole table)."""
    if piece.first_column == 0 and piece.dim == rows.shape[1]:
        return rows
    return np.ascontiguousarray(rows[:, piece.first_column : piece.first_column + piece.dim])


def put_piece_columns(out: np.ndarray, where, piece: TableConfig, rows: np.ndarray) -> None:
    """out[where, piece's columns] = rows."""
    if piece.first_column == 0 and piece.dim == out.shape[1]:
        put_rows(out, where, rows)
    else:
        out[where, piece.first_column : piece.first_column + piece.dim] = rows
