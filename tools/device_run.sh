#!/usr/bin/env bash
# Device calls: run from the repository root on the GPU machine; carry .cupy_tests
# (and .whl for RMM). Everything lands in $OUT (at most 8 files come back).
#
#   tools/device_run.sh main              install, info, tests (all), bench alloc, bench async,
#                                         compute-sanitizer out-of-bounds demo
#   tools/device_run.sh managed           install, info, tests (all), bench managed
#   tools/device_run.sh plugin            the plugin's cost on CuPy's subset (creation + manipulation,
#                                         -n 8): a warm-up run, then plain / --gpumem + budget + leaks=fail /
#                                         the same + --gpumem-faults, interleaved twice; then one run with
#                                         --gpumem --gpumem-leaks=warn --gpumem-json
#   tools/device_run.sh cupy S1 S2 ...    CuPy's v14.2.0 test subset once per allocator, in this
#                                         order ("default" = CuPy's pool, else a strategy spec),
#                                         then each strategy compared with the last "default" run
set -u
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-main}; shift || true
LOG="$OUT/run_$part.log"
exec > >(tee -a "$LOG") 2>&1
step() { echo; echo "=== $* ($(date -u +%T))"; }

step install
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv

if [ "$part" = main ]; then
  step info
  python3 -m cupy_memstrat info
  python3 -m cupy_memstrat info --json > "$OUT/info.json"

  step tests
  python3 -m pytest tests -v -p no:cacheprovider --junitxml="$OUT/tests.xml"

  step bench alloc
  python3 -m cupy_memstrat bench alloc --json "$OUT/bench_alloc.json"

  step bench async
  python3 -m cupy_memstrat bench async --json "$OUT/bench_async.json"

  step compute-sanitizer out-of-bounds demo
  for s in cupy-default device; do
    timeout 180 compute-sanitizer --tool memcheck --print-limit 2 python3 tools/oob_demo.py $s 2>&1 | grep -E "ERROR SUMMARY|Invalid __global__ write|kernel ran"
  done
fi

if [ "$part" = managed ]; then
  step info
  python3 -m cupy_memstrat info
  python3 -m cupy_memstrat info --json > "$OUT/info.json"

  step tests
  python3 -m pytest tests -v -p no:cacheprovider -rs --junitxml="$OUT/tests.xml"

  step bench managed
  python3 -m cupy_memstrat bench managed --json "$OUT/bench_managed.json"
fi

if [ "$part" = plugin ] && [ -d .cupy_tests/tests ]; then
  R=/tmp/plugin_runs; mkdir -p $R
  CM="tests/cupy_tests/creation_tests tests/cupy_tests/manipulation_tests"
  declare -A OPTS=(
    [plain]=""
    [measure]="--gpumem --gpumem-budget=64GiB --gpumem-leaks=fail"
    [faults]="--gpumem --gpumem-budget=64GiB --gpumem-leaks=fail --gpumem-faults"
  )
  run_cm() {  # tag, options...
    local tag=$1; shift
    local t0=$(date +%s.%N)
    ( cd .cupy_tests && timeout 300 python3 -m pytest $CM -n 8 -q -p no:cacheprovider --timeout=120 \
        --timeout-method=thread "$@" --junitxml=$R/$tag.xml > $R/$tag.log 2>&1; echo "exit $?" >> $R/$tag.log )
    local t1=$(date +%s.%N)
    python3 -c "import json, sys; print(json.dumps({'run': sys.argv[1], 'seconds': round(float(sys.argv[3]) - float(sys.argv[2]), 2)}))" \
      "$tag" $t0 $t1 >> $R/times.jsonl
    echo "$tag: $(tail -2 $R/$tag.log | head -1) ($(tail -1 $R/times.jsonl))"
  }
  step "warm-up (compiles the kernels)"
  run_cm warmup
  for round in 1 2; do
    for mode in plain measure faults; do
      step "round $round: $mode"
      run_cm "${mode}_$round" ${OPTS[$mode]}
    done
  done
  step "report run: --gpumem --gpumem-leaks=warn --gpumem-json"
  run_cm report --gpumem --gpumem-leaks=warn --gpumem-top=15 --gpumem-json=$R/gpumem.json
  grep -A25 -i "gpumem" $R/report.log | tail -40
  cp $R/gpumem.json "$OUT/cupy_gpumem.json" 2>/dev/null
  cp $R/times.jsonl "$OUT/plugin_times.jsonl"
  tar -czf "$OUT/plugin_runs.tar.gz" -C /tmp plugin_runs
fi

if [ "$part" = cupy ] && [ -d .cupy_tests/tests ]; then
  # creation + manipulation with 8 workers; cuda_tests/test_memory.py alone, serially:
  # its TestMemoryAsyncPool tests each take 70% of the GPU, so with 8 workers their
  # outcome (and that of whatever runs beside them) depends on timing, not on the allocator.
  R=/tmp/cupy_runs; mkdir -p $R
  i=0; runs=()
  for s in "$@"; do
    i=$((i + 1)); tag="$i-${s%%:*}"; runs+=("$tag")
    extra=""; [ "$s" != default ] && extra="--gpumem-strategy=$s"
    step "CuPy v14.2.0 subset, run $tag ($s)"
    t0=$(date +%s.%N)
    ( cd .cupy_tests && timeout 300 python3 -m pytest tests/cupy_tests/creation_tests tests/cupy_tests/manipulation_tests \
        -n 8 -q -p no:cacheprovider --timeout=120 --timeout-method=thread $extra \
        --junitxml=$R/cm_$tag.xml > $R/cm_$tag.log 2>&1; echo "exit $?" >> $R/cm_$tag.log )
    t1=$(date +%s.%N)
    ( cd .cupy_tests && timeout 200 python3 -m pytest tests/cupy_tests/cuda_tests/test_memory.py \
        -q -p no:cacheprovider --timeout=120 --timeout-method=thread $extra \
        --junitxml=$R/mem_$tag.xml > $R/mem_$tag.log 2>&1; echo "exit $?" >> $R/mem_$tag.log )
    t2=$(date +%s.%N)
    python3 -c "import json, sys; t0, t1, t2 = map(float, sys.argv[3:]); print(json.dumps({'run': sys.argv[1], 'allocator': sys.argv[2], 'cm_seconds': round(t1 - t0, 2), 'mem_seconds': round(t2 - t1, 2)}))" \
      "$tag" "$s" $t0 $t1 $t2 > $R/time_$tag.json
    tail -2 $R/cm_$tag.log; tail -2 $R/mem_$tag.log; cat $R/time_$tag.json
  done
  base=""
  for tag in "${runs[@]}"; do [ "${tag#*-}" = default ] && base=$tag; done
  for tag in "${runs[@]}"; do
    [ "$tag" = "$base" ] && continue
    for part2 in cm mem; do
      python3 tools/compare_junit.py $R/${part2}_$base.xml $R/${part2}_$tag.xml --json $R/compare_${part2}_$tag.json
    done
  done
  python3 - "$R" "$base" "${runs[@]}" > "$OUT/cupy_compare.json" <<'EOF'
import glob, json, sys
r, base, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
out = {"baseline": base, "times": [json.load(open(f"{r}/time_{t}.json")) for t in runs], "compare": {}}
for f in sorted(glob.glob(f"{r}/compare_*.json")):
    out["compare"][f.rsplit("/", 1)[1][8:-5]] = json.load(open(f))
print(json.dumps(out, indent=2))
EOF
  tar -czf "$OUT/cupy_runs.tar.gz" -C /tmp cupy_runs
fi
step done
