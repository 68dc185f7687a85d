"""The exact top-K over a catalogue against sorting every score in numpy: random rows,
rows with ties (catalogue order decides), excluded items, k above what is left, and
catalogues smaller and larger than a chunk; the one-stage BLAS scan and the two-stage scan
(8-bit codes with a bound on their error, then the candidates scored from the rows)."""

from __future__ import annotations

import numpy as np
import pytest
from hybridrec.serving import catalogue as catalogue_lib
from hybridrec.serving.catalogue import ExactCatalogue

SCANS = [False, True]  # the one-stage numpy scan, the native two-stage scan


def reference(items, rows, queries, k, exclude):
    scores = queries.astype(np.float64) @ rows.T.astype(np.float64)
    for row, excluded in enumerate(exclude or []):
        scores[row, np.isin(items, excluded)] = -np.inf
    order = np.lexsort((np.broadcast_to(np.arange(len(items)), scores.shape), -scores), axis=1)
    order = order[:, :k]
    return items[order], np.take_along_axis(scores, order, axis=1)


def assert_top_k(got, want, rows, items, queries):
    """The same items in the same order, but for items whose exact scores are within float32
    rounding of each other (either order is right); scores within rounding."""
    (got_items, got_scores), (want_items, want_scores) = got, want
    scale = np.abs(queries).sum(axis=1, keepdims=True) * np.abs(rows).max() + 1e-30
    np.testing.assert_allclose(got_scores, want_scores, rtol=0, atol=1e-5 * scale.max())
    position = {int(item): i for i, item in enumerate(items)}
    for q, (got_row, want_row) in enumerate(zip(got_items, want_items, strict=True)):
        if np.array_equal(got_row, want_row):
            continue
        exact = np.array([queries[q].astype(np.float64) @ rows[position[int(i)]] for i in got_row])
        np.testing.assert_allclose(exact, want_scores[q], rtol=0, atol=1e-5 * scale[q, 0])
        assert len(set(got_row.tolist())) == len(got_row)


