#!/usr/bin/env bash
# The project's GPU run: install the working tree, then run tests/gpu and/or the benchmarks on the
# machine's GPU, writing logs and JSON under $OUT (default ./gpu-out).
#
#   ci/gpu.sh [tests] [bench [GROUP...]] [replays] [cupy-suite [STRATEGY...]] [dask]
#                                            tests and bench when no step is named
#
#   tests        tests/gpu
#   bench        python -m cupy_memstrat bench: every group, or the GROUPs named
#   replays      two real programs recorded and replayed under CuPy's pools and every strategy
#                (python -m cupy_memstrat replay): bench workloads' cg-poisson, recorded with run --record,
#                and a module of CuPy's own tests under the plugin (--gpumem-history-keep=all; needs
#                CUPY_TESTS, as cupy-suite), the latter also under --limit REPLAY_LIMIT (default 4.5GiB)
#   cupy-suite   CuPy's own tests (creation, manipulation, cuda_tests/test_memory.py) under CuPy's pool,
#                then under each STRATEGY (default: device async managed pool), compared test by test
#                (tools/compare_junit.py); needs CUPY_TESTS, a copy of the tests/ folder of the CuPy
#                release that is installed
#   dask         ci/dask_gpu.py: cupy_memstrat.dask on dask-cuda's LocalCUDACluster (needs dask,
#                distributed and dask-cuda)
#
# Environment:
#   OUT             where the logs and results go (made if missing)
#   TESTS_TIMEOUT   seconds for tests/gpu, both passes (default 400); a run cut short keeps every test's line (-v)
#   BENCH_TIMEOUT   seconds for the benchmarks (default 420)
#   PYTEST_ARGS     extra arguments for pytest (e.g. "-n 4", "-k checks")
#   TESTS           the test files or folders the tests step runs (default tests/gpu)
#   CUPY_TESTS      for cupy-suite: the folder that holds CuPy's tests/ (e.g. a clone of CuPy at its tag)
#
# What comes back:
#   info.txt        python -m cupy_memstrat info: GPU, driver, CUDA, packages
#   tests-gpu.log   pytest -v of tests/gpu: the tests in parallel where PYTEST_ARGS says so, then those
#                   marked gpu_exclusive alone; tests-gpu.xml and tests-gpu-exclusive.xml (JUnit)
#   bench.log       the benchmarks' tables; bench.tgz their JSON and figures (bench-GROUP.json/.png)
#   cupy-suite.json each strategy's outcomes against CuPy's pool's (the format docs/results/*/cupy-suite-*.json
#                   keeps), cupy-suite.tgz the JUnit XML and logs
#   dask-gpu.json   the Dask run, and dask-task-peaks.png
#   replay-*.json   each replay's report, and replay-*.png reserved memory over the replay per path
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: some steps run from another folder
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
is_step() { case "$1" in tests|bench|replays|cupy-suite|dask) return 0 ;; *) return 1 ;; esac; }

if ! is_step "${steps[0]}"; then
  echo "ci/gpu.sh: unknown step '${steps[0]}'; expected tests, bench [GROUP...], replays, cupy-suite [STRATEGY...] or dask" >&2
  exit 2
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 2; }
"$PY" -m cupy_memstrat info >"$OUT/info.txt" 2>&1
head -20 "$OUT/info.txt"

