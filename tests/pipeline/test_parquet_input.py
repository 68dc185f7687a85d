"""Parquet input: the same ids, values, statistics and split as the equivalent text; bad input."""

import json

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to
from hybridrec.common.errors import UserError
from hybridrec.pipeline import (
    BlockParser,
    ParquetParser,
    Preprocess,
    list_chunks,
    read_metadata,
    synthetic,
)
from hybridrec.pipeline.spec import CategoricalSpec, FeatureSpec, load_spec

from hybridrec import cli

from .reference import criteo_reference_row
from .test_hashing import reference_id

CRITEO = load_spec("criteo")
ROWS = 3000
IN_MEMORY = ["--direct_running_mode=in_memory", "--direct_num_workers=1", "--quiet"]


def preprocess(*args):
    return cli.main(["preprocess", *map(str, args)])


def read_all(out, split):
    meta = read_metadata(out)
    return pa.concat_tables([pq.read_table(path) for path in meta.split_files(split)])


def criteo_table(lines: list[str]) -> pa.Table:
    """The rows of Criteo text lines as typed columns: int label, int64 I*, string C*."""
    fields = [line.split("\t") for line in lines]
    columns = {"label": pa.array([int(f[0]) for f in fields], pa.int8())}
    for i in range(13):
        values = [int(f[1 + i]) if f[1 + i] else None for f in fields]
        columns[f"I{i + 1}"] = pa.array(values, pa.int64())
    for i in range(26):
        columns[f"C{i + 1}"] = pa.array([f[14 + i] or None for f in fields], pa.string())
    return pa.table(columns)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parquet_inputs")
    text, _ = synthetic.generate_block(seed=11, block_index=0, rows=synthetic.BLOCK_ROWS)
    lines = text.decode().split("\n")[:ROWS]
    (root / "day.tsv").write_text("\n".join(lines) + "\n")
    table = criteo_table(lines)
    pq.write_table(table, root / "day.parquet", row_group_size=700)
    # The same values in other physical types, columns in another order, plus an extra column.
    assert min(v for v in table.column("I5").to_pylist() if v is not None) >= 0
    mixed = {
        "extra": pa.array(range(ROWS)),
        **{name: table.column(name) for name in reversed(table.column_names)},
        "label": table.column("label").cast(pa.bool_()),
        "I1": table.column("I1").cast(pa.int32()),
        "I2": table.column("I2").cast(pa.float64()),
        "I3": pa.array([str(v) if v is not None else None for v in table.column("I3").to_pylist()]),
        "I5": table.column("I5").cast(pa.uint32()),
        "C1": table.column("C1").dictionary_encode(),
        "C2": table.column("C2").cast(pa.large_string()),
        "C3": table.column("C3").cast(pa.binary()),
    }
    pq.write_table(pa.table(mixed), root / "mixed.pq", row_group_size=1000)
    return root, lines, table


@pytest.mark.parametrize(("split", "name"), [("position", "mixed.pq"), ("hash", "day.parquet")])
def test_parquet_and_text_give_identical_output(inputs, tmp_path, split, name):
    root, _, _ = inputs
    args = ["--split", split, "--eval-fraction", "0.2", *IN_MEMORY]
    assert preprocess("-i", root / "day.tsv", "-o", tmp_path / "text", *args) == 0
    assert preprocess("-i", root / name, "-o", tmp_path / "pq", *args) == 0
    for split_name in ("train", "eval"):
        text, parquet = (
            read_all(tmp_path / "text", split_name),
            read_all(tmp_path / "pq", split_name),
        )
        assert parquet.num_rows > 0 and parquet.schema.equals(text.schema)
        assert parquet.equals(text)
    text_meta, parquet_meta = (
        read_metadata(tmp_path / "text").raw,
        read_metadata(tmp_path / "pq").raw,
    )
    assert parquet_meta["counts"] == text_meta["counts"]
    # One block of text and one batch of rows: the partial statistics merge in the same
    # order, so even the float sums are identical.
    assert parquet_meta["stats"] == text_meta["stats"]
    assert parquet_meta["splits"]["eval"]["rows"] == text_meta["splits"]["eval"]["rows"]
    assert parquet_meta["input_files"] == [str(root / name)]


