"""The layers import downward only: kernels <- runtime <- launcher, and the operator
depends on nothing of the runtime but the task contract. Read from the source (every
import, at module level or in a function; ``if TYPE_CHECKING:`` blocks aside) and
confirmed by importing in a fresh interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kernels": "flowmill.kernels",
    "runtime": "flowmill.runtime",
    "operator": "flowmill.operator",
    "launcher": "flowmill.launcher",
}
# What the operator may use of the runtime: the task contract and what it is written with.
CONTRACT = {
    "flowmill.runtime.cluster", "flowmill.runtime.addresses", "flowmill.runtime.device_names",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:``."""
    lines = set()
    for node in ast.walk(tree):
        guard = ast.unparse(node.test) if isinstance(node, ast.If) else ""
        if guard in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for sub in node.body:
                for inner in ast.walk(sub):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        lines.add(inner.lineno)
    return lines


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every module ``path`` imports (a name from a package counts as its submodule when
    there is one)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    out = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    out.discard(name)
    return out


def _sources() -> dict[str, Path]:
    files = {}
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            if "protos" not in path.parts:
                files[_module_name(path)] = path
    return files


SOURCES = _sources()
IMPORTS = {name: _imports(path, set(SOURCES)) for name, path in SOURCES.items()}


def _of(package: str) -> dict[str, set[str]]:
    return {m: deps for m, deps in IMPORTS.items() if m == package or m.startswith(package + ".")}


def _violations(package: str, allowed) -> list[str]:
    return sorted(
        f"{m} imports {d}" for m, deps in _of(package).items() for d in deps if not allowed(d)
    )


def _within(d: str, *packages: str) -> bool:
    return any(d == p or d.startswith(p + ".") for p in packages)


def test_the_sources_were_read():
    assert {"flowmill.kernels.registry", "flowmill.runtime.session", "flowmill.operator.status",
            "flowmill.launcher.local"} <= set(SOURCES)
    assert "flowmill.kernels.shapes" in IMPORTS["flowmill.kernels.fifo_queue"]


def test_kernels_import_nothing_above_them():
    others = ("flowmill.runtime", "flowmill.operator", "flowmill.launcher")
    assert _violations("flowmill.kernels", lambda d: not _within(d, *others)) == []


def test_the_runtime_imports_neither_the_operator_nor_the_launcher():
    above = ("flowmill.operator", "flowmill.launcher")
    assert _violations("flowmill.runtime", lambda d: not _within(d, *above)) == []


def test_the_operator_uses_only_the_task_contract():
    def allowed(d: str) -> bool:
        if _within(d, "flowmill.runtime"):
            return d in CONTRACT
        return not _within(d, "flowmill.kernels", "flowmill.launcher", "numpy", "cupy")

    assert _violations("flowmill.operator", allowed) == []
    for module in CONTRACT:  # and the contract is written with the standard library alone
        third_party = {d for d in IMPORTS[module] if not _within(d, "flowmill") and
                       d.split(".")[0] not in sys.stdlib_module_names and d != "__future__"}
        assert third_party == set(), module
        assert {d for d in IMPORTS[module] if _within(d, "flowmill")} <= CONTRACT, module


def test_no_module_of_the_runtime_or_the_kernels_is_in_an_import_circle():
    """Tarjan's strongly connected components over the import graph of each package."""
    for package in ("flowmill.runtime", "flowmill.kernels"):
        graph = {m: {d for d in deps if d in IMPORTS and _within(d, package)}
                 for m, deps in _of(package).items()}
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        circles: list[list[str]] = []

        def visit(v: str, graph=graph, index=index, low=low, stack=stack, circles=circles):
            index[v] = low[v] = len(index)
            stack.append(v)
            for w in graph[v]:
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                members = stack[stack.index(v):]
                del stack[stack.index(v):]
                if len(members) > 1:
                    circles.append(sorted(members))

        for v in sorted(graph):
            if v not in index:
                visit(v)
        assert circles == [], f"{package}: {circles}"


def _loaded_after(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT / "tests", timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_python_dash_m_works_from_the_repository_root():
    """``operator/`` has no ``__init__.py``: as a bare name it is no package, so a
    ``python -m`` started in the repository root (``python -m pip install -e .``) imports
    the standard library's ``operator``; ``flowmill.operator`` is a namespace package.
    Without ``site`` (as some interpreters start) nothing imports ``operator`` before the
    root is on the path."""
    assert not (ROOT / "operator" / "__init__.py").exists()
    for argv in (["-S", "-m", "json.tool", "--help"], ["-m", "pip", "--version"]):
        run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, (argv, run.stderr[-2000:])
    loaded = _loaded_after("import operator, flowmill.operator.api; print(operator.eq)")
    assert "flowmill.operator.api" in loaded


def test_the_operator_pod_loads_no_kernels_ops_or_numpy():
    loaded = _loaded_after("import flowmill.operator.controller")
    assert "flowmill.operator.controller" in loaded
    runtime = {m for m in loaded if _within(m, "flowmill.runtime")}
    assert runtime <= CONTRACT | {"flowmill.runtime", "flowmill.runtime.hooks"}, runtime
    assert [m for m in loaded if _within(m, "flowmill.kernels", "numpy", "cupy")] == []
    # It speaks JSON to the API itself. Through its entry point (``python -m
    # flowmill.operator``) not even kopf loads the official client, installed here for
    # the tests.
    entry = _loaded_after(
        "import runpy, sys\nsys.argv = ['flowmill.operator', '--help']\n"
        "try:\n    runpy.run_module('flowmill.operator', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "import flowmill.operator.controller\n"
        "sys.modules = {k: v for k, v in sys.modules.items() if v is not None}")
    assert "kopf" in entry and "flowmill.operator.controller" in entry
    assert [m for m in entry if _within(m, "kubernetes", "numpy")] == []
    # It issues certificates through the OpenSSL its ssl module loads (libcrypto.py).
    assert [m for m in entry if _within(m, "cryptography")] == []


@pytest.mark.parametrize("module, absent", [
    ("flowmill.runtime.cluster", ("numpy", "grpc", "flowmill.runtime.graph")),
    ("flowmill.runtime.graph", ("grpc", "flowmill.runtime.session", "flowmill.runtime.server")),
    ("flowmill.runtime.session", ("grpc", "flowmill.runtime.distributed")),
    ("flowmill.kernels", ("flowmill.runtime",)),
])
def test_importing_one_module_loads_only_what_it_needs(module, absent):
    loaded = _loaded_after(f"import {module}")
    assert module in loaded
    assert [m for m in loaded if _within(m, *absent)] == []


def test_the_facade_still_gives_a_script_everything():
    loaded = _loaded_after(
        "import flowmill.runtime as fm\n"
        "names = [getattr(fm, n) for n in fm.__all__]\n"
        "assert fm.train.Adam and fm.nn.relu and fm.range is not None\n"
    )
    assert "flowmill.runtime.session_manager" in loaded
