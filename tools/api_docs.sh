#!/usr/bin/env bash
# The API reference in docs/api/, generated from the docstrings with pdoc
# (pip install -e ".[docs]"). Run it after changing a public docstring, and commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf docs/api
python -m pdoc --no-search --no-show-source -o docs/api cupy_memstrat
echo "wrote docs/api/ (open docs/api/index.html)"
