"""Model, optimizer and mesh configs: presets, overrides, validation, schedules."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from hybridrec.common import config as config_lib
from hybridrec.common.errors import ConfigError
from hybridrec.model import DenseOptimizerConfig, MeshConfig, ModelConfig, make_optimizer
from hybridrec.training.config import PRESET_DIR


@pytest.mark.parametrize(
    ("preset", "tower"),
    [("model_criteo_dlrm", "dlrm"), ("model_criteo_dcnv2", "dcnv2"), ("model_persia_mlp", "mlp")],
)
def test_presets_load(preset, tower):
    config = config_lib.load(ModelConfig, preset, preset_dir=PRESET_DIR)
    assert config.tower == tower
    assert config_lib.from_dict(ModelConfig, config_lib.to_dict(config)) == config


def test_persia_preset_shape_and_overrides():
    config = config_lib.load(
        ModelConfig,
        "model_persia_mlp",
        ["compute_dtype=bfloat16", "mlp.hidden=[64, 32]"],
        preset_dir=PRESET_DIR,
    )
    assert config.mlp.hidden == (64, 32) and config.compute_dtype == "bfloat16"
    assert config_lib.load(ModelConfig, "model_persia_mlp", preset_dir=PRESET_DIR).mlp.hidden == (
        4096,
        2048,
        1024,
        512,
        256,
    )


def test_partition_rules_read_from_toml_lists():
    config = config_lib.from_dict(ModelConfig, {"partition_rules": [["mlp", "model"]]})
    assert config.partition_rules == (("mlp", "model"),)
    with pytest.raises(ConfigError, match="twice"):
        config_lib.from_dict(ModelConfig, {"partition_rules": [["mlp", "model"], ["mlp", "data"]]})


def test_unknown_and_invalid_keys_are_errors():
    with pytest.raises(ConfigError, match=r"dlrm\.top_mpl.*did you mean dlrm\.top_mlp"):
        config_lib.from_dict(ModelConfig, {"dlrm": {"top_mpl": [1]}})
    with pytest.raises(ConfigError, match="tower must be one of .* or a user's tower"):
        config_lib.from_dict(ModelConfig, {"tower": "transformer"})
    with pytest.raises(ConfigError, match="low_rank"):
        config_lib.from_dict(ModelConfig, {"dcnv2": {"low_rank": -1}})
    with pytest.raises(ConfigError, match="decay_steps"):
        config_lib.from_dict(DenseOptimizerConfig, {"decay": "cosine"})
    with pytest.raises(ConfigError, match="axis_names"):
        config_lib.from_dict(MeshConfig, {"shape": [4, 2], "axis_names": ["model", "data"]})
    with pytest.raises(ConfigError, match="differ in length"):
        config_lib.from_dict(MeshConfig, {"shape": [4, 2]})


def test_warmup_then_cosine_schedule():
    config = DenseOptimizerConfig(
        learning_rate=0.1,
        warmup_steps=4,
        decay="cosine",
        decay_steps=10,
        final_learning_rate_factor=0.1,
    )
    _, schedule = make_optimizer(config)
    values = np.array([float(schedule(step)) for step in range(20)])
    np.testing.assert_allclose(values[:4], [0.025, 0.05, 0.075, 0.1], rtol=1e-6)
    assert values[4] == pytest.approx(0.1)
    assert np.all(np.diff(values[4:15]) <= 1e-9)  # decays monotonically
    np.testing.assert_allclose(values[14:], 0.01, rtol=1e-5)  # floor = 0.1 * peak


def test_linear_decay_reaches_the_floor():
    _, schedule = make_optimizer(
        DenseOptimizerConfig(learning_rate=1.0, decay="linear", decay_steps=4)
    )
    np.testing.assert_allclose([float(schedule(s)) for s in range(6)], [1, 0.75, 0.5, 0.25, 0, 0])


@pytest.mark.parametrize(
    "optimizer",
    [
        DenseOptimizerConfig(name="sgd", learning_rate=0.1, momentum=0.9),
        DenseOptimizerConfig(name="adagrad", learning_rate=0.5),
        DenseOptimizerConfig(name="adam", learning_rate=0.1, gradient_clip_norm=1.0),
    ],
)
def test_each_optimizer_minimizes_a_quadratic(optimizer):
    tx, _ = make_optimizer(optimizer)
    target = np.array([1.0, -2.0, 3.0], np.float32)
    params = {"w": np.zeros(3, np.float32)}
    state = tx.init(params)
    for _ in range(100):
        grads = {"w": 2 * (params["w"] - target)}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert np.linalg.norm(np.asarray(params["w"]) - target) < 0.1
