"""The `hybridrec` command: one subcommand per job, each implemented in its stage's package.

Every subcommand is a `main(argv) -> int` function, imported only when it runs so
that `hybridrec generate` does not pay for importing JAX.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from hybridrec.errors import UserError

# subcommand -> ("module:function", one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": (
        "pipeline.synthetic:main",
        "write synthetic click logs in the raw Criteo TSV layout",
    ),
    "preprocess": ("pipeline.job:main", "Beam job: raw logs -> sharded Parquet + metadata.json"),
    "train": (
        "model.train_cli:main",
        "train a model with the hybrid (async embedding, sync dense) loop",
    ),
    "evaluate": ("model.train_cli:evaluate_main", "evaluate a checkpoint on a data split"),
    "plot": ("model.plots:main", "write PNG training curves for a run directory"),
    "serve-embeddings": (
        "embedding_store.server:main",
        "host embedding shards behind an RPC server",
    ),
    "launch": (
        "hybridrec.launch:main",
        "start shard servers and N trainer processes on this machine",
    ),
    "quickstart": (
        "hybridrec.quickstart:main",
        "generate -> preprocess -> train -> evaluate on a built-in default",
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
    target, _ = SUBCOMMANDS[name]
    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    try:
        return int(function(list(argv)) or 0)
    except UserError as error:
        print(f"hybridrec {name}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybridrec {name}: interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
