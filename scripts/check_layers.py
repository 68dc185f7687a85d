"""Checks that the packages stack as docs/architecture.md draws them.

    python scripts/check_layers.py        # from the repository root; exit 1 on a finding

Reads every module of the installed namespace (`hybridrec.*`, mapped from the repository's
folders as pyproject.toml does) and reports:
  - import cycles between modules (imports inside functions count; those under
    `if TYPE_CHECKING:`, for annotations only, do not);
  - edges against the layering: a package importing one above it, or what `serve` loads
    (the served model, server and its inputs) importing training code;
  - private names taken from another module (`from x import _name`), and private modules
    taken from another package;
  - a library package starting a hybridrec process (`python -m hybridrec...`): starting
    processes is the commands' work;
  - files over MAX_LINES lines;
  - branches on the kind of run (`if` / `while` / `x if ... else y` testing `.sequences`,
    "sequence(s)" or "events", `EventMetadata` or `tower_kind(...)`) in the model, training,
    serving and command packages outside the task modules: the task decides
    (`training.task`), the rest asks it.
The last line printed is one JSON object with the counts. tests/test_layers.py runs it.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 500

# import name prefix -> folder, as pyproject.toml maps them
FOLDERS = {
    "hybridrec.common": "common",
    "hybridrec.pipeline": "pipeline",
    "hybridrec.embedding_store": "embedding_store",
    "hybridrec.model": "model",
    "hybridrec.training": "training",
    "hybridrec.serving": "serving",
    "hybridrec": "hybridrec",
}
# package -> the packages it may import (besides itself); anything else is against the layering
MAY_IMPORT = {
    "common": set(),
    "pipeline": {"common"},
    "embedding_store": {"common"},
    "model": {"common"},
    "training": {"common", "pipeline", "embedding_store", "model"},
    "serving": {"common", "pipeline", "embedding_store", "model", "training"},
    "cli": {"common", "pipeline", "embedding_store", "model", "training", "serving", "hybridrec"},
    "hybridrec": {"cli", "common", "training", "serving"},  # the commands and the Python API
}
# what `hybridrec serve` and `hybridrec.load_model` load: every module these import at
# their top level, and so on (a package's __init__ with each of its modules), must run
# without the training code, the dense towers' modules and what trains them
SERVING_ROOTS = ("hybridrec.cli.serve", "hybridrec.serving.server", "hybridrec.serving.load")
SERVING_FORBIDDEN = ("hybridrec.training", "hybridrec.model")
SERVING_FORBIDDEN_EXTERNAL = ("flax", "optax", "orbax")
LIBRARY = {"common", "pipeline", "embedding_store", "model", "training", "serving"}
# where a branch on the kind of run is a finding (`kind_branches`), and the task modules,
# the one place that decides it
KIND_CHECKED = {"model", "training", "serving", "cli"}
TASK_MODULES = ("hybridrec.training.task", "hybridrec.training.tasks")
KIND_TEST = re.compile(r"\.sequences\b|[\"'](?:sequences?|events)[\"']|EventMetadata|tower_kind\(")


@dataclass
class Report:
    cycles: list[list[str]] = field(default_factory=list)
    against_layering: list[str] = field(default_factory=list)
    private_imports: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    long_files: list[str] = field(default_factory=list)
    kind_branches: list[str] = field(default_factory=list)

    def findings(self) -> int:
        return (
            len(self.cycles)
            + len(self.against_layering)
            + len(self.private_imports)
            + len(self.processes)
            + len(self.long_files)
            + len(self.kind_branches)
        )


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module of the namespace: import name -> file."""
    found = {}
    for prefix, folder in FOLDERS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            relative = path.relative_to(repo / folder).with_suffix("")
            parts = [part for part in relative.parts if part != "__init__"]
            name = ".".join([prefix, *parts])
            found.setdefault(name, path)
    return found


def package(module: str) -> str:
    """The layer a module belongs to: hybridrec.model.step -> model, hybridrec.cli.x -> cli."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else "hybridrec"


def _imports(path: Path, module: str) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in a file that can
    run: those under `if TYPE_CHECKING:` are for annotations only and never do."""
    nodes = [ast.parse(path.read_text(), filename=str(path))]
    while nodes:
        node = nodes.pop()
        if _type_checking(node):
            nodes += node.orelse
            continue
        yield from _named(node, module, path.name == "__init__.py")
        nodes += ast.iter_child_nodes(node)


def _type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_imports(path: Path, module: str) -> Iterator[tuple[str, str | None, int]]:
    """`_imports` run when the module is imported: those outside functions and classes."""
    nodes = list(ast.parse(path.read_text(), filename=str(path)).body)
    while nodes:
        node = nodes.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from _named(node, module, path.name == "__init__.py")
        elif _type_checking(node):
            nodes[:0] = node.orelse
        else:  # if / try / with blocks at the top level run too
            nodes[:0] = [
                child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)
            ]


