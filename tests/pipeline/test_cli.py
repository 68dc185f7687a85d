"""`hybridrec generate` / `hybridrec preprocess` end to end, and every input that stops the job."""

import gzip
import json
import os
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hybridrec.common.errors import UserError
from hybridrec.pipeline import read_metadata

from hybridrec import cli

from .reference import GOOD_ROW, row

IN_MEMORY = ["--direct_running_mode=in_memory", "--direct_num_workers=1", "--quiet"]
AVAZU_COLUMNS = "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
AVAZU_ROW = "1000009418151094273,{},14102100,1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,ddd2926e,44956a24,1,2,15706,320,50,1722,0,35,-1,{}"


def preprocess(*args):
    return cli.main(["preprocess", *map(str, args)])


def read_all(meta, split):
    return pa.concat_tables([pq.read_table(path) for path in meta.split_files(split)])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    assert (
        cli.main(["generate", "-o", str(root / "day_0.tsv"), "--rows", "30000", "--seed", "5"]) == 0
    )
    bad_lines = [
        GOOD_ROW,
        row(fields=3),
        row(label="x"),
        "caf\xe9".join([GOOD_ROW[:20], GOOD_ROW[20:]]),
    ]
    with gzip.open(root / "day_1.tsv.gz", "wb") as handle:
        handle.write(("\n".join(bad_lines) + "\n").encode("latin-1"))
    return root


