"""The planner's split of a device budget by lookups per byte (`training.device.budget`):
the hottest ids of every table first, whole tables where all their rows earn a place."""

from __future__ import annotations

import types

import pytest
from hybridrec.common.errors import ConfigError
from hybridrec.training.device import budget as device_budget
from hybridrec.training.device.budget import MIN_CACHE_ROWS

ROW_BYTES = 128


def _metadata(rows: int):
    return types.SimpleNamespace(raw={"splits": {"train": {"rows": rows}, "eval": {"rows": 0}}})


def _stats(at_least: dict[int, int], missing_rate: float = 0.0) -> dict:
    return {
        "ids_with_count_at_least": {str(k): v for k, v in at_least.items()},
        "missing_rate": missing_rate,
    }


def test_lookups_of_the_hottest_ids_follow_the_counts():
    # 10 ids seen 1000+ times, 90 seen 100-999 times, 900 seen 2-99 times, 9,000 once
    stats = _stats({1: 10_000, 2: 1_000, 5: 1_000, 10: 1_000, 100: 100, 1000: 10}, 0.1)
    bands = device_budget.lookup_bands(stats, _metadata(200_000))
    assert [ids for ids, _ in bands] == [10, 90, 900, 9_000]
    assert bands[-1][1] == 9_000  # each seen once
    assert bands[1][1] == pytest.approx(90 * (100 * 1000) ** 0.5)
    # the hottest band takes what the others leave of the 180,000 lookups
    assert sum(count for _, count in bands) == pytest.approx(180_000)
    assert device_budget.lookup_bands({"distinct_estimate": 5}, _metadata(10)) == []


def _entry(name: str, bands, most: int, forced: bool = False, whole_ok: bool = True):
    return (name, "replicated", "embeddings", ROW_BYTES, forced, most, bands, whole_ok)


def test_a_budget_goes_to_the_densest_rows_of_every_table():
    small = _entry("small", [(50, 100_000.0)], 120)  # few ids, many lookups: whole
    skewed = _entry("skewed", [(5_000, 400_000.0), (95_000, 95_000.0)], 110_000)
    flat = _entry("flat", [(60_000, 60_000.0)], 66_000)  # every id once: worth the least
    chosen: list = []
    budget = 20_000 * ROW_BYTES
    used = device_budget.plan_by_lookups([small, skewed, flat], chosen, budget, "", 0, 1)
    assert used <= budget
    placed = {name: (rows, cache) for name, rows, _, _, cache in chosen}
    assert placed["small"] == (120, False)  # whole
    rows, cache = placed["skewed"]
    assert cache and rows > 15_000  # its hot band and then what is left
    assert "flat" not in placed  # a cache of it would serve fewer lookups per byte
    # a table whose smallest cache does not fit stays on the host; one that fits whole goes
    chosen = []
    tight = device_budget.plan_by_lookups([skewed, small], chosen, 3_000 * ROW_BYTES, "", 0, 1)
    assert [c[0] for c in chosen] == ["small"] and tight < 3_000 * ROW_BYTES


def test_first_rows_of_a_table_come_as_a_whole_cache():
    bands = [(10, 50_000.0), (2_000, 20_000.0), (40_000, 40_000.0)]
    segments = device_budget._segments(bands, 50_000)
    assert segments[0][0] == pytest.approx(10 + 2_000 + (MIN_CACHE_ROWS - 2_010))
    assert sum(rows for rows, _ in segments) == pytest.approx(50_000)  # headroom in the last
    assert device_budget._segments([(30, 900.0)], 100) == [(100, 900.0)]  # small: one piece


def test_a_forced_cache_the_budget_cannot_hold_is_refused():
    forced = _entry("C3", [(5_000, 50_000.0)], 10_000, forced=True)
    with pytest.raises(ConfigError, match="for the cache of table 'C3'"):
        device_budget.plan_by_lookups([forced], [], 100 * ROW_BYTES, "test", 0, 1)


def test_without_caches_tables_go_whole_by_their_lookups_per_byte():
    # trainers sharing embedding servers: no caches, so a table is whole or host only
    small = _entry("small", [(50, 100_000.0)], 120)
    skewed = _entry("skewed", [(5_000, 400_000.0), (95_000, 95_000.0)], 110_000)
    dense = _entry("dense", [(8_000, 300_000.0)], 9_000)  # more lookups per byte than skewed
    chosen: list = []
    budget = 20_000 * ROW_BYTES
    used = device_budget.plan_by_lookups(
        [small, skewed, dense], chosen, budget, "", 0, 1, caches=False
    )
    assert used <= budget
    assert {(name, rows, cache) for name, rows, _, _, cache in chosen} == {
        ("small", 120, False),
        ("dense", 9_000, False),
    }  # the skewed table's hot rows would need a cache: it stays on the host
    with_caches: list = []
    device_budget.plan_by_lookups([small, skewed, dense], with_caches, budget, "", 0, 1)
    assert ("skewed", True) in {(c[0], c[4]) for c in with_caches}


def test_a_table_whose_ids_outgrow_its_rows_goes_as_a_cache_or_stays_on_the_host():
    # embedding.capacity below the ids seen: the budget would hold the table whole, but
    # a device table cannot evict, so it gets a cache of its rows (the host store behind
    # it evicts as it does without the devices)
    small = _entry("small", [(50, 100_000.0)], 120, whole_ok=False)
    chosen: list = []
    device_budget.plan_by_lookups([small], chosen, 20_000 * ROW_BYTES, "", 0, 1)
    assert [(name, cache) for name, _, _, _, cache in chosen] == [("small", True)]
    chosen = []
    device_budget.plan_by_lookups([small], chosen, 20_000 * ROW_BYTES, "", 0, 1, caches=False)
    assert chosen == []
