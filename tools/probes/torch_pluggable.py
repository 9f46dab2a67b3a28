"""Probe: PyTorch allocating through a cupy_memstrat strategy with
``torch.cuda.memory.CUDAPluggableAllocator`` (issue 20): what it costs and
what breaks, measured rather than argued.

PyTorch takes such an allocator as two C functions in a shared object,
``void *alloc(ssize_t size, int device, cudaStream_t stream)`` and
``void free(void *ptr, size_t size, int device, cudaStream_t stream)``, and
calls them from whatever thread allocates, without the GIL (PyTorch 2.11,
torch/csrc/cuda/CUDAPluggableAllocator.cpp). A strategy keeps its tables in
Python objects, so its C entry must take the GIL. This probe compiles a
two-function shim that forwards to ctypes callbacks (ctypes takes the GIL for
them, as a hand-written entry would) and runs, each in a fresh process (the
allocator must be set before PyTorch's first CUDA allocation):

  native            PyTorch's own caching allocator
  pluggable-floor   the shim -> a Python free list of preallocated blocks: the
                    interface's own cost (GIL, ctypes, one Python call each way)
  pluggable-pool    the shim -> cupy_memstrat's ``pool`` (raw_malloc / raw_free)

and measures torch.empty + del pairs (median of 7 rounds, microseconds), then,
under ``pluggable-pool``: which threads call in (a backward pass: PyTorch's
autograd engine thread), what an allocation the strategy refuses gives the
caller (the callback cannot raise through C), whether ``record_stream`` reaches
the allocator, and whether ``torch.cuda.memory_allocated()`` still answers.

Run on the GPU machine:  python3 tools/probes/torch_pluggable.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

SHIM = r"""
#include <stddef.h>
#include <sys/types.h>
typedef void *(*alloc_fn)(ssize_t, int, void *);
typedef void (*free_fn)(void *, size_t, int, void *);
static alloc_fn A;
static free_fn F;
void shim_set(alloc_fn a, free_fn f) { A = a; F = f; }
void *shim_alloc(ssize_t n, int d, void *s) { return A ? A(n, d, s) : NULL; }
void shim_free(void *p, size_t n, int d, void *s) { if (F) F(p, n, d, s); }
"""

CHILD = r"""
import ctypes, json, statistics, sys, threading, time
mode, so = sys.argv[1], sys.argv[2]
out = {"mode": mode}

def at(step):  # on stderr, so that a crash shows where it came
    print("at:", step, file=sys.stderr, flush=True)

import torch
if mode != "native":
    import cupy
    import cupy_memstrat
    lib = ctypes.CDLL(so)
    ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    calls = {"alloc": 0, "free": 0, "threads": set(), "streams": set(), "refused": 0}
    if mode == "pluggable-floor":
        keep = cupy.empty(64 << 20, dtype=cupy.uint8)  # 64 blocks of 1 MiB to hand out
        free_list = [keep.data.ptr + (i << 20) for i in range(64)]

        def alloc(n, device, stream):
            return free_list.pop() if n else None

        def free(p, n, device, stream):
            if p:
                free_list.append(p)
    else:
        s = cupy_memstrat.create("pool")

        def alloc(n, device, stream):
            calls["alloc"] += 1
            calls["threads"].add(threading.get_ident())
            calls["streams"].add(stream or 0)
            if not n:
                return None
            try:
                return s.raw_malloc(n)
            except Exception:  # the callback cannot raise through C: PyTorch gets NULL
                calls["refused"] += 1
                return None

        def free(p, n, device, stream):
            calls["free"] += 1
            calls["threads"].add(threading.get_ident())
            if p:
                s.raw_free(p)
    c_alloc, c_free = ALLOC(alloc), FREE(free)
    lib.shim_set(c_alloc, c_free)
    a = torch.cuda.memory.CUDAPluggableAllocator(so, "shim_alloc", "shim_free")
    torch.cuda.memory.change_current_allocator(a)

def pairs(n, k):
    t0 = time.perf_counter()
    for _ in range(k):
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        del t
    return (time.perf_counter() - t0) / k * 1e6

torch.cuda.init()
at("timing")
for n in (512, 1 << 20):
    pairs(n, 2000)
    out[f"pair_us_{n}"] = statistics.median(pairs(n, 20000) for _ in range(7))
torch.cuda.synchronize()
if mode == "pluggable-pool":
    at("backward")
    main = threading.get_ident()
    x = torch.ones(1 << 16, device="cuda", requires_grad=True)
    ((x * 2).sin().sum()).backward()
    torch.cuda.synchronize()
    out["backward_ok"] = bool(torch.allclose(x.grad, 2 * torch.cos(2 * torch.ones_like(x))))
    out["threads_calling_in"] = len(calls["threads"])
    out["a_thread_other_than_the_main_one_called_in"] = any(t != main for t in calls["threads"])
    at("record_stream")
    n_alloc, n_free = calls["alloc"], calls["free"]
    side = torch.cuda.Stream()
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    t.record_stream(side)
    out["record_stream_calls_into_the_allocator"] = (calls["alloc"], calls["free"]) != (n_alloc + 1, n_free)
    del t
    at("memory_allocated")
    try:
        torch.cuda.memory_allocated()
        out["memory_allocated"] = "answers"
    except Exception as exc:  # noqa: BLE001
        out["memory_allocated"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    at("refused allocation")
    refused = calls["refused"]
    try:
        big = torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: the strategy refuses
        out["refused_allocation"] = {"raised": None, "data_ptr": big.data_ptr(), "numel": big.numel(),
                                     "strategy_refused": calls["refused"] - refused}
        del big
    except Exception as exc:  # noqa: BLE001
        out["refused_allocation"] = {"raised": f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                                     "strategy_refused": calls["refused"] - refused}
    out["strategy_stats"] = str(s.stats())
print(json.dumps(out), flush=True)
at("exit, with x and its gradient alive as a program leaves them")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {"probe": "torch_pluggable", "rounds": 7, "pairs_per_round": 20000, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        c, so = os.path.join(tmp, "shim.c"), os.path.join(tmp, "shim.so")
        with open(c, "w") as f:
            f.write(SHIM)
        cc = (sysconfig.get_config_var("CC") or "cc").split()
        subprocess.run(cc + ["-shared", "-fPIC", "-O2", c, "-o", so], check=True)
        for mode in ("native", "pluggable-floor", "pluggable-pool"):
            r = subprocess.run([sys.executable, "-c", CHILD, mode, so], capture_output=True, text=True, timeout=240)
            lines = [ln for ln in r.stdout.strip().splitlines() if ln.startswith("{")]
            res["modes"][mode] = json.loads(lines[-1]) if lines else {}
            res["modes"][mode]["rc"] = r.returncode  # -11: the process died of SIGSEGV
            steps = [ln[4:] for ln in r.stderr.splitlines() if ln.startswith("at: ")]
            res["modes"][mode]["last_step"] = steps[-1] if steps else None
            if r.returncode != 0 or r.stderr.strip():
                res["modes"][mode]["stderr_tail"] = r.stderr[-1500:]
            print(mode, json.dumps(res["modes"][mode]), flush=True)
    native = res["modes"].get("native", {})
    for mode, v in res["modes"].items():
        for n in (512, 1 << 20):
            k = f"pair_us_{n}"
            if k in v and k in native:
                v[f"ratio_to_native_{n}"] = v[k] / native[k]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
