"""The structure docs/development.md draws, kept by tests: the linter's rules, no module
reaching into another's underscore names, the CUDA seam importing nothing of the fake,
files of a readable size, and the documentation site building without a warning."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("cupy_memstrat", "pytest_gpumem")
FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))

#: files over MAX_LINES, each one coherent thing (docs/development.md, "The map")
MAX_LINES = 500
COHERENT = {
    "cupy_memstrat/strategies/managed.py": "ManagedStrategy: chunks, arenas, advice and prefetch policies, "
                                           "its hot path",
    "cupy_memstrat/strategies/async_pool.py": "AsyncPoolStrategy: the stream-ordered pool, its caches per stream, "
                                              "its hot path",
    "cupy_memstrat/api.py": "the public functions (use, using, create, stats, ...), each a few lines over a strategy",
    "cupy_memstrat/cuda.py": "RealBackend, the one class that calls CUDA, and get_backend",
    "cupy_memstrat/cli.py": "the command line: one parser and one small function per subcommand",
    "cupy_memstrat/dask.py": "the Dask worker plugin, its gathering functions and its --preload module",
    "cupy_memstrat/numba.py": "Numba's external memory manager over a strategy",
    "cupy_memstrat/bench/workloads.py": "the benchmark's workload programs and their A/A-controlled runner",
    "pytest_gpumem/plugin.py": "the plugin's pytest hooks and fixtures, each a few lines over the session's state",
    "pytest_gpumem/limits.py": "the limits a test is judged by: one unit each (marker, parse, verdict)",
}


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


def test_no_module_reaches_into_another_packages_underscore_names():
    found = [f for p in FILES for f in _underscore_reaches(p)]
    assert found == [], "\n".join(found)


def test_the_checker_sees_an_underscore_import():
    """The control: the check above finds both shapes it looks for, as if dask.py had them."""
    src = "from .strategies.base import _pinned\nfrom . import api\napi._x\nfrom .testing import FakeBackend\n"
    found = _underscore_reaches(ROOT / "cupy_memstrat" / "dask.py", text=src)
    assert [f.split(": ", 1)[1] for f in found] == ["from cupy_memstrat.strategies.base import _pinned", "api._x"]


def test_the_cuda_seam_imports_nothing_of_the_fake():
    tree = ast.parse((ROOT / "cupy_memstrat" / "cuda.py").read_text())
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [n for n in names if "testing" in n]


def test_files_are_of_a_readable_size_or_one_coherent_thing():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in FILES}
    over = sorted(f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_LINES and name not in COHERENT)
    assert over == [], "split these, or name them in COHERENT with what makes each one thing"
    stale = sorted(name for name in COHERENT if sizes.get(name, 0) <= MAX_LINES)
    assert stale == [], "no longer over the limit: take them out of COHERENT"


def test_the_linter_passes():
    """ruff with pyproject.toml's [tool.ruff] rules, over the whole tree."""
    pytest.importorskip("ruff", reason="ruff is not installed (the test extra has it)")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(ROOT)], cwd=ROOT,
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
