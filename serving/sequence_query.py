"""What a served sequence model is asked and answers: a batch's requests, their answers,
and a kept history's cache (`serving.sequence_model`, `serving.sequence_server`)."""

from __future__ import annotations

import dataclasses

import numpy as np

# what a model may read of each event besides its item, in the order its modules take them
CONTEXT = {"times": "time (seconds)", "actions": "action type"}


@dataclasses.dataclass
class CachedHistory:
    """What a kept history's next request can reuse: the tower's keys and values at its
    events (`extend.stablehlo`), and the query after them."""

    version: int  # the export version that computed it
    items: np.ndarray  # [c] uint64: the events cached, oldest first
    context: dict[str, np.ndarray]  # their times, actions, ... (what the model reads)
    keys: np.ndarray  # [blocks, L, heads, head_dim] float32 (positions >= c: unused)
    values: np.ndarray
    query: np.ndarray  # [D] float32

    @property
    def nbytes(self) -> int:
        context = sum(values.nbytes for values in self.context.values())
        return (
            self.items.nbytes + context + self.keys.nbytes + self.values.nbytes + self.query.nbytes
        )


@dataclasses.dataclass
class SequenceQuery:
    """One request's work: retrieval (`k` > 0) or ranking (`candidates`)."""

    histories: list[np.ndarray]  # per user: item ids, oldest first
    k: int = 0
    exclude_history: bool = True
    candidates: np.ndarray | None = None  # [n, C] item ids
    # kept histories: per user, its cache (None: none yet), to extend and give back
    cached: list[CachedHistory | None] | None = None
    # what the model reads of each event besides its item (`CONTEXT`): per name, per user
    # an array as long as its history (times in seconds, action type ids)
    context: dict[str, list[np.ndarray]] | None = None

    @property
    def rows(self) -> int:
        return len(self.histories)


@dataclasses.dataclass
class SequenceAnswer:
    """Retrieval: `items` [n, K] ids and `scores` [n, K]; ranking: `scores` [n, C, A]."""

    scores: np.ndarray
    items: np.ndarray | None
    truncated: list[int]  # the rows whose history was cut to max_length
    unseen: int  # items of the histories and candidates that got their initial row
    caches: list[CachedHistory | None] | None = None  # kept histories: their new caches
    computed_events: int = 0  # events the tower ran on (cached ones are not)
