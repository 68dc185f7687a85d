"""Serving what was trained: `hybridrec export` and `hybridrec serve`.

Public surface:
    export_run(run_dir, out, step=, precision=)   a run's checkpoint -> a versioned export
    ServedModel(path)                              a click-log run's export: encode_rows, predict
    ServedSequenceModel(path)                      a sequence run's export: encode, top_k,
                                                   score_candidates
    load_export(path, max_batch=)                  either, by the export's kind
    ExportError                                    a bad or incomplete export (names the file)
    MANIFEST_FILE, versions(base)                  a version's manifest; an export's versions
    create_app(path, ...) / serve(path, ...)       the Open Inference Protocol (KServe v2) server
    demo_score(export_dir, rows)                   start a server, score rows over HTTP, stop it
    demo_top_k(export_dir, histories, k=)          the same for a sequence run's next items
"""

from hybridrec.serving._format import MANIFEST_FILE, ExportError, versions

__all__ = [
    "MANIFEST_FILE",
    "ExportError",
    "ServedModel",
    "ServedSequenceModel",
    "create_app",
    "demo_score",
    "demo_top_k",
    "export_run",
    "load_export",
    "serve",
    "versions",
]


def __getattr__(name):
    # JAX and the web stack are imported only when used
    if name == "export_run":
        from hybridrec.serving.export import export_run

        return export_run
    if name == "ServedModel":
        from hybridrec.serving.model import ServedModel

        return ServedModel
    if name in ("create_app", "serve"):
        from hybridrec.serving import server

        return getattr(server, name)
    if name == "ServedSequenceModel":
        from hybridrec.serving.sequence_model import ServedSequenceModel

        return ServedSequenceModel
    if name == "load_export":
        from hybridrec.serving.load import load_export

        return load_export
    if name in ("demo_score", "demo_top_k"):
        from hybridrec.serving import demo

        return getattr(demo, name)
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
