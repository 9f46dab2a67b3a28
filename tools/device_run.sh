#!/usr/bin/env bash
# Device calls: run from the repository root on the GPU machine; carry .cupy_tests
# (and .whl for RMM). Everything lands in $OUT (at most 8 files come back).
#
#   tools/device_run.sh main              install, info, tests (all), bench alloc, bench async,
#                                         compute-sanitizer out-of-bounds demo
#   tools/device_run.sh managed           install, info, tests (all), bench managed
#   tools/device_run.sh plugin            the plugin's cost on CuPy's subset (creation + manipulation,
#                                         -n 8): a warm-up run, then plain / --gpumem + budget + leaks=fail /
#                                         the same + --gpumem-faults, interleaved three times (order
#                                         rotated each round); then one run with
#                                         --gpumem --gpumem-leaks=warn --gpumem-json
#   tools/device_run.sh checks_smoke      tests/gpu/test_checks_gpu.py, then CuPy's subset once with --gpumem-check=all
#   tools/device_run.sh checks            info, tests/gpu, then CuPy's subset: a warm-up, then plain /
#                                         --gpumem --gpumem-budget=64GiB --gpumem-leaks=fail ("unchecked") /
#                                         + --gpumem-check=streams / + --gpumem-check=all, interleaved twice,
#                                         then a --gpumem-check=all run with --gpumem-json (its findings)
#   tools/device_run.sh final             tests/gpu, then CuPy's subset: warm-up, plain, unchecked, streams,
#                                         all (with --gpumem-json), then compute-sanitizer memcheck capped
#                                         at SAN_TIMEOUT seconds (default 240; the share of tests done is kept)
#   tools/device_run.sh sanitizer         CuPy's subset plain, then under compute-sanitizer --tool memcheck
#   tools/device_run.sh probes            info, toolchain, tests/gpu, then the probes in tools/probes: the
#                                         PythonFunctionAllocator floor, the GC-cleared PFA memory, CuPy's 3
#                                         multi-GPU copy tests under default / async / CuPy's MemoryAsyncPool,
#                                         and where the plugin's per-test time goes on CuPy's subset
#   tools/device_run.sh gpu               tests/gpu only
#   tools/device_run.sh hotpath           info, tests/gpu, the PythonFunctionAllocator floor probe (C and
#                                         Python hot paths), bench alloc, bench managed
#   tools/device_run.sh mainjob           info, tests/gpu, then the README's main job: python -m cupy_memstrat
#                                         bench --out (capped at BENCH_TIMEOUT s, default 420); its folder
#                                         comes back as mainjob.tgz (8 files at most come back)
#   tools/device_run.sh safety            info, a stream-handle reuse probe, tests/gpu, then bench streams,
#                                         bench managed and bench workloads (JSON into $OUT)
#   tools/device_run.sh hotpath2          the managed hot-path probe (tools/probes/managed_hot_path.py), bench managed
#   tools/device_run.sh hotpath3          info, tests/gpu, then bench async, alloc, managed, streams and
#                                         workloads (JSON into $OUT): the async C hot path (issue 18)
#   tools/device_run.sh final2            info, tests/gpu, bench streams, async, alloc and workloads, then
#                                         CuPy's subset under CuPy's pool and async (per-stream caches)
#   tools/device_run.sh reclaim           info, tests/gpu/test_streams_gpu.py and test_managed_gpu.py, then
#                                         tools/probes/managed_reclaim.py (JSON into $OUT): destroyed
#                                         streams' chunks under managed (issue 15)
#   tools/device_run.sh pending           info, tests/gpu (with GPUMEM_VIZ_OUT: PyTorch's viewer pages of
#                                         the managed export), then tools/probes/managed_reclaim.py and
#                                         tools/probes/origins_cost.py (JSON into $OUT): what the
#                                         destroyed-stream reclaim (issue 15) and issue 21 need on the GPU
#   tools/device_run.sh session           pending, plus tools/probes/async_multistream.py and bench streams,
#                                         managed and workloads; the JSON as session_json.tgz, the viewer
#                                         pages as viz.tgz
#   tools/device_run.sh call2             tools/probes/dead_stream_trace.py, tests/gpu, tools/probes/dask_gpu.py
#                                         (carry .whl: dask, distributed, dask-cuda), the reclaim probe, bench
#                                         streams and workloads; the JSON and figure as call2_json.tgz
#   tools/device_run.sh call3             tests/gpu, tools/probes/dask_gpu.py (n 24576, 9 rounds; carry .whl),
#                                         the reclaim probe, bench streams, workloads and managed (call3_json.tgz)
#   tools/device_run.sh call4             tools/probes/dask_gpu.py (carry .whl), then CuPy's subset under CuPy's
#                                         pool and managed (carry .cupy_tests)
#   tools/device_run.sh call5             tests/gpu, the managed hot-path probe, bench streams, workloads
#                                         (9 rounds), managed and alloc (call5_json.tgz)
#   tools/device_run.sh call6             (carry .whl) tests/gpu with the interop tests, bench alloc with
#                                         the rmm, torch and torch-bare rows (call6_json.tgz)
#   tools/device_run.sh call7             (carry .whl, .cupy_tests) the interop, Numba and plugin GPU tests,
#                                         then CuPy's subset under CuPy's pool, rmm and torch
#   tools/device_run.sh call8             (carry .whl) tests/gpu, the Numba allocation probe, bench alloc
#   tools/device_run.sh call9             tests/gpu (pool:route=direct's first GPU run), bench alloc
#                                         (pool-direct beside pool), bench streams; then run
#                                         "cupy default pool:route=direct" for CuPy's subset
#   tools/device_run.sh call10            tests/gpu, bench alloc, bench workloads --rounds 7 (call10_json.tgz)
#   tools/device_run.sh call11            (carry .cupy_tests) tests/gpu/test_hot_path_gpu.py, the pool_direct_cost
#                                         probe, bench managed (call11_json.tgz), then CuPy's subset
#                                         under CuPy's pool, pool and pool:route=wrap
#   tools/device_run.sh call12            tests/gpu, bench alloc and streams, tools/debugging_walkthrough.sh
#                                         (call12_json.tgz)
#   tools/device_run.sh call13            tests/gpu, bench alloc, bench workloads with its A/A control and
#                                         0.25 s samples (pooling strategies), the async cold probe
#                                         (call13_json.tgz)
#   tools/device_run.sh call14            bench alloc, async and managed in one run (issue 18), the
#                                         pool_direct_cost and hot_path_floor probes, then tests/gpu
#                                         (call14_json.tgz)
#   tools/device_run.sh call15            (carry .whl, .cupy_tests) tests/gpu, bench alloc, async and
#                                         managed in one run (CALL15_BENCHES=alloc: alloc alone), then
#                                         the plugin's cost on CuPy's subset (two rotated rounds of
#                                         plain and --gpumem; without .cupy_tests, none) (call15_json.tgz)
#   tools/device_run.sh call16            the C counts (no event lists): bench alloc, managed and async in
#                                         one run, the pool_direct_cost and hot_path_floor probes, bench
#                                         workloads (9 rounds, pooling strategies, A/A control), then
#                                         tests/gpu (call16_json.tgz)
#   tools/device_run.sh call17            (carry .whl) bench alloc, managed and async in one run, bench
#                                         workloads (9 rounds, pooling strategies, A/A control), managed-large
#                                         cold, then tests/gpu (call17_json.tgz)
#   tools/device_run.sh call18            (carry .cupy_tests) the pool_direct_cost, hot_path_floor and
#                                         torch_pluggable probes, then the plugin's cost on CuPy's subset: a warm-up, then
#                                         plain and --gpumem in three rotated rounds (call18_json.tgz)
#   tools/device_run.sh call19            the torch_pluggable probe alone, with each child's last step
#   tools/device_run.sh call21            (carry .whl) tests/gpu after the architecture refactor (call21_json.tgz)
#   tools/device_run.sh call22            (carry .before) bench alloc and managed, after and before the refactor,
#                                         alternating, two rounds (call22_json.tgz)
#   tools/device_run.sh call23            bench async and managed, tests/gpu of pool and torch (call23_json.tgz)
#   tools/device_run.sh call24            (carry .whl) tests/gpu (memory-viz exports in viz/), then bench alloc,
#                                         managed and async, after the last repeats were removed (call24_json.tgz)
#   tools/device_run.sh call25            (carry .whl) tests/gpu, bench alloc and managed, after the trials' fixes
#   tools/device_run.sh x2a               (two GPUs; carry .whl) tests/gpu in full (x2a_json.tgz)
#   tools/device_run.sh x2b               (two GPUs; carry .whl, .cupy_tests) tools/probes/cross_device_copy.py,
#                                         CuPy's multi-GPU copy tests under default, device, async, event,
#                                         managed and cupy-async, tools/probes/dask_gpu.py --devices 0,1
#                                         (x2b_json.tgz)
#   tools/device_run.sh call20            (carry .whl) tools/probes/dask_gpu_more.py: RMM's plugin in both
#                                         orders, dask cuda worker --preload, record_history + plot (call20_json.tgz)
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

