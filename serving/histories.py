"""Users' recent events kept by the server, so that a request may name only the user.

Memory is bounded twice: each user keeps the last `max_events` item ids, and at most
`max_users` users are kept, the least recently used (appended to or read) evicted first.
The histories outlive a model version: `serve --watch` swaps the model, not the events.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class KeptHistories:
    """user (raw id, bytes) -> item ids [<= max_events] uint64, oldest first.

    Args:
        max_events: events kept per user (the most recent).
        max_users: users kept; the least recently used beyond it are evicted.
    """

    def __init__(self, max_events: int, max_users: int):
        if max_events < 1 or max_users < 1:
            raise ValueError("max_events and max_users must be >= 1")
        self.max_events = max_events
        self.max_users = max_users
        self._users: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.events_appended = 0
        self.evicted_users = 0

    def append(self, users: list[bytes], items: np.ndarray) -> int:
        """Appends event i (user `users[i]`, item `items[i]`) in order; returns the number of
        distinct users touched."""
        order = {}
        for index, user in enumerate(users):
            order.setdefault(user, []).append(index)
        with self._lock:
            for user, indices in order.items():
                new = items[np.asarray(indices)]
                old = self._users.pop(user, None)
                joined = new if old is None else np.concatenate([old, new])
                self._users[user] = joined[-self.max_events :].copy()
            while len(self._users) > self.max_users:
                self._users.popitem(last=False)
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

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "kept_users": len(self._users),
                "kept_events": int(sum(len(v) for v in self._users.values())),
                "events_appended": self.events_appended,
                "evicted_users": self.evicted_users,
                "max_events_per_user": self.max_events,
                "max_users": self.max_users,
            }
