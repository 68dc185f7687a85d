"""`hybridrec spec --sample FILE`: a spec proposed from the first rows of a raw log."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
from hybridrec.pipeline import BlockParser, load_spec
from hybridrec.pipeline.infer_spec import propose_spec
from hybridrec.pipeline.synthetic import generate_block

from hybridrec import cli


def spec_command(*args):
    return cli.main(["spec", *map(str, args)])


def own_log(rows: int = 400, seed: int = 0) -> str:
    """A CSV unlike Criteo's: header, id, timestamp, string label, a price, three fields."""
    rng = np.random.default_rng(seed)
    lines = ["event_id,event_time,outcome,price,country,device,slot"]
    for row in range(rows):
        outcome = "yes" if rng.random() < 0.3 else "no"
        price = "" if rng.random() < 0.1 else f"{rng.gamma(2.0, 3.0):.2f}"
        lines.append(
            f"e{row:06d},2026-03-{1 + row % 28:02d} {row % 24:02d}:15:00,{outcome},{price},"
            f"{rng.choice(['de', 'fr', 'us', 'jp', 'br'])},d{rng.integers(0, 90):x},"
            f"{rng.integers(1, 4)}"
        )
    return "\n".join(lines) + "\n"


def test_own_csv_kinds_reasons_and_a_spec_that_loads_and_parses(tmp_path, capsys):
    sample, out = tmp_path / "events.csv", tmp_path / "events.toml"
    sample.write_text(own_log())
    assert spec_command("--sample", sample, "--out", out) == 0
    printed = capsys.readouterr().out
    spec = load_spec(out)
    assert (spec.delimiter, spec.header, spec.label) == (",", True, "outcome")
    assert spec.label_values == ("no", "yes")
    assert spec.dense == ("price",) and spec.dense_type == "float64"
    assert [c.name for c in spec.categorical] == ["country", "device", "slot"]
    kinds = {line.split()[0]: line.split()[1] for line in printed.splitlines()[:7]}
    assert kinds == {
        "event_id": "ignored",
        "event_time": "ignored",
        "outcome": "label",
        "price": "numeric",
        "country": "categorical",
        "device": "categorical",
        "slot": "categorical",
    }
    assert "id-like: all 400 values are distinct" in printed
    assert "timestamp-like" in printed and "'yes' positive" in printed
    assert f"--spec {out} --output DATA_DIR" in printed
    # the proposed spec parses the very rows it was proposed from
    parsed = BlockParser(spec).parse(sample.read_bytes().split(b"\n", 1)[1])
    assert parsed.rejected == [] and parsed.table.num_rows == 400


def test_headerless_gzip_tsv_in_the_criteo_layout(tmp_path):
    text, _ = generate_block(seed=1, block_index=0, rows=600)
    sample = tmp_path / "day_0.tsv.gz"
    sample.write_bytes(gzip.compress(text))
    proposed = propose_spec(sample)
    spec = proposed.spec
    assert (spec.delimiter, spec.header, spec.label, spec.label_values) == (
        "\t",
        False,
        "c0",
        ("0", "1"),
    )
    assert len(spec.columns) == 40 and len(spec.categorical) == 26
    assert len(spec.dense) == 13 and spec.dense_type == "int64"
    assert proposed.rows == 600
    assert load_spec(_write(tmp_path / "s.toml", proposed.toml)) == spec


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.csv", b"", "the file is empty"),
        ("blank.csv", b"\n\n", "the file is empty"),
        ("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "line 3: binary data"),
        ("latin1.csv", b"a,b\n0,caf\xe9\n1,x\n", "line 2: not UTF-8 text (byte 6)"),
        ("fake.csv.gz", b"label,x\n0,a\n", "named .gz but not gzip data"),
        ("header.csv", b"label,x\n", "only one line"),
        ("header_blank.csv", b"label,x\n\n\n", "only one line"),
        ("ragged.csv", b"a,b,c\n1,2,3\n4,5\n", "no separator"),
        ("mostly_ragged.csv", b"a,b,c\n" + b"1,2,3\n" * 18 + b"4,5\n1\n", "splits 95% of the"),
        (
            "dense_only.csv",
            b"y,p\n" + b"".join(b"%d,%d.5\n" % (i % 2, i % 15) for i in range(30)),
            "no column looks categorical (y label, p numeric)",
        ),
        ("nolabel.csv", b"a,b\n1,x\n2,y\n3,z\n", "no column has exactly two distinct values"),
    ],
)
def test_bad_samples_are_one_line_errors_naming_the_file(tmp_path, capsys, name, content, message):
    sample = tmp_path / name
    sample.write_bytes(content)
    out = tmp_path / "spec.toml"
    assert spec_command("--sample", sample, "--out", out) == 2
    err = capsys.readouterr().err
    assert f"{sample}: " in err and message in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_missing_sample_and_existing_out(tmp_path, capsys):
    assert spec_command("--sample", tmp_path / "nothere.csv") == 2
    assert f"{tmp_path / 'nothere.csv'}: no such file" in capsys.readouterr().err
    sample, out = tmp_path / "events.csv", tmp_path / "events.toml"
    sample.write_text(own_log(rows=50))
    out.write_text("# my edits\n")
    assert spec_command("--sample", sample, "--out", out) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "# my edits\n"


def test_a_few_lines_with_other_field_counts_are_left_out_and_named(tmp_path, capsys):
    lines = own_log(rows=300).splitlines()
    lines[41] += ",extra"  # line 42
    lines[200] = lines[200].rsplit(",", 1)[0]  # line 201
    sample, out = tmp_path / "events.csv", tmp_path / "events.toml"
    sample.write_text("\n".join(lines) + "\n")
    assert spec_command("--sample", sample, "--out", out) == 0
    err = capsys.readouterr().err
    assert f"{sample}: left out 2 line(s) without the 7 fields of the others: line 42, 201" in err
    spec = load_spec(out)
    assert spec.label == "outcome" and [c.name for c in spec.categorical] == ["country", "device", "slot"]  # fmt: skip
    assert propose_spec(sample).skipped_lines == (42, 201)


def test_a_byte_order_mark_is_not_part_of_the_first_name(tmp_path):
    sample = tmp_path / "events.csv"
    sample.write_bytes(b"\xef\xbb\xbf" + own_log(rows=100).encode())
    spec = propose_spec(sample).spec
    assert spec.header and spec.columns[0] == "event_id"
