"""Sphinx configuration of the cupy-memstrat documentation.

Build (the pages are MyST Markdown; warnings are errors):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Needs the docs extra (``pip install -e ".[docs]"``: Sphinx and myst-parser). The build reaches
no network: no intersphinx, and the theme is Sphinx's built-in alabaster.
"""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# autodoc imports the packages from this checkout, installed or not
sys.path.insert(0, str(ROOT))

project = "cupy-memstrat"
author = "the cupy-memstrat authors"
copyright = "the cupy-memstrat authors (MIT license)"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# docs/results/ holds benchmark JSON and figures that benchmarks.md renders; none is a page
exclude_patterns = ["_build", "results", "results/**", "**/.ipynb_checkpoints"]

# `page.md#a-heading` links: MyST makes anchors for headings down to ###
myst_heading_anchors = 3

# The integrations import their library (cupy_memstrat.dask: distributed; cupy_memstrat.numba:
# numba-cuda; pytest_gpumem: pytest), which the docs extra does not install: where one is missing,
# autodoc imports the module against a stand-in. Where it is installed (the test extra), the real
# one is used.
autodoc_mock_imports = [m for m in ("distributed", "dask", "numba", "pytest") if importlib.util.find_spec(m) is None]

# Google-style docstrings
napoleon_google_docstring = True
napoleon_numpy_docstring = False

autodoc_default_options = {"members": True, "show-inheritance": True}
# the project's own docstrings only: a method that overrides another library's without a docstring of
# its own (MemstratPlugin.transition, of distributed.WorkerPlugin) would show that library's text,
# whose cross-references point into its own documentation; undocumented, it is left out
autodoc_inherit_docstrings = False
autodoc_member_order = "bysource"
# signatures as written, not expanded type aliases
autodoc_typehints = "signature"

html_theme = "alabaster"
html_title = "cupy-memstrat"
html_theme_options = {"description": "GPU memory strategies for CuPy, and GPU memory in pytest"}
