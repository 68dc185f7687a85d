"""The `hybridrec` command: one subcommand per job.

This package is the top floor: each subcommand is a module of `hybridrec` with a
`main(argv) -> int` that parses its flags and calls one library function of a stage
package (`pipeline`, `embedding_store`, `training`, ...). Nothing below imports it.
A subcommand's module is imported only when it runs, so that `hybridrec generate`
does not pay for importing JAX.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

from hybridrec.common.errors import UserError


def _generate(argv: list[str]) -> int:
    from hybridrec.cli import generate

    return generate.main(argv)


def _spec(argv: list[str]) -> int:
    from hybridrec.cli import spec

    return spec.main(argv)


def _preprocess(argv: list[str]) -> int:
    from hybridrec.cli import preprocess

    return preprocess.main(argv)


def _train(argv: list[str]) -> int:
    from hybridrec.cli import train

    return train.main(argv)


def _evaluate(argv: list[str]) -> int:
    from hybridrec.cli import evaluate

    return evaluate.main(argv)


def _plot(argv: list[str]) -> int:
    from hybridrec.cli import plot

    return plot.main(argv)


def _export(argv: list[str]) -> int:
    from hybridrec.cli import export

    return export.main(argv)


def _learn_hash(argv: list[str]) -> int:
    from hybridrec.cli import learn_hash

    return learn_hash.main(argv)


def _serve(argv: list[str]) -> int:
    from hybridrec.cli import serve

    return serve.main(argv)


def _serve_embeddings(argv: list[str]) -> int:
    from hybridrec.cli import serve_embeddings

    return serve_embeddings.main(argv)


def _launch(argv: list[str]) -> int:
    from hybridrec.cli import launch

    return launch.main(argv)


def _quickstart(argv: list[str]) -> int:
    from hybridrec.cli import quickstart

    return quickstart.main(argv)


# subcommand -> (function, one-line help)
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "generate": (_generate, "write synthetic click logs in the raw Criteo TSV layout"),
    "spec": (_spec, "propose a feature spec (TOML) from a sample of a raw CSV/TSV log"),
    "preprocess": (_preprocess, "Beam job: raw logs -> sharded Parquet + metadata.json"),
    "train": (_train, "train a model with the hybrid (async embedding, sync dense) loop"),
    "evaluate": (_evaluate, "evaluate a checkpoint on a data split"),
    "plot": (_plot, "write PNG training curves for a run directory"),
    "learn-hash": (_learn_hash, "learn an id -> bucket mapping for smaller tables from a run"),
    "export": (_export, "export a checkpoint for serving (StableHLO tower, embeddings, spec)"),
    "serve": (_serve, "serve an export over HTTP (Open Inference Protocol / KServe v2)"),
    "serve-embeddings": (_serve_embeddings, "host embedding shards behind an RPC server"),
    "launch": (_launch, "start shard servers and N trainer processes on this machine"),
    "quickstart": (
        _quickstart,
        "generate -> preprocess -> train -> evaluate -> serve on a built-in default",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: hybridrec <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "Run `hybridrec <command> --help` for a command's options."]
    return "\n".join(lines)


def run(name: str, argv: Sequence[str]) -> int:
    """Runs subcommand `name` with `argv`; user errors print one line and return 2."""
    function, _ = SUBCOMMANDS[name]
    try:
        return int(function(list(argv)) or 0)
    except UserError as error:
        print(f"hybridrec {name}: error: {error}", file=sys.stderr)
        return 2
    except (AssertionError, RuntimeError) as error:
        problem = _platform_problem(error)
        if problem is None:
            raise
        print(f"hybridrec {name}: error: {problem}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybridrec {name}: interrupted", file=sys.stderr)
        return 130


def _platform_problem(error: BaseException) -> str | None:
    """One line for a JAX backend that cannot start (JAX_PLATFORMS naming a platform this
    machine lacks, or a broken plugin); None for an error of any other kind."""
    frames = traceback.extract_tb(error.__traceback__)
    where = frames[-1].filename.replace(os.sep, "/") if frames else ""
    if not where.endswith("/jax/_src/xla_bridge.py"):  # raised by JAX starting its backends
        return None
    # JAX says why in a RuntimeError; with no usable platform at all it only asserts
    detail = str(error).split(" (set JAX_PLATFORMS")[0].split(" (you may need")[0]
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if not platforms:
        return f"JAX cannot start its backend: {detail or 'no platform is usable'}"
    return (
        f"JAX_PLATFORMS={platforms}: JAX cannot start {platforms!r} on this machine ("
        + (detail or "no such device is visible, or JAX's plugin for it is not installed")
        + "); on a GPU host install JAX's CUDA build (pip install 'hybridrec[cuda13]'), "
        "or unset JAX_PLATFORMS to use the devices there are"
    )


def _exit_now_if_threads_linger(code: int) -> None:
    """Ends the process at once after a failed command whose worker threads still run.

    Python joins every executor thread at exit, so a thread blocked in a call that
    retries until a timeout (an embedding lookup against a killed shard server) would
    hold the process for that long after the error was printed.
    """
    lingering = [
        thread
        for thread in threading.enumerate()
        if thread is not threading.main_thread() and not thread.daemon
    ]
    if lingering:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """The `hybridrec` process (argv None: sys.argv) or one command run in-process."""
    if argv is None:  # the process's entry point: a failure ends it promptly
        try:
            code = _main(sys.argv[1:])
        except SystemExit:  # argparse's --help and usage errors
            raise
        except BaseException:
            traceback.print_exc()
            code = 1
        if code:
            _exit_now_if_threads_linger(code)
        return code
    return _main(argv)


def _main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from hybridrec import __version__

        print(f"hybridrec {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"hybridrec: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