cupy_suite() {  # STRATEGY...: CuPy's tests under CuPy's pool (a warm-up run, then the baseline), then each strategy
  if [ -z "${CUPY_TESTS:-}" ] || [ ! -d "$CUPY_TESTS/tests/cupy_tests" ]; then
    echo "ci/gpu.sh cupy-suite: set CUPY_TESTS to a folder holding CuPy's tests/ (tests/cupy_tests/...)" >&2
    return 1
  fi
  local R="$OUT/cupy-suite" here="$PWD" runs=() s tag t0 t1 t2
  mkdir -p "$R"
  for s in default default "$@"; do
    tag="${#runs[@]}-${s%%:*}"; runs+=("$tag")
    extra=(); [ "$s" != default ] && extra=(--gpumem-strategy="$s")
    echo "== CuPy's tests, run $tag"
    t0=$(date +%s.%N)
    # creation + manipulation over 8 workers; test_memory.py alone: its MemoryAsyncPool tests each
    # take most of the GPU, so beside other workers their outcome would depend on timing
    ( cd "$CUPY_TESTS" && timeout 300 "$PY" -m pytest tests/cupy_tests/creation_tests \
        tests/cupy_tests/manipulation_tests -n 8 -q -p no:cacheprovider "${extra[@]}" \
        --junitxml="$R/cm_$tag.xml" >"$R/cm_$tag.log" 2>&1 )
    t1=$(date +%s.%N)
    ( cd "$CUPY_TESTS" && timeout 200 "$PY" -m pytest tests/cupy_tests/cuda_tests/test_memory.py -q \
        -p no:cacheprovider "${extra[@]}" --junitxml="$R/mem_$tag.xml" >"$R/mem_$tag.log" 2>&1 )
    t2=$(date +%s.%N)
    printf '{"run": "%s", "allocator": "%s", "cm_seconds": %s, "mem_seconds": %s}\n' "$tag" "$s" \
      "$(awk "BEGIN{print $t1 - $t0}")" "$(awk "BEGIN{print $t2 - $t1}")" >"$R/time_$tag.json"
    tail -1 "$R/cm_$tag.log"; tail -1 "$R/mem_$tag.log"
  done
  local base="${runs[1]}" rc=0
  for tag in "${runs[@]:2}"; do
    for part in cm mem; do
      "$PY" "$here/tools/compare_junit.py" "$R/${part}_$base.xml" "$R/${part}_$tag.xml" \
        --json "$R/compare_${part}_$tag.json" >/dev/null || rc=1
    done
  done
  "$PY" - "$R" "$base" "${runs[@]}" >"$OUT/cupy-suite.json" <<'PY'
import glob, json, sys
from cupy_memstrat.info import collect
r, base, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
out = {"what": "CuPy's tests under CuPy's pool (a warm-up run, then the baseline) and each strategy",
       "machine": collect(), "baseline": base,
       "times": [json.load(open(f"{r}/time_{t}.json")) for t in runs], "compare": {}}
for f in sorted(glob.glob(f"{r}/compare_*.json")):
    out["compare"][f.rsplit("/", 1)[1][len("compare_"):-len(".json")]] = json.load(open(f))
print(json.dumps(out, indent=1))
PY
  tar -czf "$OUT/cupy-suite.tgz" -C "$OUT" cupy-suite && rm -rf "$R"
  echo "cupy-suite: outcomes $([ $rc -eq 0 ] && echo 'the same as under CuPy'"'"'s pool' || echo 'DIFFER, see cupy-suite.json')"
  return $rc
}

