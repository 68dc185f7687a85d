"""Users' recent events kept by the server, so that a request may name only the user.

Memory is bounded: each user keeps the last `max_events` item ids, at most `max_users`
users are kept, the least recently used (appended to or read) evicted first, and the
towers' caches of kept histories (their keys and values, `serving.sequence_model.
CachedHistory`: a request then computes only the user's new events) take at most
`cache_bytes`, the least recently used dropped first. The histories outlive a model
version: `serve --watch` swaps the model, not the events (a cache names the version that
made it, and another version recomputes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

MISSING = np.iinfo(np.int64).min  # an event appended without this value
KEPT = ("times", "actions")  # kept of each event besides its item (and what else is given)


class KeptHistories:
    """user (raw id, bytes) -> item ids [<= max_events] uint64, oldest first, and what
    else was appended of them (`KEPT`: times in seconds, action type ids; event side
    features' ids, as int64, under their names when given; `MISSING`
    for events appended without).

    Args:
        max_events: events kept per user (the most recent).
        max_users: users kept; the least recently used beyond it are evicted.
    """

    def __init__(self, max_events: int, max_users: int, cache_bytes: int = 1 << 30):
        if max_events < 1 or max_users < 1:
            raise ValueError("max_events and max_users must be >= 1")
        self.max_events = max_events
        self.max_users = max_users
        self.cache_bytes = cache_bytes
        self._users: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._context: dict[bytes, dict[str, np.ndarray]] = {}
        self._caches: OrderedDict[bytes, Any] = OrderedDict()
        self._cached_bytes = 0
        self._kept_events = 0  # events held over all users (stats without a pass over them)
        self._lock = threading.Lock()
        self.events_appended = 0
        self.evicted_users = 0
        self.dropped_caches = 0

    def append(self, users: list[bytes], items: np.ndarray, context: dict | None = None) -> int:
        """Appends event i (user `users[i]`, item `items[i]`, `context[name][i]` where
        given) in order; returns the number of distinct users touched."""
        order = {}
        for index, user in enumerate(users):
            order.setdefault(user, []).append(index)
        given = {name: np.asarray(values, np.int64) for name, values in (context or {}).items()}
        absent = np.full(len(users), MISSING, np.int64)
        with self._lock:
            for user, indices in order.items():
                new = items[np.asarray(indices)]
                old = self._users.pop(user, None)
                joined = new if old is None else np.concatenate([old, new])
                self._users[user] = joined[-self.max_events :].copy()
                kept = self._context.get(user, {})
                before = 0 if old is None else len(old)  # events kept before, each name
                self._context[user] = {
                    name: np.concatenate(
                        [
                            kept.get(name, np.full(before, MISSING, np.int64)),
                            given.get(name, absent)[np.asarray(indices)],
                        ]
                    )[-self.max_events :]  # fmt: skip
                    for name in dict.fromkeys([*KEPT, *kept, *given])
                }
                self._kept_events += len(self._users[user]) - (0 if old is None else len(old))
            while len(self._users) > self.max_users:
                user, dropped = self._users.popitem(last=False)
                self._context.pop(user, None)
                self._kept_events -= len(dropped)
                self._drop_cache(user)
                self.evicted_users += 1
            self.events_appended += len(users)
        return len(order)

    def get(self, user: bytes) -> np.ndarray | None:
        """The user's kept item ids (marked as recently used), or None."""
        with self._lock:
            found = self._users.get(user)
            if found is not None:
                self._users.move_to_end(user)
            return found

    def events(self, user: bytes) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
        """(item ids, {name: values, `MISSING` where appended without}) of the user's kept
        events, read together (marked as recently used), or None."""
        with self._lock:
            found = self._users.get(user)
            if found is None:
                return None
            self._users.move_to_end(user)
            return found, self._context[user]

    def cache(self, user: bytes) -> Any:
        """The user's cache (a `CachedHistory`), or None."""
        with self._lock:
            found = self._caches.get(user)
            if found is not None:
                self._caches.move_to_end(user)
            return found

    def store_cache(self, user: bytes, cache: Any) -> None:
        """Keeps a kept user's new cache (the least recently used dropped beyond the budget)."""
        with self._lock:
            if user not in self._users:
                return  # evicted meanwhile
            self._drop_cache(user)
            if cache is None or cache.nbytes > self.cache_bytes:
                return
            self._caches[user] = cache
            self._cached_bytes += cache.nbytes
            while self._cached_bytes > self.cache_bytes:
                self._drop_cache(next(iter(self._caches)))
                self.dropped_caches += 1

    def _drop_cache(self, user: bytes) -> None:
        old = self._caches.pop(user, None)
        if old is not None:
            self._cached_bytes -= old.nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "cached_users": len(self._caches),
                "cache_bytes": self._cached_bytes,
                "dropped_caches": self.dropped_caches,
                "kept_users": len(self._users),
                "kept_events": self._kept_events,
                "events_appended": self.events_appended,
                "evicted_users": self.evicted_users,
                "max_events_per_user": self.max_events,
                "max_users": self.max_users,
            }
