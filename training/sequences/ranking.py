"""Next-item evaluation of a sequence run: every query ranks the target among all items.

A query is a trained position of an evaluation history (leave-one-out: the last one,
predicting the held-out item). Its rank is the number of catalogue items (the training
split's items) that score above the target:

1. the tower's output at every query (the eval step over packed histories);
2. the target's score, from its row (an item never trained scores from its initial row,
   looked up without admitting it);
3. the catalogue streamed from the store in chunks of `CHUNK` rows, each compared with
   every query on the devices (`count_above`): the table is never whole on the devices;
4. with the history excluded, the user's earlier items that score above the target
   are taken off (they are not candidates), as most frameworks report.

The target itself is never counted (its score on the devices may differ from the
threshold's in the last bit). HR@K, NDCG@K (K = 5, 10, 20) and MRR follow from the ranks (`ranking_metrics`), for the
configured convention and, with the suffix `_history_kept` / `_history_excluded`, the
other. `eval.ranking = "sampled_100"` adds the older papers' protocol (the target among
100 items drawn uniformly from the catalogue, neither the target nor in the history),
its keys suffixed `_sampled100`.
"""

from __future__ import annotations

import numpy as np
from hybridrec.common.progress import Progress
from hybridrec.model import StreamingMetrics
from hybridrec.model.sequence_step import count_above
from hybridrec.training.layouts import SequenceLayout
from hybridrec.training.sequences.baselines import ranking_metrics
from hybridrec.training.sequences.batches import Histories, SequenceReader
from hybridrec.training.sequences.packing import stream_pieces

CHUNK = 65536  # catalogue rows per lookup and comparison
QUERY_BLOCK = 4096  # queries per comparison
SAMPLED = 100


def _scored(rows: np.ndarray, similarity: str) -> np.ndarray:
    rows = rows.astype(np.float32, copy=False)
    if similarity == "cosine":
        return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-6)
    return rows


def _rows(store, job, ids: np.ndarray) -> np.ndarray:
    """[len(ids), D] rows of item ids, looked up without admitting or counting them."""
    lookup = store.lookup_features(
        {"item": ids},
        feature_tables=job.tables.feature_tables,
        pooling=job.config.embedding.pooling,
        train=False,
    ).result()
    return lookup.embeddings[:, 0]


def query_outputs(
    job, state, store, eval_step, histories: Histories, *, max_batches, progress, every_target=False
):
    """(outputs [Q, D], target ids [Q], history index [Q], the query's position in its
    history [Q], ranking logits [Q, A] or None, the target's action [Q]) of every query of
    `histories` (the first `max_batches` batches; 0: all): the targets among each
    history's most recent max_length positions, or `every_target` (a stream's window)."""
    config = job.config
    rows = config.data.eval_batch_size or config.data.batch_size
    length = config.model.sequence.max_length
    pieces = stream_pieces(histories, length) if every_target else None
    sequence = config.model.sequence
    reader = SequenceReader(
        histories,
        rows=rows,
        length=length,
        pieces=pieces,
        context=sequence.context,
        sides=sequence.side_features,
    )
    layout = SequenceLayout(job.mesh, ranking=config.model.sequence.ranking)
    total = reader.batches_per_epoch
    if max_batches:
        total = min(total, max_batches)
    if progress:
        progress.total = total
    outputs, targets, history, position, ranking, actions = [], [], [], [], [], []
    for batch in reader.batches(num_batches=total):
        embeddings = _rows(store, job, batch.ids["item"])[:, None]
        out = eval_step(state, layout.device_batch(batch, embeddings, train=False))
        query = batch.arrays["weights"] > 0
        if "ranking" in out:
            ranking.append(job.global_rows(out["ranking"])[query])
            actions.append(batch.arrays["actions"][query])
        out = job.global_rows(out["outputs"])
        segment = batch.arrays["segments"][query]
        outputs.append(out[query])
        targets.append(batch.ids["item"][batch.arrays["targets"][query]])
        history.append(batch.histories[segment])
        position.append(batch.starts[segment] + batch.arrays["positions"][query])
        if progress:
            progress.update(1)
    parts = (outputs, targets, history, position, ranking, actions)
    return tuple(np.concatenate(part) if part else None for part in parts)


def _pairs(histories: Histories, history: np.ndarray, position: np.ndarray):
    """(query, item) of each distinct item a query's user had up to its position."""
    sizes = position + 1
    query = np.repeat(np.arange(len(history)), sizes)
    starts = histories.offsets[history]
    items = histories.items[
        np.repeat(starts - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()))
    ]
    pairs = np.unique(np.stack([query.astype(np.uint64), items], axis=1), axis=0)
    return pairs[:, 0].astype(np.int64), pairs[:, 1]


def _pair_scores(store, job, queries, query: np.ndarray, items: np.ndarray, similarity: str):
    ids, inverse = np.unique(items, return_inverse=True)
    rows = (
        _scored(_rows(store, job, ids), similarity)
        if len(ids)
        else np.zeros((0, queries.shape[1]), np.float32)
    )
    return np.einsum("pd,pd->p", queries[query], rows[inverse])