status=0
i=0
while [ $i -lt ${#steps[@]} ]; do
  step=${steps[$i]}
  i=$((i + 1))
  case "$step" in
    tests)
      # two passes: the tests that read or fill the whole device's free memory (marker
      # gpu_exclusive) alone, after the others, which PYTEST_ARGS may spread over workers (-n 4)
      echo "== ${TESTS:-tests/gpu}"
      t0=$(date +%s)
      # shellcheck disable=SC2086
      timeout "${TESTS_TIMEOUT:-400}" "$PY" -m pytest ${TESTS:-tests/gpu} -v -p no:cacheprovider -rs \
        -m "not gpu_exclusive" --junitxml="$OUT/tests-gpu.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests-gpu.log" | tail -40
      rc=${PIPESTATUS[0]}
      [ "$rc" -eq 5 ] && rc=0  # none selected (TESTS named files without such tests)
      left=$(( ${TESTS_TIMEOUT:-400} - ($(date +%s) - t0) ))
      [ "$left" -lt 30 ] && left=30
      echo "== ${TESTS:-tests/gpu}, the gpu_exclusive tests alone"
      # shellcheck disable=SC2086
      timeout "$left" "$PY" -m pytest ${TESTS:-tests/gpu} -v -p no:cacheprovider -rs -m gpu_exclusive \
        --junitxml="$OUT/tests-gpu-exclusive.xml" 2>&1 | tee -a "$OUT/tests-gpu.log" | tail -20
      rc2=${PIPESTATUS[0]}
      [ "$rc2" -eq 5 ] && rc2=0
      echo "tests/gpu exit status $rc (then $rc2 for the gpu_exclusive tests)"
      [ "$rc" -ne 0 ] || [ "$rc2" -ne 0 ] && status=1
      ;;
    bench)
      groups=()
      while [ $i -lt ${#steps[@]} ] && ! is_step "${steps[$i]}"; do groups+=("${steps[$i]}"); i=$((i + 1)); done
      echo "== bench ${groups[*]:-(every group)}"
      mkdir -p "$OUT/bench"
      if [ ${#groups[@]} -eq 0 ]; then
        timeout "${BENCH_TIMEOUT:-420}" "$PY" -m cupy_memstrat bench --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -60
        rc=${PIPESTATUS[0]}
      else
        rc=0
        for g in "${groups[@]}"; do
          timeout "${BENCH_TIMEOUT:-420}" "$PY" -m cupy_memstrat bench "$g" --json "$OUT/bench/bench-$g.json" 2>&1 | tee -a "$OUT/bench.log" | tail -40
          [ "${PIPESTATUS[0]}" -ne 0 ] && rc=1
        done
      fi
      echo "bench exit status $rc"
      [ "$rc" -ne 0 ] && status=1
      tar -czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
      ;;
    cupy-suite)
      strategies=()
      while [ $i -lt ${#steps[@]} ] && ! is_step "${steps[$i]}"; do strategies+=("${steps[$i]}"); i=$((i + 1)); done
      [ ${#strategies[@]} -eq 0 ] && strategies=(device async managed pool)
      cupy_suite "${strategies[@]}" || status=1
      ;;
    replays)
      echo "== replays"
      mkdir -p "$OUT/recordings"
      timeout 200 "$PY" -m cupy_memstrat run -s pool --record "$OUT/recordings/cg-poisson.json" ci/workload.py cg-poisson \
        2>&1 | tail -3
      timeout 300 "$PY" -m cupy_memstrat replay "$OUT/recordings/cg-poisson.json" --json "$OUT/replay-cg-poisson.json" \
        --png "$OUT/replay-cg-poisson.png" 2>&1 | tee "$OUT/replay.log" | tail -12
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      if [ -n "${CUPY_TESTS:-}" ] && [ -d "$CUPY_TESTS/tests/cupy_tests" ]; then
        module=${REPLAY_CUPY_MODULE:-tests/cupy_tests/creation_tests/test_basic.py}
        ( cd "$CUPY_TESTS" && timeout 300 "$PY" -m pytest "$module" -q -p no:cacheprovider --gpumem \
            --gpumem-strategy=pool --gpumem-history --gpumem-history-keep=all \
            --gpumem-json="$OUT/recordings/cupy-tests.json" 2>&1 | tail -3 )
        timeout 300 "$PY" -m cupy_memstrat replay "$OUT/recordings/cupy-tests.json" --json "$OUT/replay-cupy-tests.json" \
          --png "$OUT/replay-cupy-tests.png" 2>&1 | tee -a "$OUT/replay.log" | tail -12
        [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
        # the same under a limit between the peak in use and CuPy's pool's peak reserved: which fit
        # (exit status 1 there means no path fits: a finding, not a failure of the step)
        timeout 300 "$PY" -m cupy_memstrat replay "$OUT/recordings/cupy-tests.json" --limit "${REPLAY_LIMIT:-4.5GiB}" \
          --json "$OUT/replay-cupy-tests-limit.json" --quiet 2>&1 | tee -a "$OUT/replay.log" | tail -12
        [ "${PIPESTATUS[0]}" -gt 1 ] && status=1
      else
        echo "replays: CUPY_TESTS not set: the CuPy test module is not recorded" >&2
      fi
      tar -czf "$OUT/recordings.tgz" -C "$OUT" recordings && rm -rf "$OUT/recordings"
      ;;
    dask)
      echo "== dask"
      timeout "${DASK_TIMEOUT:-300}" "$PY" ci/dask_gpu.py "$OUT" 2>&1 | tee "$OUT/dask.log" | tail -30
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      ;;
    *)
      echo "ci/gpu.sh: unknown step '$step'; expected tests, bench [GROUP...], replays, cupy-suite [STRATEGY...] or dask" >&2
      exit 2
      ;;
  esac
done
exit $status
