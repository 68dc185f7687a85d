"""A feature spec proposed from a sample of a raw log (`hybridrec spec --sample FILE`).

Reads the first rows of a delimited text file (plain or gzip), guesses the separator
and whether the first line is a header, and gives every column a kind from its values:

* label: the first column with exactly two distinct values (and none missing);
* ignored: an id (every value distinct) or a timestamp (dates, times, epoch seconds);
* numeric: every value a number, with more than `MAX_CODE_VALUES` distinct values or
  some missing;
* categorical: everything else (strings, hashes, a few integer codes never missing).

The result is the TOML text `pipeline.load_spec` reads, with one comment per column
saying why it got its kind; the user checks and edits it before preprocessing.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import zlib
from collections import Counter
from pathlib import Path

from hybridrec.common import config
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.pipeline._header import strip_bom
from hybridrec.pipeline._sample import ColumnGuess
from hybridrec.pipeline._sample import number as as_number
from hybridrec.pipeline.events import infer_events
from hybridrec.pipeline.spec import FeatureSpec

SAMPLE_ROWS = 2000  # rows read from the start of the file
SAMPLE_BYTES = 8 << 20  # at most this many (decompressed) bytes
# tried in this order, the widest split that fits winning; runs of whitespace only when
# none of them fits (text with spaces in a field would otherwise split on them)
SEPARATORS = ("\t", ",", ";", "|", "::")
WHITESPACE = "whitespace"
# a separator fits when it splits at least this share of the lines into the same number
# of fields; the other lines are left out of the sample (and reported)
MIN_FITTING_SHARE = 0.95
MAX_CODE_VALUES = 10  # integer columns with at most this many distinct values are codes
MIN_ROWS_FOR_ID = 20  # "every value distinct" means an id only in a sample this large
# positive label values, lower case (else the rarer of the two values is the positive one)
POSITIVE_LABELS = {"1", "yes", "y", "true", "t", "click", "clicked", "positive", "pos"}
LABEL_NAMES = ("label", "click", "clicked", "target", "y", "outcome", "is_click")
_TIMESTAMP = re.compile(
    r"^\d{4}-\d{2}-\d{2}([ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?$"
    r"|^\d{1,2}:\d{2}(:\d{2})?$|^\d{4}/\d{2}/\d{2}( \d{2}:\d{2}(:\d{2})?)?$"
)
_EPOCH_SECONDS = (946_684_800, 4_102_444_800)  # 2000-01-01 .. 2100-01-01
_SEPARATOR_NAMES = {
    "\t": "tab",
    ",": "comma",
    ";": "semicolon",
    "|": "pipe",
    "::": "'::'",
    WHITESPACE: "whitespace",
}


@dataclasses.dataclass(frozen=True)
class ProposedSpec:
    """What `propose_spec` found: the spec, its TOML text and the reasons."""

    spec: FeatureSpec
    columns: tuple[ColumnGuess, ...]
    toml: str
    rows: int  # data rows of the sample the guesses rest on
    # lines (1-based) left out: a field count other than most lines' (a few bad lines)
    skipped_lines: tuple[int, ...] = ()


def propose_spec(path: str | Path, *, max_rows: int = SAMPLE_ROWS):
    """Proposes a feature spec from the first `max_rows` rows of `path`: a click-log spec
    (`ProposedSpec`), or for an event log an event spec (`infer_events.ProposedEventSpec`).

    Lines with another number of fields than most (at least MIN_FITTING_SHARE of the
    lines have the same) are left out and listed in `skipped_lines`.

    Raises:
        UserError: the file is missing, empty, binary or not delimited text, or no
            column can be the label or categorical; the message names the file (and line).
    """
    path = Path(path)
    numbered = _read_lines(path, max_rows)
    if infer_events.user_per_line([line for _, line in numbered]):
        return infer_events.propose_user_per_line(path, [line for _, line in numbered])
    delimiter, width = _guess_separator(path, numbered)
    rows = [split_fields(line, delimiter) for _, line in numbered]
    fits = [len(row) == width for row in rows]
    skipped = tuple(number for (number, _), fit in zip(numbered, fits, strict=True) if not fit)
    rows = [row for row, fit in zip(rows, fits, strict=True) if fit]
    header = _looks_like_header(rows)
    names = [name.strip() for name in rows[0]] if header else [f"c{i}" for i in range(width)]
    data = (rows[1:] if header else rows)[:max_rows]
    if not data:
        raise UserError(f"{path}: only a header line; the sample needs data rows too")
    columns = [[row[index] for row in data] for index in range(width)]
    events = infer_events.propose_events(
        path, delimiter, header, names, columns,
        label_present=_choose_label(names, columns) is not None,
    )  # fmt: skip
    if events is not None:
        return dataclasses.replace(events, skipped_lines=skipped)
    if len(delimiter.encode()) != 1:
        raise UserError(
            f"{path}: fields separated by {_SEPARATOR_NAMES[delimiter]}, which a click log's "
            "spec does not take (one byte: tab, comma, ...), and no user and item columns "
            "make it an event log"
        )
    guesses = _guess_kinds(path, names, columns)
    spec = _build_spec(path, delimiter, header, names, columns, guesses)
    toml = _to_toml(spec, guesses, len(data))
    try:
        config.from_dict(FeatureSpec, tomllib.loads(toml))
    except ConfigError as error:  # names that TOML or the spec cannot hold
        raise UserError(f"{path}: the proposed spec does not load: {error}") from None
    return ProposedSpec(
        spec=spec, columns=tuple(guesses), toml=toml, rows=len(data), skipped_lines=skipped
    )


def _read_lines(path: Path, max_rows: int) -> list[tuple[int, str]]:
    """The sample's non-empty lines with their 1-based line numbers, a BOM removed."""
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a sample file")
    with path.open("rb") as handle:
        head = handle.read(SAMPLE_BYTES)
    if head[:2] == b"\x1f\x8b":
        try:
            head = zlib.decompressobj(wbits=31).decompress(head, SAMPLE_BYTES)
        except zlib.error as error:
            raise UserError(f"{path}: corrupt gzip data ({error})") from None
    elif path.suffix == ".gz" and head:
        raise UserError(f"{path}: named .gz but not gzip data")
    if not head.strip():
        raise UserError(f"{path}: the file is empty; a sample needs a few rows of the log")
    if b"\x00" in head:
        line = head.count(b"\n", 0, head.index(b"\x00")) + 1
        raise UserError(f"{path}: line {line}: binary data (a NUL byte), not a text log")
    raw_lines = strip_bom(head).split(b"\n")
    if len(raw_lines) > 1 and len(head) >= SAMPLE_BYTES:
        raw_lines = raw_lines[:-1]  # the last line may be cut by the byte limit
    lines = []
    for number, raw in enumerate(raw_lines[: max_rows + 1], 1):
        raw = raw.removesuffix(b"\r")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UserError(
                f"{path}: line {number}: not UTF-8 text (byte {error.start + 1}); "
                "is this a binary file?"
            ) from None
        if text:
            lines.append((number, text))
    if len(lines) == 1:
        raise UserError(
            f"{path}: only one line; the sample needs a header and data rows, or several rows"
        )
    return lines


