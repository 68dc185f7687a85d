"""The walk of a run's config: from `hybridrec train`'s parsed arguments to its first
training step, which files of hybridrec handle the config, in order.

Runs `hybridrec train` on a small generated dataset (click logs, or an event log with
--sequences) under a profile hook that records every call into hybridrec code handed the run's config
(`training.config.TrainConfig`) or one of its sections (`model`, `model.sequence`, ...)
as an argument (a config's own methods are not counted), until the hybrid loop's first
step. Prints the files in the order the config reaches them, how
many there are and how often the walk came back to a file it had left; the last line is
one JSON object: files, returns, walk (the files in order, consecutive repeats merged).

    python scripts/config_walk.py               # a click-log run
    python scripts/config_walk.py --sequences   # a sequence run (SASRec)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path


class FirstStep(Exception):
    """Raised from the profile hook at the hybrid loop's first step."""


def _config_types() -> set[type]:
    """TrainConfig and the types of its sections, at any depth (model.sequence, ...)."""
    from hybridrec.training.config import TrainConfig

    types, todo = set(), [TrainConfig()]
    while todo:
        value = todo.pop()
        if dataclasses.is_dataclass(value) and type(value) not in types:
            types.add(type(value))
            todo += [getattr(value, field.name) for field in dataclasses.fields(value)]
    return types


def walk(argv: list[str]) -> list[str]:
    """The hybridrec files (relative to the repository) a config was handed to, in call order."""
    import hybridrec
    from hybridrec.cli import main as cli_main

    repo = Path(hybridrec.__file__).resolve().parent.parent  # the tree the package runs from
    seen: list[str] = []
    types = tuple(_config_types())

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        path = Path(code.co_filename)
        if not path.is_relative_to(repo) or ".venv" in path.parts:
            return
        if code.co_name == "progress" and path.name == "hybrid.py":
            raise FirstStep
        # handed the config or a section of it (a config's own methods are not counted)
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        arguments = [frame.f_locals.get(n) for n in names if n != "self"]
        if not isinstance(frame.f_locals.get("self"), types) and any(
            isinstance(a, types) for a in arguments
        ):
            name = str(path.relative_to(repo))
            if not seen or seen[-1] != name:
                seen.append(name)

    sys.setprofile(hook)
    try:
        cli_main(argv)
    except (FirstStep, SystemExit):
        pass
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", action="store_true", help="a sequence run (SASRec)")
    args = parser.parse_args()
    from hybridrec.cli import main as cli_main

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.sequences:
            cli_main(["generate", "--events", "-o", str(tmp / "raw"), "--users", "200", "--items", "300"])  # fmt: skip
            inputs = ["-i", str(tmp / "raw" / "events.csv"), "--spec", str(tmp / "raw" / "events.toml")]  # fmt: skip
            preset = "sasrec"
        else:
            cli_main(["generate", "-o", str(tmp / "raw" / "synthetic.tsv.gz"), "--rows", "4000"])
            inputs = ["-i", str(tmp / "raw" / "synthetic.tsv.gz")]
            preset = "quickstart"
        cli_main(["preprocess", *inputs, "-o", str(tmp / "data"), "--quiet"])
        files = walk(
            ["train", "--config", preset, "--data", str(tmp / "data"),
             "--run-dir", str(tmp / "run"), "--set", "data.max_steps=2"]
        )  # fmt: skip
    returns = len(files) - len(set(files))
    for index, name in enumerate(files, 1):
        print(f"{index:3d}  {name}")
    print(f"{len(set(files))} files, {returns} returns to a file left earlier")
    print(json.dumps({"files": len(set(files)), "returns": returns, "walk": files}))


if __name__ == "__main__":
    main()