# CuPy's v14.2.0 creation + manipulation tests, 8 workers
CM_ARGS="tests/cupy_tests/creation_tests tests/cupy_tests/manipulation_tests -n 8 -q -p no:cacheprovider --timeout=120 --timeout-method=thread"
run_subset() {  # results folder, tag, pytest options...: one timed run, appended to $R/times.jsonl
  local R=$1 tag=$2; shift 2
  local t0=$(date +%s.%N)
  ( cd .cupy_tests && timeout 300 python3 -m pytest $CM_ARGS "$@" --junitxml=$R/$tag.xml > $R/$tag.log 2>&1; echo "exit $?" >> $R/$tag.log )
  local t1=$(date +%s.%N)
  python3 -c "import json, sys; print(json.dumps({'run': sys.argv[1], 'seconds': round(float(sys.argv[3]) - float(sys.argv[2]), 2)}))" \
    "$tag" $t0 $t1 >> $R/times.jsonl
  echo "$tag: $(tail -2 $R/$tag.log | head -1) ($(tail -1 $R/times.jsonl))"
}

info_log() {  # FILTER...: cupy_memstrat info on the log, through FILTER (head -20, tail -6, ...)
  python3 -m cupy_memstrat info | "$@"
}
info_json() {  # info, as JSON into $OUT and its first lines on the log
  step info
  python3 -m cupy_memstrat info --json > "$OUT/info.json"
  info_log head -20
}
gpu_tests() {  # tests/gpu, every test's outcome on the log, JUnit XML into $OUT
  step tests/gpu
  python3 -m pytest tests/gpu -v -p no:cacheprovider -rs --junitxml="$OUT/tests_gpu.xml"
}
benches() {  # bench GROUP --json ${BENCH_DIR:-$OUT}/bench-GROUP.json, for each group given
  for g in "$@"; do
    step "bench $g"
    python3 -m cupy_memstrat bench $g --json "${BENCH_DIR:-$OUT}/bench-$g.json"
  done
}
quiet_gpu_tests() {  # LINES: tests/gpu quietly, JUnit XML into $OUT, the last LINES lines on the log
  step "tests/gpu"
  python3 -m pytest tests/gpu -p no:cacheprovider -q -rs --junitxml="$OUT/tests_gpu.xml" 2>&1 | tail -$1
}

