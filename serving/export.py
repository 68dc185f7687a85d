"""`export_run`: a run's checkpoint -> one self-contained, versioned export directory.

What serving needs, and nothing that needs the training code: the dense tower as
StableHLO (`jax.export`, batch dimension symbolic, parameters inside), the embedding
rows of the checkpoint (fp32, fp16 or int8 row-wise) with their sorted id index, and
the feature spec with hashing, dense transform and statistics. See `serving._format`
for the layout. The rows come from the run's embedding checkpoint, also when the
run trained against remote shard servers (the checkpoint holds every row).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hybridrec.common import config as config_lib
from hybridrec.common.errors import UserError
from hybridrec.common.progress import Progress
from hybridrec.embedding_store import checkpoint as store_checkpoint
from hybridrec.model import abstract_train_state, eval_step, make_mesh
from hybridrec.pipeline.hashing import hash_scheme
from hybridrec.pipeline.id_map import ARRAYS_FILE, MAP_FILE
from hybridrec.pipeline.metadata import read_dataset
from hybridrec.serving import _format, delta
from hybridrec.serving.export_sequences import with_reference_attention, write_sequence_parts
from hybridrec.serving.quantize import encode_table
from hybridrec.training import RunCheckpoints, load_config, plan_tables, require_run_dir
from hybridrec.training.tasks import task_of

PLATFORMS = ("cpu", "cuda")  # where the exported tower runs


def _restore_params(run_dir: Path, config: Any, metadata: Any, step: int) -> tuple[Any, Any]:
    """(graphdef, host params) of the dense state at `step`, restored onto one device."""
    mesh_config = dataclasses.replace(config.mesh, shape=(1,) * len(config.mesh.shape))
    mesh = make_mesh(mesh_config, devices=jax.devices()[:1])
    abstract = abstract_train_state(
        config.model,
        config.optimizer,
        mesh,
        num_dense=len(metadata.dense_columns),
        num_features=len(metadata.categorical),
        embedding_dim=config.embedding.dim,
    )
    checkpoints = RunCheckpoints(run_dir, keep=config.checkpoint.keep)
    try:
        state = checkpoints.restore_dense(step, abstract)
    finally:
        checkpoints.close()
    return state.graphdef, jax.device_get(state.params)


def export_tower(graphdef: Any, params: Any, num_features: int, dim: int, num_dense: int) -> bytes:
    """The tower as serialized StableHLO: probabilities [b] = f(embeddings [b, F, D], dense [b, n]).

    The parameters are constants of the module, so calling it needs no Flax code and
    no parameter files; `b` is symbolic, one module serves every batch size.
    """
    state = _TowerState(graphdef=graphdef, params=jax.tree.map(jnp.asarray, params))

    def probabilities(embeddings, dense):
        return eval_step(state, {"embeddings": embeddings, "dense": dense})

    (batch,) = jax.export.symbolic_shape("b")
    # one module for CPU and CUDA hosts alike, wherever the run was trained
    exported = jax.export.export(jax.jit(probabilities), platforms=PLATFORMS)(
        jax.ShapeDtypeStruct((batch, num_features, dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_dense), jnp.float32),
    )
    return bytes(exported.serialize())


@dataclasses.dataclass
class _TowerState:
    """What `model.eval_step` reads of a train state: the tower's graphdef and parameters."""

    graphdef: Any
    params: Any


