"""hybridrec: hybrid-parallel training of recommenders with huge embedding tables.

This package is the command line (`hybridrec <command>`, see `hybridrec.cli`). The
work lives in the stage packages below it, in the order of the data flow:
`pipeline` (Apache Beam preprocessing), `embedding_store` (sharded embedding tables),
`model` (Flax dense towers and the sharded step) and `training` (the hybrid loop),
all standing on `common` (config loading, user-facing errors, progress lines).

From Python: `hybridrec.load_config`, `hybridrec.train`, `hybridrec.evaluate` and
`hybridrec.export` are the calls behind the commands (`training/api.py`);
`hybridrec.load_model(export)` is what `hybridrec serve` serves (`predict_rows(rows)` of a
click-log run, `recommend(histories, k)` of a sequence run).
"""

__version__ = "0.2.0"

# The Python API (training.api, serving.export): imported on first use, so that the
# command line starts without loading the training code.
__all__ = ["UserError", "evaluate", "export", "load_config", "load_model", "train"]


def __getattr__(name: str):
    if name in ("train", "evaluate"):
        from hybridrec.training import api

        return getattr(api, name)
    if name == "load_config":
        from hybridrec.training.config import load_config

        return load_config
    if name == "export":
        from hybridrec.serving.export import export_run

        return export_run
    if name == "load_model":
        from hybridrec.serving.load import load_model

        return load_model
    if name == "UserError":
        from hybridrec.common.errors import UserError

        return UserError
    raise AttributeError(f"module 'hybridrec' has no attribute {name!r}")
