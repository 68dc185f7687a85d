"""The exact top-K over a catalogue against sorting every score in numpy: random rows,
rows with ties (catalogue order decides), excluded items, k above what is left, and
catalogues smaller and larger than a chunk."""

from __future__ import annotations

import numpy as np
import pytest
from hybridrec.serving import catalogue as catalogue_lib
from hybridrec.serving.catalogue import ExactCatalogue


def reference(items, rows, queries, k, exclude):
    scores = queries @ rows.T
    for row, excluded in enumerate(exclude or []):
        scores[row, np.isin(items, excluded)] = -np.inf
    order = np.lexsort((np.broadcast_to(np.arange(len(items)), scores.shape), -scores), axis=1)
    order = order[:, :k]
    return items[order], np.take_along_axis(scores, order, axis=1)


@pytest.mark.parametrize("size", [50, 5000, 300_000])
def test_top_k_equals_sorting_every_score(size, monkeypatch):
    monkeypatch.setattr(catalogue_lib, "CHUNK", 65536)  # several chunks at 300k
    rng = np.random.default_rng(size)
    items = np.sort(rng.choice(np.arange(1, 10 * size, dtype=np.uint64), size, replace=False))
    rows = rng.standard_normal((size, 16)).astype(np.float32)
    rows[size // 2 :: 7] = rows[size // 3]  # many exact ties, spread over the chunks
    queries = rng.standard_normal((5, 16)).astype(np.float32)
    queries[1] = 0.0  # every score equal: catalogue order alone
    exclude = [items[rng.integers(size, size=9)] for _ in range(5)]
    scan = ExactCatalogue(items, rows)
    for k in (1, 10, min(100, size - 10)):  # at most 9 excluded: k items are left
        for excluded in (None, exclude):
            got_items, got_scores = scan.top_k(queries, k, excluded)
            want_items, want_scores = reference(items, rows, queries, k, excluded)
            np.testing.assert_array_equal(got_items, want_items)
            np.testing.assert_array_equal(got_scores, want_scores.astype(np.float32))


def test_k_beyond_what_is_left_ends_in_minus_infinity():
    items = np.arange(1, 6, dtype=np.uint64)
    scan = ExactCatalogue(items, np.eye(5, dtype=np.float32))
    found, scores = scan.top_k(np.ones((1, 5), np.float32), 5, [items[:2]])
    assert list(found[0, :3]) == [3, 4, 5] and np.isneginf(scores[0, 3:]).all()
