"""Who maps a click log's ids to device-table rows (`embedding.map_ids`): the step on an
accelerator or where asked, the host where the tables or features need it, said in the plan."""

from __future__ import annotations

import json

import pytest
from hybridrec.common.errors import ConfigError
from hybridrec.embedding_store import TableConfig
from hybridrec.embedding_store.config import InitializerConfig
from hybridrec.model.device_tables import DeviceTable, DeviceTableLayout, SparseRule
from hybridrec.training.config import load_config
from hybridrec.training.device.mapped_ids import map_on_devices, maps_on_devices
from hybridrec.training.device.plan import DevicePlan
from hybridrec.training.tasks import prepare

RULE = SparseRule("adagrad", 0.05)


def _plan(cache: bool = False) -> DevicePlan:
    tables = (
        DeviceTable("replicated", (0, 1), 100, 8, RULE),
        DeviceTable("cache.replicated", (2,), 50, 8, RULE, cache=True),
    )
    layout = DeviceTableLayout(tables if cache else tables[:1], 3)
    features = {"replicated": ("a", "b"), "cache.replicated": ("c",)}
    stores = dict.fromkeys(features, "embeddings")
    return DevicePlan(layout, features, stores, {"replicated": (1, 2)}, 8, lines=("plan",))


STORE = {
    "embeddings": TableConfig(
        name="embeddings", dim=8, capacity=1000, initializer=InitializerConfig(seed=9)
    )
}


def _mapped(plan, mode, platform, multi_valued=None):
    return map_on_devices(plan, mode, STORE, platform=platform, multi_valued=multi_valued or {})


def test_the_step_maps_ids_on_an_accelerator_or_where_asked_and_says_so():
    assert maps_on_devices("auto", "gpu") and maps_on_devices("devices", "cpu")
    assert not maps_on_devices("auto", "cpu") and not maps_on_devices("host", "gpu")
    for mode, platform in (("auto", "gpu"), ("devices", "cpu")):
        plan = _mapped(_plan(), mode, platform)
        (table,) = plan.layout.tables
        assert table.new_rows is not None and table.new_rows.kind == "uniform"
        assert table.arrays == ("ids",)
        assert plan.lines[-1].startswith("  ids mapped to rows on the devices, in the step")
    plan = _mapped(_plan(), "auto", "cpu")
    assert plan.layout.tables[0].new_rows is None
    assert "ids mapped to rows on the host (on the CPU" in plan.lines[-1]
    assert _mapped(_plan(), "host", "gpu") == _plan()


def test_caches_and_multi_valued_features_keep_the_host_mapping_or_are_one_line_errors():
    plan = _mapped(_plan(cache=True), "auto", "gpu")
    assert all(t.new_rows is None for t in plan.layout.tables)
    assert "hot-row caches admit rows on the host" in plan.lines[-1]
    plan = _mapped(_plan(), "auto", "gpu", {"b": True})
    assert (
        plan.layout.tables[0].new_rows is None and "feature 'b' is multi-valued" in plan.lines[-1]
    )
    with pytest.raises(ConfigError, match="embedding.map_ids = 'devices': feature 'b' is multi"):
        _mapped(_plan(), "devices", "gpu", {"b": True})
    with pytest.raises(ValueError, match="maps every table's ids or none"):
        DeviceTableLayout(
            (_mapped(_plan(), "devices", "cpu").layout.tables[0], _plan(True).layout.tables[1]), 3
        )


def _devices(dataset, *keys: str) -> DevicePlan:
    config = load_config("quickstart", [f"data.path={json.dumps(str(dataset))}", *keys])
    return prepare(config).devices


def test_the_hash_tables_count_in_the_device_budget(dataset):
    """A budget that holds every table's values and optimizer state, but not their hash
    tables as well: mapped in the step, fewer tables go onto the devices, within it."""
    whole = _devices(dataset, "embedding.map_ids=host", "embedding.device_budget=-1")
    assert len(whole.layout.tables) == 1 and not whole.layout.caches  # fused: one table
    values = whole.layout.tables[0].bytes_per_device(1)
    budget = int(values * 1.2)
    keys = [f"embedding.device_budget={budget}", "embedding.fuse_tables=false"]
    on_host = _devices(dataset, "embedding.map_ids=host", *keys)
    in_step = _devices(dataset, "embedding.map_ids=devices", *keys)
    assert in_step.lines[-1].startswith("  ids mapped to rows on the devices, in the step")
    assert all(t.new_rows is not None for t in in_step.layout.tables) and not in_step.layout.caches
    assert 0 < len(in_step.layout.whole) < len(on_host.layout.whole)
    assert sum(t.bytes_per_device(1) for t in in_step.layout.tables) <= budget
