"""StreamingMetrics against independent definitions written out here."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hybridrec.model import StreamingMetrics


def pairwise_auc(predictions: np.ndarray, labels: np.ndarray) -> float:
    """O(n^2) definition: P(score of a positive > score of a negative), ties count 1/2."""
    positives = predictions[labels == 1]
    negatives = predictions[labels == 0]
    wins = 0.0
    for p in positives:
        for n in negatives:
            wins += 1.0 if p > n else 0.5 if p == n else 0.0
    return wins / (len(positives) * len(negatives))


def direct_logloss(predictions: np.ndarray, labels: np.ndarray, epsilon=1e-7) -> float:
    total = 0.0
    for p, y in zip(predictions.astype(np.float64), labels, strict=True):
        p = min(max(p, epsilon), 1 - epsilon)
        total -= math.log(p) if y == 1 else math.log(1 - p)
    return total / len(labels)


def _data(seed: int, n: int, distinct: int | None):
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < 0.35).astype(np.float32)
    scores = rng.random(n) * 0.6 + 0.3 * labels  # informative but overlapping
    if distinct is not None:  # heavy ties
        scores = np.round(scores * distinct) / distinct
    return np.clip(scores, 0, 1).astype(np.float32), labels


@pytest.mark.parametrize("distinct", [None, 7, 1])
def test_matches_pairwise_auc_and_direct_logloss(distinct):
    predictions, labels = _data(0, 600, distinct)
    metrics = StreamingMetrics(compact_every=50)  # many incremental merges
    for start in range(0, 600, 37):
        metrics.update(predictions[start : start + 37], labels[start : start + 37])
    result = metrics.result()
    assert result["count"] == 600
    assert result["auc"] == pytest.approx(pairwise_auc(predictions, labels), abs=1e-12)
    assert result["logloss"] == pytest.approx(direct_logloss(predictions, labels), rel=1e-9)
    rate = labels.astype(np.float64).mean()
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert result["ne"] == pytest.approx(result["logloss"] / entropy, rel=1e-9)
    mean_prediction = predictions.astype(np.float64).mean()
    assert result["calibration"] == pytest.approx(mean_prediction / rate, rel=1e-9)
    if distinct is not None:
        assert metrics.num_distinct <= distinct + 1  # memory follows distinct predictions


def test_merge_equals_one_stream():
    predictions, labels = _data(1, 500, 20)
    whole = StreamingMetrics()
    whole.update(predictions, labels)
    first, second = StreamingMetrics(compact_every=16), StreamingMetrics()
    first.update(predictions[:200], labels[:200])
    second.update(predictions[200:], labels[200:])
    first.merge(second)
    for key, value in whole.result().items():
        assert first.result()[key] == pytest.approx(value, rel=1e-12), key


def test_rounded_mode_is_exact_for_rounded_predictions_and_bounded():
    predictions, labels = _data(2, 400, None)
    metrics = StreamingMetrics(mantissa_bits=4, compact_every=64)
    metrics.update(predictions, labels)
    rounded = metrics._round(predictions)
    assert np.max(np.abs(rounded - predictions)) <= 2.0**-5  # 4 mantissa bits, values < 1
    assert metrics.result()["auc"] == pytest.approx(pairwise_auc(rounded, labels), abs=1e-12)
    assert metrics.num_distinct <= 127 * 2**4
    exact = pairwise_auc(predictions, labels)
    assert abs(metrics.result()["auc"] - exact) < 0.02


def test_perfect_and_undefined_cases():
    metrics = StreamingMetrics()
    metrics.update(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1]))
    assert metrics.result()["auc"] == 1.0
    one_class = StreamingMetrics()
    one_class.update(np.array([0.3, 0.4]), np.array([0, 0]))
    result = one_class.result()
    assert math.isnan(result["auc"]) and math.isnan(result["ne"]) and result["count"] == 2
    assert math.isnan(StreamingMetrics().result()["logloss"])


def test_rejects_bad_inputs():
    metrics = StreamingMetrics()
    with pytest.raises(ValueError, match="labels"):
        metrics.update(np.array([0.5]), np.array([2.0]))
    with pytest.raises(ValueError, match="within"):
        metrics.update(np.array([np.nan]), np.array([1.0]))
    with pytest.raises(ValueError, match="probabilities but"):
        metrics.update(np.array([0.5, 0.5]), np.array([1.0]))
