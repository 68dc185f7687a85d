"""Apache Beam preprocessing: raw click logs -> sharded Parquet + metadata.json.

Public surface:
    read_metadata(out_dir) -> DatasetMetadata   the trainer's view of a dataset directory
    load_spec(name_or_path) -> FeatureSpec       built-in (`criteo`, `avazu`) or a spec file
    Preprocess                                   the Beam PTransform of the job
    generate(path, rows, seed=...)               synthetic Criteo-format logs
"""

from pipeline.metadata import CategoricalFeature, DatasetMetadata, read_metadata
from pipeline.spec import CategoricalSpec, FeatureSpec, builtin_specs, load_spec

__all__ = [
    "CategoricalFeature",
    "CategoricalSpec",
    "DatasetMetadata",
    "FeatureSpec",
    "Preprocess",
    "builtin_specs",
    "generate",
    "load_spec",
    "read_metadata",
]


def __getattr__(name):
    # Beam and the generator are imported only when used, so reading metadata stays light.
    if name == "Preprocess":
        from pipeline.job import Preprocess

        return Preprocess
    if name == "generate":
        from pipeline.synthetic import generate

        return generate
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