# The callN parts: their JSON gathers in J=/tmp/callN_json and comes back as $OUT/callN_json.tgz
json_dir() {  # NAME: J=/tmp/NAME_json, made, with cupy_memstrat info --json in it
  J=/tmp/$1_json; mkdir -p $J
  python3 -m cupy_memstrat info --json > "$J/info.json"
}
pack_json() {  # $J as $OUT/NAME_json.tgz (again after each stage, so that a cut run keeps what it has)
  tar -czf "$OUT/${J##*/}.tgz" -C /tmp "${J##*/}"
}
timed_gpu_tests() {  # SECONDS: tests/gpu, every outcome on the log, JUnit XML into $J, capped at SECONDS
  step tests/gpu
  timeout $1 python3 -m pytest tests/gpu -v -p no:cacheprovider -rs --junitxml="$J/tests_gpu.xml"
}
reclaim_probe() {  # DIR [PREFIX...]: tools/probes/managed_reclaim.py (run behind PREFIX, e.g. timeout 120), JSON into DIR
  local dir=$1; shift
  step "probe: destroyed streams' chunks under managed"
  "$@" python3 tools/probes/managed_reclaim.py "$dir/managed-reclaim.json"
}
pool_direct_probe() {  # where pool's direct route spends its time, JSON into $J
  step "probe: where pool's direct route spends its time"
  python3 tools/probes/pool_direct_cost.py --json "$J/pool_direct_cost.json"
}
cost_probes() {  # where pool's direct route spends its time and the PythonFunctionAllocator floor, JSON into $J
  pool_direct_probe
  step "probe: the floor of an allocator behind a PythonFunctionAllocator"
  python3 tools/probes/hot_path_floor.py --json "$J/hot_path_floor.json" device managed pool
}
warm_workloads() {  # STRATEGIES: bench workloads, 9 rounds, the warm programs, into $J/bench-workloads.json
  step "bench workloads (warm programs, pooling strategies)"
  python3 -m cupy_memstrat bench workloads --rounds 9 --strategies "$1" \
    --only cg-poisson,fft-convolution,kmeans,monte-carlo,multi-stream --json "$J/bench-workloads.json"
}
cold_workloads() {  # STRATEGIES: bench workloads, 5 rounds of managed-large, into $J/bench-workloads-cold.json
  step "bench workloads managed-large (cold)"
  python3 -m cupy_memstrat bench workloads --rounds 5 --strategies "$1" --only managed-large \
    --json "$J/bench-workloads-cold.json"
}
plugin_rounds() {  # HOW-MANY MODE...: with .cupy_tests, the plugin's cost on CuPy's subset into R=$J/plugin:
  # a warm-up, then one run per MODE (plain, or measure: --gpumem with a budget and leaks=fail)
  local how=$1; shift
  if [ -d .cupy_tests/tests ]; then
    R=$J/plugin; mkdir -p $R
    step "plugin cost: warm-up, then plain and --gpumem in $how rotated rounds"
    run_subset $R warmup
    for mode in "$@"; do
      n=$(ls $R/${mode}_*.xml 2>/dev/null | wc -l)
      if [ $mode = plain ]; then run_subset $R plain_$((n + 1)); \
      else run_subset $R measure_$((n + 1)) --gpumem --gpumem-budget=64GiB --gpumem-leaks=fail; fi
    done
  fi
}
torch_probe() {  # PyTorch allocating through a strategy (tools/probes/torch_pluggable.py), JSON into $J
  step "probe: PyTorch allocating through a strategy (CUDAPluggableAllocator)"
  timeout 300 python3 tools/probes/torch_pluggable.py --json "$J/torch_pluggable.json"
}
dask_probe() {  # SECONDS OPTION...: tools/probes/dask_gpu.py into $J (carry .whl), capped at SECONDS
  local seconds=$1; shift
  step "probe: Dask on the GPU (LocalCUDACluster)"
  timeout "$seconds" python3 tools/probes/dask_gpu.py "$J" "$@"
}
managed_hot_path_probe() {  # DIR [PREFIX...]: tools/probes/managed_hot_path.py behind PREFIX, its JSON on the log + in DIR
  local dir=$1; shift
  step "probe: the managed hot path"
  "$@" python3 tools/probes/managed_hot_path.py | tee "$dir/managed_hot_path.json"
}
origins_probe() {  # DIR: what track_origins costs (tools/probes/origins_cost.py), JSON into DIR
  step "probe: what track_origins costs"
  python3 tools/probes/origins_cost.py "$1/origins-cost.json"
}
workloads_rounds() {  # ROUNDS: bench workloads (every program, its default strategies), ROUNDS rounds, into $J
  step "bench workloads --rounds $1"
  python3 -m cupy_memstrat bench workloads --rounds "$1" --json "$J/bench-workloads.json"
}

cupy_runs() {  # STRATEGY...: with .cupy_tests, CuPy's v14.2.0 subset once per allocator, in this order
  # ("default" = CuPy's pool, else a strategy spec), then each strategy compared with the last "default" run
  [ -d .cupy_tests/tests ] || return
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
        ${CUPY_EXTRA_TESTS:-} \
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
}

multigpu_copy_tests() {  # HOW...: with .cupy_tests, CuPy's three multi-GPU copy tests once per allocator: default
  # (CuPy's pool), cupy-async (CuPy's MemoryAsyncPool), event (async behind tools/probes/cross_device_order.py),
  # else a strategy spec; JUnit XML into $J when it is set
  [ -d .cupy_tests/tests ] || return
  local K="test_copy_multigpu or test_copyto_multigpu" how extra
  local F="tests/cupy_tests/creation_tests/test_from_data.py tests/cupy_tests/manipulation_tests/test_basic.py"
  for how in "$@"; do
    step "CuPy's multi-GPU copy tests: $how"
    case $how in
      default) extra="" ;;
      cupy-async) extra="-p cupy_async_alloc" ;;
      event) extra="-p cross_device_order" ;;
      *) extra="--gpumem-strategy=$how" ;;
    esac
    ( cd .cupy_tests && PYTHONPATH=$OLDPWD/tools/probes:${PYTHONPATH:-} timeout 200 python3 -m pytest $F -k "$K" -q \
        -p no:cacheprovider $extra ${J:+--junitxml=$J/multigpu_$how.xml} 2>&1 | tail -3 )
  done
}

