"""The "auto" config values a run resolves for its dataset (training.defaults)."""

from __future__ import annotations

import json

import pytest

from common import config as config_lib
from pipeline import read_metadata
from training.config import PRESET_DIR, TrainConfig
from training.defaults import (
    choose_batch_size,
    choose_embedding_dim,
    choose_sparse_learning_rate,
    resolve_auto,
)
from training.tables import plan_tables


def test_auto_batch_aims_at_about_200_steps_in_a_power_of_two_range():
    assert choose_batch_size(0, 117_000, 1)[0] == 512
    assert choose_batch_size(0, 1_000, 1)[0] == 256  # the floor
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
    adagrad = [choose_sparse_learning_rate(0, "adagrad", batch)[0] for batch in (128, 512, 2048)]
    assert adagrad[1] == pytest.approx(0.5)
    assert adagrad[0] == pytest.approx(0.25) and adagrad[2] == pytest.approx(1.0)  # sqrt
    sgd = [choose_sparse_learning_rate(0, "sgd", batch)[0] for batch in (256, 1024)]
    assert sgd[1] == pytest.approx(4 * sgd[0])  # linear
    assert (
        choose_sparse_learning_rate(0, "adam", 4096)[0]
        == choose_sparse_learning_rate(0, "adam", 256)[0]
    )
    assert choose_sparse_learning_rate(0.05, "adagrad", 4096)[0] == 0.05  # as configured


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
