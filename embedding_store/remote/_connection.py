"""One Flight client per shard server: retries, the token, TLS, control actions, restarts.

`ServerConnection` is shared by the `RemoteShard`s of one server (`remote.py`); the
hybridrec commands use it directly for health and stats. `parse_addresses` reads
server address lists.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow.flight as flight
from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSFiles
from hybridrec.embedding_store.remote import _tls
from hybridrec.embedding_store.remote.wire import AUTH_HEADER, TOKEN_ENV

DEFAULT_RETRY_TIMEOUT = 60.0

# Restarts are reported under the remote shards' logger name.
log = logging.getLogger("embedding_store.remote.client")

# Errors that mean "the server is not there right now"; anything else is an answer.
_RETRYABLE = (flight.FlightUnavailableError, flight.FlightTimedOutError, ConnectionError)


class RemoteShardError(UserError):
    """A server refused a request, or the servers do not form a valid shard set."""


class ServerUnavailableError(RemoteShardError):
    """A server did not answer within the retry timeout."""


def parse_addresses(value: str | Sequence[str]) -> list[str]:
    """Normalizes "h1:p1,h2:p2" or a list of "host:port" / "grpc://host:port" strings.

    Returns:
        Flight URIs ("grpc://host:port", or the scheme given, e.g. "grpc+tls://"), in the
        given order. A client configured for TLS dials "grpc://" as "grpc+tls://".
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    addresses = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        uri = item if "://" in item else f"grpc://{item}"
        host_port = uri.split("://", 1)[1]
        host, sep, port = host_port.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RemoteShardError(f"embedding server address {item!r} is not host:port")
        addresses.append(uri)
    if not addresses:
        raise RemoteShardError("the embedding server address list is empty")
    if len(set(addresses)) != len(addresses):
        raise RemoteShardError(f"embedding server address list repeats an address: {value!r}")
    return addresses


class ServerConnection:
    """One Flight client to one server, shared by the RemoteShards it hosts.

    Args:
        address: "grpc://host:port" (with `tls`: dialled as "grpc+tls://host:port"),
            or "grpc+tls://host:port" (verified against the system's CAs without `tls`).
        token: shared secret, or None. With TLS it only ever travels inside the TLS
            channel: a client given `tls` refuses a plaintext address.
        tls: CA to verify the server with, and a client certificate for mutual TLS.
        retry_timeout: seconds to keep retrying an unreachable server before failing.
        call_timeout: seconds one attempt may take before it is abandoned and retried.

    A TLS handshake that fails (expired or untrusted certificate, wrong host name,
    plaintext on one side, client certificate refused) is not retried: it raises a
    RemoteShardError at once, with one line saying which.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: TLSFiles | None = None,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        call_timeout: float = 120.0,
    ):
        self.address = _tls.secure_address(address, tls)
        self.tls = tls
        self.retry_timeout = retry_timeout
        self._headers = [(AUTH_HEADER.encode(), f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(timeout=call_timeout, headers=self._headers)
        # Checkpoint writes and loads take as long as the shard is big: no per-attempt limit.
        self._slow_options = flight.FlightCallOptions(headers=self._headers)
        self._client = flight.FlightClient(self.address, **_tls.client_options(tls))
        self.client_id = uuid.uuid4().hex
        self._seq = 0
        self._lock = threading.Lock()
        self.health: dict[str, Any] = {}
        self._health_lock = threading.Lock()
        self.restarts = 0

    def next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def call(self, attempt, what: str):
        """Runs `attempt(client, options)`, retrying while the server is unreachable."""
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        failed = False
        while True:
            try:
                if failed:
                    self._check_incarnation()
                return attempt(self._client, self._options)
            except _RETRYABLE as error:
                self._raise_tls_problem(error)
                failed = True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServerUnavailableError(
                        f"embedding server {self.address} did not answer {what} for "
                        f"{self.retry_timeout:g} s (retry_timeout): {_first_line(error)}"
                    ) from None
                log.debug("%s: %s failed (%s); retrying", self.address, what, error)
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 2.0)
            except flight.FlightUnauthenticatedError:
                raise RemoteShardError(
                    f"embedding server {self.address} refused the token "
                    f"(set the same secret on both sides, e.g. ${TOKEN_ENV})"
                ) from None
            except flight.FlightError as error:
                raise RemoteShardError(
                    f"embedding server {self.address}: {what}: {_first_line(error)}"
                ) from None

    def action(
        self,
        kind: str,
        body: Mapping[str, Any] | None = None,
        *,
        retry: bool = True,
        slow: bool = False,
    ):
        """Runs a control action; its JSON result."""
        payload = json.dumps(body or {}).encode()

        def attempt(client, options):
            options = self._slow_options if slow else options
            results = list(client.do_action(flight.Action(kind, payload), options))
            return json.loads(results[0].body.to_pybytes()) if results else None

        if not retry:
            try:
                return attempt(self._client, self._options)
            except _RETRYABLE as error:
                self._raise_tls_problem(error)
                raise
        return self.call(attempt, kind)

    def _raise_tls_problem(self, error: BaseException) -> None:
        """Raises a one-line RemoteShardError if `error` came from a failed TLS handshake."""
        problem = _tls.diagnose(self.address, self.tls, error)
        if problem:
            raise RemoteShardError(problem) from None

    def handshake(self) -> dict[str, Any]:
        self.health = self.call(
            lambda client, options: json.loads(
                next(
                    iter(client.do_action(flight.Action("health", b""), options))
                ).body.to_pybytes()
            ),
            "health",
        )
        return self.health

    def _check_incarnation(self) -> None:
        """After a failure: if the server is a new process, say what that means and go on."""
        with self._health_lock:  # shards of one server may all notice at once: report once
            self._check_incarnation_locked()

    def _check_incarnation_locked(self) -> None:
        before = self.health
        health = self.action("health", retry=False)
        if before and health.get("incarnation") != before.get("incarnation"):
            self.restarts += 1
            layout = ("shards", "num_shards", "fingerprint")
            if any(health.get(key) != before.get(key) for key in layout):
                raise RemoteShardError(
                    f"embedding server {self.address} restarted with different shards or "
                    f"tables: {[health.get(k) for k in layout]} vs {[before.get(k) for k in layout]}"
                )
            restored = health.get("restored_step")
            if restored is None:
                log.warning(
                    "embedding server %s restarted without a checkpoint: every update to "
                    "shards %s is lost (rows start again from their initial values)",
                    self.address,
                    health.get("shards"),
                )
            else:
                log.warning(
                    "embedding server %s restarted from its checkpoint at step %s; updates "
                    "to shards %s since then are lost",
                    self.address,
                    restored,
                    health.get("shards"),
                )
        self.health = health

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