# The steps of the parts below that run CuPy's subset ($R: its results folder)
rotated_rounds() {  # ORDER...: round N runs the modes of the Nth ORDER in turn, each with its options ${OPTS[MODE]}
  local round=0 order mode
  for order in "$@"; do
    round=$((round + 1))
    for mode in $order; do
      step "round $round: $mode"
      run_subset "$R" "${mode}_$round" ${OPTS[$mode]}
    done
  done
}
checks_start() {  # info as JSON into $OUT, tests/gpu (its last 25 lines), then $R made, M (the options of
  # "unchecked": --gpumem, a budget, leaks=fail) and the subset's warm-up under --gpumem
  step info
  python3 -m cupy_memstrat info --json > "$OUT/info.json"
  quiet_gpu_tests 25
  mkdir -p "$R"
  M="--gpumem --gpumem-budget=64GiB --gpumem-leaks=fail"
  step "warm-up (compiles the kernels)"
  run_subset "$R" warmup --gpumem
}
memcheck_subset() {  # SECONDS: the subset under compute-sanitizer memcheck, which follows the pytest-xdist
  # workers (--target-processes all), capped at SECONDS; its log in $R/memcheck.log, each process's in $R/memcheck.PID.log
  ( cd .cupy_tests && timeout $1 compute-sanitizer --tool memcheck --target-processes all \
      --print-limit 10 --log-file "$R/memcheck.%p.log" python3 -m pytest $CM_ARGS --timeout=400 > "$R/memcheck.log" 2>&1; \
      echo "exit $?" >> "$R/memcheck.log" )
}
runs_back() {  # NAME: $R/times.jsonl as $OUT/NAME_times.jsonl, /tmp/NAME_runs as $OUT/NAME_runs.tar.gz
  cp "$R/times.jsonl" "$OUT/$1_times.jsonl"
  tar -czf "$OUT/$1_runs.tar.gz" -C /tmp "$1_runs"
}
info_and_tests() {  # PYTEST-OPTION...: info on the log and as JSON into $OUT, then tests (all), JUnit XML into $OUT
  step info
  python3 -m cupy_memstrat info
  python3 -m cupy_memstrat info --json > "$OUT/info.json"

  step tests
  python3 -m pytest tests -v -p no:cacheprovider "$@" --junitxml="$OUT/tests.xml"
}

