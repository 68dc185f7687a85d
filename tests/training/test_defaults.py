"""The "auto" config values a run resolves for its dataset (training.defaults)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hybridrec.common import config as config_lib
from hybridrec.common.errors import ConfigError
from hybridrec.model.config import DenseOptimizerConfig
from hybridrec.model.step import make_schedule
from hybridrec.pipeline import read_metadata
from hybridrec.training.config import PRESET_DIR, TrainConfig
from hybridrec.training.defaults import (
    choose_batch_size,
    choose_decay,
    choose_embedding_dim,
    choose_sparse_learning_rate,
    resolve_auto,
)
from hybridrec.training.sources import StreamSource
from hybridrec.training.tables import plan_tables


def test_auto_batch_aims_at_about_200_steps_in_a_power_of_two_range():
    assert choose_batch_size(0, 117_000, 1)[0] == 512
    assert choose_batch_size(0, 1_000, 1)[0] == 256  # the floor
    assert choose_batch_size(0, 90, 1)[0] == 64  # fewer rows than the floor: what fits
    assert choose_batch_size(0, 90, 8)[0] == 64
    with pytest.raises(ConfigError, match="the 6 training rows are fewer than one batch"):
        choose_batch_size(0, 6, 8)  # one row for each of 8 devices is 8
    assert choose_batch_size(0, 45_000_000, 1)[0] == 4096  # the ceiling
    assert choose_batch_size(0, 117_000, 3)[0] == 513  # divides over 3 devices
    assert choose_batch_size(128, 117_000, 8) == (128, "data.batch_size = 128 as configured")


def test_auto_dim_follows_the_fourth_root_of_the_largest_vocabulary():
    assert choose_embedding_dim(0, {"a": 40_000, "b": 12})[0] == 16  # 40k ** 0.25 = 14
    assert choose_embedding_dim(0, {"a": 10_000_000})[0] == 64  # 56
    assert choose_embedding_dim(0, {"a": 30})[0] == 8  # the floor
    assert choose_embedding_dim(0, {"a": 10**12})[0] == 128  # the ceiling
    dim, reason = choose_embedding_dim(0, {"site": 5_000, "app": 900})
    assert dim == 8 and "site" in reason
    assert choose_embedding_dim(32, {"a": 10})[0] == 32


def test_auto_sparse_rate_scales_with_the_batch_as_each_optimizer_needs():
    # Adagrad from a zero accumulator (the run default): the same rate at any batch
    from_zero = [choose_sparse_learning_rate(0, "adagrad", batch)[0] for batch in (128, 2048)]
    assert from_zero == [0.05, 0.05]
    adagrad = [
        choose_sparse_learning_rate(0, "adagrad", batch, initial_accumulator=0.1)[0]
        for batch in (128, 512, 2048)
    ]
    assert adagrad[1] == pytest.approx(0.5)
    assert adagrad[0] == pytest.approx(0.25) and adagrad[2] == pytest.approx(1.0)  # sqrt
    sgd = [choose_sparse_learning_rate(0, "sgd", batch)[0] for batch in (256, 1024)]
    assert sgd[1] == pytest.approx(4 * sgd[0])  # linear
    assert (
        choose_sparse_learning_rate(0, "adam", 4096)[0]
        == choose_sparse_learning_rate(0, "adam", 256)[0]
    )
    assert choose_sparse_learning_rate(0.05, "adagrad", 4096)[0] == 0.05  # as configured


def test_an_auto_decay_is_cosine_to_the_end_of_the_run_and_constant_for_a_stream():
    auto = DenseOptimizerConfig(learning_rate=0.002, warmup_steps=10)
    decayed, reason = choose_decay(auto, last_step=110)
    assert (decayed.decay, decayed.decay_steps) == ("cosine", 100)
    assert "over the run's 100 steps after 10 of warmup" in reason
    schedule = make_schedule(decayed)
    assert float(schedule(9)) == pytest.approx(0.002)  # warmup ends at the peak
    assert float(schedule(60)) == pytest.approx(0.001, rel=1e-5)  # half way down
    assert float(schedule(110)) == pytest.approx(0.0, abs=1e-9)  # the last step: 0
    assert StreamSource.last_step is None  # what a followed stream's trainer passes
    stream, reason = choose_decay(auto, last_step=None)
    assert stream.decay == "constant" and "no last step" in reason
    assert float(make_schedule(stream)(10_000)) == pytest.approx(0.002)
    configured = DenseOptimizerConfig(decay="linear", decay_steps=7)
    assert choose_decay(configured, last_step=110) == (configured, None)
    # unresolved (no run: no length), "auto" is constant
    assert float(make_schedule(DenseOptimizerConfig())(10**6)) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="needs decay_steps"):
        DenseOptimizerConfig(decay="cosine")


def test_a_run_without_a_preset_resolves_every_auto_value_for_its_data(dataset):
    """Tower, batch, dim and rate are chosen from the dataset; the DLRM bottom MLP follows
    the dim; the resolved embedding config builds tables."""
    config = config_lib.load(TrainConfig, None, [f"data.path={json.dumps(str(dataset))}"])
    assert config.embedding.dim == 0 and config.embedding.optimizer.learning_rate == 0
    with pytest.raises(ValueError, match="auto"):
        plan_tables(config.embedding, read_metadata(dataset).categorical)
    metadata = read_metadata(dataset)
    resolved, choices = resolve_auto(config, metadata, divisor=8)
    assert resolved.model.tower == "dlrm"
    assert resolved.data.batch_size % 8 == 0 and resolved.data.batch_size >= 256
    assert resolved.embedding.dim in (8, 16, 32, 64, 128)
    assert resolved.model.dlrm.bottom_mlp[-1] == resolved.embedding.dim
    assert resolved.embedding.optimizer.learning_rate > 0
    assert [line.split(":")[0] for line in choices] == [
        "tower",
        "batch",
        "embedding dim",
        "embedding learning rate",
    ]
    assert all("auto" in line and "as configured" not in line for line in choices)
    assert (
        plan_tables(resolved.embedding, metadata.categorical).tables[0].dim
        == resolved.embedding.dim
    )


def test_a_preset_keeps_what_it_sets(dataset):
    config = config_lib.load(
        TrainConfig, "criteo_dlrm", [f"data.path={json.dumps(str(dataset))}"], preset_dir=PRESET_DIR
    )
    resolved, choices = resolve_auto(config, read_metadata(dataset), divisor=1)
    assert resolved.embedding == config.embedding
    assert resolved.data.batch_size == config.data.batch_size == 4096
    assert all("as configured" in line for line in choices)


def test_a_column_plan_splits_a_wide_table_of_few_hot_rows_only():
    """Rows spread by id hash balance a table of many distinct rows; a wide table whose
    batches hit two rows loads two shards, unless its columns are split."""
    from hybridrec.embedding_store import TableConfig
    from hybridrec.training.tables import TablePlan, plan_columns

    tables = (
        TableConfig(name="wide", dim=64, capacity=100),
        TableConfig(name="spread", dim=4, capacity=10_000),
    )
    plan = TablePlan(tables=tables, feature_tables={"hot": "wide", "many": "spread"})
    rng = np.random.default_rng(0)
    batches = [
        {
            "hot": rng.integers(1, 3, 32).astype(np.uint64),
            "many": rng.integers(1, 10**6, 32).astype(np.uint64),
        }
        for _ in range(10)
    ]
    planned, description = plan_columns(plan, batches, num_shards=4)
    splits = {table.name: table.column_shards for table in planned.tables}
    assert splits["wide"] > 1 and splits["spread"] == 1
    assert "sharding plan over 4 shards" in description
    balance = description.splitlines()[-1]  # "busiest shard / mean: X whole rows -> Y with ..."
    before = float(balance.split(": ")[1].split()[0])
    after = float(balance.split("-> ")[1].split()[0])
    assert after < before


def test_resolving_tables_with_a_planned_or_fixed_column_split(dataset):
    from hybridrec.common.errors import UserError
    from hybridrec.training.tables import resolve_tables

    metadata = read_metadata(dataset)
    base = [f"data.path={json.dumps(str(dataset))}", "embedding.fuse_tables=false"]
    fixed = config_lib.load(TrainConfig, None, [*base, "embedding.column_shards=2"])
    fixed, _ = resolve_auto(fixed, metadata, divisor=1)
    tables, lines = resolve_tables(fixed, metadata, num_shards=2)
    assert lines == () and {table.column_shards for table in tables.tables} == {2}
    planned = config_lib.load(TrainConfig, None, [*base, "embedding.column_shards=0"])
    planned, _ = resolve_auto(planned, metadata, divisor=1)
    with pytest.raises(UserError, match="embedding.num_shards"):
        resolve_tables(planned, metadata, num_shards=None)  # servers of unknown shard count
    tables, lines = resolve_tables(planned, metadata, num_shards=4)
    assert lines[0].startswith("sharding plan over 4 shards")
    assert lines[-1].startswith("  busiest shard / mean:")
    assert resolve_tables(planned, metadata, num_shards=4)[0] == tables  # the same sample


def test_a_default_bottom_mlp_follows_a_configured_dim_and_a_configured_one_stays(dataset):
    metadata = read_metadata(dataset)
    base = [f"data.path={json.dumps(str(dataset))}", "model.tower='dlrm'", "embedding.dim=32"]
    follows = config_lib.load(TrainConfig, None, base)
    assert resolve_auto(follows, metadata, divisor=1)[0].model.dlrm.bottom_mlp == (512, 256, 64, 32)
    stays = config_lib.load(TrainConfig, None, [*base, "model.dlrm.bottom_mlp=[64, 16]"])
    assert resolve_auto(stays, metadata, divisor=1)[0].model.dlrm.bottom_mlp == (64, 16)


def test_weight_decay_is_decoupled_and_adams_alone():
    import jax.numpy as jnp
    from hybridrec.model.step import make_optimizer

    optimizer, _ = make_optimizer(DenseOptimizerConfig(weight_decay=0.1))
    params = {"w": jnp.ones(3)}
    updates, _ = optimizer.update({"w": jnp.zeros(3)}, optimizer.init(params), params)
    # a zero gradient: the update is the decay alone, -rate * decay * w (AdamW)
    np.testing.assert_allclose(updates["w"], -1e-3 * 0.1 * np.ones(3), rtol=1e-5)
    with pytest.raises(ValueError, match="weight_decay must be >= 0 and is adam's"):
        DenseOptimizerConfig(name="sgd", weight_decay=0.1)
