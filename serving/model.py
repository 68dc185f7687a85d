"""A loaded export: memory-mapped embedding tables, the StableHLO tower, the row encoder.

`ServedModel.predict(ids, dense)` is the whole forward pass of serving:

    ids [n, F] uint64 ──► per table: searchsorted in the sorted id index (memory-mapped)
                      ──► rows (fp32 / fp16 / int8 dequantized), unseen ids -> default row
                      ──► a multi-valued feature's bag: its rows pooled (sum, mean, sqrtn)
    embeddings [n, F, D], dense [n, d] ──► tower (jax.export module, padded to a bucket)
                      ──► probabilities [n] float32

With multi-valued features, `ids` is {feature: [n] uint64 | RaggedIds} (see
`serving.bags`), pooled exactly as training's `lookup_features` pools.

Tables stay on disk (`np.load(mmap_mode="r")`): the page cache holds the hot rows, so
a table larger than RAM is served without loading it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from hybridrec.common import config as config_lib
from hybridrec.embedding_store import EmbeddingStore, RaggedIds, TableConfig
from hybridrec.pipeline import RowEncoder, spec_from_json
from hybridrec.pipeline.id_map import read_id_map
from hybridrec.serving import _format
from hybridrec.serving.bags import POOLINGS, Ids, bag_rows, check_bag, pool_bags
from hybridrec.serving.delta import LayeredTable, version_chain

MIN_BUCKET = 8  # smallest padded batch: one compiled shape serves 1..8 rows


class ServedTable:
    """One exported table, memory-mapped.

    Args:
        directory: `tables/<name>` of an export version.
        name: the table's name.
        precision: fp32, fp16 or int8.
    """

    def __init__(self, directory: Path, name: str, precision: str):
        self.name = name
        self.ids = load_array(directory / "ids.npy", np.uint64, 1)
        self.values = load_array(directory / "values.npy", None, 2)
        self.scale_bias = None
        if precision == "int8":
            self.scale_bias = load_array(directory / "scale_bias.npy", np.float16, 2)
        if len(self.values) != len(self.ids) or (
            self.scale_bias is not None and len(self.scale_bias) != len(self.ids)
        ):
            raise _format.ExportError(f"{directory}: ids, values and scales differ in length")
        self.dim = self.values.shape[1]

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids [n] uint64 -> (row index [n] int64, found [n] bool)."""
        if not len(self.ids):
            return np.zeros(len(ids), np.int64), np.zeros(len(ids), bool)
        rows = np.searchsorted(self.ids, ids)
        rows = np.minimum(rows, len(self.ids) - 1)
        return rows, self.ids[rows] == ids

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Row index [m] -> values [m, dim] float32 (dequantized)."""
        values = self.values[index]
        if self.scale_bias is None:
            return values.astype(np.float32, copy=False)
        scale_bias = self.scale_bias[index].astype(np.float32)
        return values.astype(np.float32) * scale_bias[:, :1] + scale_bias[:, 1:]


def load_array(path: Path, dtype: Any, ndim: int) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as error:
        raise _format.ExportError(f"{path}: unreadable array ({error})") from None
    if array.ndim != ndim or (dtype is not None and array.dtype != dtype):
        raise _format.ExportError(f"{path}: {array.dtype} array of {array.ndim} dims is unexpected")
    return array


def open_tables(path: Path, names: list[str], checksums: bool) -> dict[str, Any]:
    """The tables of the export version `path`, memory-mapped; a delta version's read
    through its chain of versions."""
    chain = version_chain(path)
    for base in chain[1:]:
        _format.read_manifest(base, checksums=checksums)
    tables: dict[str, Any] = {}
    for table in names:
        layers, deleted = [], []
        for version in chain:
            directory = version / _format.TABLES_DIR / table
            precision = json.loads((version / _format.MANIFEST_FILE).read_text())["precision"]
            layers.append(ServedTable(directory, table, precision))
            removed = directory / "deleted.npy"
            deleted.append(
                load_array(removed, np.uint64, 1) if removed.exists() else np.zeros(0, np.uint64)
            )
        tables[table] = layers[0] if len(layers) == 1 else LayeredTable(layers, deleted)
    return tables


class ServedVersion:
    """What every loaded export version has: its directory, checked manifest (name,
    version, precision) and features.json, read once.

    Args:
        path: an export version directory, or a base directory (its newest version).
        checksums: check every file's sha256 against the manifest first.
    """

    def __init__(self, path: str | Path, *, checksums: bool = True):
        self.path = _format.resolve(path)
        self.manifest = _format.read_manifest(self.path, checksums=checksums)
        self.name = self.manifest["name"]
        self.version = int(self.manifest["version"])
        self.precision = self.manifest["precision"]
        self.features_path = self.path / _format.FEATURES_FILE
        try:
            self.features = json.loads(self.features_path.read_text())
        except (OSError, ValueError) as error:
            raise _format.ExportError(f"{self.features_path}: unreadable ({error})") from None


def load_module(path: Path) -> Any:
    """A serialized jax.export module, jitted; an ExportError names a file that is not one."""
    try:
        exported = jax.export.deserialize(bytearray(path.read_bytes()))
    except Exception as error:  # noqa: BLE001 - any decoding failure names the file
        raise _format.ExportError(f"{path}: not a jax.export module ({error})") from None
    return jax.jit(exported.call)


def pad_rows(array: np.ndarray, size: int, value: float = 0) -> np.ndarray:
    """`array` with rows of `value` appended up to `size` rows (a compiled batch shape)."""
    if len(array) >= size:
        return array
    padding = np.full((size - len(array), *array.shape[1:]), value, array.dtype)
    return np.concatenate([array, padding])


class ServedModel(ServedVersion):
    """One export version of a click-log run, ready to score.

    Args:
        path: an export version directory, or a base directory (its newest version).
        max_batch: the largest batch the tower runs at once (compiled up front).
        checksums: check every file's sha256 against the manifest first (sizes are
            always checked).
    """

    kind = "clicks"  # the manifest's kind (the task that trained it)
    takes_events = False  # rows carry their own features: no kept histories to append to

    def __init__(self, path: str | Path, *, max_batch: int = 256, checksums: bool = True):
        super().__init__(path, checksums=checksums)
        features_path = self.features_path
        try:
            self.spec = spec_from_json(self.features["spec"])
        except (ValueError, KeyError) as error:
            raise _format.ExportError(f"{features_path}: unreadable ({error})") from None
        self.encoder = RowEncoder(self.spec)
        self.feature_names = [feature.name for feature in self.spec.categorical]
        self.bag_features = [f.name for f in self.spec.categorical if f.multi_valued]
        self.single_features = [f.name for f in self.spec.categorical if not f.multi_valued]
        self.pooling = self.features.get("pooling")
        kinds = self.features.get("feature_kinds")  # absent in exports without bags
        if kinds is not None and kinds != {
            f.name: "multi" if f.multi_valued else "single" for f in self.spec.categorical
        }:
            raise _format.ExportError(f"{features_path}: feature_kinds disagree with the spec")
        if self.bag_features and self.pooling not in POOLINGS:
            raise _format.ExportError(
                f"{features_path}: pooling {self.pooling!r} is not one of {', '.join(POOLINGS)} "
                f"(needed by the multi-valued features {', '.join(self.bag_features)})"
            )
        self.num_dense = len(self.spec.dense)
        self.dim = int(self.features["embedding_dim"])
        feature_tables = self.features["feature_tables"]
        self.tables = open_tables(
            self.path,
            list(dict.fromkeys(feature_tables[name] for name in self.feature_names)),
            checksums,
        )
        self._feature_tables = [self.tables[feature_tables[n]] for n in self.feature_names]
        self._defaults = DefaultRows(self.features["default_rows"])
        # a run trained with embedding.id_map: its mapping travels with the export
        kind = self.features.get("id_map_kind")
        self.id_map = read_id_map(self.path / _format.ID_MAP_DIR, kind) if kind else None
        self._tower = load_module(self.path / _format.MODEL_FILE)
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        self._lock = threading.Lock()
        self.unseen = dict.fromkeys(self.tables, 0)  # ids that got the default row, per table
        self.rows_scored = 0
        for bucket in self.buckets:  # compile every shape now, not on a request
            self._run_tower(
                np.zeros((bucket, len(self.feature_names), self.dim), np.float32),
                np.zeros((bucket, self.num_dense), np.float32),
            )

    # ------------------------------------------------------------------ inputs

    def encode_rows(self, lines: Sequence[bytes | str]) -> tuple[Ids, np.ndarray]:
        """Raw rows -> (ids, dense [n, d] float32), as the Beam job does.

        ids is [n, F] uint64, or with multi-valued features {feature: [n] uint64 |
        RaggedIds} in spec order.

        Raises:
            pipeline.RowError: a row the job would reject (its index and reason).
        """
        encoded = self.encoder.encode(lines)
        if self.bag_features:
            ids = {}
            for name in self.feature_names:
                feature = encoded.ids[name]
                if isinstance(feature, tuple):
                    values, offsets = feature
                    feature = RaggedIds(values=values, offsets=offsets.astype(np.int64))
                ids[name] = feature
            return ids, encoded.dense
        ids = np.empty((len(encoded.dense), len(self.feature_names)), np.uint64)
        for column, name in enumerate(self.feature_names):
            ids[:, column] = encoded.ids[name]
        return ids, encoded.dense

    # ------------------------------------------------------------------ forward

    def _columns(self, ids: Ids) -> tuple[int, list[np.ndarray | RaggedIds]]:
        """(rows, per feature in spec order: ids [n] uint64 or a checked RaggedIds)."""
        if isinstance(ids, np.ndarray):
            if self.bag_features:
                raise ValueError(
                    f"multi-valued features {', '.join(self.bag_features)} need ids as "
                    "{feature: [n] ids | RaggedIds}, not one [n, F] array"
                )
            return len(ids), [ids[:, column] for column in range(ids.shape[1])]
        if list(ids) != self.feature_names:
            raise ValueError(f"ids must hold the features {self.feature_names} in this order")
        columns = [ids[name] for name in self.feature_names]
        first = columns[0]
        rows = len(first.offsets) - 1 if isinstance(first, RaggedIds) else len(first)
        for name, column in zip(self.feature_names, columns, strict=True):
            if name in self.bag_features:
                if not isinstance(column, RaggedIds):
                    raise ValueError(f"feature {name!r} is multi-valued: pass a RaggedIds")
                check_bag(name, column.values, column.offsets, rows)
            elif not isinstance(column, np.ndarray) or column.shape != (rows,):
                raise ValueError(f"feature {name!r}: ids must be a [{rows}] uint64 array")
        return rows, columns

    def _lookup(self, table: ServedTable, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids [m] uint64 -> (rows [m, D] float32, found [m] bool); unseen ids get defaults."""
        rows, found = table.find(ids)
        if found.all():
            return table.rows(rows), found
        out = np.empty((len(ids), self.dim), np.float32)
        out[found] = table.rows(rows[found])
        out[~found] = self._defaults(table.name, ids[~found], self.dim)
        with self._lock:
            self.unseen[table.name] += int(np.count_nonzero(~found))
        return out, found

    def embeddings(self, ids: Ids) -> tuple[np.ndarray, np.ndarray]:
        """ids -> (embeddings [n, F, D] float32, unseen [n] int64 per row).

        Args:
            ids: [n, F] uint64, or {feature: [n] uint64 | RaggedIds} in spec order.
        """
        n, columns = self._columns(ids)
        if self.id_map is not None:  # the run trained on bucket ids (embedding.id_map)
            columns = list(
                self.id_map.apply(dict(zip(self.feature_names, columns, strict=True))).values()
            )
        out = np.empty((n, len(columns), self.dim), np.float32)
        unseen = np.zeros(n, np.int64)
        for column, (feature, table) in enumerate(zip(columns, self._feature_tables, strict=True)):
            if isinstance(feature, RaggedIds):
                values = np.ascontiguousarray(feature.values, np.uint64)
                offsets = feature.offsets.astype(np.int64, copy=False)
                rows, found = self._lookup(table, values)
                out[:, column] = pool_bags(rows, offsets, self.pooling)
                unseen += np.bincount(bag_rows(offsets)[~found], minlength=n)
            else:
                out[:, column], found = self._lookup(table, feature)
                unseen += ~found
        return out, unseen

    def _run_tower(self, embeddings: np.ndarray, dense: np.ndarray) -> np.ndarray:
        n = len(embeddings)
        bucket = next(b for b in self.buckets if b >= n)
        embeddings, dense = pad_rows(embeddings, bucket), pad_rows(dense, bucket)
        return np.asarray(self._tower(embeddings, dense))[:n]

    def predict(self, ids: Ids, dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Click probabilities.

        Args:
            ids: [n, F] uint64 hashed ids, features in spec order; with multi-valued
                features {feature: [n] uint64 | RaggedIds} in spec order.
            dense: [n, d] float32 transformed dense values.

        Returns:
            probabilities [n] float32 and unseen [n] int64 (ids per row that got a default row).
        """
        embeddings, unseen = self.embeddings(ids)
        dense = np.ascontiguousarray(dense, np.float32)
        chunks = [
            self._run_tower(
                embeddings[start : start + self.max_batch], dense[start : start + self.max_batch]
            )
            for start in range(0, len(dense), self.max_batch)
        ]
        with self._lock:
            self.rows_scored += len(dense)
        probabilities = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return probabilities.astype(np.float32, copy=False), unseen

    def predict_rows(self, lines: Sequence[bytes | str]) -> np.ndarray:
        """Click probabilities [n] float32 of raw rows in the dataset's layout (label column
        optional), as `serve` answers a `rows` request.

        Raises:
            pipeline.RowError: a row the Beam job would reject (its index and reason).
        """
        ids, dense = self.encode_rows(lines)
        return self.predict(ids, dense)[0]

    def work(self) -> str:
        """What it has done, for the server's closing line."""
        return f"{self.rows_scored:,} rows scored"

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"rows_scored": self.rows_scored, "unseen_ids": dict(self.unseen)}

    def close(self) -> None:
        self._defaults.close()


def batch_buckets(max_batch: int, smallest: int = MIN_BUCKET) -> list[int]:
    """The padded batch sizes compiled: powers of two from `smallest`, then `max_batch`."""
    buckets, size = [], smallest
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch]


class DefaultRows:
    """Rows of ids the export lacks: what `hybridrec evaluate` reads for them.

    A table that admits every id reads an unseen id as its deterministic initial row
    (the embedding store computes it from the id; nothing is stored); otherwise zeros.
    """

    def __init__(self, rules: dict[str, dict[str, Any]]):
        configs = []
        for rule in rules.values():
            if rule["kind"] == "initializer":
                table = dict(rule["table"], capacity=1)
                table.pop("tiering", None)
                configs.append(config_lib.from_dict(TableConfig, table))
        self._initialized = {config.name for config in configs}
        self._store = EmbeddingStore(configs, num_shards=1) if configs else None

    def __call__(self, table: str, ids: np.ndarray, dim: int) -> np.ndarray:
        if table not in self._initialized:
            return np.zeros((len(ids), dim), np.float32)
        return self._store.lookup(table, np.ascontiguousarray(ids), train=False).result()

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
