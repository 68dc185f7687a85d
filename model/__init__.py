"""Dense side of hybridrec: Flax towers and the synchronous sharded train step.

Public API (see docs/model.md):
    ModelConfig, DLRMConfig, DCNv2Config, DHENConfig, MLPConfig, DenseOptimizerConfig, MeshConfig
    make_mesh, maybe_initialize_distributed, make_global_batch, local_rows
    create_train_state, abstract_train_state, TrainState
    make_train_step, make_eval_step, train_step, eval_step, fetch_metrics, NonFiniteLossError,
    check_finite_losses
    StreamingMetrics, build_tower, forward_flops_per_example
"""

from hybridrec.model.config import (
    DATA_AXIS,
    MODEL_AXIS,
    DCNv2Config,
    DenseOptimizerConfig,
    DHENConfig,
    DLRMConfig,
    MeshConfig,
    MLPConfig,
    ModelConfig,
)
from hybridrec.model.distributed import local_rows, make_global_batch, maybe_initialize_distributed
from hybridrec.model.metrics import StreamingMetrics
from hybridrec.model.sharding import make_mesh
from hybridrec.model.step import (
    NonFiniteLossError,
    ShardedStep,
    TrainState,
    abstract_train_state,
    check_finite_losses,
    create_train_state,
    eval_step,
    fetch_metrics,
    make_eval_step,
    make_optimizer,
    make_train_step,
    train_step,
)
from hybridrec.model.towers import build_tower, forward_flops_per_example

__all__ = [
    "DATA_AXIS",
    "MODEL_AXIS",
    "DCNv2Config",
    "DHENConfig",
    "DLRMConfig",
    "DenseOptimizerConfig",
    "MLPConfig",
    "MeshConfig",
    "ModelConfig",
    "NonFiniteLossError",
    "ShardedStep",
    "StreamingMetrics",
    "TrainState",
    "abstract_train_state",
    "build_tower",
    "check_finite_losses",
    "create_train_state",
    "eval_step",
    "fetch_metrics",
    "forward_flops_per_example",
    "local_rows",
    "make_eval_step",
    "make_global_batch",
    "make_mesh",
    "make_optimizer",
    "make_train_step",
    "maybe_initialize_distributed",
    "train_step",
]
