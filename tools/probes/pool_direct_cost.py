"""Where the time of pool's route "direct" goes, per 512 B alloc+free pair
through cupy.cuda.alloc, beside CuPy's own pool in the same process.

Builds variants of csrc/hotpath.c with parts of PoolDirect cut out, each into
its own folder, and runs each in a subprocess that measures CuPy's pool and the
variant in interleaved rounds (median of 7 rounds of 200 000 pairs):

  full           the extension as built (the route as users get it)
  no-dict        the token is not put in the pool's memory object (no __dict__
                 made and cleared; the token dies at once and accounts the free
                 at the malloc)
  no-accounting  the live table, the counts and the generations untouched
  bare           PoolDirect returns the pool's MemoryPointer and does nothing
                 else: the cost of a C callable in front of CuPy's pool

Variants other than "full" count wrongly by construction: for measurement only.

    python tools/probes/pool_direct_cost.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CUTS = {
    "no-dict": [("rc = PyObject_SetAttr(mem, S_token, (PyObject *)t);", "rc = 0;")],
    "no-accounting": [
        ("        if (rc == 0)\n            rc = gen_set(&self->generations, pv, g);\n"
         "        if (rc == 0 && (rc = account_malloc(acc, d, device, ptr, size)) < 0)\n"
         "            gen_del(&self->generations, pv);\n", ""),
        ("    Accounting *acc = o->acc;\n    long long c;\n",
         "    if (1)\n        return 0;\n    Accounting *acc = o->acc;\n    long long c;\n"),
    ],
    "bare": [("    PyObject *mem = PyObject_GetAttr(mp, S_mem), *ptr = NULL, *size = NULL, *device = NULL;",
              "    if (1)\n        return mp;\n"
              "    PyObject *mem = PyObject_GetAttr(mp, S_mem), *ptr = NULL, *size = NULL, "
              "*device = NULL;")],
}

CHILD = r"""
import importlib.util, json, statistics, sys, time
path = sys.argv[1]
if path != "-":
    spec = importlib.util.spec_from_file_location("cupy_memstrat._hotpath", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["cupy_memstrat._hotpath"] = mod
import cupy
import cupy_memstrat
s = cupy_memstrat.create("pool")
m = s.cupy_allocator()
assert type(m).__name__ == "PoolDirect", type(m)
pool = cupy.get_default_memory_pool()
alloc, N = cupy.cuda.alloc, 200_000
def run(f):
    cupy.cuda.set_allocator(f)
    for _ in range(20_000):
        alloc(512)
    t0 = time.perf_counter()
    for _ in range(N):
        alloc(512)
    return (time.perf_counter() - t0) / N * 1e6
a, b = [], []
for r in range(7):
    for label, f in ((("cupy", pool.malloc), ("variant", m)) if r % 2 == 0
                     else (("variant", m), ("cupy", pool.malloc))):
        (a if label == "cupy" else b).append(run(f))
cupy.cuda.set_allocator(pool.malloc)
print(json.dumps({"cupy_us": statistics.median(a), "variant_us": statistics.median(b),
                  "ratio": statistics.median(y / x for x, y in zip(a, b))}))
"""


def build(tmp: str, name: str, cuts) -> str:
    src = open(os.path.join(ROOT, "csrc", "hotpath.c")).read()
    for old, new in cuts:
        if src.count(old) != 1:
            raise SystemExit(f"{name}: the cut {old[:60]!r} does not match csrc/hotpath.c once")
        src = src.replace(old, new)
    d = os.path.join(tmp, name)
    os.makedirs(d)
    c = os.path.join(d, "hotpath.c")
    open(c, "w").write(src)
    so = os.path.join(d, "_hotpath" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    subprocess.run(cc + ["-shared", "-fPIC", "-O2", "-w", "-I" + sysconfig.get_paths()["include"], c, "-o", so],
                   check=True)
    return so


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"probe": "pool_direct_cost", "size_bytes": 512, "rounds": 7, "pairs_per_round": 200_000, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"full": "-"}
        for name, cuts in CUTS.items():
            paths[name] = build(tmp, name, cuts)
        for name, path in paths.items():
            r = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
            out["variants"][name] = json.loads(r.stdout.strip().splitlines()[-1])
            v = out["variants"][name]
            print(f"{name:14s} CuPy's pool {v['cupy_us']:.3f} us, variant {v['variant_us']:.3f} us, "
                  f"ratio {v['ratio']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
