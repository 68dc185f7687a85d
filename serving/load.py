"""Loading an export of either kind: a click-log run's or a sequence run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridrec.serving import _format


def export_kind(path: str | Path) -> str:
    """ "clicks" or "sequences": the run kind of the export version `path` resolves to."""
    version = _format.resolve(path)
    manifest = _format.read_manifest(version, verify=False)
    return manifest.get("kind", "clicks")


def _click_model(path: str | Path, **options: Any) -> Any:
    from hybridrec.serving.model import ServedModel

    return ServedModel(path, **options)


def _sequence_model(path: str | Path, **options: Any) -> Any:
    from hybridrec.serving.sequence_model import ServedSequenceModel

    return ServedSequenceModel(path, **options)


# an export's kind (the name of the task that trained it, `training.task.Task.name`) ->
# its served model; each imported only when an export of its kind is loaded
SERVED_MODELS = {"clicks": _click_model, "sequences": _sequence_model}


def load_export(path: str | Path, *, max_batch: int, checksums: bool = True) -> Any:
    """The export at `path` (a version, or a base: its newest), ready to serve: a
    `ServedModel` for a click-log run, a `ServedSequenceModel` for a sequence run."""
    kind = export_kind(path)
    if kind not in SERVED_MODELS:
        raise _format.ExportError(
            f"{_format.resolve(path)}: an export of kind {kind!r}, which this version of "
            f"hybridrec does not serve ({', '.join(SERVED_MODELS)})"
        )
    return SERVED_MODELS[kind](path, max_batch=max_batch, checksums=checksums)


def load_model(path: str | Path, *, max_batch: int = 256) -> Any:
    """`hybridrec.load_model`: the export at `path` (its newest version), checked, ready to
    answer in process what `hybridrec serve` answers over HTTP."""
    return load_export(path, max_batch=max_batch)