def split_fields(line: str, delimiter: str) -> list[str]:
    """A line's fields at `delimiter` ("whitespace": runs of spaces and tabs)."""
    return line.split() if delimiter == WHITESPACE else line.split(delimiter)


def _guess_separator(path: Path, numbered: list[tuple[int, str]]) -> tuple[str, int]:
    """The separator that splits most lines (MIN_FITTING_SHARE) into the same number (> 1)
    of fields, the widest such split if several do (whitespace only when no other does);
    returns (separator, fields)."""
    lines = [line for _, line in numbered]
    best, best_width = None, 1
    for separator in (*SEPARATORS, WHITESPACE):
        if best is not None and separator == WHITESPACE:
            break
        widths = Counter(len(split_fields(line, separator)) for line in lines)
        width, count = widths.most_common(1)[0]
        if count >= MIN_FITTING_SHARE * len(lines) and width > best_width:
            best, best_width = separator, width
    if best is None:
        message = (
            f"{path}: no separator ({', '.join(_SEPARATOR_NAMES.values())}) splits "
            f"{MIN_FITTING_SHARE:.0%} of the lines into the same number of fields"
        )
        for separator in SEPARATORS:  # a multi-byte separator the lines hold, but unevenly
            if len(separator) == 1 or not any(separator in line for line in lines):
                continue
            counts = [len(split_fields(line, separator)) for line in lines]
            width, count = Counter(counts).most_common(1)[0]
            number, odd = next((n, c) for (n, _), c in zip(numbered, counts, strict=True) if c != width)  # fmt: skip
            message += (
                f"; {_SEPARATOR_NAMES[separator]} splits {count:,} of the {len(lines):,} sample "
                f"lines into {width} fields, but line {number} into {odd}"
            )
        raise UserError(message)
    return best, best_width