def test_types_lists_and_nulls_match_the_text_parser():
    spec = FeatureSpec(
        name="clicks",
        delimiter=",",
        columns=("y", "price", "count", "user", "tags", "codes", "topics", "note"),
        label="y",
        dense=("price", "count"),
        dense_type="float64",
        categorical=(
            CategoricalSpec(name="user"),
            CategoricalSpec(name="tags", multi_valued=True, separator="|"),
            CategoricalSpec(name="codes", multi_valued=True, separator="|"),
            CategoricalSpec(name="topics", multi_valued=True, separator="|"),
        ),
    )
    text = (
        "1,2.5,3,17,a|b,5|6,t1|t2,x\n"
        "0,,,-4,,,,\n"
        "1,-1.25,7,9223372036854775807,b,|7,t3,y\n"
        "0,1000,0,,a||c,8,,z\n"
        "1,nan,1,5,a,5,t1,w\n"
    )
    batch = pa.record_batch(
        {
            "note": pa.array(["x", None, "y", "z", "w"]),
            "y": pa.array([1, 0, 1, 0, 1], pa.int8()),
            "price": pa.array([2.5, None, -1.25, 1000.0, float("nan")]),
            "count": pa.array([3, None, 7, 0, 1], pa.int32()),
            "user": pa.array([17, -4, 2**63 - 1, None, 5], pa.int64()),
            "tags": pa.array([["a", "b"], [], ["b"], ["a", "", "c"], ["a"]]),
            "codes": pa.array([[5, 6], None, [None, 7], [8], [5]], pa.list_(pa.uint64())),
            "topics": pa.array(["t1|t2", None, "t3", "", "t1"]).dictionary_encode(),
        }
    )
    from_text = BlockParser(spec).parse(text.encode(), row_hashes=True)
    from_parquet = ParquetParser(spec).parse(batch, row_hashes=True)
    assert from_parquet.table.num_rows == 4
    assert from_parquet.table.equals(from_text.table)
    assert from_parquet.line_offsets.tolist() == from_text.line_offsets.tolist() == [0, 1, 2, 3]
    assert from_parquet.row_hashes.tolist() == from_text.row_hashes.tolist()
    assert [r[:2] for r in from_parquet.rejected] == [r[:2] for r in from_text.rejected]
    assert from_parquet.rejected[0][1:3] == ("non_finite_dense", "price=nan")
    assert from_text.rejected[0][1:3] == ("non_finite_dense", "price='nan'")
    assert from_parquet.rejected[0][3]["codes"] == [5]
    table = from_parquet.table
    assert table.column("user").to_pylist()[1] == reference_id(b"-4", 1)  # decimal text
    assert table.column("codes").to_pylist()[1:3] == [[3 << 56], [3 << 56, reference_id(b"7", 3)]]
    assert table.column("tags").to_pylist()[1] == [2 << 56]  # empty list -> one missing id
    # uint64 beyond int64 hashes as its decimal text as well
    big = pa.record_batch({**batch.to_pydict(), "user": pa.array([2**64 - 1] * 5, pa.uint64())})
    ids = ParquetParser(spec).parse(big).table.column("user").to_pylist()
    assert ids == [reference_id(b"18446744073709551615", 1)] * 4


BAD_ROWS = {  # 0-based row -> (reason, detail)
    3: ("non_finite_dense", "I1=nan"),
    150: ("non_finite_dense", "I1=inf"),
    222: ("non_numeric_dense", "I1=1.5 (not an integer; the spec's dense_type is int64)"),
    301: ("int64_overflow", "I1=1e+30"),
    302: ("int64_overflow", "I2=18446744073709551615"),
    350: ("bad_label", "label 2 is not 0 or 1"),
    399: ("bad_label", "label is missing (null)"),
}


@pytest.fixture(scope="module")
def bad_rows_file(inputs):
    root, _, table = inputs
    table = table.slice(0, 400)
    i1 = [float(v) if v is not None else None for v in table.column("I1").to_pylist()]
    i1[3], i1[150], i1[222], i1[301] = float("nan"), float("inf"), 1.5, 1e30
    i2 = [abs(v) if v is not None else None for v in table.column("I2").to_pylist()]
    i2[302] = 2**64 - 1
    labels = table.column("label").to_pylist()
    labels[350], labels[399] = 2, None
    table = table.set_column(0, "label", pa.array(labels, pa.int64()))
    table = table.set_column(1, "I1", pa.array(i1)).set_column(2, "I2", pa.array(i2, pa.uint64()))
    path = root / "bad_rows.bin"  # no Parquet extension: read with --input-format parquet
    pq.write_table(table, path, row_group_size=100)
    return path


