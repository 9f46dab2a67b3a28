#!/usr/bin/env bash
# One full device call: install, machine info, tests/gpu, bench alloc, CuPy's own
# test subset under CuPy's default pool and under the device strategy, and the
# compute-sanitizer out-of-bounds demo. Everything lands in $OUT (at most 8 files).
#   run from the repository root on the GPU machine; carry .cupy_tests (and .whl for RMM)
set -u
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
exec > >(tee -a "$LOG") 2>&1
step() { echo; echo "=== $* ($(date -u +%T))"; }

step install
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv

step info
python3 -m cupy_memstrat info
python3 -m cupy_memstrat info --json > "$OUT/info.json"

step tests
python3 -m pytest tests -v -p no:cacheprovider --junitxml="$OUT/tests.xml"

step bench alloc
python3 -m cupy_memstrat bench alloc --json "$OUT/bench_alloc.json"

step compute-sanitizer out-of-bounds demo
for s in cupy-default device; do
  timeout 180 compute-sanitizer --tool memcheck --print-limit 2 python3 tools/oob_demo.py $s 2>&1 | grep -E "ERROR SUMMARY|Invalid __global__ write|kernel ran" 
done

if [ -d .cupy_tests/tests ]; then
  # creation + manipulation with 8 workers; cuda_tests/test_memory.py alone, serially:
  # its TestMemoryAsyncPool tests each take 70% of the GPU, so with 8 workers their
  # outcome (and that of whatever runs beside them) depends on timing, not on the allocator.
  step "CuPy v14.2.0 test subset: default pool, then device"
  mkdir -p /tmp/cupy_runs
  for s in default device; do
    extra=""; [ $s = device ] && extra="--gpumem-strategy=device"
    ( cd .cupy_tests && timeout 400 python3 -m pytest tests/cupy_tests/creation_tests tests/cupy_tests/manipulation_tests \
        -n 8 -q -p no:cacheprovider --timeout=120 --timeout-method=thread $extra \
        --junitxml=/tmp/cupy_runs/cm_$s.xml > /tmp/cupy_runs/cm_$s.log 2>&1; echo "exit $?" >> /tmp/cupy_runs/cm_$s.log )
    tail -2 /tmp/cupy_runs/cm_$s.log
    ( cd .cupy_tests && timeout 200 python3 -m pytest tests/cupy_tests/cuda_tests/test_memory.py \
        -q -p no:cacheprovider --timeout=120 --timeout-method=thread $extra \
        --junitxml=/tmp/cupy_runs/mem_$s.xml > /tmp/cupy_runs/mem_$s.log 2>&1; echo "exit $?" >> /tmp/cupy_runs/mem_$s.log )
    tail -2 /tmp/cupy_runs/mem_$s.log
  done
  python3 tools/compare_junit.py /tmp/cupy_runs/cm_default.xml /tmp/cupy_runs/cm_device.xml --json /tmp/cupy_runs/compare_cm.json
  python3 tools/compare_junit.py /tmp/cupy_runs/mem_default.xml /tmp/cupy_runs/mem_device.xml --json /tmp/cupy_runs/compare_mem.json
  python3 -c "import json; json.dump({k: json.load(open(f'/tmp/cupy_runs/compare_{k}.json')) for k in ('cm', 'mem')}, open('$OUT/cupy_compare.json', 'w'), indent=2)"
  tar -czf "$OUT/cupy_runs.tar.gz" -C /tmp cupy_runs
fi
step done
