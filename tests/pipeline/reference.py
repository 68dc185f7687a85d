"""Shared test data: a known Criteo row and a plain-Python implementation of the transform."""

import math

from .test_hashing import reference_id

DENSE = ["1", "-1", "", "7", "31", "0", "3", "", "99", "", "2", "", "5"]
CATEGORICAL = [f"{0x68FD1E64 + i:08x}" if i % 7 else "" for i in range(26)]
CATEGORICAL[0] = "68fd1e64"


def row(label="1", fields=40, dense=None):
    values = list(DENSE)
    for name, value in (dense or {}).items():
        values[int(name[1:]) - 1] = value
    fields_list = [label, *values, *CATEGORICAL]
    fields_list = fields_list[:fields] + ["extra"] * (fields - 40)
    return "\t".join(fields_list)


GOOD_ROW = row()


def criteo_reference_row(line: str) -> dict:
    """Contract 1 values of one raw Criteo line, computed the slow, obvious way."""
    fields = line.split("\t")
    result = {"label": float(fields[0])}
    for i in range(13):
        raw = fields[1 + i]
        result[f"I{i + 1}"] = math.log1p(max(int(raw), 0)) if raw else 0.0
    for i in range(26):
        result[f"C{i + 1}"] = reference_id(fields[14 + i].encode(), i + 1)
    return result
