"""Serving what was trained: `hybridrec export` and `hybridrec serve`.

Public surface:
    export_run(run_dir, out, step=, precision=)   a run's checkpoint -> a versioned export
    ServedModel(path)                              a loaded export: encode_rows, predict
    ExportError                                    a bad or incomplete export (names the file)
    MANIFEST_FILE, versions(base)                  a version's manifest; an export's versions
    create_app(path, ...) / serve(path, ...)       the Open Inference Protocol (KServe v2) server
    demo_score(export_dir, rows)                   start a server, score rows over HTTP, stop it
"""

from hybridrec.serving._format import MANIFEST_FILE, ExportError, versions

__all__ = [
    "MANIFEST_FILE",
    "ExportError",
    "ServedModel",
    "create_app",
    "demo_score",
    "export_run",
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
    if name == "demo_score":
        from hybridrec.serving.demo import demo_score

        return demo_score
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
