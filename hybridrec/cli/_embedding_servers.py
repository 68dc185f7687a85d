"""Where a command finds the embedding servers: config, else environment variables.

The one place the commands read `$HYBRIDREC_EMBEDDING_SERVERS`,
`$HYBRIDREC_EMBEDDING_TOKEN` and `$HYBRIDREC_EMBEDDING_RETRY_TIMEOUT`; the library
(`embedding_store.remote.client.connect`) takes what is found here as arguments.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hybridrec.cli._flags import read_token_file
from hybridrec.common.errors import UserError
from hybridrec.embedding_store.remote.client import (
    DEFAULT_RETRY_TIMEOUT,
    ServerSet,
    parse_addresses,
)
from hybridrec.embedding_store.remote.wire import TOKEN_ENV

SERVERS_ENV = "HYBRIDREC_EMBEDDING_SERVERS"
RETRY_TIMEOUT_ENV = "HYBRIDREC_EMBEDDING_RETRY_TIMEOUT"


def embedding_servers(configured: str | Sequence[str] | None) -> ServerSet:
    """The servers from `configured` (`embedding.servers`); when that is empty, from
    $HYBRIDREC_EMBEDDING_SERVERS. Token and retry timeout come from their variables.

    Raises:
        UserError: an address is not host:port, or the retry timeout is not a number.
    """
    if configured:
        addresses, source = parse_addresses(configured), "embedding.servers"
    else:
        text = os.environ.get(SERVERS_ENV, "").strip()
        addresses, source = (parse_addresses(text), f"${SERVERS_ENV}") if text else ([], "")
    return ServerSet(
        addresses=tuple(addresses),
        source=source,
        token=read_token(None),
        retry_timeout=_retry_timeout(),
    )


def read_token(path: str | None) -> str | None:
    """The shared secret from the file at `path`, else $HYBRIDREC_EMBEDDING_TOKEN, else None."""
    if path:
        return read_token_file(path)
    return os.environ.get(TOKEN_ENV) or None


def _retry_timeout() -> float:
    text = os.environ.get(RETRY_TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_RETRY_TIMEOUT
    except ValueError:
        raise UserError(f"${RETRY_TIMEOUT_ENV}={text!r} is not a number") from None
    if not value >= 0:
        raise UserError(f"${RETRY_TIMEOUT_ENV}={text!r} must be >= 0 seconds")
    return value
