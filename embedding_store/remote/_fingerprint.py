"""The digest of a table set that a client and its shard servers must agree on."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from hybridrec.common import config
from hybridrec.embedding_store.config import TableConfig


def table_fingerprint(tables: Sequence[TableConfig]) -> str:
    """A short digest of the table configs clients and servers must agree on (any order).

    Tiering is left out: where a server keeps its cold rows is its own business.
    """
    configs = sorted(
        ({k: v for k, v in config.to_dict(table).items() if k != "tiering"} for table in tables),
        key=lambda t: t["name"],
    )
    text = json.dumps(configs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
