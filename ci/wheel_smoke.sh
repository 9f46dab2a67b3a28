#!/usr/bin/env bash
# Build the sdist and the wheel (python -m build: the wheel is built from the sdist, so a file the
# sdist lacks fails here), install the wheel into a fresh virtual environment and smoke-test it
# without a GPU: the import, the C hot path, the CUDA sources, `info` on the simulated GPU, and a
# pytest session with the plugin. Run by .ci/run; needs network access to PyPI for the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PY" -m pip install -q build
"$PY" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
echo "built $(basename "$wheel") and $(basename "$(ls "$work"/dist/*.tar.gz)")"

"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel[cuda13]" "pytest>=8"
cd "$work"  # away from the source tree: the installed wheel is what gets imported
"$work/venv/bin/python" - <<'PY'
import importlib.resources, cupy_memstrat, cupy_memstrat._hotpath
src = importlib.resources.files("cupy_memstrat.csrc")
assert (src / "checks.cu").is_file(), "the wheel lacks csrc/checks.cu"
assert "site-packages" in cupy_memstrat.__file__, cupy_memstrat.__file__
print("import ok:", cupy_memstrat.__version__, "C hot path and CUDA sources present")
PY
CUPY_MEMSTRAT_BACKEND=fake "$work/venv/bin/python" -m cupy_memstrat info | grep "allocation hot path: c"
cat >"$work/test_smoke.py" <<'PY'
import cupy, pytest

@pytest.mark.limit_gpu_memory("1MiB")
def test_over_budget():
    cupy.empty(2 << 20, dtype=cupy.uint8)

def test_fits():
    cupy.empty(1000, dtype=cupy.uint8)
PY
set +e
CUPY_MEMSTRAT_BACKEND=fake "$work/venv/bin/python" -m pytest -q -p no:cacheprovider --gpumem test_smoke.py \
  >"$work/pytest.log" 2>&1
rc=$?
set -e
if [ "$rc" -ne 1 ] || ! grep -q "1 failed, 1 passed" "$work/pytest.log" || ! grep -q "peak 2.0 MiB > budget 1.0 MiB" "$work/pytest.log"; then
  cat "$work/pytest.log"
  echo "wheel smoke test: the plugin did not fail the test over budget as expected (exit $rc)" >&2
  exit 1
fi
echo "wheel smoke test passed: the plugin failed the test over its budget and passed the other"
