"""The Preprocess PTransform on Beam's TestPipeline: outputs, counters, splits, invariance."""

import json

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to
from hybridrec.pipeline import Preprocess, list_chunks, synthetic
from hybridrec.pipeline.spec import load_spec

from .reference import GOOD_ROW, criteo_reference_row, row

CRITEO = load_spec("criteo")
ROWS = 3000
BAD = {  # 1-based line number -> (line, reason)
    5: (row(fields=12), "wrong_field_count"),
    1234: (row(label="yes"), "bad_label"),
    2500: (row(dense={"I7": "NaN"}), "non_numeric_dense"),
    2999: (row(dense={"I1": "99999999999999999999"}), "int64_overflow"),
}


@pytest.fixture(scope="module")
def raw_file(tmp_path_factory):
    text, _ = synthetic.generate_block(seed=3, block_index=0, rows=synthetic.BLOCK_ROWS)
    lines = text.decode().split("\n")[:ROWS]
    lines[0] = GOOD_ROW
    for number, (line, _) in BAD.items():
        lines[number - 1] = line
    path = tmp_path_factory.mktemp("raw") / "day_0.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path, lines


def test_a_file_is_cut_into_equal_chunks(tmp_path):
    path = tmp_path / "log.csv"
    path.write_bytes(b"x" * 1000)
    chunks = list_chunks([str(path)], 300)
    assert [(c.start, c.end) for c in chunks] == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert [(c.start, c.end) for c in list_chunks([str(path)], 1000)] == [(0, -1)]


def run_transform(
    path, temp_dir, *, chunk_bytes, block_bytes, split_mode="position", check=None, valid=0.0
):
    chunks = list_chunks([str(path)], chunk_bytes)
    # the DirectRunner's engine itself: the DirectRunner would try Prism first (see runners)
    pipeline = test_pipeline.TestPipeline(runner=FnApiRunner())
    outputs = (
        pipeline
        | "Chunks" >> beam.Create(chunks)
        | Preprocess(
            CRITEO,
            split_mode=split_mode,
            eval_fraction=0.25,
            temp_dir=str(temp_dir),
            block_bytes=block_bytes,
            valid_fraction=valid,
        )
    )
    if check:
        check(outputs)
    result = pipeline.run()
    result.wait_until_finish()
    counters = {c.key.metric.name: c.committed for c in result.metrics().query()["counters"]}
    return len(chunks), counters


