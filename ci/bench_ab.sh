#!/usr/bin/env bash
# Benchmarks of two trees, alternating on one machine: the working tree ("after") and BEFORE_DIR
# ("before", a copy of another commit: git archive REF | tar -x -C DIR), each group run for both
# trees in every round, the order swapped each round; then tools/compare_bench.py prints each
# ratio's medians and the A/A spread (the largest difference between two runs of one tree).
#
#   ci/bench_ab.sh BEFORE_DIR [GROUP...]        groups: default alloc managed
#
# Environment: OUT (default ./gpu-out), ROUNDS (default 2), PYTHON (default python3).
# What comes back: ab/compare.txt and ab/compare.json; ab.tgz holds every run's JSON and log.
set -uo pipefail
[ $# -ge 1 ] && [ -d "$1" ] || { echo "ci/bench_ab.sh: expected BEFORE_DIR (a folder holding the other tree), got '${1:-}'" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BEFORE=$(cd "$1" && pwd); shift
groups=("$@"); [ ${#groups[@]} -eq 0 ] && groups=(alloc managed)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/ab"; OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

( cd "$ROOT" && "$PY" -m pip install -q --no-deps --no-build-isolation -e . ) >"$OUT/ab/install.log" 2>&1 \
  || { cat "$OUT/ab/install.log"; exit 2; }
( cd "$BEFORE" && "$PY" setup.py -q build_ext --inplace ) >"$OUT/ab/build-before.log" 2>&1 \
  || { cat "$OUT/ab/build-before.log"; exit 2; }

run() {  # TREE DIR GROUP ROUND: from a folder of neither tree, so that PYTHONPATH picks the tree
  ( cd "$OUT/ab" && PYTHONPATH="$2" timeout 300 "$PY" -m cupy_memstrat bench "$3" --json "$3-$1-$4.json" \
      >"$3-$1-$4.log" 2>&1 ) || echo "bench $3 of $1 (round $4) failed: see $OUT/ab/$3-$1-$4.log"
  echo "$3 $1 round $4 done"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for g in "${groups[@]}"; do
    if [ $((r % 2)) -eq 1 ]; then run before "$BEFORE" "$g" "$r"; run after "$ROOT" "$g" "$r"
    else run after "$ROOT" "$g" "$r"; run before "$BEFORE" "$g" "$r"; fi
  done
done
"$PY" "$ROOT/tools/compare_bench.py" "$OUT/ab" --json "$OUT/ab/compare.json" | tee "$OUT/ab/compare.txt"
rc=${PIPESTATUS[0]}
tar -czf "$OUT/ab.tgz" -C "$OUT" ab && find "$OUT/ab" -type f ! -name 'compare.*' -delete
exit "$rc"