def evaluate_sequences(
    job,
    state,
    store,
    eval_step,
    catalogue,
    *,
    split: str = "",
    histories: Histories | None = None,
    max_batches: int = 0,
    progress_name: str | None = None,
) -> dict[str, float]:
    """Ranking metrics of `state` with `store`'s rows on `split` (or on `histories`: a
    stream's window), see the module's doc."""
    config = job.config
    similarity = config.model.sequence.similarity
    window = histories is not None
    if histories is None:
        sequence = config.model.sequence
        histories = Histories.read(
            job.metadata, split, times=sequence.reads_times, sides=sequence.side_features
        )
    progress = Progress(progress_name, total=1, unit="batches") if progress_name else None
    queries, targets, history, position, ranking, actions = query_outputs(
        job, state, store, eval_step, histories, max_batches=max_batches, progress=progress,
        every_target=window,
    )  # fmt: skip
    if progress:
        progress.close()
    result = {"queries": float(len(queries))}
    if ranking is not None:
        names = job.metadata.raw["spec"].get("action_types") or []
        result |= ranking_by_action(ranking, actions, names)
    if not config.model.sequence.retrieval:
        return result
    unique_targets, target_index = np.unique(targets, return_inverse=True)
    target_rows = _scored(_rows(store, job, unique_targets), similarity)[target_index]
    threshold = np.einsum("qd,qd->q", queries, target_rows)
    above = np.zeros(len(queries), np.int64)
    for start in range(0, len(catalogue), CHUNK):
        ids = catalogue.items[start : start + CHUNK]
        items = _scored(_rows(store, job, ids), similarity)
        valid = np.ones(len(ids), bool)
        where = np.minimum(np.searchsorted(ids, targets), len(ids) - 1)
        own = np.where(ids[where] == targets, where, -1).astype(np.int32)  # the target itself
        for first in range(0, len(queries), QUERY_BLOCK):
            block = slice(first, first + QUERY_BLOCK)
            counted = count_above(queries[block], threshold[block], items, valid, own[block])
            above[block] += np.asarray(counted)
    # the user's earlier items above the target: taken off when the history is excluded
    query, items = _pairs(histories, history, position)
    candidate = catalogue.contains(items) & (items != targets[query])
    query, items = query[candidate], items[candidate]
    scores = _pair_scores(store, job, queries, query, items, similarity)
    history_above = np.bincount(query[scores > threshold[query]], minlength=len(queries))
    excluded, kept = ranking_metrics(above - history_above), ranking_metrics(above)
    if config.eval.exclude_history:
        result |= excluded | {f"{k}_history_kept": v for k, v in kept.items()}
    else:
        result |= kept | {f"{k}_history_excluded": v for k, v in excluded.items()}
    if config.eval.ranking == "sampled_100":
        ranks = _sampled_ranks(store, job, catalogue, queries, threshold, query, items, config.seed)
        result |= {f"{k}_sampled100": v for k, v in ranking_metrics(ranks).items()}
    return result


def ranking_by_action(logits: np.ndarray, actions: np.ndarray, names) -> dict[str, float]:
    """AUC and NE of each action type (`auc_<name>`, `ne_<name>`) over the queries whose
    next event has an action, and their means (`auc`, `ne`)."""
    known = actions > 0
    out = {}
    for index in range(logits.shape[1]):
        name = names[index] if index < len(names) else str(index + 1)
        metrics = StreamingMetrics()
        probabilities = 1.0 / (1.0 + np.exp(-logits[known, index].astype(np.float64)))
        metrics.update(
            probabilities.astype(np.float32), (actions[known] == index + 1).astype(np.float32)
        )
        scores = metrics.result()
        out[f"auc_{name}"], out[f"ne_{name}"] = float(scores["auc"]), float(scores["ne"])
    aucs = [v for k, v in out.items() if k.startswith("auc_")]
    nes = [v for k, v in out.items() if k.startswith("ne_")]
    return {**out, "auc": float(np.mean(aucs)), "ne": float(np.mean(nes))}


def _sampled_ranks(store, job, catalogue, queries, threshold, query, items, seed) -> np.ndarray:
    """Ranks among SAMPLED items drawn uniformly from the catalogue per query; a drawn item
    that is the target or in the history (`query`, `items` pairs) is left out."""
    similarity = job.config.model.sequence.similarity
    rng = np.random.default_rng([seed, 100])
    drawn = catalogue.items[rng.integers(len(catalogue), size=(len(queries), SAMPLED))]
    ids, inverse = np.unique(drawn, return_inverse=True)
    rows = _scored(_rows(store, job, ids), similarity)
    scores = np.einsum("qd,qsd->qs", queries, rows[inverse.reshape(drawn.shape)])
    seen = set(zip(query.tolist(), items.tolist(), strict=True))
    left_out = np.array(
        [[(q, int(i)) in seen for i in row] for q, row in enumerate(drawn)], bool
    ).reshape(drawn.shape)
    return np.sum((scores > threshold[:, None]) & ~left_out, axis=1)
