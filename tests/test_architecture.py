"""The structure docs/development.md draws, kept by tests: imports point down its layers
with no circle anywhere, no module reaches into another package's underscore names, the
real backend imports nothing of the simulator, the linter's rules hold, and the
documentation site builds without a warning."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("cupy_memstrat", "pytest_gpumem")
FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))

def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in FILES}


def _imported_from(path, node) -> str:
    if node.level == 0:
        return node.module or ""
    base = _module(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _one_package(a: str, b: str) -> bool:
    """Inside one (sub)package's own modules: a package and its modules, or two modules of
    the same subpackage (testing._core and testing._checks, faults and faults._uvm)."""
    pa, pb = a.rsplit(".", 1)[0], b.rsplit(".", 1)[0]
    return a.startswith(b + ".") or b.startswith(a + ".") or (pa == pb and pa not in PACKAGES)


def _underscore_reaches(path, text=None):
    """``from M import _x`` and ``M._x`` (M a project module the file imported) across packages."""
    tree, me, found, modules = ast.parse(path.read_text() if text is None else text), _module(path), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _imported_from(path, node)
            if src.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                if f"{src}.{a.name}" in MODULES:
                    modules[a.asname or a.name] = f"{src}.{a.name}"
                elif a.name.startswith("_") and not _one_package(me, src):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {src} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES and a.asname:
                    modules[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and not _one_package(me, modules[node.value.id])):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


#: the layers of docs/development.md, bottom first: a module imports from its own layer and those below
LAYERS = (
    ("foundation", ("cupy_memstrat.errors", "cupy_memstrat.sizes", "cupy_memstrat._userwarn", "cupy_memstrat.paths",
                    "cupy_memstrat.options", "cupy_memstrat.stats", "cupy_memstrat.hookspecs",
                    "cupy_memstrat.memory_doc", "cupy_memstrat.trace")),
    ("the seam to CUDA", ("cupy_memstrat.backends", "cupy_memstrat.testing")),
    ("strategies", ("cupy_memstrat.strategies",)),
    ("checks and fault counters", ("cupy_memstrat.checks", "cupy_memstrat.faults")),
    ("the library", ("cupy_memstrat.registry", "cupy_memstrat.api", "cupy_memstrat.history",
                     "cupy_memstrat.memory_viz", "cupy_memstrat.info", "cupy_memstrat.replay", "cupy_memstrat")),
    ("integrations and tools", ("cupy_memstrat.dask", "cupy_memstrat.numba", "cupy_memstrat.bench",
                                "cupy_memstrat.cli", "cupy_memstrat.__main__")),
    ("the pytest plugin", ("pytest_gpumem",)),
)


def _layer(module: str) -> int:
    """The index in LAYERS of ``module``: its longest matching prefix."""
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} is in no layer of LAYERS: add it"
    return level


def _imports(path, text=None) -> set[str]:
    """The project modules ``path`` imports, wherever the import stands (in a function or under
    TYPE_CHECKING too): ``from P import name`` counts as P.name where that is a module, else P."""
    tree, me, out = ast.parse(path.read_text() if text is None else text), _module(path), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _imported_from(path, node)
            if src.split(".")[0] in PACKAGES:
                out.update(f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
    out.discard(me)
    return {m if m in MODULES else m.rpartition(".")[0] for m in out}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_no_import_circle():
    assert _circles(GRAPH) == []


def test_imports_point_down_the_layers():
    up = sorted(f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
                for m, targets in GRAPH.items() for t in targets if _layer(t) > _layer(m))
    assert up == [], "\n".join(up)


def test_the_import_checks_see_a_circle_and_an_upward_import():
    """The controls: a circle of three and a strategy importing the public API are found."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    text = "from ..api import use\nfrom .. import sizes\n"
    found = _imports(ROOT / "cupy_memstrat" / "strategies" / "device.py", text=text)
    assert found == {"cupy_memstrat.api", "cupy_memstrat.sizes"}
    assert _layer("cupy_memstrat.api") > _layer("cupy_memstrat.strategies.device") > _layer("cupy_memstrat.sizes")


def test_the_real_backend_and_the_protocols_import_nothing_of_the_simulator():
    for module in ("cupy_memstrat.backends.cuda", "cupy_memstrat.backends.protocols"):
        assert not [t for t in GRAPH[module] if ".sim" in t or "testing" in t], module


def test_no_module_reaches_into_another_packages_underscore_names():
    found = [f for p in FILES for f in _underscore_reaches(p)]
    assert found == [], "\n".join(found)


def test_the_checker_sees_an_underscore_import():
    """The control: the check above finds both shapes it looks for, as if dask.py had them."""
    src = "from .strategies.base import _pinned\nfrom . import api\napi._x\nfrom .testing import FakeBackend\n"
    found = _underscore_reaches(ROOT / "cupy_memstrat" / "dask.py", text=src)
    assert [f.split(": ", 1)[1] for f in found] == ["from cupy_memstrat.strategies.base import _pinned", "api._x"]