# The parts with steps of their own (the case below runs them)
part_mainjob() {
  step info
  python3 -m cupy_memstrat info
  step tests/gpu
  python3 -m pytest tests/gpu -v -p no:cacheprovider --junitxml="$OUT/tests_gpu.xml"
  step "bench (the main job)"
  t0=$(date +%s)
  timeout "${BENCH_TIMEOUT:-420}" python3 -m cupy_memstrat bench --out "$OUT/memstrat-bench"
  echo "bench exit $? after $(( $(date +%s) - t0 )) s"
  tar czf "$OUT/mainjob.tgz" -C "$OUT" memstrat-bench && rm -rf "$OUT/memstrat-bench"
}
part_main() {
  info_and_tests

  step bench alloc
  python3 -m cupy_memstrat bench alloc --json "$OUT/bench_alloc.json"

  step bench async
  python3 -m cupy_memstrat bench async --json "$OUT/bench_async.json"

  step compute-sanitizer out-of-bounds demo
  for s in cupy-default device; do
    timeout 180 compute-sanitizer --tool memcheck --print-limit 2 python3 tools/oob_demo.py $s 2>&1 | grep -E "ERROR SUMMARY|Invalid __global__ write|kernel ran"
  done
}
part_call22() {
  # issue 17: bench alloc and bench managed on the refactored tree and on the tree before it
  # (carry .before: git archive b582c60 cupy_memstrat csrc setup.py pyproject.toml), alternating,
  # so that the two are compared in one machine start
  json_dir call22
  inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  ext=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  gcc -shared -fPIC -O2 -I"$inc" .before/csrc/hotpath.c -o .before/cupy_memstrat/_hotpath$ext || exit 1
  # run from inside .before: python puts the current folder first on sys.path (call22's first try
  # ran PYTHONPATH=.before from the checkout, and so imported the refactored tree four times)
  before() { ( cd .before && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$@" ); }
  python3 -c 'import cupy_memstrat; print("after: ", cupy_memstrat.__file__, cupy_memstrat.hot_path_status())'
  before python3 -c 'import cupy_memstrat; print("before:", cupy_memstrat.__file__, cupy_memstrat.hot_path_status())'
  before python3 -c 'import cupy_memstrat, sys; sys.exit("/.before/" not in cupy_memstrat.__file__)' || exit 1
  python3 -c 'import cupy_memstrat, sys; sys.exit("/.before/" in cupy_memstrat.__file__)' || exit 1
  for round in 1 2; do
    for g in alloc managed; do
      for tree in after before; do
        [ $round = 2 ] && tree=$([ $tree = after ] && echo before || echo after)
        step "bench $g, $tree the refactor (round $round)"
        if [ $tree = after ]; then python3 -m cupy_memstrat bench $g --json "$J/bench-$g-after-$round.json"
        else before python3 -m cupy_memstrat bench $g --json "$J/bench-$g-before-$round.json"; fi
        pack_json
      done
    done
  done
}
part_managed() {
  info_and_tests -rs

  step bench managed
  python3 -m cupy_memstrat bench managed --json "$OUT/bench_managed.json"
}
part_plugin() {
  R=/tmp/plugin_runs; mkdir -p $R
  declare -A OPTS=(
    [plain]=""
    [measure]="--gpumem --gpumem-budget=64GiB --gpumem-leaks=fail"
    [faults]="--gpumem --gpumem-budget=64GiB --gpumem-leaks=fail --gpumem-faults"
  )
  step "warm-up (compiles the kernels)"
  run_subset $R warmup
  # three rounds, the order rotated each round so that drift in the machine does not favour one setting
  rotated_rounds "plain measure faults" "measure faults plain" "faults plain measure"
  step "report run: --gpumem --gpumem-leaks=warn --gpumem-json (and tools/probes/plugin_cost.py)"
  PLUGIN_COST_DIR=$R/plugin_cost PYTHONPATH=$PWD/tools/probes:${PYTHONPATH:-} \
    run_subset $R report --gpumem --gpumem-leaks=warn --gpumem-top=15 --gpumem-json=$R/gpumem.json -p plugin_cost
  python3 -c "import glob, json, sys; rows = [json.load(open(f)) for f in glob.glob(sys.argv[1] + '/*.json')]; \
print('Meter.open seconds per worker:', [round(r['timers'].get('Meter.open', {}).get('seconds', 0), 3) for r in rows])" $R/plugin_cost
  grep -A25 -i "gpumem" $R/report.log | tail -40
  cp $R/gpumem.json "$OUT/cupy_gpumem.json" 2>/dev/null
  runs_back plugin
}
part_checks_smoke() {
  step "tests/gpu/test_checks_gpu.py"
  python3 -m pytest tests/gpu/test_checks_gpu.py -v -p no:cacheprovider -rs --junitxml="$OUT/tests_checks.xml"
  if [ -d .cupy_tests/tests ]; then
    step "CuPy subset with --gpumem-check=all (findings listed in JSON)"
    ( cd .cupy_tests && timeout 300 python3 -m pytest $CM_ARGS --gpumem --gpumem-check=all --gpumem-top=5 \
        --gpumem-json=$OUT/cupy_checks.json > $OUT/cupy_checks.log 2>&1; echo "exit $?" >> $OUT/cupy_checks.log )
    tail -15 $OUT/cupy_checks.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=[(t['nodeid'],x['kind'],x['message'][:160]) for t in d['tests'] for x in t.get('findings') or []]; print(len(f),'findings'); [print(*x) for x in f[:30]]" $OUT/cupy_checks.json
  fi
}
part_checks() {
  R=/tmp/check_runs
  checks_start
  declare -A OPTS=(
    [plain]=""
    [unchecked]="$M"
    [streams]="$M --gpumem-check=streams"
    [all]="$M --gpumem-check=streams,poison,redzone"
  )
  rotated_rounds "plain unchecked streams all" "all streams unchecked plain"
  step "report run: --gpumem-check=all --gpumem-json"
  run_subset $R report --gpumem --gpumem-check=all --gpumem-top=5 --gpumem-json=$R/checks.json
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=[(t['nodeid'],x['kind']) for t in d['tests'] for x in t.get('findings') or []]; print(len(f),'findings'); [print(*x) for x in f[:30]]" $R/checks.json
  cp $R/checks.json "$OUT/cupy_checks.json"
  runs_back check
}
part_final() {
  # one call: tests/gpu, then CuPy's subset: a warm-up, plain / unchecked / streams / all (the last
  # one writing its findings as JSON), then compute-sanitizer memcheck for ${SAN_TIMEOUT:-240} s at most
  R=/tmp/final_runs
  checks_start
  for mode in plain unchecked streams all; do
    step "$mode"
    case $mode in
      plain) run_subset $R plain ;;
      unchecked) run_subset $R unchecked $M ;;
      streams) run_subset $R streams $M --gpumem-check=streams ;;
      all) run_subset $R all $M --gpumem-check=streams,poison,redzone --gpumem-top=5 --gpumem-json=$R/checks.json ;;
    esac
  done
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=[(t['nodeid'],x['kind'],x['message'][:200]) for t in d['tests'] for x in t.get('findings') or []]; print(len(f),'findings'); [print(*x) for x in f[:20]]" $R/checks.json
  step "compute-sanitizer --tool memcheck (at most ${SAN_TIMEOUT:-240} s)"
  compute-sanitizer --version | tail -1
  t0=$(date +%s.%N)
  memcheck_subset "${SAN_TIMEOUT:-240}"
  t1=$(date +%s.%N)
  tail -4 $R/memcheck.log
  grep -h "ERROR SUMMARY" $R/memcheck.*.log 2>/dev/null | sort | uniq -c | head
  python3 - $R/memcheck.log $t0 $t1 <<'PY' | tee -a $R/times.jsonl
import json, re, sys
text = open(sys.argv[1]).read()
done = sum(len(re.sub(r"[^.FEsxXM]", "", line.split("[")[0])) for line in text.splitlines() if re.match(r"^[.FEsxXM]+ *\[ *\d+%\]", line))
pct = re.findall(r"\[ *(\d+)%\]", text)
print(json.dumps({"run": "memcheck", "seconds": round(float(sys.argv[3]) - float(sys.argv[2]), 2),
                  "tests_done_in_full_progress_lines": done, "last_progress_percent": int(pct[-1]) if pct else 0,
                  "finished": "passed" in text.splitlines()[-2] if len(text.splitlines()) > 1 else False}))
