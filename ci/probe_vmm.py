"""Measure what CUDA's virtual memory management (cuMemAddressReserve, cuMemCreate, cuMemMap,
cuMemSetAccess, cuMemUnmap, cuMemRelease) does on this machine's device 0, for the simulator of
the ``expandable`` strategy: granularity, the alignment of reserved ranges, what each call
refuses and with which error, what the device's free memory says, and what each call costs.

    python ci/probe_vmm.py OUT.json

Every probe is independent: one that fails records its error and the next one runs. Sizes stay
within a few GiB of physical memory.
"""

from __future__ import annotations

import json
import sys
import time

import cupy
from cuda.bindings import driver as cu

MiB, GiB = 1 << 20, 1 << 30
OUT: dict = {}


def name(err) -> str:
    return getattr(err, "name", str(err))


def ok(err) -> bool:
    return err == cu.CUresult.CUDA_SUCCESS


def prop(dev: int):
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = dev
    return p


def access(dev: int):
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = dev
    d.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return d


def free_mem() -> int:
    return cupy.cuda.runtime.memGetInfo()[0]


def probe(fn):
    try:
        OUT[fn.__name__] = fn()
    except Exception as exc:  # noqa: BLE001 - a probe that fails is a finding too
        OUT[fn.__name__] = {"exception": f"{type(exc).__name__}: {exc}"}
    print(fn.__name__, json.dumps(OUT[fn.__name__])[:400], flush=True)


def low_bit(x: int) -> int:
    return x & -x if x else 0


def gran() -> int:
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return cu.cuMemGetAllocationGranularity(prop(0), flag)[1]


def granularity():
    out = {}
    for flag in ("CU_MEM_ALLOC_GRANULARITY_MINIMUM", "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED"):
        err, g = cu.cuMemGetAllocationGranularity(prop(0), getattr(cu.CUmemAllocationGranularity_flags, flag))
        out[flag] = g if ok(err) else name(err)
    err, v = cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0)
    out["vmm_supported"] = v if ok(err) else name(err)
    return out


