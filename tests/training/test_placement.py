"""DMT placement: two hosts (a server and a JAX process each), real Flight servers, gloo.

The tower-parallel run must learn what the flat data-parallel run of the same DMT model
learns from the same batches, while its lookups and updates never leave the host.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.pipeline import CategoricalFeature
from hybridrec.training.config import EmbeddingConfig
from hybridrec.training.learned.placement import tower_of_process, tower_table_plans

from hybridrec.cli.placement_run import check_servers, launch

TOWERS = "model.towers=[[0,1,2,3,4,5,6,7,8,9,10,11,12],[13,14,15,16,17,18,19,20,21,22,23,24,25]]"
SMALL_DMT = [
    "model.dlrm.bottom_mlp=[32, 8]",
    "model.dlrm.top_mlp=[64, 32]",
    "embedding.dim=8",
    "embedding.capacity=100000",
    "data.batch_size=256",
    "data.shuffle_buffer=0",
    "optimizer.warmup_steps=0",
    # Adagrad from a zero accumulator takes a full step on a row's first gradient, however
    # small: float-order differences between the layouts would then show in the loss. The
    # layouts are compared here, so the accumulators start at optax's 0.1.
    "embedding.optimizer.initial_accumulator=0.1",
    TOWERS,
    "model.tower_outputs=2",
    "model.tower_mlp=[16]",
]
STEPS = 25


@pytest.mark.slow
def test_placed_towers_learn_like_flat_dmt_without_remote_lookups(dataset, tmp_path):
    common = {"data": dataset, "preset": "criteo_dlrm", "overrides": SMALL_DMT, "hosts": 2}
    common |= {"steps": STEPS, "eval_batches": 4, "workdir": tmp_path}
    flat = launch(mode="flat", **common)
    placed = launch(mode="towers", **common)
    assert [record["tower"] for record in placed] == [0, 1]
    for record in flat + placed:
        assert len(record["losses"]) == STEPS
    # every process sees the same global loss; the two layouts the same trajectory
    np.testing.assert_allclose(placed[0]["losses"], placed[1]["losses"], rtol=0, atol=0)
    np.testing.assert_allclose(placed[0]["losses"], flat[0]["losses"], rtol=2e-4)
    assert placed[0]["losses"][-1] < placed[0]["losses"][0]
    assert abs(placed[0]["eval"]["auc"] - flat[0]["eval"]["auc"]) < 2e-3
    for record in flat:  # half the shards are on the other host
        assert record["store_bytes_per_step"]["remote"] > 0.3 * sum(
            record["store_bytes_per_step"].values()
        )
    for record in placed:
        assert record["store_bytes_per_step"]["remote"] == 0
        assert record["store_bytes_per_step"]["local"] > 0
    # what crosses hosts instead: each process's compressed outputs, half of them sent
    # away, forward and backward: 256 rows x 2 outputs x 8 dims x f32
    exchange = placed[0]["collective_bytes_per_step"]["all-to-all"]
    assert exchange == 2 * (256 * 2 * 8 * 4) // 2
    assert "all-to-all" not in flat[0]["collective_bytes_per_step"]
    assert (
        placed[0]["collective_bytes_per_step"]["all-reduce"]
        == flat[0]["collective_bytes_per_step"]["all-reduce"]
    )


def test_towers_map_to_process_groups_and_tables():
    assert [tower_of_process(p, 4, 2) for p in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match="3 towers need a process count that divides by 3"):
        tower_of_process(0, 4, 3)
    features = [
        CategoricalFeature(name=f"C{i}", table=f"C{i}", multi_valued=False) for i in range(4)
    ]
    embedding = EmbeddingConfig(dim=4, capacity=1000)
    embedding = dataclasses.replace(
        embedding, optimizer=dataclasses.replace(embedding.optimizer, learning_rate=0.1)
    )
    plans = tower_table_plans(embedding, features, [[0, 3], [1, 2]])
    assert [plan.tables[0].name for plan in plans] == ["tower_0", "tower_1"]
    assert plans[0].feature_tables == {"C0": "tower_0", "C3": "tower_0"}
    assert plans[1].tables[0].capacity == 2 * 1000  # fused: capacity per feature table
    shared = [*features[:3], CategoricalFeature(name="C3", table="C0", multi_valued=False)]
    with pytest.raises(ConfigError, match="table 'C0' is read by features of towers 0 and 1"):
        tower_table_plans(embedding, shared, [[0, 2], [1, 3]])


@pytest.mark.slow
def test_two_hosts_per_tower_keep_lookups_within_their_group(dataset, tmp_path):
    """4 hosts, 2 towers: a tower's tables are on its 2 hosts' servers, a shard each."""
    common = {"data": dataset, "preset": "criteo_dlrm", "overrides": SMALL_DMT, "hosts": 4}
    common |= {"steps": 22, "eval_batches": 1, "workdir": tmp_path}
    flat = launch(mode="flat", **common)
    placed = launch(mode="towers", **common)
    assert [record["tower"] for record in placed] == [0, 0, 1, 1]
    np.testing.assert_allclose(placed[0]["losses"], flat[0]["losses"], rtol=2e-4)
    for record in placed:
        moved = record["store_bytes_per_step"]
        assert moved["remote"] == 0 and moved["group"] > 0 and moved["local"] > 0
    # 128 rows per process, 2 outputs x 8 dims x f32, half sent away, forward and backward
    assert placed[0]["collective_bytes_per_step"]["all-to-all"] == 2 * (128 * 2 * 8 * 4) // 2


def test_server_lists_must_be_per_host_lists():
    assert check_servers([["127.0.0.1:1"], ["127.0.0.1:2"]]) == [["127.0.0.1:1"], ["127.0.0.1:2"]]
    for bad in (["127.0.0.1:1"], {}, [], [[]], [[7001]]):
        with pytest.raises(UserError, match="expected a non-empty JSON list of per-host"):
            check_servers(bad)
