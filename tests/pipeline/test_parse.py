"""Block parsing: the vectorized path against plain Python, and every kind of bad row."""

import numpy as np
import pyarrow as pa
import pytest
from hybridrec.pipeline import BlockParser, hashing
from hybridrec.pipeline.spec import load_spec

from .reference import GOOD_ROW, criteo_reference_row, row

CRITEO = load_spec("criteo")


@pytest.fixture(scope="module")
def parser():
    return BlockParser(CRITEO)


def test_matches_python_reference(parser):
    rng = np.random.default_rng(1)
    lines = []
    for i in range(300):
        dense = [
            "" if rng.random() < 0.3 else str(int(rng.integers(-5, 10 ** int(rng.integers(1, 12)))))
            for _ in range(13)
        ]
        cats = [
            "" if rng.random() < 0.2 else f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)
        ]
        lines.append("\t".join([str(i % 2), *dense, *cats]))
    parsed = parser.parse(("\n".join(lines) + "\n").encode())
    assert parsed.rejected == [] and parsed.table.num_rows == 300
    assert parsed.table.schema.field("C1").type == pa.uint64()
    assert parsed.table.schema.field("I1").type == pa.float32()
    for i, line in enumerate(lines):
        expected = criteo_reference_row(line)
        got = {name: parsed.table.column(name)[i].as_py() for name in expected}
        for name, value in expected.items():
            if name.startswith("I"):
                assert got[name] == pytest.approx(value, rel=1e-6), (i, name)
            else:
                assert got[name] == value, (i, name)


def test_last_line_without_newline_and_empty_block(parser):
    assert parser.parse(GOOD_ROW.encode()).table.num_rows == 1
    empty = parser.parse(b"")
    assert empty.table.num_rows == 0 and empty.lines == 0


BAD_ROWS = [
    (row(fields=39), "wrong_field_count", "39 fields, expected 40"),
    (row(fields=41), "wrong_field_count", "41 fields"),
    ("", "wrong_field_count", "1 fields"),
    (row(label="2"), "bad_label", "'2' is not 0 or 1"),
    (row(label=""), "bad_label", ""),
    (row(label="1.0"), "bad_label", ""),
    (row(dense={"I3": "12a"}), "non_numeric_dense", "I3='12a'"),
    (row(dense={"I5": "-"}), "non_numeric_dense", "I5='-'"),
    (row(dense={"I1": "1.5"}), "non_numeric_dense", "I1='1.5'"),
    (row(dense={"I2": " 7"}), "non_numeric_dense", "I2=' 7'"),
    (row(dense={"I4": "9223372036854775808"}), "int64_overflow", "I4="),
    (row(dense={"I4": "-99999999999999999999"}), "int64_overflow", "I4="),
    (row(dense={"I4": "12345678901234567890123"}), "int64_overflow", ""),
]


@pytest.mark.parametrize(("line", "reason", "detail"), BAD_ROWS)
def test_bad_rows_are_rejected_with_reason(parser, line, reason, detail):
    block = "\n".join([GOOD_ROW, line, GOOD_ROW]) + "\n"
    parsed = parser.parse(block.encode())
    assert parsed.table.num_rows == 2
    assert parsed.line_offsets.tolist() == [0, 2]
    [(offset, got_reason, got_detail, text)] = parsed.rejected
    assert (offset, got_reason) == (1, reason)
    assert detail in got_detail
    assert text == line


def test_invalid_utf8_rejected_and_valid_utf8_accepted(parser):
    bad = row().encode().replace(b"68fd1e64", b"68fd\xff\xfe64", 1)
    good = row().encode().replace(b"68fd1e64", "caf\u00e9".encode(), 1)
    parsed = parser.parse(b"\n".join([good, bad, good]) + b"\n")
    assert [(o, r) for o, r, _, _ in parsed.rejected] == [(1, "invalid_utf8")]
    assert "\\xff" in parsed.rejected[0][3]
    assert parsed.table.num_rows == 2


def test_int64_limits_are_exact(parser):
    lines = [row(dense={"I4": "9223372036854775807"}), row(dense={"I4": "-9223372036854775808"})]
    parsed = parser.parse(("\n".join(lines) + "\n").encode())
    assert parsed.rejected == []
    assert parsed.table.column("I4").to_pylist() == pytest.approx(
        [np.log1p(9223372036854775807), 0.0]
    )


def test_crlf_lines_are_accepted_and_counted(parser):
    lf = parser.parse(("\n".join([GOOD_ROW] * 3) + "\n").encode())
    crlf = parser.parse(("\r\n".join([GOOD_ROW] * 3) + "\r\n").encode())
    assert crlf.crlf_lines == 3 and crlf.rejected == []
    assert crlf.table.equals(lf.table)


def test_multi_valued_feature_and_float_dense(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        'name = "t"\ndelimiter = ","\ncolumns = ["y", "x", "tags"]\nlabel = "y"\n'
        'dense = ["x"]\ndense_type = "float64"\ndense_transform = "identity"\n'
        '[[categorical]]\nname = "tags"\nmulti_valued = true\nseparator = "|"\n'
    )
    parser = BlockParser(load_spec(path))
    parsed = parser.parse(b"1,2.5,a|b|a\n0,,\n0,x,a\n1,-3e2,b\n")
    assert [(o, r) for o, r, _, _ in parsed.rejected] == [(2, "non_numeric_dense")]
    assert parsed.table.column("x").to_pylist() == [2.5, 0.0, -300.0]
    a, b = (
        hashing.feature_ids(hashing.hash_bytes_list([v]), np.array([False]), 1, 8)[0]
        for v in (b"a", b"b")
    )
    assert parsed.table.column("tags").to_pylist() == [[a, b, a], [hashing.missing_id(1, 8)], [b]]
