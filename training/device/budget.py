"""How a device budget is split among the tables that do not all fit (`device_plan`).

By lookups per byte: the pipeline counts, per feature, the ids seen at least 1, 2, 5, 10,
100 and 1000 times, which tells how many lookups the hottest N ids of a table take
(`lookup_bands`). Pieces of every table get rows densest first until the budget is
spent (`plan_by_lookups`): a table that gets all its rows goes onto the devices whole,
one that gets part of them a hot-row cache of that many rows. A cache's own host work is
priced in (CACHE_LOOKUP_COST), and no cache is smaller than MIN_CACHE_ROWS. Without those
counts, caches share what is left equally (`plan_caches`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridrec.common.errors import ConfigError
from hybridrec.pipeline import DatasetMetadata

REPLICATE_BYTES = 4 << 20  # tables up to this size get a replica on every device
MIN_CACHE_ROWS = 4096  # a smaller cache than this is not planned
# a cache's host work for each lookup of its table, in host-store lookups and updates
CACHE_LOOKUP_COST = 0.5


def lookup_bands(stats: dict, metadata: DatasetMetadata) -> list[tuple[float, float]]:
    """[(ids, lookups)] of a feature, hottest ids first: how many of its lookups the
    hottest ids take, estimated from the pipeline's counts of ids seen at least k times
    (`ids_with_count_at_least`); an id seen k to k' times counts sqrt(k * k') lookups
    (k for exactly k), and the hottest band takes what the others leave of the feature's
    rows. Empty without those counts."""
    at_least = {int(k): float(v) for k, v in (stats.get("ids_with_count_at_least") or {}).items()}
    if not at_least or at_least.get(1, 0) <= 0:
        return []
    rows = sum(split.get("rows", 0) for split in (metadata.raw.get("splits") or {}).values())
    total = rows * (1.0 - float(stats.get("missing_rate", 0.0)))
    thresholds = sorted(at_least, reverse=True)  # e.g. 1000, 100, 10, 5, 2, 1
    bands = []  # (ids, lookups) of each band, hottest first
    for i, low in enumerate(thresholds):
        ids = at_least[low] - (at_least[thresholds[i - 1]] if i else 0)
        high = thresholds[i - 1] if i else None
        each = low if high == low + 1 else math.sqrt(low * high) if high else low
        bands.append((max(ids, 0.0), max(ids, 0.0) * each))
    top_ids, top_floor = bands[0]
    rest = sum(count for _, count in bands[1:])
    bands[0] = (top_ids, max(total - rest, top_floor))
    return [band for band in bands if band[0] > 0]


def merge_bands(curves: Sequence[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """One table's bands from its features' (their ids never collide): densest first."""
    bands = [band for curve in curves for band in curve]
    return sorted(bands, key=lambda band: -band[1] / band[0])


def plan_by_lookups(
    weighed: Sequence[tuple],
    chosen: list,
    budget: int,
    budget_note: str,
    used: int,
    devices: int,
    *,
    caches: bool = True,
    row_overhead: int = 0,
) -> int:
    """Gives the tables in `weighed` rows on the devices by the lookups each byte serves
    (their bands of ids, densest first over all tables, until the budget is spent);
    appends the whole tables and caches to `chosen`; returns the budget used.

    A table that gets all its planned rows goes onto the devices whole (unless it may not:
    `whole_ok` False, its ids outgrow its rows); one that gets fewer gets a hot-row cache
    of them when that is at least MIN_CACHE_ROWS (a forced
    cache that gets fewer is a ConfigError); the rest stay on the host only. A table's
    first rows (`_segments`) are granted whole or not at all, so no grant falls below the
    smallest cache. Without `caches`, each table is one piece: whole or host only.
    `row_overhead`: bytes a row costs on every device besides its values and state.
    """
    segments = []  # (value per byte, table index, rows, bytes per row, whole or nothing)
    per_row = []  # bytes per device of one row, and its layout
    for index, (_, layout, _, row_bytes, forced, most, bands, whole_ok) in enumerate(weighed):
        sharded, _ = split_layout(layout, (most + 1) * row_bytes, devices)
        cost = (row_bytes / devices if sharded else row_bytes) + row_overhead
        per_row.append((cost, "sharded" if sharded else "replicated"))
        if caches:
            pieces = _values(_segments(bands, most), forced, whole_ok and not forced)
        elif whole_ok:  # one piece: the table's lookups over all its rows
            pieces = [(float(most), sum(count for _, count in bands), True)]
        else:
            pieces = []
        for rows, value, atomic in pieces:
            segments.append((value / rows / cost, index, rows, cost, atomic))
    rows = [0.0] * len(weighed)
    stopped = [False] * len(weighed)  # a piece did not fit: the table takes no more
    # 2 rows of each table in reserve: a device table holds one row more than planned
    spare = budget - used - 2 * sum(cost for cost, _ in per_row)
    for density, index, ids, cost, atomic in sorted(segments, key=lambda s: -s[0]):
        if density <= 0 or stopped[index]:
            continue
        if atomic and ids * cost > spare:
            stopped[index] = True
            continue
        take = min(ids, max(spare, 0.0) / cost)
        rows[index] += take
        spare -= take * cost
    for index, (spec_table, _, store_name, row_bytes, forced, most, _, whole_ok) in enumerate(
        weighed
    ):
        planned, layout = min(round(rows[index]), most), per_row[index][1]
        whole = planned >= most and not forced and whole_ok
        if not whole and planned < min(MIN_CACHE_ROWS, most):
            if forced:
                raise _cache_too_small(budget, budget_note, budget - used, spec_table)
            continue
        sharded, per_device = split_layout(layout, (planned + 1) * row_bytes, devices)
        used += per_device + (planned + 1) * row_overhead
        chosen.append((spec_table, planned, sharded, store_name, not whole))
    return used


def _segments(bands: Sequence[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    """A table's (rows, lookups) in the order they come onto the devices, summing `most`
    rows: the first takes its densest bands up to the smallest cache (MIN_CACHE_ROWS, or
    the whole table when it is smaller), each further band one more, and the last the
    planned rows' headroom too (ids not seen yet)."""
    first = min(MIN_CACHE_ROWS, most)
    segments: list[list[float]] = []  # [rows, lookups]
    left = float(most)
    for ids, count in bands:
        take = min(ids, left)
        left -= take
        if segments and segments[0][0] < first:  # the first is not yet a whole cache
            part = min(take, first - segments[0][0])
            segments[0][0] += part
            segments[0][1] += count * part / ids
            take -= part
        if take > 0:
            segments.append([take, count * take / ids])
    if segments:
        segments[-1][0] += left
    return [(rows, count) for rows, count in segments]


