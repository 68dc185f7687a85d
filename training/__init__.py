"""The hybrid trainer: a run directory trained, checkpointed, resumed and evaluated.

Public API (docs/training.md; imported on first use, so that `import hybridrec.training`
stays light):
    TrainConfig, load_config                     the run's configuration (presets + overrides)
    Trainer, FollowOptions                       `hybridrec train` (epochs of a dataset) and
                                                 `train --follow` (a stream): one loop
    HybridLoop                               the overlapped lookup / step / update loop
    RunCheckpoints, require_run_dir              a run directory's checkpoints and config
    plan_tables                                  a config's embedding tables for a dataset
    evaluate_checkpoint                          metrics of a committed checkpoint
    learn_id_map, propose_towers_from_run        what a finished run teaches the next one
"""

import importlib

# Public name -> module that defines it.
_LAZY = {
    "TrainConfig": "hybridrec.training.config",
    "load_config": "hybridrec.training.config",
    "require_run_dir": "hybridrec.training.run_dir",
    "Trainer": "hybridrec.training.trainer",
    "FollowOptions": "hybridrec.training.trainer",
    "HybridLoop": "hybridrec.training.hybrid",
    "RunCheckpoints": "hybridrec.training.checkpoint",
    "plan_tables": "hybridrec.training.tables",
    "evaluate_checkpoint": "hybridrec.training.evaluate",
    "learn_id_map": "hybridrec.training.learned.hash_map",
    "propose_towers_from_run": "hybridrec.training.learned.partition",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridrec.training' has no attribute {name!r}")