def _private_names(paths, classes_only=True) -> set[str]:
    """Underscore names the files define: methods and ``self._x`` attributes of their classes
    (and, with ``classes_only=False``, module-level names and functions too)."""
    names = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        scopes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + ([] if classes_only else [tree])
        for scope in scopes:
            for n in ast.walk(scope):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                        not classes_only and isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)):
                    name = n.name if hasattr(n, "name") else n.id
                elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                      and n.value.id == "self"):
                    name = n.attr
                else:
                    continue
                if name.startswith("_") and not name.startswith("__"):
                    names.add(name)
    return names


STRATEGY_FILES = [p for p in FILES if p.parent.name in ("strategies", "checks")]
#: names private to the strategies (and the checking layer over them), less those the backends also
#: define (tests may look into the simulated GPU: ``fake._pool(handle)``, ``backends._backend``)
STRATEGY_PRIVATE = _private_names(STRATEGY_FILES) - _private_names(
    [p for p in FILES if "backends" in p.parts], classes_only=False)


def _private_reads(path, text=None) -> list[str]:
    """``x._name`` in a test file where ``_name`` is private to the strategies (a name the test
    file's own classes define, as a strategy it writes, is its own)."""
    tree = ast.parse(path.read_text() if text is None else text)
    own = _private_names([path]) if text is None else set()
    return [f"{path.relative_to(ROOT)}:{n.lineno}: .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in STRATEGY_PRIVATE and n.attr not in own]


def test_no_test_reads_a_private_attribute_of_a_strategy():
    """Tests use the strategies' public surfaces and those of their parts (accounts, deferred,
    recovery, direct_route, ...), so that a strategy's inside can change without them."""
    found = [f for p in sorted((ROOT / "tests").rglob("*.py")) for f in _private_reads(p)]
    assert found == [], "\n".join(found)


def test_the_private_read_check_sees_one():
    """The control: a test reading a strategy's hot path through its private name is found."""
    assert {"_hot_path", "_settle", "_give_back_pending"} <= STRATEGY_PRIVATE
    found = _private_reads(ROOT / "tests" / "test_api.py", text="malloc = s._hot_path()[0]\n")
    assert [f.split(": ", 1)[1] for f in found] == ["._hot_path"]


def _package(path) -> str:
    return ".".join(path.relative_to(ROOT).parts[:-1])


#: underscore names of classes -> the (sub)packages whose classes define them
_CLASS_PRIVATE: dict[str, set[str]] = {}
for _p in FILES:
    for _name in _private_names([_p]):
        _CLASS_PRIVATE.setdefault(_name, set()).add(_package(_p))


def _foreign_private_calls(path, text=None) -> list[str]:
    """``x._name`` (x not self or cls) in a module where ``_name`` is private to the classes of
    other (sub)packages only: one part of the library using another's inside."""
    tree, me = ast.parse(path.read_text() if text is None else text), _package(path)
    return [f"{path.relative_to(ROOT)}:{n.lineno}: .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in _CLASS_PRIVATE and me not in _CLASS_PRIVATE[n.attr]
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


def test_no_module_uses_the_private_methods_of_another_packages_classes():
    found = [f for p in FILES for f in _foreign_private_calls(p)]
    assert found == [], "\n".join(found)


def test_the_foreign_private_check_sees_one():
    """The control: the public API calling a strategy's private method is found."""
    found = _foreign_private_calls(ROOT / "cupy_memstrat" / "api.py", text="s._settle()\n")
    assert [f.split(": ", 1)[1] for f in found] == ["._settle"]


def test_the_linter_passes():
    """ruff with pyproject.toml's [tool.ruff] rules, over the project's own folders and files
    (a user's scratch script at the top of a checkout is not the project's)."""
    pytest.importorskip("ruff", reason="ruff is not installed (the test extra has it)")
    paths = [str(ROOT / p) for p in ("cupy_memstrat", "pytest_gpumem", "tests", "ci", "tools", "setup.py")
             if (ROOT / p).exists()]
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", *paths], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_documentation_site_builds_without_a_warning(tmp_path):
    """docs/ as a Sphinx site (MyST pages, the API reference from the docstrings), warnings as
    errors: a broken link, a skipped heading level or a malformed docstring fails it."""
    for module in ("sphinx", "myst_parser"):
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[docs]')")
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "record_reserved" in (tmp_path / "html" / "api.html").read_text()
    assert (tmp_path / "html" / "index.html").exists()


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists the packages a wheel carries; a package folder missing from the list
    imports here (the source tree) and fails on a user's machine."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {str(p.parent.relative_to(ROOT)).replace("/", ".")
               for top in ("cupy_memstrat", "pytest_gpumem") for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