def _looks_like_header(rows: list[list[str]]) -> bool:
    """The first line names the columns: distinct non-numeric names, none of which shows
    up again in its column."""
    first = [value.strip() for value in rows[0]]
    if len(rows) < 2 or len(set(first)) != len(first):
        return False
    if any(not value or as_number(value) is not None for value in first):
        return False
    return all(first[index] not in {row[index] for row in rows[1:]} for index in range(len(first)))


def _integer(number: float) -> bool:
    return number == int(number)


def _guess_kinds(path: Path, names: list[str], columns: list[list[str]]) -> list[ColumnGuess]:
    rows = len(columns[0])
    label = _choose_label(names, columns)
    if label is None:
        raise UserError(
            f"{path}: no column has exactly two distinct values in the first {rows} rows, "
            "so none can be the label; write the spec by hand (docs/pipeline.md)"
        )
    guesses = []
    for index, (name, values) in enumerate(zip(names, columns, strict=True)):
        present = [value for value in values if value != ""]
        distinct = set(present)
        numbers = [as_number(value) for value in present]
        numeric = bool(present) and all(number is not None for number in numbers)
        missing = rows - len(present)
        if index == label:
            guesses.append(ColumnGuess(name, "label", _label_reason(values)))
        elif not present:
            guesses.append(ColumnGuess(name, "ignored", "always empty"))
        elif all(_TIMESTAMP.match(value) for value in present):
            guesses.append(ColumnGuess(name, "ignored", f"timestamp-like ({present[0]!r})"))
        elif numeric and all(
            _integer(n) and _EPOCH_SECONDS[0] <= n < _EPOCH_SECONDS[1] for n in numbers
        ):
            guesses.append(ColumnGuess(name, "ignored", f"epoch seconds ({present[0]!r})"))
        elif len(distinct) == rows >= MIN_ROWS_FOR_ID and not (
            numeric and not all(_integer(n) for n in numbers)
        ):
            guesses.append(ColumnGuess(name, "ignored", f"id-like: all {rows} values are distinct"))
        elif numeric and (len(distinct) > MAX_CODE_VALUES or missing):
            kind = "integers" if all(_integer(n) for n in numbers) else "numbers"
            reason = f"{kind}, {len(distinct)} distinct values"
            if missing:
                reason += f", {missing} missing"
            guesses.append(ColumnGuess(name, "numeric", reason))
        elif numeric:
            guesses.append(
                ColumnGuess(
                    name,
                    "categorical",
                    f"only {len(distinct)} distinct numbers: codes, not amounts",
                )
            )
        else:
            example = ", ".join(repr(value) for value in list(dict.fromkeys(present))[:3])
            guesses.append(
                ColumnGuess(name, "categorical", f"{len(distinct)} distinct values ({example})")
            )
    return guesses


