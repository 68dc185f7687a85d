"""The shard server's small parts: its token check, latency window and JSON fields."""

from __future__ import annotations

import collections
import hmac
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow.flight as flight
from hybridrec.embedding_store.remote import wire

LATENCY_WINDOW = 8192


class TokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Rejects every call whose `authorization: Bearer <token>` header is wrong."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info, headers):
        values = headers.get(wire.AUTH_HEADER) or headers.get(wire.AUTH_HEADER.title()) or []
        given = values[0] if values else ""
        given = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given, self._expected):
            raise flight.FlightUnauthenticatedError("missing or wrong embedding-server token")
        return None


class Latency:
    """A sliding window of request latencies for p50/p99."""

    def __init__(self):
        self._samples: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._lock = threading.Lock()
        self.count = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)
            self.count += 1

    def summary(self) -> dict[str, float]:
        with self._lock:
            count, samples = self.count, np.array(self._samples, dtype=np.float64) * 1e3
        if not len(samples):
            return {"count": count, "p50_ms": 0.0, "p99_ms": 0.0}
        p50, p99 = np.percentile(samples, [50, 99])
        return {"count": count, "p50_ms": float(p50), "p99_ms": float(p99)}


def field(body: Mapping[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    valid = isinstance(value, kind) and (kind is not int or not isinstance(value, bool))
    if kind is int:
        valid = valid and value >= 0
    if kind is str:
        valid = valid and bool(value)
    if not valid:
        raise wire.WireError(f"field {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