PY
  cp $R/checks.json "$OUT/cupy_checks.json"
  runs_back final
}
part_sanitizer() {
  # The same subset, plain (CuPy's own pool) and under compute-sanitizer memcheck, which
  # follows the pytest-xdist workers (--target-processes all). ${SAN_TIMEOUT:-420} s at most.
  R=/tmp/san_runs; mkdir -p $R
  step "plain"
  t0=$(date +%s.%N)
  ( cd .cupy_tests && timeout 300 python3 -m pytest $CM_ARGS > $R/plain.log 2>&1; echo "exit $?" >> $R/plain.log )
  t1=$(date +%s.%N)
  tail -2 $R/plain.log
  step "compute-sanitizer --tool memcheck"
  compute-sanitizer --version | tail -1
  memcheck_subset "${SAN_TIMEOUT:-420}"
  t2=$(date +%s.%N)
  tail -3 $R/memcheck.log
  grep -h "ERROR SUMMARY" $R/memcheck.*.log | sort | uniq -c | head
  python3 -c "import json, sys; t0, t1, t2 = map(float, sys.argv[1:]); print(json.dumps({'plain_seconds': round(t1 - t0, 2), 'memcheck_seconds': round(t2 - t1, 2)}))" \
    $t0 $t1 $t2 | tee "$OUT/sanitizer_times.json"
  tar -czf "$OUT/san_runs.tar.gz" -C /tmp san_runs
}
part_hotpath() {
  step info
  python3 -m cupy_memstrat info | tail -7
  python3 -m cupy_memstrat info --json > "$OUT/info.json"
  quiet_gpu_tests 15
  step "PythonFunctionAllocator floor, C and Python hot paths"
  python3 tools/probes/hot_path_floor.py --json "$OUT/hot_path_floor.json"
  step "bench alloc"
  python3 -m cupy_memstrat bench alloc --quiet --json "$OUT/bench_alloc.json" | tail -14
  step "bench managed"
  python3 -m cupy_memstrat bench managed --quiet --json "$OUT/bench_managed.json" | tail -30
}
part_probes() {
  step info
  python3 -m cupy_memstrat info --json > "$OUT/info.json"
  step toolchain
  gcc --version | head -1
  python3 -c "import os, sysconfig; p = sysconfig.get_paths()['include']; print(p, 'Python.h', os.path.exists(os.path.join(p, 'Python.h')))"
  python3 -c "import setuptools; print('setuptools', setuptools.__version__)"
  quiet_gpu_tests 15
  step "PythonFunctionAllocator floor"
  python3 tools/probes/hot_path_floor.py --json "$OUT/hot_path_floor.json"
  step "GC-cleared PythonFunctionAllocatorMemory"
  timeout 120 python3 tools/probes/pfa_gc_clear.py
  if [ -d .cupy_tests/tests ]; then
    multigpu_copy_tests default async cupy-async
    step "where the plugin's per-test time goes (CuPy's subset, --gpumem --gpumem-budget --gpumem-leaks=fail)"
    export PLUGIN_COST_DIR=/tmp/plugin_cost
    ( cd .cupy_tests && PYTHONPATH=$OLDPWD/tools/probes:${PYTHONPATH:-} timeout 300 python3 -m pytest $CM_ARGS \
        --gpumem --gpumem-budget=64GiB --gpumem-leaks=fail -p plugin_cost 2>&1 | tail -2 )
    python3 - /tmp/plugin_cost <<'PY' | tee "$OUT/plugin_cost.json"
import glob, json, sys
rows = [json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + "/*.json"))]
tot = {}
for r in rows:
    for k, v in r["timers"].items():
        t = tot.setdefault(k, {"calls": 0, "seconds": 0.0})
        t["calls"] += v["calls"]; t["seconds"] += v["seconds"]
print(json.dumps({"workers": rows, "totals": tot,
                  "n_allocs": sum(r["n_allocs"] for r in rows),
                  "session_seconds": sum(r["session_seconds"] for r in rows)}, indent=1))
PY
  fi
}

step install
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv

