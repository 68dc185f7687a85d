"""The packages stack as docs/architecture.md draws them (scripts/check_layers.py), and an
install puts nothing beside the `hybridrec` namespace."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _check_layers():
    spec = importlib.util.spec_from_file_location("check_layers", REPO / "scripts/check_layers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_repository_has_no_cycle_no_edge_against_the_layering_and_no_long_file():
    report = _check_layers().check(REPO)
    assert report.cycles == []
    assert report.against_layering == []
    assert report.private_imports == []
    assert report.processes == []
    assert report.long_files == []
    assert report.kind_branches == []


def test_the_check_finds_what_it_looks_for(tmp_path):
    """A copy of the layout with one of each mistake planted: each is reported."""
    check_layers = _check_layers()
    files = {
        "common/__init__.py": "",
        "pipeline/__init__.py": "",
        "embedding_store/__init__.py": "",
        "model/__init__.py": "",
        "model/step.py": "from hybridrec.embedding_store import Store\n",  # against layering
        "training/__init__.py": "",
        "training/a.py": "from hybridrec.training import b\n",  # a cycle a <-> b
        "training/b.py": "from hybridrec.training.a import _helper\n",  # private name
        # a branch on the kind of run outside the task modules; inside them, the task's own
        "training/job.py": "def reader(job):\n    return 1 if job.sequences else 2\n",
        "training/tasks/__init__.py": "",
        "training/tasks/one.py": 'def f(m):\n    if m.kind == "events":\n        return 1\n',
        # an annotation-only import makes no cycle
        "training/c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from hybridrec.training import d\n",
        "training/d.py": "from hybridrec.training import c\n",
        "serving/__init__.py": "",
        "serving/server.py": "from hybridrec.training import a\nfrom hybridrec.serving import helper\n",  # serve loads training
        # ... and, through a module it loads, the towers' code and Flax (a function's own
        # import runs only when called: not counted)
        "serving/helper.py": "import flax.nnx\nfrom hybridrec.model import step\n\n\ndef f():\n    import optax\n",
        "embedding_store/spawn.py": 'COMMAND = ["python", "-m", "hybridrec", "serve"]\n',
        "pipeline/long.py": "x = 1\n" * (check_layers.MAX_LINES + 1),
        "hybridrec/__init__.py": "",
        "hybridrec/cli/__init__.py": "from hybridrec.serving import server\n",  # allowed
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    report = check_layers.check(tmp_path)
    assert report.cycles == [["hybridrec.training.a", "hybridrec.training.b"]]
    assert [f.split(": ", 1)[1] for f in report.against_layering] == [
        "hybridrec.model.step -> hybridrec.embedding_store",
        "hybridrec.serving.server (loaded by serve) -> hybridrec.training.a",
        "hybridrec.serving.helper (loaded by serve) -> flax.nnx",
        "hybridrec.serving.helper (loaded by serve) -> hybridrec.model.step",
    ]
    loaded, _ = check_layers.serving_runtime(tmp_path)
    assert loaded["hybridrec.serving.helper"] == "hybridrec.serving.server"
    assert report.private_imports == [
        "training/b.py:1: hybridrec.training.b takes hybridrec.training.a._helper"
    ]
    assert len(report.processes) == 1 and "embedding_store/spawn.py:1" in report.processes[0]
    assert report.long_files == [f"pipeline/long.py: {check_layers.MAX_LINES + 1} lines"]
    assert report.kind_branches == [
        "training/job.py:2: hybridrec.training.job branches on job.sequences"
    ]


def test_an_install_adds_one_top_level_name(tmp_path):
    """What pip installs lives under `hybridrec` (the folders are mapped onto it)."""
    # run outside the checkout, whose folders (and build metadata) the path would find first
    probe = textwrap.dedent(
        """
        import importlib.util, json
        from importlib import metadata
        import hybridrec.embedding_store, hybridrec.model, hybridrec.pipeline
        import hybridrec.serving, hybridrec.training
        bare = ("model", "training", "pipeline", "serving", "common", "embedding_store")
        print(json.dumps({
            "top_level": metadata.distribution("hybridrec").read_text("top_level.txt").split(),
            "bare": [name for name in bare if importlib.util.find_spec(name)],
            "model": hybridrec.model.__name__,
        }))
        """
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    report = json.loads(found.stdout)
    assert report == {"top_level": ["hybridrec"], "bare": [], "model": "hybridrec.model"}


def test_every_package_folder_is_installed():
    """A non-editable install copies only the packages pyproject.toml lists: every folder
    with an __init__.py under the library's folders must be one of them."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in setuptools["package-dir"].items()}
    folders["hybridrec"] = "hybridrec"
    found = set()
    for folder, name in folders.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join([name, *parts]))
    assert found - set(setuptools["packages"]) == set()