def read_rejected(temp_dir):
    """The rejected rows the transform wrote (one file per chunk with any), in chunk order."""
    paths = sorted((temp_dir / "rejected").glob("chunk-*.jsonl"))
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def read_split(temp_dir, split):
    files = sorted((temp_dir / split).glob("chunk-*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files])


def test_outputs_counters_and_golden_row(raw_file, tmp_path):
    path, lines = raw_file

    def check(stats):
        assert_that(
            stats
            | "Counts"
            >> beam.Map(
                lambda s: (
                    s.rows_read,
                    dict(s.rows_by_split),
                    sum(rows for kind, _, rows in s.files if kind != "rejected"),
                )
            ),
            equal_to([(ROWS, {"train": 2250 - 2, "eval": 750 - 2}, ROWS - 4)]),
            label="CombinedStatistics",
        )

    num_chunks, counters = run_transform(
        path, tmp_path, chunk_bytes=100_000, block_bytes=30_000, check=check
    )
    assert num_chunks > 5  # line numbers above were computed across chunk boundaries
    assert counters == {"rows_read": ROWS, "rows_written": ROWS - 4, "rows_rejected": 4}
    rejected = [(r["file"], r["line"], r["reason"]) for r in read_rejected(tmp_path)]
    assert rejected == [(str(path), n, reason) for n, (_, reason) in BAD.items()]
    train = read_split(tmp_path, "train")
    first = train.slice(0, 1).to_pylist()[0]
    expected = criteo_reference_row(GOOD_ROW)
    assert first["C1"] == 0x01AFD2EA734B8E1A  # golden: C1 = "68fd1e64"
    assert {k: first[k] for k in expected if k.startswith("C")} == {
        k: v for k, v in expected.items() if k.startswith("C")
    }
    assert all(train.column(name).null_count == 0 for name in train.column_names)


def test_position_split_takes_the_last_lines(raw_file, tmp_path):
    path, lines = raw_file
    run_transform(path, tmp_path, chunk_bytes=200_000, block_bytes=64_000)
    eval_table = read_split(tmp_path, "eval")
    expected = [
        criteo_reference_row(line)["C3"]
        for number, line in enumerate(lines[2250:], start=2251)
        if number not in BAD
    ]
    assert eval_table.column("C3").to_pylist() == expected


@pytest.mark.parametrize("split_mode", ["position", "hash"])
def test_ids_and_split_do_not_depend_on_chunking(raw_file, tmp_path, split_mode):
    path, _ = raw_file
    run_transform(path, tmp_path / "a", chunk_bytes=10**9, block_bytes=10**8, split_mode=split_mode)
    run_transform(
        path, tmp_path / "b", chunk_bytes=77_777, block_bytes=20_000, split_mode=split_mode
    )
    for split in ("train", "eval"):
        a, b = read_split(tmp_path / "a", split), read_split(tmp_path / "b", split)
        assert a.num_rows > 0 and a.equals(b)
    if split_mode == "hash":
        eval_rows = read_split(tmp_path / "a", "eval").num_rows
        assert 0.2 * ROWS < eval_rows < 0.3 * ROWS  # ~25% by hash, not the last lines
        positions = read_split(tmp_path / "a", "train").column("C3").to_pylist()
        last = {
            criteo_reference_row(line)["C3"]
            for number, line in enumerate(raw_file[1][2250:], start=2251)
            if number not in BAD
        }
        assert len(last & set(positions)) > 100


@pytest.mark.parametrize("split_mode", ["position", "hash"])
def test_a_valid_split_takes_the_lines_before_eval_and_leaves_eval_alone(
    raw_file, tmp_path, split_mode
):
    """--valid-fraction: under a position split the 15% of lines before eval's 25%, under a
    hash split a range of the hash beside eval's; eval is the same rows as without it, and
    train keeps every other row (its statistics of train rows only), for any chunking."""
    path, lines = raw_file

    def c3(split, root):
        return read_split(root, split).column("C3").to_pylist() if (root / split).exists() else []

    run_transform(path, tmp_path / "plain", chunk_bytes=10**9, block_bytes=10**8, split_mode=split_mode)  # fmt: skip
    for name, chunk_bytes in (("one", 10**9), ("many", 61_111)):
        root = tmp_path / name
        run_transform(
            path, root, chunk_bytes=chunk_bytes, block_bytes=20_000, split_mode=split_mode, valid=0.15
        )  # fmt: skip
        assert c3("eval", root) == c3("eval", tmp_path / "plain")
        train, valid = c3("train", root), c3("valid", root)
        assert sorted(train + valid) == sorted(c3("train", tmp_path / "plain"))
        if split_mode == "position":  # lines 2251 - 450 .. 2250
            expected = [
                criteo_reference_row(line)["C3"]
                for number, line in enumerate(lines[1800:2250], start=1801)
                if number not in BAD
            ]
            assert valid == expected
        else:
            assert 0.1 * ROWS < len(valid) < 0.2 * ROWS
    assert c3("valid", tmp_path / "one") == c3("valid", tmp_path / "many")


def test_statistics_match_numpy(raw_file, tmp_path):
    path, _ = raw_file
    target = tmp_path / "stats.json"

    def check(stats):
        _ = stats | "Save" >> beam.Map(lambda s: target.write_text(json.dumps(s.to_json(CRITEO))))

    run_transform(path, tmp_path, chunk_bytes=50_000, block_bytes=20_000, check=check)
    summary = json.loads(target.read_text())
    train = read_split(tmp_path, "train")
    stats = summary["stats"]
    assert stats["label_rate"] == pytest.approx(np.mean(train.column("label").to_numpy()))
    for name in ("I1", "I5", "I13"):
        values = train.column(name).to_numpy().astype(np.float64)
        got = stats["dense"][name]
        assert got["mean"] == pytest.approx(values.mean(), rel=1e-6)
        assert got["std"] == pytest.approx(values.std(), rel=1e-6)
        assert (got["min"], got["max"]) == (values.min(), values.max())
    for name in ("C1", "C6", "C3"):
        ids = train.column(name).to_numpy()
        distinct = len(np.unique(ids))
        got = stats["categorical"][name]
        assert got["distinct_estimate"] == pytest.approx(
            distinct, rel=0.15 if not got["exact"] else 0
        )
        if got["exact"]:
            counts = np.unique(ids, return_counts=True)[1]
            assert got["ids_with_count_at_least"]["2"] == int((counts >= 2).sum())
    assert summary["counts"]["rejected_by_reason"] == {
        "bad_label": 1,
        "int64_overflow": 1,
        "non_numeric_dense": 1,
        "wrong_field_count": 1,
    }