def _default_rule(table_config: Any) -> dict[str, Any]:
    """How serving fills a row for an id the checkpoint lacks: what `evaluate` reads for it."""
    if table_config.admission.admits_all and table_config.initializer.kind != "zeros":
        return {"kind": "initializer", "table": config_lib.to_dict(table_config)}
    return {"kind": "zeros"}


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    precision: str = "fp32",
    name: str | None = None,
    quiet: bool = False,
    delta_from: int | None = None,
) -> dict[str, Any]:
    """Writes the next version of the export `out` from the checkpoint of `run_dir`.

    Args:
        run_dir: a `hybridrec train` run directory (a click-log or a sequence run).
        out: export base directory; the new version is `out/<n>` (n = newest + 1).
        step: checkpoint step (default: the newest complete one).
        precision: embedding rows as fp32, fp16 or int8 (row-wise, fp16 scale and bias).
        name: model name served under /v2/models/{name} (default: out's directory name).
        quiet: no progress lines.
        delta_from: write a delta of this version of `out` (same run, same precision, an
            earlier step): only the embedding rows changed since it (`serving.delta`);
            a full export when the run's checkpoint chain does not allow one.

    Returns:
        A summary: path, version, name, step, precision, kind ("full" | "delta"),
        base_version, bytes per part, seconds.
    """
    started = time.perf_counter()
    run_dir, out = Path(run_dir), Path(out)
    if precision not in _format.PRECISIONS:
        raise UserError(f"precision {precision!r} is not one of {', '.join(_format.PRECISIONS)}")
    require_run_dir(run_dir)
    name = _model_name(name, out)
    config = load_config(None, [], run_dir)
    metadata = read_dataset(config.data.path)
    task = task_of(metadata)  # its name is the export's kind: what serves it
    checkpoints = RunCheckpoints(run_dir, keep=config.checkpoint.keep)
    step, step_reason = checkpoints.choose_step(step, "export")
    plan = plan_tables(config.embedding, metadata.categorical)  # the tables the run trained
    base = _delta_base(out, delta_from, run_dir, step, precision)
    progress = None if quiet else Progress("export", total=len(plan.tables) + 1, unit="parts")
    temporary, final = _format.new_version_dir(out)
    try:
        features = MODEL_WRITERS[task.name](temporary, run_dir, config, metadata, checkpoints, step)
        if progress:
            progress.update(1)
        table_summaries, base = _write_tables(
            temporary, checkpoints, plan, step, base, config.embedding.dim, precision, progress
        )
        features = {**_features(config, metadata, plan), **features}
        if config.embedding.id_map:  # the run trained on bucket ids: serve through the map
            features["id_map_kind"] = config.embedding.id_map_kind
            _copy_id_map(Path(config.embedding.id_map), temporary / _format.ID_MAP_DIR)
        (temporary / _format.FEATURES_FILE).write_text(json.dumps(features, indent=1) + "\n")
        files = _format.file_entries(temporary)
        about = {
            "name": name,
            "version": int(final.name),
            "step": int(step),
            "precision": precision,
        }
        manifest = _manifest(about, task.name, run_dir, table_summaries, files, base)
        _format.commit(temporary, final, manifest)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    sizes = _sizes(files)
    if progress:
        progress.close()
    return {
        "path": str(final),
        "version": int(final.name),
        "name": name,
        "step": int(step),
        "step_reason": step_reason,
        "precision": precision,
        "kind": "full" if base is None else "delta",
        "base_version": None if base is None else base["version"],
        **sizes,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _model_name(name: str | None, out: Path) -> str:
    """The name the export is served under (default: `out`'s directory name)."""
    name = name or out.resolve().name
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise UserError(f"model name {name!r} must use only letters, digits, _ - .")
    return name


def _write_tower(temporary: Path, run_dir: Path, config, metadata, checkpoints, step: int) -> dict:
    """A click-log run's tower at `step` into `temporary` (StableHLO); no features added."""
    graphdef, params = _restore_params(run_dir, config, metadata, step)
    tower = export_tower(
        graphdef,
        params,
        len(metadata.categorical),
        config.embedding.dim,
        len(metadata.dense_columns),
    )
    (temporary / _format.MODEL_FILE).write_bytes(tower)
    return {}


def _write_sequence_model(
    temporary: Path, run_dir: Path, config, metadata, checkpoints, step: int
) -> dict:
    """A sequence run's encoder, heads and item parts at `step` into `temporary`; returns
    the features they add (`serving.export_sequences`)."""
    graphdef, params = _restore_params(run_dir, with_reference_attention(config), metadata, step)
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
    trained = _trained_shards(checkpoints, step, metadata)
    return write_sequence_parts(temporary, model, config, metadata, trained)


# a task's name (`training.task.Task.name`, the manifest's kind) -> its model's writer
MODEL_WRITERS = {"clicks": _write_tower, "sequences": _write_sequence_model}


def _manifest(about: dict, kind: str, run_dir: Path, tables, files, base) -> dict:
    """The version's manifest: `about` (name, version, step, precision), what it holds and
    where it comes from; a delta names its base and the length of its chain."""
    manifest = {
        "format": _format.FORMAT,
        "format_version": _format.FORMAT_VERSION,
        "name": about["name"],
        "version": about["version"],
        "kind": kind,
        "run_dir": str(run_dir.resolve()),
        "step": about["step"],
        "precision": about["precision"],
        "platforms": list(PLATFORMS),
        "created_unix": time.time(),
        "versions": _library_versions(),
        "tables": tables,
        "files": files,
    }
    if base is not None:
        manifest["base_version"] = base["version"]
        manifest["chain_length"] = base.get("chain_length", 1) + 1
    return manifest


def _copy_id_map(source: Path, target: Path) -> None:
    """The run's id map (`embedding.id_map`), which serving maps raw ids through."""
    target.mkdir()
    for file_name in (MAP_FILE, ARRAYS_FILE):
        shutil.copyfile(source / file_name, target / file_name)


def _write_tables(temporary, checkpoints, plan, step, base, dim, precision, progress):
    """Every table's rows under `tables/` (a delta: only those changed since `base`'s step);
    returns (per table: rows and dim, the base, None where a delta could not be written)."""
    tables = [table.name for table in plan.tables]
    changed = {}
    if base is not None:
        for table in tables:
            rows = delta.changed_rows(checkpoints.embeddings_url, base["step"], step, table)
            if rows is None:  # a full snapshot after the base: no delta
                changed, base = {}, None
                break
            changed[table] = rows
    summaries = {}
    for table in tables:
        if base is not None:
            ids, values, deleted = changed[table]
        else:
            ids, values = store_checkpoint.read_table_rows(checkpoints.embeddings_url, step, table)
        if values.shape[1:] not in ((dim,), (0,)):
            raise UserError(
                f"{checkpoints.embeddings_url}: table {table!r} has rows of width "
                f"{values.shape[1]}, the run's config says embedding.dim = {dim}"
            )
        directory = temporary / _format.TABLES_DIR / table
        directory.mkdir(parents=True)
        np.save(directory / "ids.npy", ids)
        values = values.reshape(len(ids), dim)
        for part, array in encode_table(values, precision).items():
            np.save(directory / f"{part}.npy", array)
        if base is not None:
            np.save(directory / "deleted.npy", deleted)
        summaries[table] = {"rows": len(ids), "dim": dim}
        if progress:
            progress.update(1)
    return summaries, base


def _trained_shards(checkpoints: RunCheckpoints, step: int, metadata) -> int | None:
    """A stream run's shards trained (wholly or partly) by `step`; None for a batch run."""
    if "stream" not in metadata.raw:
        return None
    position = checkpoints.read_position(step, 0, 1)["stream"]
    return int(position["shard"]) + (int(position["offset"]) > 0)


def _features(config: Any, metadata: Any, plan: Any) -> dict[str, Any]:
    """features.json: how serving turns a request's raw ids into the tables' rows."""
    return {
        "spec": metadata.raw["spec"],
        "hash_scheme": metadata.raw.get("hash_scheme", hash_scheme(8)),
        "statistics": metadata.raw.get("stats", {}),
        "feature_tables": dict(plan.feature_tables),
        # single: one id per row; multi: a bag of ids per row, pooled with `pooling`
        "feature_kinds": {
            feature.name: "multi" if feature.multi_valued else "single"
            for feature in metadata.categorical
        },
        "pooling": config.embedding.pooling,
        "embedding_dim": config.embedding.dim,
        "default_rows": {table.name: _default_rule(table) for table in plan.tables},
    }


def _delta_base(
    out: Path, version: int | None, run_dir: Path, step: int, precision: str
) -> dict[str, Any] | None:
    """The manifest of version `version` of `out` if a delta of it can be written, else None."""
    if version is None:
        return None
    try:
        base = _format.read_manifest(out / str(version), verify=False)
    except _format.ExportError:
        return None
    same_run = base.get("run_dir") == str(run_dir.resolve())
    if not same_run or base.get("precision") != precision or base["step"] >= step:
        return None
    return base


def _sizes(files: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Bytes of the tower, the embedding values (with scales), the id index, and in total."""
    sizes = {"tower_bytes": 0, "embedding_bytes": 0, "index_bytes": 0, "total_bytes": 0}
    for path, entry in files.items():
        sizes["total_bytes"] += entry["bytes"]
        if path == _format.MODEL_FILE:
            sizes["tower_bytes"] += entry["bytes"]
        elif path.endswith("/ids.npy"):
            sizes["index_bytes"] += entry["bytes"]
        elif path.startswith(_format.TABLES_DIR + "/"):
            sizes["embedding_bytes"] += entry["bytes"]
    return sizes


def _library_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"jax": jax.__version__, "numpy": np.__version__}
    try:
        versions["hybridrec"] = metadata.version("hybridrec")
    except metadata.PackageNotFoundError:
        versions["hybridrec"] = "unknown"
    return versions
