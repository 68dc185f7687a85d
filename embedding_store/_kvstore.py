"""Where the store's tensorstore I/O goes: kvstore specs from URLs, one shared context.

Used by checkpoints (`checkpoint.py`) and by the cold tier of tiered tables
(`_storage.py`).
"""

from __future__ import annotations

import os
from typing import Any

import tensorstore as ts
from hybridrec.embedding_store.errors import CheckpointError

_CONTEXT = ts.Context()  # shared so that memory:// stores are visible to every reader


def context() -> ts.Context:
    """The tensorstore context all store I/O uses (one memory:// namespace per process)."""
    return _CONTEXT


def kvstore_spec(location: str, *parts: str) -> dict[str, Any]:
    """A kvstore JSON spec for a URL or local path, with `parts` appended as a directory."""
    if "://" not in location:
        location = "file://" + os.path.abspath(location)
    try:
        spec = ts.KvStore.Spec(location if location.endswith("/") else location + "/").to_json()
    except ValueError as error:
        raise CheckpointError(f"{location}: not a tensorstore kvstore URL ({error})") from None
    suffix = "/".join(p.strip("/") for p in parts if p)
    base = spec.get("path", "")
    spec["path"] = (base.rstrip("/") + "/" if base else "") + (suffix + "/" if suffix else "")
    return spec
