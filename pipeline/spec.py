"""Feature specs: what the columns of a raw click log mean.

A spec names the label, the dense columns and the categorical columns of a
delimited text log (TSV/CSV), and the embedding table each categorical feature
uses. Built-in specs live in `pipeline/specs/<name>.toml` (`criteo`, `avazu`);
any other dataset is described by a spec file in the same format (see
docs/pipeline.md). Unknown keys are errors, like everywhere in hybridrec.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from hybridrec.common import config
from hybridrec.common.errors import ConfigError, UserError

SPEC_DIR = Path(__file__).parent / "specs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CategoricalSpec:
    """One categorical feature of a raw log."""

    name: str  # column name in the raw log and in the output Parquet
    table: str = ""  # embedding table the ids index; defaults to the feature name
    multi_valued: bool = False  # true: the field holds several values joined by `separator`
    separator: str = ""  # separator between the values of a multi-valued field (one character)

    def __post_init__(self):
        if not self.name:
            raise ValueError("categorical feature with an empty name")
        if not self.table:
            object.__setattr__(self, "table", self.name)
        if self.multi_valued and len(self.separator.encode()) != 1:
            raise ValueError(
                f"categorical {self.name}: multi_valued needs a one-byte separator, got {self.separator!r}"
            )
        if not self.multi_valued and self.separator:
            raise ValueError(f"categorical {self.name}: separator is set but multi_valued is false")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """A dataset layout: raw columns, label, dense and categorical features."""

    name: str  # dataset name, recorded in metadata.json
    delimiter: str = "\t"  # field separator of the raw text (one byte: tab, comma, ...)
    header: bool = False  # true: the first line of every input file is a header naming `columns`
    columns: tuple[str, ...]  # every field of a raw row, in order (unused ones are ignored)
    label: str  # column holding the label
    # the label column's raw values meaning [negative, positive], e.g. ["no", "yes"]
    label_values: tuple[str, str] = ("0", "1")
    dense: tuple[str, ...] = ()  # numeric columns, output as float32 after `dense_transform`
    dense_type: Literal["int64", "float64"] = "int64"  # how dense fields are parsed
    dense_transform: Literal["log1p", "identity"] = "log1p"  # log1p: missing->0, clip<0->0, log1p
    # categorical features, output as uint64 ids; at least one (the models embed them)
    categorical: tuple[CategoricalSpec, ...] = ()
    prefix_bits: int = 8  # high bits of every id holding the feature prefix (1 + feature index)

    def __post_init__(self):
        if len(self.delimiter.encode()) != 1 or self.delimiter in "\r\n":
            raise ValueError(f"delimiter must be one byte (not a newline), got {self.delimiter!r}")
        repeated = repeated_name(self.columns)
        if repeated:
            raise ValueError(f"columns: {repeated!r} is listed twice")
        if not self.categorical:
            raise ValueError(
                "no [[categorical]] feature: the models embed categorical ids and need at "
                "least one (a dense-only dataset cannot train)"
            )
        known = set(self.columns)
        used = [self.label, *self.dense, *(c.name for c in self.categorical)]
        for name in used:
            if name not in known:
                raise ValueError(f"feature {name!r} is not one of the spec's columns")
        if (
            len(self.label_values) != 2
            or len(set(self.label_values)) != 2
            or any(not v or self.delimiter in v or "\n" in v for v in self.label_values)
        ):
            raise ValueError(
                f"label_values must be two different non-empty values [negative, positive] "
                f"without the delimiter, got {list(self.label_values)}"
            )
        repeated = repeated_name(used)
        if repeated:
            raise ValueError(self._used_twice(repeated))
        if not 1 <= self.prefix_bits <= 16:
            raise ValueError(f"prefix_bits must be in [1, 16], got {self.prefix_bits}")
        if len(self.categorical) >= 2**self.prefix_bits:
            raise ValueError(
                f"{len(self.categorical)} categorical features need more than prefix_bits={self.prefix_bits}"
            )
        for feature in self.categorical:
            if feature.multi_valued and feature.separator == self.delimiter:
                raise ValueError(f"categorical {feature.name}: separator equals the delimiter")

    def _used_twice(self, name: str) -> str:
        """The message for a column that is two features: which two."""
        features = {
            "label": [self.label],
            "dense": self.dense,
            "categorical": [c.name for c in self.categorical],
        }
        roles = [role for role, names in features.items() for other in names if other == name]
        if roles[0] == roles[1]:
            return f"{roles[0]}: {name!r} is listed twice"
        return (
            f"column {name!r} is both {roles[0]} and {roles[1]} "
            "(label, dense and categorical features must be different columns)"
        )

    def column_index(self, name: str) -> int:
        return self.columns.index(name)

    def to_json(self) -> dict:
        """The spec as recorded in metadata.json (Contract 1 field names)."""
        data = config.to_dict(self)
        data["categorical"] = [
            {
                "name": c.name,
                "table": c.table,
                "multi_valued": c.multi_valued,
                "separator": c.separator,
            }
            for c in self.categorical
        ]
        return data


def repeated_name(names) -> str | None:
    """The first name that occurs twice in `names`, or None."""
    seen = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def builtin_specs() -> list[str]:
    return sorted(path.stem for path in SPEC_DIR.glob("*.toml"))


def load_spec(name_or_path: str | Path) -> FeatureSpec:
    """Loads a built-in spec by name (`criteo`, `avazu`) or a spec TOML file.

    Raises:
        UserError: unknown name, missing file, TOML syntax error, unknown key or an
            inconsistent spec; the message names the file.
    """
    text = str(name_or_path)
    path = Path(text)
    if not (path.suffix == ".toml" or path.exists() or "/" in text):
        builtin = SPEC_DIR / f"{text}.toml"
        if not builtin.exists():
            raise UserError(
                f"unknown spec {text!r}: not a file and not a built-in spec "
                f"({', '.join(builtin_specs())})"
            )
        path = builtin
    if not path.exists():
        raise UserError(f"spec file {path} does not exist")
    data = config.read_toml(path)
    try:
        return config.from_dict(FeatureSpec, data)
    except ConfigError as error:
        message = str(error).removeprefix(f"{FeatureSpec.__name__}: ")
        raise ConfigError(f"spec {path}: {message}") from None