# The parts: each a recipe of the steps above, under the comment that says what its call ran
case $part in
  mainjob) part_mainjob ;;
  main) part_main ;;
  final2) info_json; gpu_tests; benches streams async alloc workloads; cupy_runs default async ;;
  hotpath3) info_json; gpu_tests; benches async alloc managed streams workloads ;;
  reclaim)
    info_json
    step "tests/gpu: streams and managed"
    python3 -m pytest tests/gpu/test_streams_gpu.py tests/gpu/test_managed_gpu.py -v -p no:cacheprovider -rs \
      --junitxml="$OUT/tests_gpu.xml"
    reclaim_probe "$OUT" ;;
  pending)
    info_json; mkdir -p /tmp/viz; GPUMEM_VIZ_OUT=/tmp/viz gpu_tests
    cp /tmp/viz/memory-viz-managed-trace.html "$OUT/" 2>/dev/null
    reclaim_probe "$OUT"; origins_probe "$OUT" ;;

  # pending + bench streams, managed, workloads + the async multi-stream probe; the JSON in one tgz
  session)
    J=/tmp/session_json; mkdir -p $J /tmp/viz
    python3 -m cupy_memstrat info --json > "$J/info.json"; info_log head -20
    GPUMEM_VIZ_OUT=/tmp/viz gpu_tests; tar -czf "$OUT/viz.tgz" -C /tmp viz
    reclaim_probe "$J"
    step "probe: async on the multi-stream pipeline"
    python3 tools/probes/async_multistream.py "$J/async-multistream.json"
    origins_probe "$J"; BENCH_DIR=$J benches streams managed workloads; pack_json ;;

  # the dead-stream trace, tests/gpu, Dask on the GPU (wheels in .whl), the reclaim probe,
  # bench streams and workloads; the JSON in one tgz
  call2)
    json_dir call2; info_log head -20
    step "probe: the dead-stream pattern, round by round"
    timeout 120 python3 tools/probes/dead_stream_trace.py "$J/dead-stream-trace.json" | tail -40
    gpu_tests; dask_probe 200 --rounds 5; reclaim_probe "$J" timeout 120
    BENCH_DIR=$J benches streams workloads; pack_json ;;

  # tests/gpu, Dask on the GPU (a larger workload, 9 rounds of the tracking cost), the reclaim
  # probe, bench streams, workloads and managed; the JSON in one tgz
  call3) json_dir call3; info_log head -20; gpu_tests; dask_probe 240 --n 24576 --rounds 9
    reclaim_probe "$J" timeout 120; BENCH_DIR=$J benches streams workloads managed; pack_json ;;

  # tests/gpu (with what the last session could not run: from_external, the growth gate, trim
  # reset), the managed hot-path probe, bench streams, workloads (9 rounds: the ratio in rounds)
  # and managed (the latency back to back), bench alloc; the JSON in one tgz
  call5) json_dir call5; info_log head -20; gpu_tests; managed_hot_path_probe "$J" timeout 60
    BENCH_DIR=$J benches streams; workloads_rounds 9; BENCH_DIR=$J benches managed alloc; pack_json ;;

  # issue 20 (carry .whl: RMM): tests/gpu (the rmm and torch strategies, the Numba memory
  # manager, the mixed CuPy + PyTorch + Numba probe's JSON), then bench alloc with their rows
  call6) json_dir call6; info_log head -30; GPUMEM_INTEROP_OUT=$J gpu_tests; BENCH_DIR=$J benches alloc; pack_json ;;

  # issue 20 again after call6's findings (carry .whl and .cupy_tests): the interop, Numba and
  # plugin GPU tests (the mixed probe's JSON), then CuPy's subset under CuPy's pool, rmm and torch
  call7)
    J=/tmp/call7_json; mkdir -p $J
    step "tests/gpu: interop, numba, plugin"
    GPUMEM_INTEROP_OUT=$J python3 -m pytest tests/gpu/test_interop_gpu.py tests/gpu/test_numba_gpu.py \
      tests/gpu/test_plugin_gpu.py -v -p no:cacheprovider -rs --junitxml="$J/tests_gpu_interop.xml"
    pack_json; cupy_runs default rmm torch ;;

  # after the mend and the review (carry .whl): tests/gpu in full, the Numba allocation probe,
  # bench alloc (the rmm and torch rows)
  call8)
    json_dir call8; GPUMEM_INTEROP_OUT=$J gpu_tests
    step "probe: a Numba allocation through cupy_memstrat.numba"
    timeout 150 python3 tools/probes/numba_alloc_cost.py "$J/numba-alloc-cost.json"
    BENCH_DIR=$J benches alloc; pack_json ;;

  # pool:route=direct (added without a GPU): tests/gpu in full, bench alloc with the pool-direct
  # row beside pool, bench streams with pool:route=direct among the safe allocators
  call9) json_dir call9; gpu_tests; BENCH_DIR=$J benches alloc streams; pack_json ;;

  # pool's route "direct" the default (record_stream holds the block): tests/gpu in full, bench
  # alloc (pool beside pool-wrap) and bench workloads --rounds 7 (pool beside pool:route=wrap)
  call10) json_dir call10; gpu_tests; BENCH_DIR=$J benches alloc; workloads_rounds 7; pack_json ;;

  # after call10: its one failure's file again (the test expected the PythonFunctionAllocator's
  # guard for pool), where the direct route's time goes (tools/probes/pool_direct_cost.py),
  # bench managed, then CuPy's subset under CuPy's pool, pool (direct) and pool:route=wrap
  call11)
    json_dir call11
    step "tests/gpu/test_hot_path_gpu.py"
    python3 -m pytest tests/gpu/test_hot_path_gpu.py -v -p no:cacheprovider --junitxml="$J/tests_hot_path.xml"
    pool_direct_probe; BENCH_DIR=$J benches managed; pack_json; cupy_runs default pool pool:route=wrap ;;

  # the final code: tests/gpu in full, bench alloc, then docs/debugging.md's worked examples
  # (tools/debugging_walkthrough.sh: the OOM hunt, PyTorch's viewer, the plugin, the growth gate)
  call12)
    json_dir call12; gpu_tests; BENCH_DIR=$J benches alloc streams
    step "docs/debugging.md, worked on the GPU"
    timeout 240 bash tools/debugging_walkthrough.sh $J/debugging
    pack_json ;;

  # the last commits of the previous session (never run on a GPU): tests/gpu in full; then bench
  # workloads with its A/A control and 0.25 s samples for the pooling strategies, managed-large
  # apart (cold), and where async's cold time goes (tools/probes/async_cold.py)
  call13)
    json_dir call13; timed_gpu_tests 340; BENCH_DIR=$J benches alloc
    warm_workloads "pool;async;managed;pool:route=wrap"; cold_workloads "pool;async"
    step "probe: async's cold large allocation"
    python3 tools/probes/async_cold.py --json "$J/async_cold.json"
    pack_json ;;

  # the allocation benches side by side in one run (bench alloc, async, managed), the two probes
  # that say where the time goes (pool's direct route; PythonFunctionAllocator's floor and device
  # against raw cudaMalloc), then tests/gpu in full, last so that a cut run still has the benches
  call14) json_dir call14; info_log tail -8; BENCH_DIR=$J benches alloc async managed; cost_probes; pack_json
    timed_gpu_tests 420; pack_json ;;

  # the final code (pool's dead-stream guard): tests/gpu in full first, then bench alloc, async and
  # managed side by side in one run (issue 18), then the plugin's cost on CuPy's subset again
  call15) json_dir call15; info_log tail -6; timed_gpu_tests 380; pack_json
    BENCH_DIR=$J benches ${CALL15_BENCHES:-alloc async managed}; pack_json
    plugin_rounds two plain measure measure plain; pack_json ;;

  # the hot path's counts in C (no event lists to fold): the allocation benches side by side, the
  # two probes that say where the time goes, bench workloads for the pooling strategies, then
  # tests/gpu in full, last so that a cut run still has the benches
  call16) json_dir call16; info_log tail -6; BENCH_DIR=$J benches alloc managed async; cost_probes; pack_json
    warm_workloads "pool;async;managed"; pack_json; timed_gpu_tests ${GPU_TIMEOUT:-330}; pack_json ;;

  # the final hot path: the allocation benches side by side, bench workloads for the pooling
  # strategies and managed-large cold, then tests/gpu in full, last so that a cut run keeps the benches
  call17) json_dir call17; info_log tail -6; BENCH_DIR=$J benches alloc managed async; pack_json
    warm_workloads "pool;async;managed"; cold_workloads "pool;async;managed"; pack_json
    timed_gpu_tests ${GPU_TIMEOUT:-330}; pack_json ;;

  # where pool's time goes now, the PythonFunctionAllocator floor, then the plugin's cost on
  # CuPy's subset (issue 18): a warm-up, then plain and --gpumem in three rotated rounds
  call18) json_dir call18; cost_probes; torch_probe; pack_json
    plugin_rounds three plain measure measure plain plain measure; pack_json ;;

  # the CUDAPluggableAllocator probe again, with the step each child reached (call18's
  # pluggable-pool child died of SIGSEGV before its output could be kept)
  call19) json_dir call19; torch_probe; pack_json ;;

  # issue 17 (the architecture refactor, behaviour unchanged): tests/gpu in full (carry .whl for
  # RMM and Dask)
  call21) json_dir call21; timed_gpu_tests ${GPU_TIMEOUT:-540}; pack_json ;;

  call22) part_call22 ;;

  # after the last two repeats were removed (pool's and torch's reserved bytes through one mixin, the
  # benches' frame): bench async and bench managed, and the GPU tests of pool and torch
  call23)
    json_dir call23; BENCH_DIR=$J benches async managed; pack_json
    step "tests/gpu: pool and torch"
    timeout 150 python3 -m pytest tests/gpu/test_cupy_pool_gpu.py tests/gpu/test_interop_gpu.py -v -p no:cacheprovider \
      -rs --junitxml="$J/tests_gpu_pool_torch.xml"
    pack_json ;;

  # issue 17's last repeats removed (the C hot path's held_select, the library's, the tests'): tests/gpu
  # in full, its memory-viz test writing the exports into $J/viz, then bench alloc, managed and async
  # (carry .whl)
  call24) json_dir call24; GPUMEM_VIZ_OUT=$J/viz timed_gpu_tests ${GPU_TIMEOUT:-330}; pack_json
    BENCH_DIR=$J benches alloc managed; pack_json; BENCH_DIR=$J benches async; pack_json ;;

  # after the trials' fixes (record_stream takes CuPy streams only; current_token holds what it reads;
  # the hot path's attributes renamed): tests/gpu in full, then bench alloc and managed (carry .whl)
  call25) json_dir call25; timed_gpu_tests ${GPU_TIMEOUT:-420}; pack_json
    BENCH_DIR=$J benches alloc managed; pack_json ;;

  # issue 22, on two GPUs (kind nvidia-h200-x2): x2a is tests/gpu in full, whose two-GPU tests skip on one;
  # x2b (carry .whl and .cupy_tests) the cross-device copy probe (each kind of memory, and the event an
  # allocator can record at allocation), CuPy's three multi-GPU copy tests under six allocators, and
  # Dask's LocalCUDACluster with one worker per GPU
  x2a) json_dir x2a; timed_gpu_tests ${GPU_TIMEOUT:-540}; pack_json ;;
  x2b) json_dir x2b; step "probe: cross-device copies"
    timeout 150 python3 tools/probes/cross_device_copy.py "$J/cross_device_copy.json"; pack_json
    multigpu_copy_tests default device async event managed cupy-async; pack_json
    dask_probe 300 --devices 0,1 --rounds 5; pack_json ;;

  # issue 19's last GPU paths (carry .whl: dask, distributed, dask-cuda, RMM): next to dask-cuda's
  # RMM plugin in both orders, two `dask cuda worker --preload` workers, record_history and the
  # side-by-side plot (tools/probes/dask_gpu_more.py)
  call20)
    json_dir call20
    step "probe: dask_gpu_more"
    timeout 420 python3 tools/probes/dask_gpu_more.py "$J"
    echo "probe exit $?"
    pack_json ;;

  # Dask on the GPU again (the per-task hook without CUDA reads; the Prometheus endpoint), then
  # CuPy's v14.2.0 subset under CuPy's pool and managed (carry .whl and .cupy_tests)
  call4) json_dir call4; dask_probe 240 --n 24576 --rounds 9; pack_json; cupy_runs default managed ;;

  safety)
    info_json
    step "probe: are stream handles reused after a stream dies?"
    python3 tools/probes/stream_handles.py
    gpu_tests; benches streams managed workloads ;;
  hotpath2)
    managed_hot_path_probe "$OUT"
    step "bench managed"
    python3 -m cupy_memstrat bench managed --json "$OUT/bench-managed.json" ;;
  managed) part_managed ;;
  plugin) [ -d .cupy_tests/tests ] && part_plugin ;;
  checks_smoke) part_checks_smoke ;;
  checks) [ -d .cupy_tests/tests ] && part_checks ;;
  final) [ -d .cupy_tests/tests ] && part_final ;;
  sanitizer) [ -d .cupy_tests/tests ] && part_sanitizer ;;
  gpu) quiet_gpu_tests 15 ;;
  hotpath) part_hotpath ;;
  probes) part_probes ;;
  cupy) cupy_runs "$@" ;;
esac
step done
