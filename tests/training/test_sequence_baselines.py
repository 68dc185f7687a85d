"""The baselines' ranks against brute force (every item scored for every user), and on a
generated log the order the generator promises: popularity < co-occurrence < oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hybridrec.pipeline.events.synthetic_events import (
    EventLogConfig,
    oracle_hit_rate,
)
from hybridrec.training.sequences.baselines import evaluate_baselines, ranking_metrics, read_split

from tests.training.test_sequence_training import events_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    config = EventLogConfig(users=1500, items=400, topics=10, mean_events=15, seed=5)
    return events_dataset(tmp_path_factory.mktemp("baselines"), config), config


def brute_force(data, exclude_history: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every catalogue item scored for every test user; ties by item id."""
    train, _ = read_split(data, "train")
    rows, first_target = read_split(data, "test")
    items, counts = np.unique(np.concatenate(train), return_counts=True)
    popularity = dict(zip(items.tolist(), counts.tolist(), strict=True))
    follows: dict[tuple[int, int], int] = {}
    for row in train:
        for a, b in zip(row[:-1].tolist(), row[1:].tolist(), strict=True):
            follows[(a, b)] = follows.get((a, b), 0) + 1
    pop_ranks, cooc_ranks = [], []
    for row, first in zip(rows, first_target, strict=True):
        target, last = int(row[first]), int(row[first - 1])
        history = set(row[:first].tolist()) - {target} if exclude_history else set()
        candidates = [i for i in items.tolist() if i not in history]
        if target not in popularity:
            pop_ranks.append(len(items))
            cooc_ranks.append(len(items))
            continue

        # popularity order: count descending, then id ascending (as a larger key: -id)
        pop_ranks.append(sum(
            popularity[i] > popularity[target] or (popularity[i] == popularity[target] and i < target)
            for i in candidates
        ))  # fmt: skip
        cooc_ranks.append(sum(
            (follows.get((last, i), 0), popularity[i], -i)
            > (follows.get((last, target), 0), popularity[target], -target)
            for i in candidates
        ))  # fmt: skip
    return np.array(pop_ranks), np.array(cooc_ranks)


@pytest.mark.parametrize("exclude_history", [False, True])
def test_ranks_equal_brute_force(dataset, exclude_history):
    data, _ = dataset
    result = evaluate_baselines(data, exclude_history=exclude_history)
    pop, cooc = brute_force(data, exclude_history)
    for name, ranks in (("popularity", pop), ("cooccurrence", cooc)):
        for metric, value in ranking_metrics(ranks).items():
            assert result[name][metric] == pytest.approx(value), (name, metric)


def test_the_generated_log_leaves_room_above_the_baselines(dataset):
    data, config = dataset
    result = evaluate_baselines(data, exclude_history=False)
    oracle = oracle_hit_rate(config, users=1500)
    popularity, cooccurrence = (result[n]["hr@10"] for n in ("popularity", "cooccurrence"))
    assert popularity < cooccurrence < oracle
    assert oracle - cooccurrence > 0.05


def test_ranking_metrics():
    metrics = ranking_metrics(np.array([0, 4, 9, 10]), ks=(10,))
    assert metrics["hr@10"] == 0.75
    expected = (1 + 1 / np.log2(6) + 1 / np.log2(11)) / 4
    assert metrics["ndcg@10"] == pytest.approx(expected)
    assert metrics["mrr"] == pytest.approx((1 + 1 / 5 + 1 / 10 + 1 / 11) / 4)
