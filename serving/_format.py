"""The export directory: file names, the manifest, checksums, versions and atomic commits.

Layout of one export version (`hybridrec export` writes `EXPORT/<version>/`):

    manifest.json          format version, versions, model name, run, step, precision,
                           and every other file with its size and sha256
    model.stablehlo        the dense tower: jax.export serialization, batch dimension symbolic
    features.json          feature spec, hash scheme, dense transform, dataset statistics,
                           feature -> table, feature -> kind (single | multi), the
                           pooling of multi-valued features' bags, each table's
                           default-row rule
    tables/<table>/ids.npy         [rows] uint64, sorted: the id -> row index
    tables/<table>/values.npy      [rows, dim] float32 | float16 | uint8 (int8 row-wise)
    tables/<table>/scale_bias.npy  [rows, 2] float16 (int8 only): value = q * scale + bias

A version directory appears under its final name only when complete (written as a
temporary directory, then renamed), so a reader listing `EXPORT/` never sees half an
export. Versions are increasing integers; `serve` loads the newest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.common.files import fsync_directory

FORMAT = "hybridrec-export"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
ID_MAP_DIR = "id_map"  # the id -> bucket mapping of a run trained with embedding.id_map
MODEL_FILE = "model.stablehlo"
FEATURES_FILE = "features.json"
TABLES_DIR = "tables"
PRECISIONS = ("fp32", "fp16", "int8")
# a sequence run's export, besides MODEL_FILE (its encoder) and the tables
RANKING_FILE = "ranking.stablehlo"  # the ranking head, with the ranking objective
EXTEND_FILE = "extend.stablehlo"  # the encoder from cached keys and values
CATALOGUE_FILE = "catalogue.npy"  # the training items' ids, the ranking's candidates
ITEM_NAMES_FILE = "item_names.parquet"  # each item's raw id
ITEM_SIDES_FILE = "item_sides.parquet"  # item side features' ids, with side_features
_TEMPORARY_PREFIX = ".incomplete-"


class ExportError(UserError):
    """An export directory that cannot be written or loaded; the message names the file."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_entries(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes", "sha256"}} of every file under `root` but the manifest."""
    entries = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST_FILE:
            entries[path.relative_to(root).as_posix()] = {
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
    return entries


def versions(base: Path) -> list[int]:
    """Complete versions under an export base directory, ascending."""
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit() and p.is_dir())


def resolve(path: str | Path) -> Path:
    """The version directory to load: `path` itself if it holds a manifest, else its newest version."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists():
        return path
    if not path.exists():
        raise ExportError(
            f"export directory {path} does not exist; make one with "
            f"`hybridrec export --run RUN_DIR --out {path}`"
        )
    found = versions(path)
    if not found:
        raise ExportError(
            f"{path}: no export in it (neither {MANIFEST_FILE} nor numbered version directories); "
            f"write one with `hybridrec export --run RUN_DIR --out {path}`"
        )
    return path / str(found[-1])


def new_version_dir(base: Path) -> tuple[Path, Path]:
    """(temporary directory to write, final directory) of the next version under `base`."""
    base.mkdir(parents=True, exist_ok=True)
    found = versions(base)
    final = base / str((found[-1] if found else 0) + 1)
    temporary = base / f"{_TEMPORARY_PREFIX}{final.name}-{os.getpid()}"
    temporary.mkdir()
    return temporary, final


def commit(temporary: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Writes the manifest last, fsyncs, and renames the version into place."""
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    with (temporary / MANIFEST_FILE).open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    if final.exists():
        raise ExportError(f"{final}: another export took this version while writing; re-run")
    os.rename(temporary, final)
    fsync_directory(final.parent)


def read_manifest(
    version_dir: Path, *, verify: bool = True, checksums: bool = True
) -> dict[str, Any]:
    """Reads and checks the manifest; with `verify`, every listed file's size and sha256.

    `checksums=False` checks sizes only: hashing reads every byte, which for tables
    larger than RAM means reading them from disk once at load.

    Raises:
        ExportError: the manifest is missing, unreadable or of another format, or a file
            is missing, has the wrong size or checksum, or is not listed.
    """
    path = version_dir / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path}: missing (incomplete export)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExportError(f"{path}: unreadable ({error})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(
            f"{path}: not a {FORMAT} manifest of format_version {FORMAT_VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('format_version')!r})"
        )
    files = manifest.get("files", {})
    for required in (MODEL_FILE, FEATURES_FILE):
        if required not in files:
            raise ExportError(f"{path}: does not list {required}")
    if not verify:
        return manifest
    for name, entry in files.items():
        file = version_dir / name
        if not file.is_file():
            raise ExportError(f"{file}: missing (incomplete export)")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise ExportError(f"{file}: {size} bytes, the manifest says {entry['bytes']}")
        if checksums and sha256_file(file) != entry["sha256"]:
            raise ExportError(f"{file}: sha256 does not match the manifest (corrupted)")
    return manifest
