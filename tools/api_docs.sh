#!/usr/bin/env bash
# The API reference in docs/api/, generated from the docstrings with pdoc
# (pip install -e ".[docs]"). Run it after changing a public docstring, and commit the result.
# Written into a temporary folder first: docs/api is replaced only when pdoc succeeded
# (a missing pdoc once left the repository without its reference).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import pdoc" 2>/dev/null; then
  echo "api_docs: pdoc is not installed for $(command -v python) (pip install -e \".[docs]\"); docs/api left as it is" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m pdoc --no-search --no-show-source -o "$tmp/api" cupy_memstrat
rm -rf docs/api
mv "$tmp/api" docs/api
echo "wrote docs/api/ (open docs/api/index.html)"
