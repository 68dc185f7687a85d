"""What an embedding table is: its shape, initializer, optimizer, admission, eviction, storage.

These are plain frozen configs built with `common.config` (TOML presets and
`key=value` overrides). How rows are sharded lives in `routing.py`, how they are
stored in `_storage.py` and `checkpoint.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Literal

from hybridrec.common import config as common_config
from hybridrec.common import sparse_rules
from hybridrec.common.errors import UserError

StorageDtype = Literal["float32", "bfloat16", "float16"]
OptimizerName = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitializerConfig:
    """How a new row gets its values: a pure function of (seed, id, column)."""

    kind: Literal["uniform", "normal", "zeros"] = "uniform"  # distribution of initial values
    low: float = -0.01  # uniform: lower bound (inclusive)
    high: float = 0.01  # uniform: upper bound (exclusive)
    mean: float = 0.0  # normal: mean
    stddev: float = 0.01  # normal: standard deviation
    seed: int = 0  # with the id and column, fixes every initial value on every shard and run

    def __post_init__(self):
        if self.kind == "uniform" and not self.low < self.high:
            raise ValueError(f"initializer: low ({self.low}) must be < high ({self.high})")
        if self.kind == "normal" and self.stddev < 0:
            raise ValueError(f"initializer.stddev must be >= 0, got {self.stddev}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"initializer.seed must be in [0, 2**63), got {self.seed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseOptimizerConfig:
    """Per-row optimizer applied by the shards; the math follows optax's dense versions."""

    name: OptimizerName = (
        "adagrad"  # sgd | adagrad | rowwise_adagrad (one accumulator per row) | adam
    )
    # step size; 0 = not chosen yet (a trainer picks one for its batch: training.defaults),
    # a table needs a positive one
    learning_rate: float = 0.01
    initial_accumulator: float = (
        0.1  # adagrad / rowwise_adagrad: accumulator of a new row (optax: 0.1)
    )
    epsilon: float | None = None  # numerical floor; None = optax default (adagrad 1e-7, adam 1e-8)
    beta1: float = 0.9  # adam: first-moment decay
    beta2: float = 0.999  # adam: second-moment decay

    def __post_init__(self):
        if not self.learning_rate >= 0 or not math.isfinite(self.learning_rate):
            raise ValueError(
                f"optimizer.learning_rate must be > 0 (0 = auto), got {self.learning_rate}"
            )
        if self.initial_accumulator < 0:
            raise ValueError(
                f"optimizer.initial_accumulator must be >= 0, got {self.initial_accumulator}"
            )
        if self.epsilon is not None and self.epsilon < 0:
            raise ValueError(f"optimizer.epsilon must be >= 0, got {self.epsilon}")
        for field in ("beta1", "beta2"):
            if not 0 <= getattr(self, field) < 1:
                raise ValueError(f"optimizer.{field} must be in [0, 1), got {getattr(self, field)}")

    @property
    def eps(self) -> float:
        """The epsilon in use (the optax default for this optimizer when unset)."""
        if self.epsilon is not None:
            return self.epsilon
        return 1e-8 if self.name == "adam" else 1e-7

    def state_width(self, dim: int) -> int:
        """Float32 optimizer-state columns per row."""
        return sparse_rules.state_width(self.name, dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """When a never-seen id gets a row; until then it reads as zeros and takes no update."""

    min_count: int = 1  # training lookups of an id before it may be admitted (1 = at first sight)
    probability: float = 1.0  # chance of admission per sighting once min_count is reached
    seed: int = 0  # makes the probabilistic draw a pure function of (seed, id, sighting)

    def __post_init__(self):
        if self.min_count < 1:
            raise ValueError(f"admission.min_count must be >= 1, got {self.min_count}")
        if not 0 < self.probability <= 1:
            raise ValueError(f"admission.probability must be in (0, 1], got {self.probability}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"admission.seed must be in [0, 2**63), got {self.seed}")

    @property
    def admits_all(self) -> bool:
        """True when every id is admitted at first sight (no counters are kept)."""
        return self.min_count == 1 and self.probability >= 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvictionConfig:
    """Which rows are dropped: least recently used at capacity, and/or idle for too long."""

    policy: Literal["lru", "none"] = (
        "lru"  # at capacity: drop least-recently-used rows, or refuse new ids
    )
    lru_batch_fraction: float = 0.01  # share of a shard's capacity freed per LRU eviction round
    ttl_steps: int = 0  # drop rows not updated for more than this many training steps (0 = off)
    ttl_sweep_every: int = 0  # steps between TTL sweeps; 0 = max(1, ttl_steps // 8)

    def __post_init__(self):
        if not 0 < self.lru_batch_fraction <= 1:
            raise ValueError(
                f"eviction.lru_batch_fraction must be in (0, 1], got {self.lru_batch_fraction}"
            )
        if self.ttl_steps < 0:
            raise ValueError(f"eviction.ttl_steps must be >= 0, got {self.ttl_steps}")
        if self.ttl_sweep_every < 0:
            raise ValueError(f"eviction.ttl_sweep_every must be >= 0, got {self.ttl_sweep_every}")

    @property
    def sweep_interval(self) -> int:
        return self.ttl_sweep_every or max(1, self.ttl_steps // 8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TieringConfig:
    """Hot rows in RAM, the rest in a tensorstore array on disk or object storage."""

    ram_rows: int = 0  # rows of the table kept in RAM across all shards (0 = all rows in RAM)
    path: str = (
        ""  # cold-tier location: local directory or kvstore URL ("" = a temporary directory)
    )
    chunk_rows: int = 4096  # rows per chunk of the cold-tier zarr3 array (per-chunk cost dominates)
    evict_fraction: float = 0.125  # share of the RAM rows written back per eviction round (bulk)

    def __post_init__(self):
        if self.ram_rows < 0:
            raise ValueError(f"tiering.ram_rows must be >= 0, got {self.ram_rows}")
        if self.chunk_rows < 1:
            raise ValueError(f"tiering.chunk_rows must be >= 1, got {self.chunk_rows}")
        if not 0 < self.evict_fraction <= 1:
            raise ValueError(f"tiering.evict_fraction must be in (0, 1], got {self.evict_fraction}")

    @property
    def enabled(self) -> bool:
        return self.ram_rows > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table. Several features may share it (see `feature_tables`)."""

    name: str  # table name, unique within a store
    dim: int  # values per row
    capacity: int  # maximum rows across all shards; each shard holds ceil(capacity / num_shards)
    initializer: InitializerConfig = dataclasses.field(
        default_factory=InitializerConfig
    )  # new rows
    optimizer: SparseOptimizerConfig = dataclasses.field(
        default_factory=SparseOptimizerConfig
    )  # updates
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)  # new ids
    eviction: EvictionConfig = dataclasses.field(default_factory=EvictionConfig)  # dropping rows
    storage_dtype: StorageDtype = "float32"  # dtype of stored values; optimizer state stays float32
    tiering: TieringConfig = dataclasses.field(
        default_factory=TieringConfig
    )  # RAM budget + cold tier
    # split each row's columns into this many equal slices, each routed to another shard
    # (1 = whole rows); `embedding_store.columns.plan_column_shards` proposes it per table
    column_shards: int = 1
    # set on a column slice only: the first column of the whole table that this slice holds
    first_column: int = 0

    def __post_init__(self):
        if not self.name or not all(c.isalnum() or c in "_-." for c in self.name):
            raise ValueError(
                f"table name {self.name!r} must be non-empty and use only letters, digits, _ - ."
            )
        if self.dim < 1:
            raise ValueError(f"table {self.name}: dim must be >= 1, got {self.dim}")
        if self.capacity < 1:
            raise ValueError(f"table {self.name}: capacity must be >= 1, got {self.capacity}")
        if self.column_shards < 1 or self.dim % self.column_shards:
            raise ValueError(
                f"table {self.name}: column_shards must be >= 1 and divide dim {self.dim}, "
                f"got {self.column_shards}"
            )
        if self.column_shards > 1 and self.optimizer.name == "rowwise_adagrad":
            raise ValueError(
                f"table {self.name}: rowwise_adagrad needs whole rows (one accumulator per "
                "row); use column_shards = 1 or another optimizer"
            )
        if self.first_column < 0:
            raise ValueError(f"table {self.name}: first_column must be >= 0")
        if not self.optimizer.learning_rate > 0:
            raise ValueError(f"table {self.name}: optimizer.learning_rate must be > 0")

    def shard_capacity(self, num_shards: int) -> int:
        """Rows one shard may hold."""
        return -(-self.capacity // num_shards)

    def shard_ram_rows(self, num_shards: int) -> int:
        """Hot rows one shard keeps in RAM when tiered (0 = not tiered)."""
        return -(-self.tiering.ram_rows // num_shards) if self.tiering.enabled else 0


def load_tables(source: str | Path) -> list[TableConfig]:
    """Reads TableConfigs from a TOML file (JSON where the name ends in `.json`).

    The file holds one list of tables, either at the top level (`[[tables]]`) or in one
    section (`[[embedding.tables]]`).
    """
    path = Path(source)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: no such table config file") from None
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: invalid JSON: {error}") from None
    else:
        path = common_config.resolve_preset(source)
        data = common_config.read_toml(path)
    found = [("tables", data.get("tables"))] if isinstance(data, dict) else []
    if isinstance(data, dict):
        found += [
            (f"{key}.tables", value["tables"])
            for key, value in data.items()
            if isinstance(value, dict) and "tables" in value
        ]
    found = [(where, value) for where, value in found if value is not None]
    if isinstance(data, list):
        found = [("", data)]
    if len(found) != 1 or not isinstance(found[0][1], list) or not found[0][1]:
        raise UserError(
            f"{path}: expected exactly one non-empty list of tables "
            "(`[[tables]]` or `[[<section>.tables]]`)"
        )
    where, items = found[0]
    tables = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise UserError(f"{path}: {where}[{i}] is not a table")
        try:
            tables.append(common_config.from_dict(TableConfig, item, where=f"{where}[{i}]"))
        except UserError as error:
            raise UserError(f"{path}: {error}") from None
    names = [table.name for table in tables]
    if len(set(names)) != len(names):
        raise UserError(f"{path}: table names repeat: {names}")
    return tables
