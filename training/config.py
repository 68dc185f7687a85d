"""The configuration of a hybrid training run (`hybridrec train --config PRESET --set a.b=c`).

Presets live in `training/configs/` (`criteo_dlrm`, `quickstart`, ...); every key
can be overridden on the command line, and an unknown key is an error.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from hybridrec.common import config as config_lib
from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSConfig
from hybridrec.embedding_store import (
    AdmissionConfig,
    EvictionConfig,
    InitializerConfig,
    SparseOptimizerConfig,
    TableConfig,
    TieringConfig,
)
from hybridrec.model.config import DenseOptimizerConfig, MeshConfig, ModelConfig
from hybridrec.training.checkpoint import CONFIG_FILE

PRESET_DIR = Path(__file__).parent / "configs"  # built-in presets, by file stem


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Which preprocessed data, in which batches and order."""

    path: str = ""  # directory written by `hybridrec preprocess` (holds metadata.json)
    train_split: str = "train"  # split to train on
    eval_split: str = "eval"  # split to evaluate on
    # global batch: rows per training step over all processes; 0 = chosen from the size of
    # the training split (about 200 steps per epoch, a power of two within [256, 4096])
    batch_size: int = 0
    eval_batch_size: int = 0  # global rows per evaluation step; 0 = batch_size
    shuffle_buffer: int = 131072  # minimum rows per shuffle window; 0 = read in file order
    epochs: int = 1  # passes over the training split (when max_steps = 0)
    max_steps: int = 0  # stop after this many steps; 0 = run `epochs` epochs
    prefetch: int = 4  # batches decoded ahead by the input thread
    # threads reading and shuffling the Parquet windows after the current one, a window
    # each (so up to this many windows of `shuffle_buffer` rows are held ahead);
    # 0 = auto: half the machine's cores, at most 8 (1 on a 2-core machine)
    read_threads: int = 0
    # every training process reads the global batch stream and keeps its rows: the data
    # order is the same for any number of processes, so a run resumed on another count
    # goes on as it would have; false: each reads its own share of the files (less I/O)
    global_order: bool = False
    # sequence runs: positions per batch; the rows of a batch are token_budget /
    # model.sequence.max_length (0: batch_size rows)
    token_budget: int = 0

    def __post_init__(self):
        if self.batch_size < 0 or self.eval_batch_size < 0:
            raise ValueError("data.batch_size (0 = auto) and eval_batch_size must be >= 0")
        if (
            self.epochs < 1
            or self.max_steps < 0
            or self.shuffle_buffer < 0
            or self.prefetch < 1
            or self.read_threads < 0
        ):
            raise ValueError(
                "data.epochs and prefetch must be >= 1; max_steps, shuffle_buffer and "
                "read_threads (0 = auto) >= 0"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingOptimizerConfig(SparseOptimizerConfig):
    """The store's per-row optimizer as a run configures it: the same keys, but the step
    size defaults to 0 = auto (chosen for the optimizer and batch size, training.defaults),
    and Adagrad's accumulators start at 0, as FBGEMM's (TorchRec) do: a new row's first
    step is the full rate (measured on the Criteo sample: docs/training.md)."""

    learning_rate: float = 0.0
    initial_accumulator: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingConfig:
    """The embedding tables (one per table named in the dataset's feature spec) and their store."""

    # values per embedding row (all tables; the dense tower sees [B, F, dim]); 0 = auto: a
    # power of two near the fourth root of the largest feature's distinct ids (training.defaults)
    dim: int = 0
    capacity: int = 4_000_000  # maximum rows per table across all shards
    pooling: Literal["sum", "mean", "sqrtn"] = "sum"  # how multi-valued features are pooled
    initializer: InitializerConfig = dataclasses.field(
        default_factory=InitializerConfig
    )  # new rows
    # per-row sparse optimizer
    optimizer: EmbeddingOptimizerConfig = dataclasses.field(
        default_factory=EmbeddingOptimizerConfig
    )
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)  # new ids
    eviction: EvictionConfig = dataclasses.field(default_factory=EvictionConfig)  # dropping rows
    storage_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # stored value dtype
    # hot rows in RAM, the rest in a tensorstore array on disk (tiering.ram_rows = 0: all in RAM)
    tiering: TieringConfig = dataclasses.field(default_factory=TieringConfig)
    # shards: in-process count (None = one per two CPU cores, 1 to 4); with servers, None =
    # what they host, and a number
    # is checked against the servers' total shard count
    num_shards: int | None = None
    # remote shard servers "host:port" (`hybridrec serve-embeddings`); empty = in-process shards
    servers: tuple[str, ...] = ()
    # with servers: dtype of looked-up rows and gradients on the wire (servers keep float32
    # rows and optimizer math); bfloat16 / float16 halve the float bytes
    wire_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # with servers: TLS to them (PEM paths): `ca` verifies their certificates (connects over
    # grpc+tls://; the token then only travels encrypted), `cert` + `key` for mutual TLS
    tls: TLSConfig = dataclasses.field(default_factory=TLSConfig)
    # keep the rows of every feature in one physical table (ids carry a per-feature prefix, so
    # they never collide): one store request per shard and batch instead of one per table, as
    # table-batched embeddings do; capacity and tiering.ram_rows then count per feature table
    fuse_tables: bool = True
    # split each table's columns over this many shards, on top of the rows' split by id
    # (ZionEX's column-wise sharding, embedding_store.columns): 1 = whole rows; 0 = planned per
    # table at start-up from the ids of the first training batches and printed
    column_shards: int = 1
    # map each feature's ids to a fixed budget of rows (`hybridrec learn-hash` writes the map
    # from a previous run, training.learned_hash): "" = every id its own row
    id_map: str = ""
    # with id_map: "learned" (frequent ids alone, the tail grouped by the previous run's
    # embeddings) or "hashing_trick" (the same budgets, ids hashed into them)
    id_map_kind: Literal["learned", "hashing_trick"] = "learned"
    # bytes per device for embedding rows kept on the devices, looked up and trained inside
    # the jitted step (synchronously): the planner (training.device.plan) puts the smallest
    # tables there first; -1 = auto, a quarter of a device's free memory; 0 = all on the host
    device_budget: int = -1
    # per spec table, overriding the planner: "host"; "device" with optional ":ROWS"
    # (default: from the dataset's distinct ids) and ":sharded" / ":replicated" (default:
    # replicated up to 4 MiB), e.g. "device:200000:sharded"; or "cache" (a hot-row cache on
    # the devices in front of the host table) with the same options, ROWS its capacity
    # (default: planned from the budget), e.g. "cache:50000"
    placement: dict[str, str] = dataclasses.field(default_factory=dict)
    # who maps a batch's ids to the rows of the tables held whole on the devices: "host"
    # (training.device.held_rows: deduplicated and looked up beside the step), "devices" (the
    # step, in a hash table on the devices: model.device_ids; single-valued features, no
    # hot-row caches, click logs), "auto" = the devices on an accelerator, the host on CPU
    map_ids: Literal["auto", "host", "devices"] = "auto"

    def __post_init__(self):
        if (
            self.dim < 0
            or self.capacity < 1
            or (self.num_shards is not None and self.num_shards < 1)
        ):
            raise ValueError(
                "embedding.dim must be >= 0 (0 = auto); capacity and num_shards must be >= 1"
            )
        if self.column_shards < 0:
            raise ValueError(
                f"embedding.column_shards must be >= 1, or 0 to plan it; got {self.column_shards}"
            )
        if self.device_budget < -1:
            raise ValueError(
                f"embedding.device_budget must be bytes >= 0, or -1 (auto); got {self.device_budget}"
            )
        for table, where in self.placement.items():
            parse_placement(table, where)

    def table(self, name: str) -> TableConfig:
        return TableConfig(
            name=name,
            dim=self.dim,
            capacity=self.capacity,
            initializer=self.initializer,
            optimizer=self.optimizer,
            admission=self.admission,
            eviction=self.eviction,
            storage_dtype=self.storage_dtype,
            tiering=self.tiering,
            column_shards=max(self.column_shards, 1),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """PERSIA's hybrid schedule: embeddings async with bounded staleness, dense sync."""

    # k: at most k batches looked up whose gradients are not yet applied when a new lookup is
    # issued (the lookup of batch t may miss the updates of batches t-k..t-1); 0 = synchronous
    staleness: int = 4
    # lookups issued ahead of the batch being trained (each still within the bound k):
    # 1 hides the store's latency behind one dense step; 0 = as far ahead as k allows
    lookahead: int = 1
    # after dispatching a dense step, the trainer waits until at most this many dispatched
    # steps are unfinished before taking the next batch (0 = never waits). Running further
    # ahead of the devices adds no speed, only staleness: the lookups it lets out early
    # miss updates that waiting would have seen (at batch 512 the measured staleness falls
    # from 4.0 to 2.6 with 1). 1 still keeps the next step queued behind the running one.
    steps_ahead: int = 1
    # nice-value increment of the input and lookup threads (and the store workers they
    # start), so host work yields the cores to the dense step on CPU hosts; 0 = unchanged.
    # Only with staleness > 0: with k = 0 the step waits for that work anyway
    background_nice: int = 10

    def __post_init__(self):
        if self.staleness < 0 or self.lookahead < 0 or self.steps_ahead < 0:
            raise ValueError("hybrid.staleness, lookahead and steps_ahead must be >= 0")
        if not 0 <= self.background_nice <= 19:
            raise ValueError(
                f"hybrid.background_nice must be in [0, 19], got {self.background_nice}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation on the eval split."""

    # evaluate every this many steps; 0 = only at the end; -1 = auto: about once an epoch
    # where the run keeps its best checkpoint (`checkpoint.keep_best`), bounded in steps
    # and by the evaluation's share of the time (`training.stopping`), else 0
    every_steps: int = -1
    max_batches: int = (
        0  # batches per periodic evaluation; 0 = the whole split (final: always whole)
    )

    # sequence runs: rank the target among every training item except the user's earlier
    # ones (true), or among all of them (false); both are reported, this one unsuffixed
    exclude_history: bool = True
    # sequence runs: "full" ranking of every item, or also "sampled_100", the target among
    # 100 sampled items as older papers report (its keys suffixed `_sampled100`)
    ranking: Literal["full", "sampled_100"] = "full"

    def __post_init__(self):
        if self.every_steps < -1 or self.max_batches < 0:
            raise ValueError(
                "eval.every_steps must be >= 0 (-1: auto) and eval.max_batches >= 0, got "
                f"{self.every_steps} and {self.max_batches}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints of dense state, data position and embeddings at one step."""

    every_steps: int = 0  # checkpoint every this many steps; 0 = only at the end
    keep: int = 2  # complete checkpoints kept
    # an evaluation metric ("hr@10", "ndcg@10", "auc", "logloss", ...): the checkpoint with
    # its best value on the eval split is kept besides the newest `keep` (every evaluation
    # then checkpoints), and `evaluate` / `export` read it by default; lower is better for
    # "logloss" and "ne". "auto": the task's metric (HR@10, AUC) where the run evaluates a
    # validation split of its own (sequence runs; click logs with a "valid" split), else
    # none; "" = none
    keep_best: str = "auto"
    # embedding rows and optimizer state on disk: fp32 (exact), fp16, or int8 / int4 row-wise
    # quantized (per-row scale and bias; ids exact); a restore reads the precision it was written at
    precision: Literal["fp32", "fp16", "int8", "int4"] = "fp32"

    def __post_init__(self):
        if self.every_steps < 0 or self.keep < 1:
            raise ValueError("checkpoint.every_steps must be >= 0 and keep >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoppingConfig:
    """When a run that keeps its best checkpoint stops before `data.epochs`
    (`training.stopping`; docs/training.md, "Training that stops at its best")."""

    # evaluations in a row without a better `checkpoint.keep_best` figure after which the
    # run stops (data.epochs is then a cap); 0 = never early; -1 = auto: 5 where the run
    # keeps a best checkpoint, else 0
    patience: int = -1

    def __post_init__(self):
        if self.patience < -1:
            raise ValueError(
                f"train.patience must be >= 0 (0 = off, -1 = auto), got {self.patience}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Metrics and progress output."""

    every_steps: int = 50  # fetch metrics from the devices and write a record every this many steps
    tensorboard: bool = True  # also write TensorBoard event files
    progress_interval: float = 2.0  # seconds between progress lines
    # trace steps profile_from .. profile_from + profile_steps - 1 with jax.profiler into
    # <run dir>/profile and sum up where their time went (0 = no trace); the traced steps
    # run slower
    profile_from: int = 0
    profile_steps: int = 20

    def __post_init__(self):
        if self.every_steps < 1 or self.progress_interval < 0:
            raise ValueError("log.every_steps must be >= 1 and progress_interval >= 0")
        if self.profile_from < 0 or self.profile_steps < 1:
            raise ValueError("log.profile_from must be >= 0 and log.profile_steps >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run needs besides the data files themselves."""

    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # input
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)  # dense tower
    optimizer: DenseOptimizerConfig = dataclasses.field(
        default_factory=DenseOptimizerConfig
    )  # dense optimizer
    embedding: EmbeddingConfig = dataclasses.field(default_factory=EmbeddingConfig)  # tables
    hybrid: HybridConfig = dataclasses.field(default_factory=HybridConfig)  # staleness bound
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)  # device mesh
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)  # evaluation schedule
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)  # saves
    train: StoppingConfig = dataclasses.field(default_factory=StoppingConfig)  # early stop
    log: LogConfig = dataclasses.field(default_factory=LogConfig)  # metrics output
    seed: int = 0  # dense initialization and data order


def parse_placement(table: str, where: str) -> tuple[str, int, str]:
    """`embedding.placement.<table>` -> (place "host" | "device" | "cache", rows (0: planned), layout
    "" | "sharded" | "replicated"); a ValueError naming the key for anything else."""
    place, *options = where.split(":")
    rows, layout = 0, ""
    for option in options:
        if option.isdigit() and int(option) > 0 and not rows:
            rows = int(option)
        elif option in ("sharded", "replicated") and not layout:
            layout = option
        else:
            place = ""
    if place not in ("device", "cache", "host") or (place == "host" and options):
        raise ValueError(
            f'embedding.placement.{table} = {where!r}: use "host", or "device" or "cache" with '
            'optional ":ROWS" (ROWS > 0) and ":sharded" or ":replicated"'
        )
    return place, rows, layout


def load_config(
    preset: str | Path | None = None,
    overrides: Sequence[str] = (),
    run_dir: str | Path | None = None,
) -> TrainConfig:
    """A run's configuration: a preset name (`training/configs/`) or TOML file, plus
    `section.key=value` overrides; without a preset, the config saved in `run_dir` (to
    resume, evaluate or export it) plus the overrides, else the defaults."""
    if preset is None and run_dir is not None and (Path(run_dir) / CONFIG_FILE).exists():
        saved_file = Path(run_dir) / CONFIG_FILE
        saved = json.loads(saved_file.read_text())
        try:
            return config_lib.from_dict(
                TrainConfig, config_lib.apply_overrides(saved, list(overrides))
            )
        except UserError as error:
            raise UserError(f"{saved_file}: {error}") from None
    preset = str(preset) if preset is not None else None
    return config_lib.load(TrainConfig, preset, list(overrides), preset_dir=PRESET_DIR)