def _choose_label(names: list[str], columns: list[list[str]]) -> int | None:
    candidates = [
        index for index, values in enumerate(columns) if len(set(values)) == 2 and "" not in values
    ]
    for index in candidates:
        if names[index].lower() in LABEL_NAMES:
            return index
    return candidates[0] if candidates else None


def _label_values(values: list[str]) -> tuple[str, str]:
    """[negative, positive] of a two-valued column."""
    counts = Counter(values)
    first, second = sorted(counts)
    if {first, second} == {"0", "1"}:
        return "0", "1"
    for value in (first, second):
        if value.lower() in POSITIVE_LABELS:
            return (second if value == first else first), value
    rarer, commoner = sorted(counts, key=lambda value: (counts[value], value))
    return commoner, rarer


def _label_reason(values: list[str]) -> str:
    negative, positive = _label_values(values)
    share = sum(value == positive for value in values) / len(values)
    return f"two distinct values: {positive!r} positive ({share:.1%}), {negative!r} negative"


def _build_spec(path, delimiter, header, names, columns, guesses) -> FeatureSpec:
    if not any(guess.kind == "categorical" for guess in guesses):
        kinds = ", ".join(f"{guess.name} {guess.kind}" for guess in guesses)
        raise UserError(
            f"{path}: no column looks categorical ({kinds}); the models need at least one "
            "categorical feature: write the spec by hand (docs/pipeline.md)"
        )
    label = next(guess for guess in guesses if guess.kind == "label")
    label_values = _label_values(columns[names.index(label.name)])
    dense = [guess.name for guess in guesses if guess.kind == "numeric"]
    dense_numbers = [
        as_number(value) for name in dense for value in columns[names.index(name)] if value != ""
    ]
    integers = all(_integer(number) for number in dense_numbers)
    non_negative = all(number >= 0 for number in dense_numbers)
    stem = path.name.split(".")[0] or "dataset"
    data = {
        "name": re.sub(r"[^A-Za-z0-9_]+", "_", stem),
        "delimiter": delimiter,
        "header": header,
        "columns": names,
        "label": label.name,
        "label_values": list(label_values),
        "dense": dense,
        "dense_type": "int64" if integers else "float64",
        "dense_transform": "log1p" if non_negative else "identity",
        "categorical": [{"name": g.name} for g in guesses if g.kind == "categorical"],
    }
    try:
        return config.from_dict(FeatureSpec, data)
    except ConfigError as error:
        raise UserError(f"{path}: the proposed spec is not valid: {error}") from None


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\t", "\\t")
    return f'"{escaped}"'


def _toml_list(values) -> str:
    return "[" + ", ".join(_toml_string(value) for value in values) + "]"


def _to_toml(spec: FeatureSpec, guesses: list[ColumnGuess], rows: int) -> str:
    """The spec as a TOML file `load_spec` reads, the reasons as comments."""
    width = max(len(guess.name) for guess in guesses)
    lines = [
        f"# Proposed by `hybridrec spec` from the first {rows} rows; check every column.",
        "# column kinds and why:",
        *(f"#   {g.name:<{width}}  {g.kind:<11}  {g.reason}" for g in guesses),
        "",
        f"name = {_toml_string(spec.name)}",
        f"delimiter = {_toml_string(spec.delimiter)}",
        f"header = {'true' if spec.header else 'false'}",
        f"columns = {_toml_list(spec.columns)}",
        f"label = {_toml_string(spec.label)}",
        f"label_values = {_toml_list(spec.label_values)}  # [negative, positive]",
        f"dense = {_toml_list(spec.dense)}",
        f"dense_type = {_toml_string(spec.dense_type)}",
        f"dense_transform = {_toml_string(spec.dense_transform)}",
    ]
    for feature in spec.categorical:
        lines += ["", "[[categorical]]", f"name = {_toml_string(feature.name)}"]
    return "\n".join(lines) + "\n"
