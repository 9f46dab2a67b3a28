"""Probe: which CUPTI set-up orders record unified-memory counters; "alloc-before" shows that CUPTI
reports nothing for managed memory allocated before the activity kind was enabled (H200, cupti-python
13.0.1: 0 records, docs/faults.md). Usage: python tools/probes/cupti_modes.py MODE."""
import collections, ctypes, sys, traceback
import cupy, numpy as np
from cupti import cupti

cupy.cuda.runtime.free(0)
cupy.cuda.Device(0).synchronize()
recs = []

def req():
    return 8 << 20, 0

def comp(acts):
    try:
        for a in acts:
            recs.append((int(a.kind), int(getattr(a, "counter_kind", -1)), int(getattr(a, "value", -1))))
    except Exception:
        traceback.print_exc()

k = cupti.ActivityUnifiedMemoryCounterKind
kinds = [k.BYTES_TRANSFER_HTOD, k.BYTES_TRANSFER_DTOH, k.CPU_PAGE_FAULT_COUNT, k.GPU_PAGE_FAULT]
mode = sys.argv[1]

def configure():
    cfg = cupti.ActivityUnifiedMemoryCounterConfig(4)
    for i, kd in enumerate(kinds):
        cfg[i].scope = int(cupti.ActivityUnifiedMemoryCounterScope.PROCESS_ALL_DEVICES)
        cfg[i].kind = int(kd)
        cfg[i].device_id = 0
        cfg[i].enable = 1
    print("configure ->", cupti.activity_configure_unified_memory_counter(cfg.ptr, 4))
    return cfg

def work():
    n = 64 << 20
    p = cupy.cuda.runtime.mallocManaged(n, 1)
    h = np.frombuffer((ctypes.c_char * n).from_address(p), dtype=np.float32)
    h[:] = 1.0
    x = cupy.ndarray(n // 4, cupy.float32, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(p, n, None), 0))
    x *= 2
    cupy.cuda.Device().synchronize()
    h.sum()
    cupy.cuda.runtime.free(p)

try:
    if mode == "sample-order":  # enable, then register (as NVIDIA's samples)
        cfg = configure()
        cupti.activity_enable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
        cupti.activity_register_callbacks(req, comp)
    elif mode == "register-first":
        cupti.activity_register_callbacks(req, comp)
        cfg = configure()
        cupti.activity_enable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
    elif mode == "toggle":  # what cupy_memstrat.faults does: enable, disable, enable
        cupti.activity_register_callbacks(req, comp)
        cfg = configure()
        cupti.activity_enable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
        cupti.activity_disable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
        cupti.activity_enable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
    elif mode == "alloc-before":  # managed memory allocated before CUPTI is on
        n = 64 << 20
        p = cupy.cuda.runtime.mallocManaged(n, 1)
        h = np.frombuffer((ctypes.c_char * n).from_address(p), dtype=np.float32)
        h[:] = 1.0
        cupti.activity_register_callbacks(req, comp)
        cfg = configure()
        cupti.activity_enable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
        x = cupy.ndarray(n // 4, cupy.float32, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(p, n, None), 0))
        x *= 2
        cupy.cuda.Device().synchronize()
        cupti.activity_flush_all(1)
        c = collections.Counter(r[1] for r in recs)
        print(mode, "records", len(recs), dict(c), "htod", sum(r[2] for r in recs if r[1] == int(kinds[0])))
        sys.exit(0)
    elif mode == "faults":
        from cupy_memstrat import faults
        c = faults.FaultCounter(source="cupti")
        c.start(); work(); print(c.stop()); sys.exit(0)
    work()
    cupti.activity_flush_all(1)
except Exception:
    traceback.print_exc()
c = collections.Counter(r[1] for r in recs)
print(mode, "records", len(recs), "by counter_kind", dict(c), "htod bytes",
      sum(r[2] for r in recs if r[1] == int(kinds[0])), "kinds", collections.Counter(r[0] for r in recs))
