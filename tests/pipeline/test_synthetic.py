"""The synthetic Criteo-format generator: layout, determinism, realism, learnability."""

import gzip

import numpy as np

from hybridrec import cli
from pipeline import synthetic


def parse(text: bytes) -> list[list[str]]:
    return [line.split("\t") for line in text.decode().splitlines()]


def test_layout_matches_criteo(tmp_path):
    path = tmp_path / "day.tsv.gz"
    assert cli.main(["generate", "-o", str(path), "--rows", "70000", "--seed", "1"]) == 0
    rows = parse(gzip.decompress(path.read_bytes()))
    assert len(rows) == 70000 and {len(r) for r in rows} == {40}
    assert {r[0] for r in rows} == {"0", "1"}
    dense = np.array([[int(v) if v else 0 for v in r[1:14]] for r in rows[:20000]])
    assert (dense[:, 1] < 0).any()  # I2 has negative values, as in Criteo
    assert any(r[1] == "" for r in rows) and any(r[-1] == "" for r in rows)  # missing values
    categorical = [v for r in rows[:1000] for v in r[14:] if v]
    assert all(len(v) == 8 and int(v, 16) >= 0 for v in categorical)


def test_deterministic_and_prefix_stable(tmp_path):
    a, _ = synthetic.generate_block(7, 0, 1000)
    b, _ = synthetic.generate_block(7, 0, 1000)
    c, _ = synthetic.generate_block(8, 0, 1000)
    assert a == b and a != c
    synthetic.generate(tmp_path / "small.tsv", 100, seed=7)
    synthetic.generate(tmp_path / "large.tsv", 70_000, seed=7)
    small = (tmp_path / "small.tsv").read_bytes()
    assert (tmp_path / "large.tsv").read_bytes().startswith(small)
    assert small.count(b"\n") == 100


def test_realistic_and_learnable():
    text, clicks = synthetic.generate_block(0, 0, synthetic.BLOCK_ROWS)
    rows = parse(text)
    labels = np.array([int(r[0]) for r in rows])
    assert clicks == labels.sum() and 0.22 < labels.mean() < 0.28
    distinct = [len({r[14 + j] for r in rows}) for j in range(26)]
    # in 65k rows, like the real Kaggle sample: from a handful to ~20-30k distinct values
    assert min(distinct) <= 10 and max(distinct) > 20_000
    cardinalities = [card for card, _, _ in synthetic.CATEGORICAL_PROFILE]
    assert min(cardinalities) <= 10 and max(cardinalities) >= 2_000_000
    missing = [np.mean([r[14 + j] == "" for r in rows]) for j in range(26)]
    assert max(missing) > 0.4 and min(missing) == 0.0
    # Zipf-like: the most frequent C1 value is far more common than the median one
    values, counts = np.unique([r[14] for r in rows], return_counts=True)
    assert counts.max() > 50 * np.median(counts)
    # Per-value click rates of C1 learned on one half rank the other half: AUC clearly > 0.5
    half = len(rows) // 2
    _, inverse = np.unique([r[14] for r in rows], return_inverse=True)
    clicks_per_value = np.bincount(inverse[:half], weights=labels[:half], minlength=len(values))
    seen_per_value = np.bincount(inverse[:half], minlength=len(values))
    rate = (clicks_per_value + labels.mean()) / (seen_per_value + 1.0)
    assert auc(rate[inverse[half:]], labels[half:]) > 0.55


def auc(scores, labels):
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    for value in np.unique(scores):  # average ranks of ties
        tie = scores == value
        ranks[tie] = ranks[tie].mean()
    positives = labels == 1
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return (ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