@pytest.mark.parametrize("native", SCANS, ids=["one-stage", "two-stage"])
@pytest.mark.parametrize("size", [50, 5000, 300_000])
def test_top_k_equals_sorting_every_score(size, native, monkeypatch):
    monkeypatch.setattr(catalogue_lib, "CHUNK", 65536)  # several chunks at 300k
    rng = np.random.default_rng(size)
    items = np.sort(rng.choice(np.arange(1, 10 * size, dtype=np.uint64), size, replace=False))
    rows = rng.standard_normal((size, 16)).astype(np.float32)
    rows[size // 2 :: 7] = rows[size // 3]  # many exact ties, spread over the chunks
    queries = rng.standard_normal((5, 16)).astype(np.float32)
    queries[1] = 0.0  # every score equal: catalogue order alone
    exclude = [items[rng.integers(size, size=9)] for _ in range(5)]
    scan = ExactCatalogue(items, rows, native=native)
    for k in (1, 10, min(100, size - 10)):  # at most 9 excluded: k items are left
        for excluded in (None, exclude):
            got = scan.top_k(queries, k, excluded)
            assert_top_k(got, reference(items, rows, queries, k, excluded), rows, items, queries)


@pytest.mark.parametrize("native", SCANS, ids=["one-stage", "two-stage"])
def test_k_beyond_what_is_left_ends_in_minus_infinity(native):
    items = np.arange(1, 6, dtype=np.uint64)
    scan = ExactCatalogue(items, np.eye(5, dtype=np.float32), native=native)
    found, scores = scan.top_k(np.ones((1, 5), np.float32), 5, [items[:2]])
    assert list(found[0, :3]) == [3, 4, 5] and np.isneginf(scores[0, 3:]).all()
    found, scores = scan.top_k(np.zeros((0, 5), np.float32), 3)  # no queries
    assert found.shape == scores.shape == (0, 3)


def test_two_stage_holds_where_codes_are_coarse():
    """Rows the 8-bit codes fit badly (a large common offset under small differences, one
    huge value among small ones, constant rows, cosine-normalized rows), dimensions that
    are no multiple of anything, 70 queries (past one bit each of the scan's mask): the
    bound keeps every item of the exact top-K among the candidates."""
    rng = np.random.default_rng(7)
    size, dim = 20_011, 37
    rows = rng.standard_normal((size, dim)).astype(np.float32)
    rows[:5000] = 1000.0 + 1e-3 * rows[:5000]  # offset 1000, differences of 1e-3
    rows[5000:10000, 3] *= 1e4  # one value dwarfs the row's others
    rows[10000:10100] = 0.25  # constant rows
    rows[10100:] /= np.linalg.norm(rows[10100:], axis=1, keepdims=True)
    items = np.arange(1, size + 1, dtype=np.uint64)
    queries = rng.standard_normal((70, dim)).astype(np.float32)
    queries[::3] *= 1e-3
    exclude = [items[rng.integers(size, size=rng.integers(0, 300))] for _ in range(70)]
    scan = ExactCatalogue(items, rows, native=True)
    assert scan.codes.nbytes < rows.nbytes / 2
    for k in (1, 100, 2000):
        got = scan.top_k(queries, k, exclude)
        assert_top_k(got, reference(items, rows, queries, k, exclude), rows, items, queries)


def test_two_stage_scores_few_items_exactly():
    """Most items are ruled out by their bound: a thousand-item top-100 of a 300k catalogue
    scores a few hundred items a query from the rows, not all of them."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((300_000, 64)).astype(np.float32)
    scan = ExactCatalogue(np.arange(1, 300_001, dtype=np.uint64), rows, native=True)
    queries = rng.standard_normal((8, 64)).astype(np.float32)
    nothing = np.zeros(0, np.int64)
    rows_scored, query = scan.codes.candidates(queries, 100, (nothing, nothing))
    assert len(rows_scored) < 8 * 1000 and np.bincount(query).min() >= 100


def test_the_kernels_compute_the_same_integers():
    """AVX-512 VNNI's kernel (where the CPU has it) and the portable one: the same
    candidates for a dimension no multiple of 4 and an odd number of queries."""
    rng = np.random.default_rng(11)
    rows = rng.standard_normal((10_007, 50)).astype(np.float32)
    queries = rng.standard_normal((9, 50)).astype(np.float32)
    excluded = (np.repeat(np.arange(9), 20), rng.integers(10_007, size=180))
    shape = (len(rows), rows.shape[1], rows.__getitem__)
    fast = catalogue_lib.BoundedCodes(*shape).candidates(queries, 50, excluded)
    portable = catalogue_lib.BoundedCodes(*shape, portable=True).candidates(queries, 50, excluded)
    for got, want in zip(fast, portable, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("native", SCANS, ids=["one-stage", "two-stage"])
def test_rows_read_through_a_function_give_the_same_answers(native):
    """A catalogue whose rows are read by position (as a served model reads its table):
    the same top-K as the one given the matrix; the two-stage scan asks only for chunks
    at start-up and for its candidates after, never holding the matrix."""
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((20_000, 24)).astype(np.float32)
    items = np.arange(1, 20_001, dtype=np.uint64)
    asked = []

    def read_rows(index):
        asked.append(len(index))
        return rows[index]

    scan = ExactCatalogue(items, read_rows=read_rows, dim=24, native=native)
    assert (scan.rows is None) == native
    asked.clear()
    queries = rng.standard_normal((6, 24)).astype(np.float32)
    exclude = [items[rng.integers(20_000, size=30)] for _ in range(6)]
    got = scan.top_k(queries, 50, exclude)
    want = ExactCatalogue(items, rows, native=native).top_k(queries, 50, exclude)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert sum(asked) < (6 * 2000 if native else 1)  # candidates only; none for one stage
    with pytest.raises(ValueError, match="not both"):
        ExactCatalogue(items, rows, read_rows=read_rows, dim=24)