def _named(node: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) of an import statement."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None, node.lineno
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                anchor = anchor.rpartition(".")[0]
            base = f"{anchor}.{base}" if base else anchor
        for alias in node.names:
            yield base, alias.name, node.lineno


def serving_runtime(repo: Path = REPO) -> tuple[dict[str, str], list[str]]:
    """The modules `hybridrec serve` loads ({module: the module that first loads it}, from
    SERVING_ROOTS through top-level imports and parent packages) and the findings: each
    import among them of SERVING_FORBIDDEN or SERVING_FORBIDDEN_EXTERNAL."""
    known = modules(repo)
    loaded: dict[str, str] = {root: "" for root in SERVING_ROOTS if root in known}
    queue, findings = list(loaded), []
    while queue:
        module = queue.pop(0)
        path = known[module]
        parents = [module.rsplit(".", depth)[0] for depth in range(1, module.count("."))]
        targets = [(parent, None, 0) for parent in parents if parent in known]
        targets += list(_top_imports(path, module))
        for imported, name, line in targets:
            full = f"{imported}.{name}" if name else imported
            target = _resolve(full, known)
            where = f"{path.relative_to(repo)}:{line}"
            if target is None:
                if imported.split(".")[0] in SERVING_FORBIDDEN_EXTERNAL:
                    findings.append(f"{where}: {module} (loaded by serve) -> {imported}")
                continue
            if target.startswith(SERVING_FORBIDDEN):
                findings.append(f"{where}: {module} (loaded by serve) -> {target}")
            elif target not in loaded:
                loaded[target] = module
                queue.append(target)
    return loaded, list(dict.fromkeys(findings))


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _starts_hybridrec(path: Path) -> Iterator[int]:
    """Lines of list literals like [python, "-m", "hybridrec...", ...]."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.List):
            values = [item.value if isinstance(item, ast.Constant) else None for item in node.elts]
            for first, second in zip(values, values[1:], strict=False):
                if first == "-m" and isinstance(second, str) and second.startswith("hybridrec"):
                    yield node.lineno


def _kind_branches(path: Path) -> Iterator[tuple[int, str]]:
    """(line, test) of each branch whose test names the kind of run (`KIND_TEST`)."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            test = ast.get_source_segment(source, node.test) or ""
            if KIND_TEST.search(test):
                yield node.lineno, test


def check(repo: Path = REPO) -> Report:
    """Reads the repository's modules and returns what breaks the layering."""
    known = modules(repo)
    report = Report()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for module, path in known.items():
        where = path.relative_to(repo)
        for imported, name, line in _imports(path, module):
            full = f"{imported}.{name}" if name else imported
            target = _resolve(full, known)
            if target is None or target == module:
                continue
            if target.startswith(module + "."):  # a package importing its own submodule
                continue
            edges[module].add(target)
            source_layer, target_layer = package(module), package(target)
            if source_layer != target_layer and target_layer not in MAY_IMPORT[source_layer]:
                report.against_layering.append(f"{where}:{line}: {module} -> {target}")
            private_name = name is not None and name.startswith("_") and name != "__version__"
            if private_name and f"{imported}.{name}" not in known:
                report.private_imports.append(f"{where}:{line}: {module} takes {imported}.{name}")
            private_module = any(part.startswith("_") for part in target.split(".")[2:])
            if private_module and source_layer != target_layer:
                report.private_imports.append(f"{where}:{line}: {module} takes module {target}")
        if package(module) in LIBRARY:
            for line in _starts_hybridrec(path):
                report.processes.append(f"{where}:{line}: {module} starts a hybridrec process")
        if package(module) in KIND_CHECKED and not module.startswith(TASK_MODULES):
            for line, test in _kind_branches(path):
                report.kind_branches.append(f"{where}:{line}: {module} branches on {test}")
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            report.long_files.append(f"{where}: {lines} lines")
    report.against_layering += serving_runtime(repo)[1]
    report.cycles = _cycles(edges)
    for kind in ("against_layering", "private_imports"):
        setattr(report, kind, list(dict.fromkeys(getattr(report, kind))))
    return report


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def main() -> int:
    report = check()
    if "--serving-runtime" in sys.argv[1:]:  # every module `hybridrec serve` loads, and why
        for module, by in serving_runtime()[0].items():
            print(f"serving runtime: {module}" + (f" (loaded by {by})" if by else " (a root)"))
    for component in report.cycles:
        print("cycle:", " <-> ".join(component))
    for kind in ("against_layering", "private_imports", "processes", "long_files", "kind_branches"):
        for finding in getattr(report, kind):
            print(f"{kind.replace('_', ' ')}: {finding}")
    print(
        json.dumps(
            {
                "modules": len(modules()),
                "cycles": len(report.cycles),
                "against_layering": len(report.against_layering),
                "private_imports": len(report.private_imports),
                "processes": len(report.processes),
                "long_files": len(report.long_files),
                "kind_branches": len(report.kind_branches),
                "serving_runtime_modules": len(serving_runtime()[0]),
            }
        )
    )
    return 1 if report.findings() else 0


if __name__ == "__main__":
    sys.exit(main())
