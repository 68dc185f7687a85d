"""Evaluation metrics over a whole eval set, streamed batch by batch in bounded memory.

`StreamingMetrics` keeps, for every distinct predicted probability, how many positive
and negative examples got it, in sorted arrays merged incrementally. That is exactly
what ROC AUC needs (ties between a positive and a negative count one half), so the AUC
is exact, not a histogram approximation.

Memory: 20 bytes per distinct float32 prediction (value + two int64 counts), plus a
pending buffer of at most `max(compact_every, distinct)` (prediction, label) pairs
(5 bytes each) between merges. Distinct predictions are at most the number of
examples, so 45M eval examples cost at most ~1.3 GB. To cap memory independently
of the eval set size, pass `mantissa_bits=k`: predictions are rounded to float32 with
k mantissa bits before counting, leaving at most 127 * 2^k distinct values
(k = 12: ~0.5M values, ~10 MB); the AUC is then exact for the rounded predictions.
Logloss, normalized entropy and calibration always use the unrounded predictions.
"""

from __future__ import annotations

import math

import numpy as np


class StreamingMetrics:
    """AUC (exact, ties handled), logloss, normalized entropy and calibration.

    Example:
        metrics = StreamingMetrics()
        for batch in eval_batches:
            metrics.update(probabilities, labels)
        metrics.result()  # {"auc": ..., "logloss": ..., "ne": ..., "calibration": ..., "count": ...}
    """

    def __init__(
        self,
        *,
        epsilon: float = 1e-7,
        compact_every: int = 1 << 20,
        mantissa_bits: int | None = None,
    ):
        """
        Args:
            epsilon: probabilities are clipped to [epsilon, 1 - epsilon] for the logloss.
            compact_every: pending examples that trigger a merge into the sorted counts.
            mantissa_bits: None for exact AUC; k in [0, 23] to round predictions to k
                mantissa bits for the AUC counts (bounded memory, see the module doc).
        """
        if mantissa_bits is not None and not 0 <= mantissa_bits <= 23:
            raise ValueError(f"mantissa_bits must be within [0, 23], got {mantissa_bits}")
        self.epsilon = epsilon
        self.compact_every = compact_every
        self.mantissa_bits = mantissa_bits
        self._values = np.empty(0, np.float32)  # sorted distinct predictions
        self._positives = np.empty(0, np.int64)  # positives per distinct prediction
        self._negatives = np.empty(0, np.int64)  # negatives per distinct prediction
        self._pending_values: list[np.ndarray] = []
        self._pending_labels: list[np.ndarray] = []
        self._pending = 0
        self._count = 0
        self._positive_count = 0
        self._prediction_sum = 0.0
        self._logloss_sum = 0.0

    def _round(self, values: np.ndarray) -> np.ndarray:
        if self.mantissa_bits is None:
            return values
        drop = 23 - self.mantissa_bits
        if drop == 0:
            return values
        bits = values.view(np.uint32)
        half = np.uint32(1 << (drop - 1))
        mask = np.uint32((0xFFFFFFFF >> drop) << drop)
        return ((bits + half) & mask).view(np.float32)

    def update(self, probabilities: np.ndarray, labels: np.ndarray) -> None:
        """Adds a batch.

        Args:
            probabilities: [n] predicted click probabilities in [0, 1].
            labels: [n] labels, 0 or 1 (any numeric dtype).
        """
        predictions = np.asarray(probabilities, dtype=np.float32).reshape(-1)
        labels = np.asarray(labels).reshape(-1)
        if predictions.shape != labels.shape:
            raise ValueError(f"{predictions.shape[0]} probabilities but {labels.shape[0]} labels")
        if not np.all((predictions >= 0) & (predictions <= 1)):
            raise ValueError("probabilities must be finite and within [0, 1]")
        positive = labels == 1
        if not np.all(positive | (labels == 0)):
            raise ValueError("labels must be 0 or 1")
        clipped = np.clip(predictions.astype(np.float64), self.epsilon, 1.0 - self.epsilon)
        self._logloss_sum += float(-np.sum(np.where(positive, np.log(clipped), np.log1p(-clipped))))
        self._prediction_sum += float(np.sum(predictions, dtype=np.float64))
        self._count += predictions.size
        self._positive_count += int(np.count_nonzero(positive))
        self._pending_values.append(self._round(predictions))
        self._pending_labels.append(positive)
        self._pending += predictions.size
        if self._pending >= max(self.compact_every, self._values.size):
            self._compact()

    def _compact(self) -> None:
        if not self._pending:
            return
        values = np.concatenate([self._values, *self._pending_values])
        new_labels = np.concatenate(self._pending_labels)
        positives = np.concatenate([self._positives, new_labels.astype(np.int64)])
        negatives = np.concatenate([self._negatives, (~new_labels).astype(np.int64)])
        self._merge_counts(values, positives, negatives)
        self._pending_values, self._pending_labels, self._pending = [], [], 0

    def _merge_counts(
        self, values: np.ndarray, positives: np.ndarray, negatives: np.ndarray
    ) -> None:
        distinct, inverse = np.unique(values, return_inverse=True)
        self._values = distinct
        # float64 weights are exact for counts below 2**53
        self._positives = np.bincount(inverse, positives, distinct.size).astype(np.int64)
        self._negatives = np.bincount(inverse, negatives, distinct.size).astype(np.int64)

    def merge(self, other: StreamingMetrics) -> None:
        """Adds everything `other` has seen (e.g. another process's eval shard)."""
        self._compact()
        other._compact()
        self._merge_counts(
            np.concatenate([self._values, other._values]),
            np.concatenate([self._positives, other._positives]),
            np.concatenate([self._negatives, other._negatives]),
        )
        self._count += other._count
        self._positive_count += other._positive_count
        self._prediction_sum += other._prediction_sum
        self._logloss_sum += other._logloss_sum

    @property
    def num_distinct(self) -> int:
        """Distinct predictions held (after merging the pending buffer)."""
        self._compact()
        return int(self._values.size)

    def result(self) -> dict[str, float]:
        """Metrics so far: auc, logloss, ne, calibration, label_rate, mean_prediction, count.

        `auc` is NaN without both a positive and a negative; `ne` (logloss divided by the
        entropy of the label rate) and `calibration` (mean prediction / label rate) are NaN
        when undefined.
        """
        self._compact()
        count = self._count
        positives = self._positive_count
        negatives = count - positives
        nan = float("nan")
        if positives and negatives:
            negatives_below = np.cumsum(self._negatives) - self._negatives
            wins = np.sum(
                self._positives * (negatives_below + 0.5 * self._negatives), dtype=np.float64
            )
            auc = float(wins / (float(positives) * float(negatives)))
        else:
            auc = nan
        logloss = self._logloss_sum / count if count else nan
        label_rate = positives / count if count else nan
        mean_prediction = self._prediction_sum / count if count else nan
        if count and 0 < positives < count:
            entropy = -(
                label_rate * math.log(label_rate) + (1 - label_rate) * math.log(1 - label_rate)
            )
            ne = logloss / entropy
        else:
            ne = nan
        calibration = mean_prediction / label_rate if positives else nan
        return {
            "auc": auc,
            "logloss": logloss,
            "ne": ne,
            "calibration": calibration,
            "label_rate": label_rate,
            "mean_prediction": mean_prediction,
            "count": count,
        }
