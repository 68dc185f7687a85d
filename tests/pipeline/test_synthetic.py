"""The synthetic Criteo-format generator: layout, determinism, realism, learnability."""

import gzip

import numpy as np
from hybridrec.pipeline import synthetic

from hybridrec import cli


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
    synthetic.generate(tmp_path / "small.tsv", 100, seed=7, workers=1)
    synthetic.generate(tmp_path / "large.tsv", 70_000, seed=7, workers=2)  # blocks in 2 processes
    small = (tmp_path / "small.tsv").read_bytes()
    assert (tmp_path / "large.tsv").read_bytes().startswith(small)
    assert small.count(b"\n") == 100


def test_realistic_and_learnable():
    text, clicks = synthetic.generate_block(0, 0, synthetic.BLOCK_ROWS)
    more, more_clicks = synthetic.generate_block(0, 1, synthetic.BLOCK_ROWS)
    rows, clicks = parse(text + more), clicks + more_clicks
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
    _, counts = np.unique([r[14] for r in rows], return_counts=True)
    assert counts.max() > 50 * np.median(counts)
    # Click rates learned on one half rank the other half (AUC clearly > 0.5), and the
    # rate of each (C6, C14) pair beats the best additive use of C6 and C14: the label
    # has interactions that a logistic regression cannot represent.
    half = len(rows) // 2
    c6 = np.unique([r[19] for r in rows], return_inverse=True)[1]
    c14 = np.unique([r[27] for r in rows], return_inverse=True)[1]
    pair = c6 * (c14.max() + 1) + c14

    def rates(groups):
        clicks = np.bincount(groups[:half], weights=labels[:half], minlength=groups.max() + 1)
        seen = np.bincount(groups[:half], minlength=groups.max() + 1)
        return ((clicks + 5 * labels.mean()) / (seen + 5.0))[groups[half:]]

    def logit(p):
        return np.log(p / (1 - p))

    additive = auc(logit(rates(c6)) + logit(rates(c14)), labels[half:])
    interacting = auc(rates(pair), labels[half:])
    assert additive > 0.55 and interacting > additive + 0.02


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


def test_cardinality_scale_widens_the_long_tail_only(tmp_path):
    rows = synthetic.BLOCK_ROWS
    base, _ = synthetic.generate_block(3, 0, rows)
    assert synthetic.generate_block(3, 0, rows, 1.0)[0] == base  # the default is scale 1
    wide, _ = synthetic.generate_block(3, 0, rows, 10.0)
    base_rows, wide_rows = parse(base), parse(wide)
    long_tail = [0, 0]
    for j, (card, _, _) in enumerate(synthetic.CATEGORICAL_PROFILE):
        before = len({r[14 + j] for r in base_rows})
        after = len({r[14 + j] for r in wide_rows})
        if card >= synthetic.LONG_TAIL:  # more distinct ids in the same rows
            assert after > before, (j, before, after)
            long_tail = [long_tail[0] + before, long_tail[1] + after]
        else:  # the same values, drawn the same way
            assert after == before, (j, before, after)
    assert long_tail[1] > 1.15 * long_tail[0]  # measured: 1.20 in one block
    # the label reads only features below the long tail: the same clicks, as learnable
    assert [r[0] for r in wide_rows] == [r[0] for r in base_rows]
    out = tmp_path / "bad.tsv"
    assert cli.main(["generate", "-o", str(out), "--rows", "10", "--cardinality-scale", "0"]) == 2
