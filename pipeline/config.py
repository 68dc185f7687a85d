"""What one preprocessing run does: inputs, output, spec, split, chunking and runner."""

from __future__ import annotations

import dataclasses

from hybridrec.common.errors import UserError

INPUT_FORMATS = ("auto", "text", "parquet")
SPLIT_MODES = ("position", "hash")
COMPRESSIONS = ("zstd", "snappy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """The arguments of `pipeline.run_preprocess` (the flags of `hybridrec preprocess`)."""

    inputs: tuple[str, ...]  # input files or globs, in order (local or any Beam filesystem)
    output: str  # output directory (local path or gs://, s3://, ...)
    spec: str = "criteo"  # built-in spec name or spec TOML file
    input_format: str = "auto"  # auto: .parquet/.pq names are Parquet, others text
    split: str = "position"  # position: last eval_fraction of lines is eval; hash: by row hash
    eval_fraction: float = 0.1  # fraction of rows in the eval split, in [0, 1)
    # fraction of rows in a "valid" split for tuning and stopping (click logs): under a
    # position split the lines just before eval's, under a hash split a range of the row
    # hash beside eval's; 0 = none
    valid_fraction: float = 0.0
    chunk_mb: float = 32.0  # uncompressed text is cut into equal chunks of at most this many MB
    block_mb: float = 16.0  # MB of text parsed per batch
    compression: str = "zstd"  # Parquet codec
    bucket_mb: float = 64.0  # event logs: MB of input a bucket of users holds, about
    overwrite: bool = False  # replace a complete output directory
    runner: str = "direct"  # Beam runner: a short name (see pipeline.RUNNER_NAMES) or a class path
    dask_address: str | None = None  # dask runner: tcp://HOST:PORT of a running scheduler
    dask_workers: int = 0  # dask runner without an address: local worker processes; 0 = cores
    dask_timeout: float = 10.0  # dask runner: seconds to wait for the scheduler to answer

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(str(path) for path in self.inputs))
        object.__setattr__(self, "output", str(self.output).rstrip("/") or "/")
        if not self.inputs:
            raise UserError("--input: give at least one file or glob")
        if self.input_format not in INPUT_FORMATS:
            raise UserError(f"--input-format must be one of {', '.join(INPUT_FORMATS)}")
        if self.split not in SPLIT_MODES:
            raise UserError(f"--split must be one of {', '.join(SPLIT_MODES)}")
        if self.compression not in COMPRESSIONS:
            raise UserError(f"--compression must be one of {', '.join(COMPRESSIONS)}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise UserError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if not 0.0 <= self.valid_fraction < 1.0 or self.eval_fraction + self.valid_fraction >= 1:
            raise UserError(
                f"--valid-fraction must be in [0, 1) and leave rows to train beside "
                f"--eval-fraction {self.eval_fraction:g}, got {self.valid_fraction:g}"
            )
        if self.chunk_mb <= 0 or self.block_mb <= 0 or self.bucket_mb <= 0:
            raise UserError("--chunk-mb, --block-mb and --bucket-mb must be positive")
        if self.dask_workers < 0:
            raise UserError(f"--dask-workers must be >= 0, got {self.dask_workers}")
        if self.dask_timeout <= 0:
            raise UserError(f"--dask-timeout must be positive, got {self.dask_timeout}")

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 2**20)

    @property
    def block_bytes(self) -> int:
        return int(self.block_mb * 2**20)
