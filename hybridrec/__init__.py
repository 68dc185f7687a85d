"""hybridrec: hybrid-parallel training of recommenders with huge embedding tables.

This package is the command line (`hybridrec <command>`, see `hybridrec.cli`). The
work lives in the stage packages below it, in the order of the data flow:
`pipeline` (Apache Beam preprocessing), `embedding_store` (sharded embedding tables),
`model` (Flax dense towers and the sharded step) and `training` (the hybrid loop),
all standing on `common` (config loading, user-facing errors, progress lines).
"""

__version__ = "0.2.0"