def reserve_sizes():
    total = cupy.cuda.runtime.memGetInfo()[1]
    out = {"total_memory": total}
    for label, size in (("1GiB", GiB), ("total", total - total % (2 * MiB)),
                        ("2x_total", 2 * total // (2 * MiB) * 2 * MiB),
                        ("1TiB", 1 << 40), ("16TiB", 16 << 40), ("64TiB", 64 << 40), ("256TiB", 256 << 40),
                        ("1PiB", 1 << 50)):
        err, ptr = cu.cuMemAddressReserve(size, 0, 0, 0)
        if ok(err):
            p = int(ptr)
            out[label] = {"ok": True, "ptr_low_bit": low_bit(p), "free_memory_change": 0}
            cu.cuMemAddressFree(ptr, size)
        else:
            out[label] = {"ok": False, "error": name(err)}
    for label, size in (("1MiB_not_granular", MiB), ("2MiB+4KiB", 2 * MiB + 4096), ("zero", 0)):
        err, ptr = cu.cuMemAddressReserve(size, 0, 0, 0)
        out[label] = {"ok": ok(err), "error": None if ok(err) else name(err),
                      "ptr_low_bit": low_bit(int(ptr)) if ok(err) else None}
        if ok(err):
            cu.cuMemAddressFree(ptr, size)
    # alignment asked for
    for align in (2 * MiB, 64 * MiB, GiB):
        err, ptr = cu.cuMemAddressReserve(4 * GiB, align, 0, 0)
        out[f"align_{align >> 20}MiB"] = {"ok": ok(err), "ptr_low_bit": low_bit(int(ptr)) if ok(err) else None,
                                          "error": None if ok(err) else name(err)}
        if ok(err):
            cu.cuMemAddressFree(ptr, 4 * GiB)
    # a second reservation asked right after the first (growing a range in place)
    err, a = cu.cuMemAddressReserve(GiB, 0, 0, 0)
    err2, b = cu.cuMemAddressReserve(GiB, 0, int(a) + GiB, 0)
    out["adjacent_hint"] = {"ok": ok(err2), "got_hint": ok(err2) and int(b) == int(a) + GiB,
                            "error": None if ok(err2) else name(err2)}
    if ok(err2):
        cu.cuMemAddressFree(b, GiB)
    cu.cuMemAddressFree(a, GiB)
    return out


def create_and_oom():
    out = {}
    g = gran()
    for label, size in (("1MiB", MiB), ("granule+4KiB", g + 4096), ("zero", 0)):
        err, h = cu.cuMemCreate(size, prop(0), 0)
        out[label] = {"ok": ok(err), "error": None if ok(err) else name(err)}
        if ok(err):
            cu.cuMemRelease(h)
    f0 = free_mem()
    err, h = cu.cuMemCreate(g, prop(0), 0)
    f1 = free_mem()
    out["free_drop_after_create_one_granule"] = f0 - f1
    cu.cuMemRelease(h)
    out["free_back_after_release"] = free_mem() - f1
    f0 = free_mem()
    err, h = cu.cuMemCreate(GiB, prop(0), 0)
    out["free_drop_after_create_1GiB"] = f0 - free_mem()
    cu.cuMemRelease(h)
    # more than is free: the error, and whether the next call still works (not sticky)
    too_much = (free_mem() + 4 * GiB) // g * g
    err, h = cu.cuMemCreate(too_much, prop(0), 0)
    out["create_over_free"] = {"ok": ok(err), "error": None if ok(err) else name(err)}
    if ok(err):
        cu.cuMemRelease(h)
    err, h = cu.cuMemCreate(g, prop(0), 0)
    out["create_after_oom"] = {"ok": ok(err), "error": None if ok(err) else name(err)}
    if ok(err):
        cu.cuMemRelease(h)
    err_rt = cupy.cuda.runtime.getLastError() if hasattr(cupy.cuda.runtime, "getLastError") else None
    out["runtime_last_error_after"] = err_rt
    return out


def map_rules():
    out = {}
    g = gran()
    size = 64 * g
    err, base = cu.cuMemAddressReserve(size, 0, 0, 0)
    base = int(base)
    handles = []
    for _ in range(3):
        handles.append(cu.cuMemCreate(g, prop(0), 0)[1])
    big = cu.cuMemCreate(2 * g, prop(0), 0)[1]
    (err,) = cu.cuMemMap(base + g // 2, g, 0, handles[0], 0)
    out["map_unaligned_va"] = name(err)
    (err,) = cu.cuMemMap(base, g, g // 2, handles[0], 0)
    out["map_nonzero_offset"] = name(err)
    (err,) = cu.cuMemMap(base, g, 0, handles[0], 0)
    out["map_first"] = name(err)
    (err,) = cu.cuMemMap(base, g, 0, handles[1], 0)
    out["map_over_a_mapped_page"] = name(err)
    (err,) = cu.cuMemMap(base + g, g, 0, handles[1], 0)
    out["map_adjacent"] = name(err)
    # access before cuMemSetAccess
    try:
        cupy.cuda.runtime.memset(base, 1, 16)
        cupy.cuda.runtime.deviceSynchronize()
        out["memset_before_set_access"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["memset_before_set_access"] = str(exc)[:120]
    (err,) = cu.cuMemSetAccess(base, 2 * g, [access(0)], 1)
    out["set_access_two_pages_one_call"] = name(err)
    # a kernel over both pages, as CuPy sees the memory
    mem = cupy.cuda.UnownedMemory(base, 2 * g, None)
    arr = cupy.ndarray((2 * g,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    arr[:] = 7
    out["kernel_across_pages_sum_ok"] = int(arr.sum(dtype=cupy.int64)) == 7 * 2 * g
    attrs = cupy.cuda.runtime.pointerGetAttributes(base)
    out["pointer_type"] = int(attrs.type)
    (err,) = cu.cuMemMap(base + 2 * g, 2 * g, 0, big, 0)
    out["map_two_granule_handle"] = name(err)
    cu.cuMemSetAccess(base + 2 * g, 2 * g, [access(0)], 1)
    (err,) = cu.cuMemUnmap(base + 2 * g, g)
    out["unmap_half_of_a_handle"] = name(err)
    (err,) = cu.cuMemUnmap(base, 2 * g)
    out["unmap_two_handles_one_call"] = name(err)
    # the pages mapped again after an unmap: access must be set again?
    (err,) = cu.cuMemMap(base, g, 0, handles[0], 0)
    out["remap_after_unmap"] = name(err)
    try:
        cupy.cuda.runtime.memset(base, 2, 16)
        cupy.cuda.runtime.deviceSynchronize()
        out["memset_after_remap_without_set_access"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["memset_after_remap_without_set_access"] = str(exc)[:120]
    cu.cuMemSetAccess(base, g, [access(0)], 1)
    # release while mapped: the memory stays until the unmap
    f0 = free_mem()
    (err,) = cu.cuMemRelease(handles[0])
    out["release_while_mapped"] = name(err)
    out["free_change_release_while_mapped"] = free_mem() - f0
    cu.cuMemUnmap(base, g)
    out["free_change_after_unmap"] = free_mem() - f0
    cu.cuMemUnmap(base + 2 * g, 2 * g)
    for h in handles[1:] + [big]:
        cu.cuMemRelease(h)
    (err,) = cu.cuMemAddressFree(base, size)
    out["address_free"] = name(err)
    (err,) = cu.cuMemAddressFree(base, size)
    out["address_free_twice"] = name(err)
    return out


def costs():
    out = {}
    g = gran()
    err, base = cu.cuMemAddressReserve(8 * GiB, 0, 0, 0)
    base = int(base)
    for label, size, n in (("2MiB", g, 200), ("64MiB", 64 * MiB, 40), ("1GiB", GiB, 4)):
        t0 = time.perf_counter()
        hs = []
        for i in range(n):
            h = cu.cuMemCreate(size, prop(0), 0)[1]
            cu.cuMemMap(base + i * size, size, 0, h, 0)
            cu.cuMemSetAccess(base + i * size, size, [access(0)], 1)
            hs.append(h)
        t1 = time.perf_counter()
        for i, h in enumerate(hs):
            cu.cuMemUnmap(base + i * size, size)
            cu.cuMemRelease(h)
        t2 = time.perf_counter()
        # one cuMemSetAccess over many pages mapped one by one
        hs = []
        t3 = time.perf_counter()
        for i in range(n):
            h = cu.cuMemCreate(size, prop(0), 0)[1]
            cu.cuMemMap(base + i * size, size, 0, h, 0)
            hs.append(h)
        cu.cuMemSetAccess(base, n * size, [access(0)], 1)
        t4 = time.perf_counter()
        cu.cuMemUnmap(base, n * size)
        for h in hs:
            cu.cuMemRelease(h)
        t5 = time.perf_counter()
        ptrs = []
        t6 = time.perf_counter()
        for _ in range(n):
            ptrs.append(cupy.cuda.runtime.malloc(size))
        t7 = time.perf_counter()
        for p in ptrs:
            cupy.cuda.runtime.free(p)
        t8 = time.perf_counter()
        out[label] = {"n": n, "us_create_map_access": (t1 - t0) / n * 1e6, "us_unmap_release": (t2 - t1) / n * 1e6,
                      "us_create_map_then_one_access": (t4 - t3) / n * 1e6,
                      "us_unmap_all_release": (t5 - t4) / n * 1e6,
                      "us_cudaMalloc": (t7 - t6) / n * 1e6, "us_cudaFree": (t8 - t7) / n * 1e6}
    cu.cuMemAddressFree(base, 8 * GiB)
    return out


def main() -> int:
    cupy.cuda.Device(0).use()
    cupy.zeros(1)  # the primary context, current on this thread
    OUT["device"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    OUT["driver"] = cupy.cuda.runtime.driverGetVersion()
    for fn in (granularity, reserve_sizes, create_and_oom, map_rules, costs):
        probe(fn)
    with open(sys.argv[1], "w") as f:
        json.dump(OUT, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
