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

Why: with ids hashed over shards, a table's average load is already even; what is not is
a hot row (Zipf traffic), whose every lookup and update lands on one shard. Splitting the
columns of a table with hot rows spreads each hot row's bytes over C shards.
`plan_column_shards` chooses C per table from its dim and a sample of its measured
accesses, simulating the routing itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from embedding_store.config import TableConfig
from embedding_store.routing import shard_of

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


def shard_loads(
    tables: Sequence[TableConfig], accesses: Mapping[str, np.ndarray], num_shards: int
) -> np.ndarray:
    """Bytes of rows each shard serves for the sampled accesses: [num_shards] float64.

    Args:
        tables: the tables with their `column_shards`.
        accesses: {table: ids [n] uint64}, a sample of lookups (repeats count).
        num_shards: shard count.
    """
    loads = np.zeros(num_shards)
    for table in tables:
        ids = accesses.get(table.name)
        if ids is None or not len(ids):
            continue
        unique, counts = np.unique(ids, return_counts=True)
        for position, piece in enumerate(column_slices(table)):
            shards = shard_of(unique, num_shards, position)
            loads += np.bincount(shards, weights=counts * 4.0 * piece.dim, minlength=num_shards)
    return loads


def plan_column_shards(
    tables: Sequence[TableConfig],
    accesses: Mapping[str, np.ndarray],
    num_shards: int,
    *,
    tolerance: float = 0.05,
) -> dict[str, int]:
    """A column split per table that evens out the shards' load: {table: column_shards}.

    Greedy, in the spirit of ZionEX's and TorchRec's planners: start from whole rows,
    and while the busiest shard serves more than (1 + tolerance) times the mean, double
    the split of the table that puts the most bytes on that shard, if its dim allows
    (slices of at least MIN_SLICE_DIM columns, at most `num_shards` slices, not
    rowwise_adagrad) and the busiest shard's load drops. Tables never accessed in the
    sample keep their split.

    Args:
        tables: the tables (their current `column_shards` are the starting point).
        accesses: {table: ids [n] uint64}: measured lookups, e.g. a few batches.
        num_shards: shard count.
        tolerance: acceptable busiest-over-mean load.
    """
    plan = {table.name: table.column_shards for table in tables}

    def with_plan(current):
        return [dataclasses.replace(t, column_shards=current[t.name]) for t in tables]

    loads = shard_loads(with_plan(plan), accesses, num_shards)
    while loads.max() > (1 + tolerance) * loads.mean():
        busiest = int(np.argmax(loads))
        candidates = []
        for table in tables:
            split = plan[table.name] * 2
            if (
                table.name not in accesses
                or split > num_shards
                or table.dim % split
                or table.dim // split < MIN_SLICE_DIM
                or table.optimizer.name == "rowwise_adagrad"
            ):
                continue
            current = dataclasses.replace(table, column_shards=plan[table.name])
            share = shard_loads([current], accesses, num_shards)
            candidates.append((share[busiest], table.name, split))
        improved = False
        for _, name, split in sorted(candidates, reverse=True):
            trial = {**plan, name: split}
            trial_loads = shard_loads(with_plan(trial), accesses, num_shards)
            if trial_loads.max() < loads.max():
                plan, loads, improved = trial, trial_loads, True
                break
        if not improved:
            break
    return plan


def describe_plan(
    tables: Sequence[TableConfig],
    plan: Mapping[str, int],
    accesses: Mapping[str, np.ndarray],
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
        count = len(accesses.get(table.name, ()))
        lines.append(
            f"  {table.name}: dim {table.dim}, {count:,} sampled lookups, "
            f"column_shards {plan[table.name]}"
            + (f" ({table.dim // plan[table.name]} columns each)" if plan[table.name] > 1 else "")
        )
    lines.append(
        f"  busiest shard / mean: {before.max() / before.mean():.3f} whole rows -> "
        f"{after.max() / after.mean():.3f} with the plan"
    )
    return "\n".join(lines)