def test_end_to_end_multi_process_and_worker_invariance(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    # the DirectRunner with one worker process per core (asked for: the default runs threads)
    args = ["--chunk-mb", "1", "--eval-fraction", "0.2", "--direct_running_mode=multi_processing"]
    assert preprocess("-i", inputs / "day_*", "-o", out, *args) == 0
    summary = capsys.readouterr().out
    workers = min(os.cpu_count(), 8)
    assert f"DirectRunner (multi_processing, {workers} worker(s))" in summary
    assert "preprocessed 30,004 rows" in summary and "rejected: 3" in summary
    meta = read_metadata(out)
    assert meta.dense_columns == tuple(f"I{i}" for i in range(1, 14))
    assert [c.name for c in meta.categorical] == [f"C{i}" for i in range(1, 27)]
    assert meta.label_column == "label" and not meta.categorical[0].multi_valued
    assert meta.split_rows("train") + meta.split_rows("eval") == 30_001
    assert len(meta.split_files("train")) > 2  # 1 MB chunks -> several shards
    raw = meta.raw
    assert raw["format_version"] == 1
    assert raw["hash_scheme"] == {"name": "hybridrec-wordmix64", "version": 1, "prefix_bits": 8}
    assert raw["counts"]["rows_rejected"] == 3
    assert raw["counts"]["rejected_by_reason"] == {
        "bad_label": 1,
        "invalid_utf8": 1,
        "wrong_field_count": 1,
    }
    assert 0.2 < raw["stats"]["label_rate"] < 0.3
    assert set(raw["stats"]["dense"]["I1"]) >= {"mean", "std", "min", "max"}
    assert raw["stats"]["categorical"]["C3"]["distinct_estimate"] > 1000
    train = read_all(meta, "train")
    assert train.num_rows == meta.split_rows("train")
    assert train.schema.field("C26").type == pa.uint64()
    assert all(train.column(name).null_count == 0 for name in train.column_names)
    metadata = pq.ParquetFile(meta.split_files("train")[0]).metadata
    assert metadata.num_rows > 0 and metadata.row_group(0).num_rows <= 65_536
    rejected = [
        json.loads(line)
        for f in (out / "rejected").glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert sorted((r["file"].rsplit("/", 1)[-1], r["line"], r["reason"]) for r in rejected) == [
        ("day_1.tsv.gz", 2, "wrong_field_count"),
        ("day_1.tsv.gz", 3, "bad_label"),
        ("day_1.tsv.gz", 4, "invalid_utf8"),
    ]

    # A complete directory is not overwritten by accident.
    assert preprocess("-i", inputs / "day_0.tsv", "-o", out, *IN_MEMORY) == 2
    assert "already holds a complete dataset; pass --overwrite" in capsys.readouterr().err
    assert read_metadata(out).split_rows("train") == meta.split_rows("train")

    # One in-process worker and one big chunk give byte-identical ids, values and split.
    other = tmp_path / "other"
    assert (
        preprocess(
            "-i",
            inputs / "day_0.tsv",
            inputs / "day_1.tsv.gz",
            "-o",
            other,
            "--eval-fraction",
            "0.2",
            *IN_MEMORY,
        )
        == 0
    )
    other_meta = read_metadata(other)
    assert len(other_meta.split_files("train")) < len(meta.split_files("train"))
    for split in ("train", "eval"):
        assert read_all(other_meta, split).equals(read_all(meta, split))

    # The same chunks on two worker threads (the default's kind): the same bytes.
    threads = tmp_path / "threads"
    flags = ["--direct_running_mode=in_memory", "--direct_num_workers=2"]
    assert preprocess("-i", inputs / "day_*", "-o", threads, *args[:-1], *flags) == 0
    assert "DirectRunner (in_memory, 2 worker(s))" in capsys.readouterr().out
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(threads) for p in threads.rglob("*") if p.is_file())
    for name in files:
        if name.name != "metadata.json":
            assert (threads / name).read_bytes() == (out / name).read_bytes(), name
    assert {**read_metadata(threads).raw, "runner": ""} == {**raw, "runner": ""}


def test_overwrite_replaces_a_complete_directory(inputs, tmp_path):
    out = tmp_path / "out"
    assert (
        preprocess("-i", inputs / "day_1.tsv.gz", "-o", out, *IN_MEMORY, "--eval-fraction", "0")
        == 0
    )
    assert read_metadata(out).split_rows("train") == 1
    assert (
        preprocess(
            "-i",
            inputs / "day_1.tsv.gz",
            "-o",
            out,
            *IN_MEMORY,
            "--overwrite",
            "--eval-fraction",
            "0.5",
        )
        == 0
    )
    assert read_metadata(out).raw["split_rule"]["eval_fraction"] == 0.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-i", "{root}/nope.tsv"], "input {root}/nope.tsv: no such file"),
        (["-i", "{root}/*.csv"], "no such file (or the glob matches nothing)"),
        (["-i", "{root}/day_0.tsv", "--spec", "criteo_v2"], "unknown spec 'criteo_v2'"),
        (["-i", "{root}"], "input {root} is a directory; pass its files or a glob"),
        (["-i", "{root}/day_0.tsv", "--eval-fraction", "1.5"], "--eval-fraction must be in [0, 1)"),
    ],
)
def test_errors_before_the_job_starts(inputs, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    argv = [a.format(root=inputs) for a in args]
    assert preprocess(*argv, "-o", out, *IN_MEMORY) == 2
    err = capsys.readouterr().err
    assert message.format(root=inputs) in err and "Traceback" not in err
    assert not (out / "_SUCCESS").exists()


def test_truncated_gzip_names_file_and_line(tmp_path, capsys):
    good = ("\n".join([GOOD_ROW] * 20000) + "\n").encode()
    data = gzip.compress(good)
    path = tmp_path / "cut.tsv.gz"
    path.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    assert preprocess("-i", path, "-o", out, *IN_MEMORY) == 2
    err = capsys.readouterr().err
    complete_lines = zlib.decompressobj(wbits=31).decompress(data[: len(data) // 2]).count(b"\n")
    assert f"{path}: line {complete_lines + 1}: compressed data is truncated" in err
    assert "Traceback" not in err and "hybridrec-input-error" not in err
    assert not (out / "_SUCCESS").exists()
    with pytest.raises(UserError, match="incomplete dataset directory"):
        read_metadata(out)


def test_empty_files(tmp_path, capsys):
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    out = tmp_path / "out"
    assert preprocess("-i", empty, "-o", out, *IN_MEMORY) == 2
    assert "no input rows: every input file is empty" in capsys.readouterr().err
    assert not (out / "_SUCCESS").exists()
    data = tmp_path / "data.tsv"
    data.write_text(GOOD_ROW + "\n" + row(label="0") + "\n")
    assert preprocess("-i", empty, data, "-o", out, *IN_MEMORY, "--eval-fraction", "0.5") == 0
    meta = read_metadata(out)
    assert meta.raw["counts"]["empty_files"] == [str(empty)]
    assert "note: empty input files" in capsys.readouterr().out
    assert (meta.split_rows("train"), meta.split_rows("eval")) == (1, 1)


def test_crlf_file_is_accepted_and_counted(tmp_path):
    path = tmp_path / "windows.tsv"
    path.write_bytes(("\r\n".join([GOOD_ROW] * 10) + "\r\n").encode())
    out = tmp_path / "out"
    assert preprocess("-i", path, "-o", out, *IN_MEMORY, "--eval-fraction", "0") == 0
    meta = read_metadata(out)
    assert meta.raw["counts"]["crlf_lines_accepted"] == 10
    assert read_all(meta, "train").column("C1").to_pylist() == [0x01AFD2EA734B8E1A] * 10


def test_every_row_rejected_is_an_error_with_the_reasons_and_the_first_row(tmp_path, capsys):
    path = tmp_path / "bad.tsv"
    path.write_text("a\tb\n" * 4 + row(label="x") + "\n")
    out = tmp_path / "out"
    assert preprocess("-i", path, "-o", out, *IN_MEMORY) == 2
    err = capsys.readouterr().err
    assert "every input row was rejected (5 rows: bad_label=1, wrong_field_count=4)" in err
    assert f"first: {path}:1: wrong_field_count (" in err and f"see {out}/rejected" in err
    assert len(err.strip().splitlines()) == 1
    assert not (out / "_SUCCESS").exists()
    assert len((out / "rejected" / "rejected-00000-of-00001.jsonl").read_text().splitlines()) == 5


def test_header_spec_checks_the_header(tmp_path, capsys):
    values = AVAZU_ROW.format(0, 79)
    path = tmp_path / "avazu.csv"
    path.write_text(f"{AVAZU_COLUMNS}\n{values}\n{values}\n")
    out = tmp_path / "out"
    assert (
        preprocess("-i", path, "-o", out, "--spec", "avazu", "--eval-fraction", "0", *IN_MEMORY)
        == 0
    )
    table = read_all(read_metadata(out), "train")
    assert table.num_rows == 2 and table.column("click").to_pylist() == [0.0, 0.0]
    assert "id" not in table.column_names and len(table.column_names) == 23
    wrong = tmp_path / "wrong.csv"
    wrong.write_text(f"{AVAZU_COLUMNS.replace('click', 'clicked')}\n{values}\n")
    assert preprocess("-i", wrong, "-o", tmp_path / "w", "--spec", "avazu", *IN_MEMORY) == 2
    err = capsys.readouterr().err
    assert f"{wrong}: line 1: header does not match spec avazu: " in err
    assert "field 2: 'clicked' in the file, 'click' in the spec" in err
    short = tmp_path / "short.csv"
    short.write_text(f"{AVAZU_COLUMNS.rsplit(',', 1)[0]}\n{values}\n")
    assert preprocess("-i", short, "-o", tmp_path / "w", "--spec", "avazu", *IN_MEMORY) == 2
    assert "field 24: missing in the file, 'C21' in the spec (23 fields" in capsys.readouterr().err


def test_a_byte_order_mark_is_not_part_of_the_first_field(tmp_path):
    """Header or not, the UTF-8 BOM some editors write before the first line is dropped."""
    bom = "\ufeff"
    with_header = tmp_path / "avazu.csv"
    with_header.write_text(f"{bom}{AVAZU_COLUMNS}\n{AVAZU_ROW.format(1, 2)}\n", encoding="utf-8")
    headerless = tmp_path / "criteo.tsv"
    headerless.write_text(f"{bom}{GOOD_ROW}\n{GOOD_ROW}\n", encoding="utf-8")
    for path, spec in ((with_header, "avazu"), (headerless, "criteo")):
        out = tmp_path / spec
        flags = ["--spec", spec, "--eval-fraction", "0", *IN_MEMORY]
        assert preprocess("-i", path, "-o", out, *flags) == 0
        meta = read_metadata(out)
        assert meta.raw["counts"]["rows_rejected"] == 0 and meta.split_rows("train") >= 1


def _complete_dataset(tmp_path):
    """A complete header-spec dataset and its files' contents, to compare after a failed run."""
    data = tmp_path / "good.csv"
    data.write_text(AVAZU_COLUMNS + "\n" + "\n".join(AVAZU_ROW.format(1, i) for i in range(9)))
    out = tmp_path / "out"
    assert preprocess("-i", data, "-o", out, "--spec", "avazu", *IN_MEMORY) == 0
    files = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    return out, files


def test_a_failed_overwrite_keeps_the_complete_dataset(tmp_path, capsys):
    """--overwrite replaces a complete dataset only once the new one is ready: a header
    error is found before the output is touched, and a job that fails while running
    (truncated .gz) or writes no row leaves the old dataset as it was."""
    out, files = _complete_dataset(tmp_path)
    wrong = tmp_path / "wrong.csv"
    wrong.write_text(AVAZU_COLUMNS.replace("C1,", "C1x,") + "\n" + AVAZU_ROW.format(0, 1) + "\n")
    truncated = tmp_path / "cut.csv.gz"
    rows = "\n".join(AVAZU_ROW.format(0, i) for i in range(5000))
    compressed = gzip.compress(f"{AVAZU_COLUMNS}\n{rows}\n".encode())
    truncated.write_bytes(compressed[: len(compressed) // 2])  # its header line is intact
    rejected = tmp_path / "rejected.csv"
    rejected.write_text(AVAZU_COLUMNS + "\n" + AVAZU_ROW.format("yes", 1) + "\n")
    cases = [
        (wrong, "field 4: 'C1x' in the file, 'C1' in the spec"),
        (truncated, "compressed data is truncated"),
        (rejected, f"see {out}/_temporary/rejected (the dataset already in {out} is unchanged)"),
    ]
    for path, message in cases:
        assert preprocess("-i", path, "-o", out, "--spec", "avazu", "--overwrite", *IN_MEMORY) == 2
        kept = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert {name: kept.get(name) for name in files} == files
        assert read_metadata(out).split_rows("train") + read_metadata(out).split_rows("eval") == 9
        assert message in capsys.readouterr().err
    assert (out / "_temporary" / "rejected" / "rejected-00000-of-00001.jsonl").exists()
    assert preprocess("-i", tmp_path / "good.csv", "-o", out, "--spec", "avazu", "--overwrite",
                      "--eval-fraction", "0.5", *IN_MEMORY) == 0  # fmt: skip
    assert read_metadata(out).split_rows("eval") == 5 and not (out / "_temporary").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--evall-fraction", "0.5"],
            "unknown flag --evall-fraction (did you mean --eval-fraction?)",
        ),  # fmt: skip
        (["--overwirte"], "unknown flag --overwirte (did you mean --overwrite?)"),
        (
            ["--direct-num-workers=2"],
            "unknown flag --direct-num-workers (did you mean --direct_num_workers?)",
        ),  # fmt: skip
        (
            ["--no-such-option"],
            "unknown flag --no-such-option: not a flag of this command nor a Beam",
        ),  # fmt: skip
        (
            ["--direct_running_mode=fast"],
            "Beam pipeline option argument --direct_running_mode: invalid choice",
        ),  # fmt: skip
    ],
)
def test_flags_neither_preprocess_nor_beam_knows_are_errors(tmp_path, capsys, flags, message):
    data = tmp_path / "data.tsv"
    data.write_text(GOOD_ROW + "\n")
    out = tmp_path / "out"
    assert preprocess("-i", data, "-o", out, *flags, "--quiet") == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_summary_and_last_progress_line_of_a_small_run(tmp_path, capsys):
    """Beam options pass through; a run without rejected rows lists no rejected/; the last
    progress line reads 100% however small the input."""
    data = tmp_path / "data.tsv"
    data.write_text("\n".join([GOOD_ROW] * 20) + "\n")
    out = tmp_path / "out"
    flags = ["--direct_running_mode=in_memory", "--direct_num_workers=2", "--project=p"]
    assert preprocess("-i", data, "-o", out, *flags) == 0
    captured = capsys.readouterr()
    assert "DirectRunner (in_memory, 2 worker(s))" in captured.out
    assert f"output:   {out}/ (metadata.json, train/, eval/, _SUCCESS)" in captured.out
    assert "(100%)" in captured.err.strip().splitlines()[-1]
    assert not (out / "rejected").exists()


def test_position_split_inside_a_header_file_with_a_bad_row(tmp_path):
    """The eval boundary falls inside the first chunk, which holds the header and a bad row."""
    rows = [AVAZU_ROW.format(0, 1), AVAZU_ROW.format(0, 2), "too,few", AVAZU_ROW.format(1, 3)]
    rows += [AVAZU_ROW.format(1, 4), AVAZU_ROW.format(1, 5)]
    path = tmp_path / "avazu.csv"
    path.write_text(AVAZU_COLUMNS + "\n" + "\n".join(rows) + "\n")
    out = tmp_path / "out"
    flags = ["--spec", "avazu", "--eval-fraction", "0.4", *IN_MEMORY]
    assert preprocess("-i", path, "-o", out, *flags) == 0
    meta = read_metadata(out)
    # 7 lines (header included); eval is the last round(7 * 0.4) = 3: the rows of lines 5-7
    assert read_all(meta, "train").column("click").to_pylist() == [0.0, 0.0]
    assert read_all(meta, "eval").column("click").to_pylist() == [1.0, 1.0, 1.0]
    assert len(set(read_all(meta, "eval").column("C21").to_pylist())) == 3  # rows 3, 4, 5
    assert meta.raw["stats"]["label_rate"] == 0.0
    rejected = json.loads((out / meta.raw["rejected_files"][0]).read_text())
    assert (rejected["line"], rejected["reason"]) == (4, "wrong_field_count")


def test_real_criteo_sample(criteo_sample, tmp_path, capsys):
    out = tmp_path / "out"
    assert preprocess("-i", criteo_sample, "-o", out) == 0
    meta = read_metadata(out)
    counts = meta.raw["counts"]
    assert counts["rows_read"] == 137_139
    assert counts["rows_written"] + counts["rows_rejected"] == 137_139
    assert meta.split_rows("eval") == pytest.approx(13_714, abs=counts["rows_rejected"] + 1)
    assert meta.raw["stats"]["label_rate"] == pytest.approx(0.2568, abs=0.01)
    eval_table = read_all(meta, "eval")
    assert np.all(eval_table.column("I1").to_numpy() >= 0)


def test_spec_file_with_multi_valued_feature(tmp_path):
    spec = tmp_path / "clicks.toml"
    spec.write_text(
        'name = "clicks"\ndelimiter = ","\ncolumns = ["y", "price", "user", "tags"]\n'
        'label = "y"\ndense = ["price"]\ndense_type = "float64"\n'
        '[[categorical]]\nname = "user"\n'
        '[[categorical]]\nname = "tags"\ntable = "tag"\nmulti_valued = true\nseparator = "|"\n'
    )
    data = tmp_path / "clicks.csv"
    data.write_text("1,2.5,u1,a|b\n0,,u2,\n1,-4,,b\n0,x,u1,a\n")
    out = tmp_path / "out"
    assert (
        preprocess("-i", data, "-o", out, "--spec", spec, "--eval-fraction", "0", *IN_MEMORY) == 0
    )
    meta = read_metadata(out)
    assert [(c.name, c.table, c.multi_valued) for c in meta.categorical] == [
        ("user", "user", False),
        ("tags", "tag", True),
    ]
    table = read_all(meta, "train")
    assert table.schema.field("tags").type == pa.list_(pa.uint64())
    tags = table.column("tags").to_pylist()
    assert [len(t) for t in tags] == [2, 1, 1] and tags[0][1] == tags[2][0]  # "b" == "b"
    assert tags[1] == [2 << 56]  # the missing id of feature 2
    assert table.column("price").to_pylist() == pytest.approx([np.log1p(2.5), 0.0, 0.0])
    assert meta.raw["counts"]["rejected_by_reason"] == {"non_numeric_dense": 1}
    assert meta.raw["stats"]["categorical"]["tags"]["distinct_estimate"] == 3  # a, b, missing
