#!/usr/bin/env bash
# The API reference, generated from the docstrings with pdoc (pip install -e ".[docs]"):
#   tools/api_docs.sh [FOLDER]     (default docs/api; open FOLDER/index.html)
# docs/api is not committed (docs/development.md says why): build it when you want to read it.
# Written into a temporary folder first: FOLDER is replaced only when pdoc succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/api}
if ! python -c "import pdoc" 2>/dev/null; then
  echo "api_docs: pdoc is not installed for $(command -v python) (pip install -e \".[docs]\"); $out left as it is" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the package, and the modules the guides send you to that the package does not import
mods="cupy_memstrat cupy_memstrat.testing cupy_memstrat.options cupy_memstrat.registry pytest_gpumem"
python -c "import cupy_memstrat.dask" 2>/dev/null && mods="$mods cupy_memstrat.dask"  # needs the dask extra
python -m pdoc --no-search --no-show-source -o "$tmp/api" $mods
rm -rf "$out"
mkdir -p "$(dirname "$out")"
mv "$tmp/api" "$out"
echo "wrote $out/ (open $out/index.html)"