def _values(
    segments: Sequence[tuple[float, float]], forced_cache: bool, whole_ok: bool = True
) -> list[tuple[float, float, bool]]:
    """(rows, value, whole or nothing) of a table's pieces, in the order they come onto the
    devices; a piece's value is the lookups it serves less what a cache costs the host.

    A cache's bookkeeping on the host (its id map, admission counts and the split of each
    bag) costs about CACHE_LOOKUP_COST of a host-store lookup and update for every lookup
    of the table, held or not; a whole table costs none. So the first piece of a table
    pays for the cache, and the last piece, which makes the table whole, earns that back
    (it is ordered by that value, but may be taken in part: a larger cache); a table that
    may not go whole (`whole_ok` False) pays and never earns it back. Pieces whose
    value per row rises are merged, so a table's values per row only fall; the first
    piece comes whole or not at all.
    """
    total = sum(count for _, count in segments)
    pieces = [[rows, count, position == 0] for position, (rows, count) in enumerate(segments)]
    if not forced_cache and pieces:  # a forced cache is paid for by whoever forced it
        pieces[0][1] -= CACHE_LOOKUP_COST * total
        if whole_ok:  # the last piece makes the table whole: no cache to pay for
            pieces[-1][1] += CACHE_LOOKUP_COST * total
    merged: list[list] = []
    for piece in pieces:
        merged.append(piece)
        while len(merged) > 1 and merged[-1][1] / merged[-1][0] > merged[-2][1] / merged[-2][0]:
            rows, value, atomic = merged.pop()
            merged[-1][0] += rows
            merged[-1][1] += value
            merged[-1][2] = merged[-1][2] or atomic
    return [(rows, value, atomic) for rows, value, atomic in merged]


def _cache_too_small(budget: int, budget_note: str, left: int, spec_table: str) -> ConfigError:
    """The error of a forced cache that what is `left` of the budget cannot hold."""
    return ConfigError(
        f"embedding.device_budget = {budget:,} bytes per device ({budget_note}) leaves "
        f"{size_text(max(left, 0))} for the cache of table {spec_table!r} "
        f"(embedding.placement), under {MIN_CACHE_ROWS:,} rows; give it rows "
        '("cache:ROWS") or a larger budget'
    )


def split_layout(layout: str, total: int, devices: int) -> tuple[bool, int]:
    """(split by rows, bytes per device) of a table of `total` bytes: split when its layout
    says "sharded", or, with none given, when larger than REPLICATE_BYTES."""
    sharded = layout == "sharded" or (not layout and total > REPLICATE_BYTES and devices > 1)
    return sharded, math.ceil(total / devices) if sharded else total


def plan_caches(
    cached: Sequence[tuple], chosen: list, budget: int, budget_note: str, used: int, devices: int
) -> int:
    """Appends to `chosen` the caches of the tables in `cached` that get one; returns the
    budget used.

    A forced cache with its rows gets them (a ConfigError if they do not fit); the others
    share what is left equally (up to the rows their table is planned to hold), forced
    ones first; an auto one that would hold fewer than MIN_CACHE_ROWS rows is not
    planned, a forced one is a ConfigError.
    """
    ordered = sorted(cached, key=lambda c: (not c[5], not c[1]))
    for index, entry in enumerate(ordered):
        spec_table, rows, layout, store_name, row_bytes, forced, most = entry
        left = budget - used
        if not rows:
            share = left // (len(ordered) - index)
            sharded, _ = split_layout(layout, share, devices)
            rows = min(share * (devices if sharded else 1) // row_bytes - 1, most)
            if rows < min(MIN_CACHE_ROWS, most):
                if forced:
                    raise _cache_too_small(budget, budget_note, left, spec_table)
                continue
        sharded, per_device = split_layout(layout, (rows + 1) * row_bytes, devices)
        if used + per_device > budget:
            raise ConfigError(
                f"embedding.device_budget = {budget:,} bytes per device ({budget_note}) is too "
                f"small for the cache of table {spec_table!r} forced by embedding.placement "
                f"({size_text(per_device)} per device, {size_text(used)} taken)"
            )
        used += per_device
        chosen.append((spec_table, rows, sharded, store_name, True))
    return used


def size_text(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
