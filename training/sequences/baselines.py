"""Two baselines of next-item prediction on an event-log dataset's leave-one-out split, under
full ranking (every item of the training data ranked for each user): what a sequential
model must beat.

- **popularity**: items ranked by how often they occur in the training rows;
- **co-occurrence**: items ranked by how often they followed the user's last item in the
  training rows (item-to-item transitions, the "people who watched X next watched Y"
  rule), ties and unseen pairs by popularity.

Ranks are computed exactly without scoring every item for every user: the popularity order
is global, and a user's transition row is sparse. Equal scores rank by item id. With
`exclude_history` the user's earlier items are left out of the ranking (except the target),
as most frameworks do. HR@K is the share of users whose target ranks in the top K, NDCG@K
averages 1 / log2(rank + 2) over them (rank from 0).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.pipeline.metadata import METADATA_FILE

KS = (5, 10, 20)


def read_split(data_dir, split: str) -> tuple[list[np.ndarray], np.ndarray]:
    """(items of each row, first_target of each row) of an event dataset's split."""
    import json
    from pathlib import Path

    root = Path(data_dir)
    meta = json.loads((root / METADATA_FILE).read_text())
    tables = [
        pq.read_table(root / name, columns=["items", "first_target"])
        for name in meta["splits"][split]["files"]
    ]
    table = pa.concat_tables(tables)
    column = table.column("items").combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy()
    rows = [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    return rows, table.column("first_target").to_numpy()


def ranking_metrics(ranks: np.ndarray, ks=KS) -> dict[str, float]:
    """HR@K and NDCG@K of 0-based target ranks, and MRR."""
    ranks = np.asarray(ranks, np.float64)
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"hr@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean())
    out["mrr"] = float((1.0 / (ranks + 1.0)).mean())
    return out


class _Catalogue:
    """The training items in popularity order (count descending, then id)."""

    def __init__(self, train_rows: list[np.ndarray]):
        items = np.concatenate(train_rows) if train_rows else np.zeros(0, np.uint64)
        self.items, counts = np.unique(items, return_counts=True)
        order = np.lexsort((self.items, -counts))
        self.position = np.empty(len(order), np.int64)  # item index -> popularity rank
        self.position[order] = np.arange(len(order))

    def index(self, ids: np.ndarray) -> np.ndarray:
        """Item index of each id, -1 for ids never seen in training."""
        where = np.minimum(np.searchsorted(self.items, ids), max(len(self.items) - 1, 0))
        found = (self.items[where] == ids) if len(self.items) else np.zeros(len(ids), bool)
        return np.where(found, where, -1)


def _transitions(train_rows, catalogue: _Catalogue) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """item index -> (next item indices, counts), from consecutive training events."""
    sources, targets = [], []
    for row in train_rows:
        index = catalogue.index(row)
        sources.append(index[:-1])
        targets.append(index[1:])
    source, target = np.concatenate(sources), np.concatenate(targets)
    pairs, counts = np.unique(np.stack([source, target], axis=1), axis=0, return_counts=True)
    out = {}
    bounds = np.flatnonzero(np.diff(pairs[:, 0])) + 1
    for start, end in zip(np.r_[0, bounds], np.r_[bounds, len(pairs)], strict=True):
        out[int(pairs[start, 0])] = (pairs[start:end, 1], counts[start:end])
    return out


def _above(catalogue, candidates: np.ndarray, target: int) -> int:
    """How many of `candidates` (item indices) rank above `target` by popularity."""
    return int((catalogue.position[candidates] < catalogue.position[target]).sum())


def evaluate_baselines(data_dir, *, exclude_history: bool, split: str = "test") -> dict:
    """{"popularity": metrics, "cooccurrence": metrics, "users": n} on `split`."""
    train_rows, _ = read_split(data_dir, "train")
    rows, first_target = read_split(data_dir, split)
    catalogue = _Catalogue(train_rows)
    transitions = _transitions(train_rows, catalogue)
    popularity, cooccurrence = [], []
    for row, first in zip(rows, first_target, strict=True):
        index = catalogue.index(row)
        target = int(index[first])
        history = np.unique(index[:first][index[:first] >= 0])
        history = history[history != target] if exclude_history else np.zeros(0, np.int64)
        if target < 0:  # an item never trained: ranked after every trained one
            popularity.append(len(catalogue.items))
            cooccurrence.append(len(catalogue.items))
            continue
        pop_rank = int(catalogue.position[target]) - _above(catalogue, history, target)
        popularity.append(pop_rank)
        last = int(index[first - 1]) if first > 0 else -1
        nexts, counts = transitions.get(last, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        keep = ~np.isin(nexts, history)
        nexts, counts = nexts[keep], counts[keep]
        mine = counts[nexts == target]
        count = int(mine[0]) if len(mine) else 0
        better = int((counts > count).sum())
        if count:  # among the pairs with as many transitions, by popularity
            tied = nexts[(counts == count) & (nexts != target)]
            cooccurrence.append(better + _above(catalogue, tied, target))
        else:  # below every followed item; among the rest by popularity
            others = _above(catalogue, nexts, target)
            cooccurrence.append(better + pop_rank - others)
    return {
        "users": len(rows),
        "popularity": ranking_metrics(np.array(popularity)),
        "cooccurrence": ranking_metrics(np.array(cooccurrence)),
    }
