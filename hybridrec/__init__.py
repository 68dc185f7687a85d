"""hybridrec: hybrid-parallel training of recommenders with huge embedding tables.

The stages live in their own packages: `pipeline` (Apache Beam preprocessing),
`embedding_store` (sharded, tensorstore-backed embedding tables) and `model`
(Flax dense towers and the hybrid trainer). This package holds what they share:
the command line, the config loader, user-facing errors and progress reporting.
"""

from hybridrec.errors import UserError

__all__ = ["UserError"]
__version__ = "0.1.0"
