"""Header lines of text inputs: compared with the spec's columns, field by field.

A spec with `header = true` says the first line of every text input names its columns.
The launcher checks every input's header before the job touches the output
(`_chunks.check_headers`); the workers check it again as they read (`strip_header`).
A UTF-8 byte order mark at the start of a file is not part of its first field.
"""

from __future__ import annotations

from hybridrec.pipeline._errors import InputError
from hybridrec.pipeline.spec import FeatureSpec

BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark, written by some Windows tools
_SHOWN = 60  # characters of a field shown in a message


def strip_bom(data: bytes) -> bytes:
    """`data` without a leading UTF-8 byte order mark."""
    return data[len(BOM) :] if data.startswith(BOM) else data


def mismatch(header: str, spec: FeatureSpec) -> str | None:
    """Where `header` (a header line, no newline) differs from the spec's columns, or None.

    Returns:
        The first differing field, e.g. "field 5: 'prize' in the file, 'price' in the
        spec", with the field counts when they differ too.
    """
    # an event log's "whitespace" delimiter: runs of spaces and tabs
    fields = header.split() if spec.delimiter == "whitespace" else header.split(spec.delimiter)
    columns = list(spec.columns)
    if fields == columns:
        return None
    counts = ""
    if len(fields) != len(columns):
        counts = (
            f" ({len(fields)} fields in the file at delimiter {spec.delimiter!r}, "
            f"{len(columns)} in the spec)"
        )
    for index, (found, expected) in enumerate(zip(fields, columns, strict=False), 1):
        if found != expected:
            return (
                f"field {index}: {found[:_SHOWN]!r} in the file, {expected!r} in the spec{counts}"
            )
    index = min(len(fields), len(columns))
    if len(fields) < len(columns):
        return f"field {index + 1}: missing in the file, {columns[index]!r} in the spec{counts}"
    return f"field {index + 1}: {fields[index][:_SHOWN]!r} in the file, not in the spec{counts}"


def strip_header(block: bytes, spec: FeatureSpec, path: str) -> bytes:
    """`block` (the first block of a file, BOM removed) without its header line.

    Raises:
        InputError: the header does not match the spec's columns.
    """
    end = block.find(b"\n")
    end = len(block) if end < 0 else end
    problem = mismatch(decode_line(block[:end]), spec)
    if problem:
        raise InputError(f"{path}: line 1: header does not match spec {spec.name!r}: {problem}")
    return block[end + 1 :]


def decode_line(line: bytes) -> str:
    """A header line as text (a CR before the newline dropped, invalid UTF-8 escaped)."""
    return line.rstrip(b"\r").decode("utf-8", errors="backslashreplace")
