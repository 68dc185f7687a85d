"""Apache Beam preprocessing: raw click logs -> sharded Parquet + metadata.json.

Public surface:
    read_metadata(out_dir) -> DatasetMetadata   the trainer's view of a dataset directory
    load_spec(name_or_path) -> FeatureSpec       built-in (`criteo`, `avazu`) or a spec file
    run_preprocess(PreprocessConfig(...))        the whole job: Beam pipeline, metadata, _SUCCESS
    Preprocess                                   the Beam PTransform of the job
    generate(path, rows, seed=...)               synthetic Criteo-format logs
    list_chunks, count_lines, process_chunk, SplitRule, BlockParser, ParquetParser,
    PartialStats                                 the per-chunk steps, usable without Beam
    follow(FollowConfig(...))                    follow mode: new files -> shards + manifest
    read_shards(data_dir)                        the committed shards of a stream dataset
"""

import logging as _logging

from hybridrec.pipeline.manifest import ManifestEntry, read_manifest, read_shards  # noqa: F401
from hybridrec.pipeline.metadata import (
    CategoricalFeature,
    DatasetMetadata,
    EventMetadata,
    read_dataset,
    read_metadata,
)
from hybridrec.pipeline.rows import EncodedRows, RowEncoder, RowError, spec_from_json  # noqa: F401
from hybridrec.pipeline.spec import CategoricalSpec, FeatureSpec, builtin_specs, load_spec


class _DropBeamImportNoise(_logging.Filter):
    """Beam's GCP module warns at import about optional cloud client libraries, which
    preprocessing does not use; the warning would reach every command's terminal."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()


_logging.getLogger().addFilter(_DropBeamImportNoise())

# Public name -> module that defines it. Beam, pyarrow and the generator are imported only
# when one of these is used, so that reading metadata stays light.
_LAZY = {
    "BlockParser": "hybridrec.pipeline._parse",
    "Chunk": "hybridrec.pipeline._chunks",
    "FollowConfig": "hybridrec.pipeline.follow",
    "ParquetParser": "hybridrec.pipeline._parquet",
    "PartialStats": "hybridrec.pipeline.stats",
    "Preprocess": "hybridrec.pipeline.click_job",
    "PreprocessConfig": "hybridrec.pipeline.config",
    "PreprocessResult": "hybridrec.pipeline.click_job",
    "SplitRule": "hybridrec.pipeline._splits",
    "count_lines": "hybridrec.pipeline._chunks",
    "follow": "hybridrec.pipeline.follow",
    "generate": "hybridrec.pipeline.synthetic",
    "generate_block": "hybridrec.pipeline.synthetic",
    "list_chunks": "hybridrec.pipeline._chunks",
    "process_chunk": "hybridrec.pipeline._chunks",
    "run_preprocess": "hybridrec.pipeline.click_job",
}

__all__ = [
    "CategoricalFeature",
    "CategoricalSpec",
    "DatasetMetadata",
    "FeatureSpec",
    "builtin_specs",
    "load_spec",
    "read_metadata",
    "read_dataset",
    "EventMetadata",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
