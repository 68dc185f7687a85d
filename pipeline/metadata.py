"""metadata.json of a preprocessed dataset, and the reader the trainer uses.

A dataset directory is complete only when `_SUCCESS` exists; it is written after
everything else, so a reader never sees a half-written dataset as complete.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hybridrec.common.errors import UserError

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
SUCCESS_FILE = "_SUCCESS"


@dataclasses.dataclass(frozen=True)
class CategoricalFeature:
    """A categorical column of the output: its name, embedding table and kind."""

    name: str
    table: str
    multi_valued: bool
    separator: str = ""


@dataclasses.dataclass(frozen=True)
class DatasetMetadata:
    """What a preprocessed dataset holds; read with `read_metadata`."""

    root: Path
    label_column: str
    dense_columns: tuple[str, ...]
    categorical: tuple[CategoricalFeature, ...]
    raw: dict  # the whole metadata.json

    def split_files(self, split: str) -> list[Path]:
        """Parquet files of `split` ("train" or "eval"), in input order."""
        return [self.root / name for name in self._split(split)["files"]]

    def split_rows(self, split: str) -> int:
        return int(self._split(split)["rows"])

    def _split(self, split: str) -> dict:
        splits = self.raw["splits"]
        if split not in splits:
            raise UserError(f"{self.root}: no split {split!r} (have {', '.join(splits)})")
        return splits[split]


def read_metadata(out_dir: str | Path) -> DatasetMetadata:
    """Reads a complete dataset directory written by `hybridrec preprocess`.

    Raises:
        UserError: the directory is missing, or has no `_SUCCESS` (incomplete), or
            metadata.json is unreadable or of an unknown format version.
    """
    root = Path(out_dir)
    make = f"`hybridrec preprocess --input RAW_FILES --spec SPEC --output {root}`"
    if not root.exists():
        raise UserError(f"dataset directory {root} does not exist; make one with {make}")
    if not root.is_dir():
        raise UserError(
            f"dataset path {root} is a file, not a dataset directory; if it is a raw log, "
            f"preprocess it first: `hybridrec preprocess --input {root} --spec SPEC --output "
            f"DATA_DIR` (SPEC: criteo, avazu or the file `hybridrec spec --sample {root}` proposes)"
        )
    if not (root / SUCCESS_FILE).exists():
        raise UserError(
            f"incomplete dataset directory {root}: no {SUCCESS_FILE} marker (preprocessing did "
            f"not finish, or this is not a dataset); finish it by running {make} again"
        )
    path = root / METADATA_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: cannot read dataset metadata: {error}") from None
    if raw.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path}: format_version {raw.get('format_version')!r} is not supported "
            f"(this hybridrec reads {FORMAT_VERSION})"
        )
    if raw.get("kind") == "events":
        raise UserError(
            f"{root} is an event-log dataset (user histories, kind 'events'); this command "
            "reads click-log datasets (a label, dense and categorical columns)"
        )
    spec = raw["spec"]
    return DatasetMetadata(
        root=root,
        label_column=spec["label"],
        dense_columns=tuple(spec["dense"]),
        categorical=tuple(
            CategoricalFeature(
                name=c["name"],
                table=c["table"],
                multi_valued=bool(c["multi_valued"]),
                separator=c.get("separator", ""),
            )
            for c in spec["categorical"]
        ),
        raw=raw,
    )