def test_bad_rows_are_rejected_with_file_row_and_reason(bad_rows_file, tmp_path):
    out = tmp_path / "out"
    args = ["--input-format", "parquet", "--chunk-mb", "0.001", "--eval-fraction", "0"]
    assert preprocess("-i", bad_rows_file, "-o", out, *args, *IN_MEMORY) == 0
    meta = read_metadata(out)
    assert len(meta.split_files("train")) == 4  # one chunk per 100-row row group
    counts = meta.raw["counts"]
    assert (counts["rows_read"], counts["rows_written"], counts["rows_rejected"]) == (400, 393, 7)
    assert counts["rejected_by_reason"] == {
        "bad_label": 2,
        "int64_overflow": 2,
        "non_finite_dense": 2,
        "non_numeric_dense": 1,
    }
    rejected = [
        json.loads(line)
        for path in sorted((out / "rejected").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert {r["row"]: (r["reason"], r["detail"]) for r in rejected} == BAD_ROWS
    assert {r["file"] for r in rejected} == {str(bad_rows_file)}
    assert next(r for r in rejected if r["row"] == 3)["values"]["I1"] == "nan"
    train = read_all(out, "train")
    assert all(train.column(name).null_count == 0 for name in train.column_names)
    assert np.isfinite(train.column("I1").to_numpy()).all()


def test_bad_rows_on_test_pipeline_with_counters(inputs, bad_rows_file, tmp_path):
    chunks = list_chunks([str(bad_rows_file)], 5_000, spec=CRITEO, input_format="parquet")
    assert len(chunks) > 2 and {c.format for c in chunks} == {"parquet"}
    # the DirectRunner's engine itself: the DirectRunner would try Prism first (see runners)
    pipeline = test_pipeline.TestPipeline(runner=FnApiRunner())
    stats = (
        pipeline
        | beam.Create(chunks)
        | Preprocess(
            CRITEO,
            split_mode="position",
            eval_fraction=0.25,
            temp_dir=str(tmp_path),
            block_bytes=40 * 256,
        )
    )
    assert_that(
        stats | beam.Map(lambda s: (s.rows_read, dict(s.rows_by_split))),
        equal_to([(400, {"train": 300 - 3, "eval": 100 - 4})]),
        label="Counts",
    )
    result = pipeline.run()
    result.wait_until_finish()
    counters = {c.key.metric.name: c.committed for c in result.metrics().query()["counters"]}
    assert counters == {"rows_read": 400, "rows_written": 393, "rows_rejected": 7}
    rejected = [
        json.loads(line)
        for path in sorted((tmp_path / "rejected").glob("chunk-*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert [(r["row"], r["reason"]) for r in rejected] == [
        (row, reason) for row, (reason, _) in BAD_ROWS.items()
    ]
    train = pa.concat_tables(
        pq.read_table(path) for path in sorted((tmp_path / "train").glob("chunk-*.parquet"))
    )
    assert train.num_rows == 297
    first, expected = train.slice(0, 1).to_pylist()[0], criteo_reference_row(inputs[1][0])
    assert first.keys() == expected.keys()  # row 0 against the plain-Python text reference
    for name, value in expected.items():
        assert first[name] == (value if name.startswith("C") else pytest.approx(value, rel=1e-6))


def write_bad_schema(root, table, case):
    if case == "missing_column":
        table = table.drop_columns(["C7"])
    elif case == "float_categorical":
        table = table.set_column(
            table.schema.get_field_index("C3"), "C3", pa.array([1.5] * len(table))
        )
    elif case == "list_single_valued":
        table = table.set_column(
            table.schema.get_field_index("C4"), "C4", pa.array([["a"]] * len(table))
        )
    elif case == "struct_dense":
        table = table.set_column(
            table.schema.get_field_index("I4"), "I4", pa.array([{"x": 1}] * len(table))
        )
    path = root / f"{case}.parquet"
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "missing_column",
            "column 'C7' (categorical of spec 'criteo') is missing; a Parquet input's column names must be the spec's column names",
        ),
        (
            "float_categorical",
            "column 'C3' has type double; a categorical column must be integer or string",
        ),
        (
            "list_single_valued",
            "column 'C4' has type list<element: string>; a categorical column must be integer or string",
        ),
        (
            "struct_dense",
            "column 'I4' has type struct<x: int64>; a dense column must be integer, float or string",
        ),
        ("truncated", "not a readable Parquet file (Parquet magic bytes not found in footer"),
        ("not_parquet", "not a readable Parquet file"),
    ],
)
def test_bad_files_stop_before_the_job_starts(inputs, tmp_path, capsys, case, message):
    root, _, table = inputs
    small = table.slice(0, 50)
    if case == "truncated":
        data = (root / "day.parquet").read_bytes()
        path = tmp_path / "cut.parquet"
        path.write_bytes(data[: len(data) // 2])
    elif case == "not_parquet":
        path = tmp_path / "day.pq"
        path.write_text("1\t2\t3\n")
    else:
        path = write_bad_schema(tmp_path, small, case)
    out = tmp_path / "out"
    assert preprocess("-i", root / "day.tsv", path, "-o", out, *IN_MEMORY) == 2
    err = capsys.readouterr().err
    assert f"{path}: {message}" in err
    assert "Traceback" not in err and "hybridrec-input-error" not in err
    assert not out.exists()  # checked while listing the inputs: nothing was written


def test_corrupt_row_group_stops_the_job(inputs, tmp_path, capsys):
    _, _, table = inputs
    path = tmp_path / "corrupt.parquet"
    pq.write_table(table, path, compression="none", write_page_checksum=True, row_group_size=1000)
    data = bytearray(path.read_bytes())
    middle = len(data) // 3
    data[middle : middle + 64] = b"9" * 64
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert preprocess("-i", path, "-o", out, *IN_MEMORY) == 2
    err = capsys.readouterr().err
    assert f"{path}: corrupt Parquet data in row groups" in err
    assert "Traceback" not in err and "hybridrec-input-error" not in err
    assert not (out / "_SUCCESS").exists()
    with pytest.raises(UserError, match="incomplete dataset directory"):
        read_metadata(out)
