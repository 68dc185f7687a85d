"""Shared fixtures of the dense-model tests: tiny configs and deterministic batches."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hybridrec.model import (
    DCNv2Config,
    DenseOptimizerConfig,
    DHENConfig,
    DLRMConfig,
    MeshConfig,
    MLPConfig,
    ModelConfig,
    make_mesh,
)

NUM_DENSE = 6  # DCN-V2 width 6 + 3 * 8 = 30 splits over a model axis of 2
NUM_FEATURES = 3
EMBEDDING_DIM = 8
ROWS = 32  # global batch of most tests
# Tests share one tower/optimizer/batch shape where they can, so JAX's compilation cache
# serves later tests (the multi-process worker uses the same values).
OPTIMIZER = DenseOptimizerConfig(
    name="adam", learning_rate=1e-2, warmup_steps=2, decay="cosine", decay_steps=10
)


def tiny_model_config(tower: str, **overrides) -> ModelConfig:
    """Small towers whose hidden widths shard over a model axis of size 2."""
    return ModelConfig(
        tower=tower,
        dlrm=DLRMConfig(bottom_mlp=(16, EMBEDDING_DIM), top_mlp=(32, 16)),
        dcnv2=DCNv2Config(num_cross_layers=2, low_rank=0, deep_mlp=(32, 16)),
        mlp=MLPConfig(hidden=(32, 16, 8)),
        dhen=DHENConfig(
            num_layers=1,
            bottom_mlp=(16, EMBEDDING_DIM),
            module_mlp=(16,),
            top_mlp=(32, 16),
            cross_low_rank=4,
        ),
        min_sharded_width=8,
        **overrides,
    )


def make_batch(seed: int, rows: int, *, num_features: int = NUM_FEATURES) -> dict[str, np.ndarray]:
    """A host batch: embeddings [rows, F, D], dense [rows, NUM_DENSE], labels [rows]."""
    rng = np.random.default_rng(seed)
    return {
        "embeddings": rng.normal(scale=0.5, size=(rows, num_features, EMBEDDING_DIM)).astype(
            np.float32
        ),
        "dense": rng.normal(size=(rows, NUM_DENSE)).astype(np.float32),
        "labels": (rng.random(rows) < 0.3).astype(np.float32),
    }


@pytest.fixture
def dims() -> dict[str, int]:
    return {"num_dense": NUM_DENSE, "num_features": NUM_FEATURES, "embedding_dim": EMBEDDING_DIM}


@pytest.fixture
def tiny_config():
    """`tiny_config(tower, **overrides) -> ModelConfig`."""
    return tiny_model_config


@pytest.fixture
def batch_factory():
    """`batch_factory(seed, rows) -> dict of host arrays`."""
    return make_batch


def _aligned(value: np.ndarray) -> np.ndarray:
    raw = np.empty(value.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start : start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    return out


@pytest.fixture
def aligned():
    """`aligned(array)`: a copy at a 64-byte boundary, memory that JAX's CPU client would
    share instead of copying (to test that host arrays are copied, not shared)."""
    return _aligned


@pytest.fixture
def optimizer() -> DenseOptimizerConfig:
    return OPTIMIZER


@pytest.fixture
def data_model_mesh():
    """A ("data", "model") mesh of every device: 4 x 2 on the 8-device CPU mesh, data only
    where fewer devices do not split in two (one GPU)."""
    shape = (4, 2) if jax.device_count() == 8 else (-1, 1)
    return make_mesh(MeshConfig(shape=shape, axis_names=("data", "model")))
