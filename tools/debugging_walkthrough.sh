#!/usr/bin/env bash
# The worked examples of docs/debugging.md, run as a user would, each command's output kept:
#   1. an out-of-memory hunt: a program under managed with oom_snapshot and track_origins=8,
#      the snapshot exported for PyTorch's memory viewer and read by torch.cuda._memory_viz;
#   2. the same error under the pytest plugin;
#   3. the CI growth gate: a baseline run, then a run where one test grew, one is new and
#      one is gone.
# Usage: tools/debugging_walkthrough.sh OUTDIR   (on a GPU; with CUPY_MEMSTRAT_BACKEND=fake:memory=2GiB
# and HUNT_BIG=$((500<<20)) elements the out-of-memory steps run on the simulated GPU, which runs no
# kernels: the growth gate's tests fail there). The work folder is removed at the end, so the paths
# its outputs print are gone. The big request defaults to
# 50 Gi float32 elements (200 GiB): more than an H200 has, refused by managed's oversubscription
# guard before CUDA is asked, and by cudaMalloc under device.
set -u
OUTDIR=$(realpath -m "${1:?output folder}")
mkdir -p "$OUTDIR"
W=$(mktemp -d /tmp/dd.XXXX)
cd "$W" || exit 1
BIG=${HUNT_BIG:-$((50 << 30))}
run() {  # name, command...: the command line and its output (stdout and stderr) into OUTDIR/name.txt
  local name=$1; shift
  { echo "\$ $*"; "$@" 2>&1; echo "(exit $?)"; } > "$OUTDIR/$name.txt"
  cat "$OUTDIR/$name.txt"
}

cat > hunt.py <<EOF
import cupy
import cupy_memstrat

cupy_memstrat.use("managed", oom_snapshot="oom.json", track_origins=8)

def load_batch(n):
    return cupy.empty(n, dtype=cupy.float32)

def train():
    cache = [load_batch(64 << 20) for _ in range(3)]  # 3 x 256 MiB kept by mistake
    big = load_batch($BIG)                           # too much
    return cache, big

train()
EOF
run 1-hunt python3 hunt.py
run 2-oom-json python3 -c "
import json
doc = json.load(open('oom.json'))
oom = doc['oom']
print('requested_bytes', oom['requested_bytes'], 'reason', oom['reason'])
print('size       origin                        frames')
for a in oom['live']:
    print(a['size'], a['origin'], a['frames'])
"
run 3-export python3 -m cupy_memstrat export oom.json -o oom.pickle
run 4-viz-stats python3 -W ignore -m torch.cuda._memory_viz stats oom.pickle
run 5-viz-trace python3 -W ignore -m torch.cuda._memory_viz trace oom.pickle
run 6-viz-plot python3 -W ignore -m torch.cuda._memory_viz trace_plot oom.pickle -o oom.html
ls -l oom.html >> "$OUTDIR/6-viz-plot.txt" 2>&1

mkdir -p plugin && cat > plugin/test_oom.py <<EOF
import cupy


def test_loads_too_much():
    keep = cupy.empty(64 << 20, dtype=cupy.float32)
    big = cupy.empty($BIG, dtype=cupy.float32)
    del keep, big
EOF
run 7-plugin-oom python3 -m pytest plugin/test_oom.py -p no:cacheprovider --gpumem \
  --gpumem-strategy=device:oom_snapshot=oom.json -q

mkdir -p gate/tests && cat > gate/tests/test_mem.py <<'EOF'
import cupy


def test_peak():
    x = cupy.empty(4 << 20, dtype=cupy.uint8)
    del x


def test_steady():
    y = cupy.ones(1 << 20, dtype=cupy.float32)
    assert float(y.sum()) == 1 << 20


def test_old():
    z = cupy.zeros(1 << 16, dtype=cupy.float32)
    del z
EOF
( cd gate && run 8-gate-baseline python3 -m pytest tests -p no:cacheprovider --gpumem --gpumem-json=baseline.json -q )
cat > gate/tests/test_mem.py <<'EOF'
import cupy


def test_peak():
    x = cupy.empty(5 << 20, dtype=cupy.uint8)  # grew: 5 MiB where the baseline had 4 MiB
    del x


def test_steady():
    y = cupy.ones(1 << 20, dtype=cupy.float32)
    assert float(y.sum()) == 1 << 20


def test_new():
    w = cupy.zeros(1 << 16, dtype=cupy.float32)
    del w
EOF
( cd gate && run 9-gate-compare python3 -m pytest tests -p no:cacheprovider --gpumem \
    --gpumem-compare=baseline.json --gpumem-max-growth=10% -q )
cp hunt.py plugin/test_oom.py "$OUTDIR/" 2>/dev/null
rm -rf "$W"
