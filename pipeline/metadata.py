"""metadata.json of a preprocessed dataset, and the reader the trainer uses.

A dataset directory is complete only when `_SUCCESS` exists; it is written after
everything else, so a reader never sees a half-written dataset as complete.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.common.errors import UserError
from hybridrec.pipeline import manifest

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


class _Splits:
    """The splits of a dataset's metadata.json (`raw["splits"]`)."""

    root: Path
    raw: dict

    def split_files(self, split: str) -> list[Path]:
        """Parquet files of `split` ("train" or "eval"), in input order."""
        return [self.root / name for name in self._split(split)["files"]]

    def split_rows(self, split: str) -> int:
        return int(self._split(split)["rows"])

    def has_split(self, split: str) -> bool:
        return split in self.raw["splits"]

    def _split(self, split: str) -> dict:
        splits = self.raw["splits"]
        if split not in splits:
            raise UserError(f"{self.root}: no split {split!r} (have {', '.join(splits)})")
        return splits[split]


@dataclasses.dataclass(frozen=True)
class DatasetMetadata(_Splits):
    """What a preprocessed click-log dataset holds; read with `read_metadata`."""

    root: Path
    label_column: str
    dense_columns: tuple[str, ...]
    categorical: tuple[CategoricalFeature, ...]
    raw: dict  # the whole metadata.json
    kind = "clicks"


# the tables an event-log dataset's histories are looked up in: its item ids (side
# features a run reads share the item table, under their own prefixes)
ITEM_FEATURE = CategoricalFeature(name="item", table="item", multi_valued=False)


@dataclasses.dataclass(frozen=True)
class EventMetadata(_Splits):
    """What a preprocessed event-log dataset (user histories, `kind = "events"`) holds."""

    root: Path
    raw: dict  # the whole metadata.json
    kind = "events"
    label_column = ""
    dense_columns: tuple[str, ...] = ()
    categorical: tuple[CategoricalFeature, ...] = (ITEM_FEATURE,)

    @property
    def sequence(self) -> dict:
        """Users, events, history-length quantiles, ... (docs/pipeline.md)."""
        return self.raw.get("sequence") or {}

    @property
    def distinct_items(self) -> int:
        return int(((self.raw.get("tables") or {}).get("item") or {}).get("distinct_estimate", 1))

    @property
    def side_tables(self) -> dict[str, str]:
        """The side features: column -> its id table (the event features', then the item
        features'), as the spec records them (a dataset written before it did: its event
        and item features)."""
        spec = self.raw.get("spec") or {}
        if "side_features" in spec:
            return dict(spec["side_features"])
        sides = {feature["name"]: feature["table"] for feature in spec.get("event_features") or []}
        return sides | {name: name for name in (spec.get("items") or {}).get("features") or []}

    @property
    def event_features(self) -> tuple[str, ...]:
        """The event features' columns (a value per event), in the spec's order."""
        spec = self.raw.get("spec") or {}
        return tuple(feature["name"] for feature in spec.get("event_features") or [])

    def item_names(self) -> tuple[np.ndarray, pa.Array]:
        """(item ids [n] uint64 ascending, their raw ids [n] large_binary): how each item
        was written in the input (its first occurrence), for serving raw ids."""
        files = (self.raw.get("item_names") or {}).get("files")
        if files is not None and "stream" in self.raw:  # and the items each file brought first
            files = [*files, *(e.raw["items_file"] for e in manifest.read_shards(self.root) if "items_file" in e.raw)]  # fmt: skip
        if files is None:
            raise UserError(
                f"{self.root}: this dataset has no item names (written by an older "
                "`hybridrec preprocess`); preprocess it again to serve raw item ids"
            )
        tables = []
        for name in files:
            try:
                tables.append(pq.read_table(self.root / name))
            except (OSError, pa.ArrowInvalid) as error:
                raise UserError(
                    f"{self.root / name}: cannot read its item names: {error}"
                ) from None
        if not tables:
            return np.zeros(0, np.uint64), pa.array([], pa.large_binary())
        table = pa.concat_tables(tables)
        ids = table.column("item").to_numpy().astype(np.uint64)
        order = np.argsort(ids)
        names = table.column("name").combine_chunks().cast(pa.large_binary())
        return ids[order], names.take(pa.array(order))


def read_metadata(out_dir: str | Path) -> DatasetMetadata:
    """Reads a complete click-log dataset directory written by `hybridrec preprocess`.

    Raises:
        UserError: the directory is missing, or has no `_SUCCESS` (incomplete), or
            metadata.json is unreadable or of an unknown format version, or the dataset
            holds user histories.
    """
    metadata = read_dataset(out_dir)
    if isinstance(metadata, EventMetadata):
        raise UserError(
            f"{metadata.root} is an event-log dataset (user histories, kind 'events'); this "
            "command reads click-log datasets (a label, dense and categorical columns)"
        )
    return metadata


def read_dataset(out_dir: str | Path) -> DatasetMetadata | EventMetadata:
    """Reads a complete dataset directory of either kind: click logs or user histories
    (see `read_metadata` for the errors)."""
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
        return EventMetadata(root=root, raw=raw)
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
