"""What CUDA's virtual memory management does, as measured on an H100
(docs/results/h100/vmm-facts.json): one set of checks run against the simulated GPU
(tests/test_vmm_backend.py) and against the real one (tests/gpu/test_vmm_gpu.py), so that the
simulator is held to the GPU. Each check uses at most a few MiB of physical memory, except the
one that asks for more than the device has (refused, nothing allocated)."""

import pytest

from cupy_memstrat import backends as B

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40


def _status(exc) -> int:
    return getattr(exc, "status", None)


def refused(call, status) -> None:
    """``call()`` raises the backend's error with ``status``."""
    with pytest.raises(Exception) as info:
        call()
    assert _status(info.value) == status, f"{info.value!r}: expected status {status}"


def granularity_and_reserve(b) -> None:
    g = b.vmm_granularity(0)
    assert g == 2 * MiB
    for size in (GiB, 64 * TiB):
        ptr = b.vmm_reserve(size)
        assert ptr % (32 * MiB) == 0
        b.vmm_free_address(ptr, size)
    ptr = b.vmm_reserve(4 * GiB, GiB)
    assert ptr % GiB == 0
    b.vmm_free_address(ptr, 4 * GiB)
    refused(lambda: b.vmm_reserve(256 * TiB), B.ERROR_MEMORY_ALLOCATION)
    refused(lambda: b.vmm_reserve(MiB), B.ERROR_INVALID_VALUE)
    refused(lambda: b.vmm_reserve(0), B.ERROR_INVALID_VALUE)
    a = b.vmm_reserve(GiB)
    c = b.vmm_reserve(GiB, 0, a + GiB)  # the range right after: granted where free
    assert c == a + GiB
    b.vmm_free_address(c, GiB)
    b.vmm_free_address(a, GiB)
    refused(lambda: b.vmm_free_address(a, GiB), B.ERROR_INVALID_VALUE)


def create_counts_physical_memory_and_oom_is_not_sticky(b) -> None:
    g = b.vmm_granularity(0)
    refused(lambda: b.vmm_create(0, MiB), B.ERROR_INVALID_VALUE)
    refused(lambda: b.vmm_create(0, 0), B.ERROR_INVALID_VALUE)
    free0 = b.mem_get_info(0)[0]
    h = b.vmm_create(0, g)
    assert free0 - b.mem_get_info(0)[0] == g
    b.vmm_release(h)
    assert b.mem_get_info(0)[0] == free0
    free, _ = b.mem_get_info(0)
    refused(lambda: b.vmm_create(0, (free + 4 * GiB) // g * g), B.ERROR_MEMORY_ALLOCATION)
    h = b.vmm_create(0, g)  # the next call works
    b.vmm_release(h)


def map_access_unmap(b) -> None:
    g = b.vmm_granularity(0)
    base = b.vmm_reserve(64 * g)
    h1, h2, h3 = b.vmm_create(0, g), b.vmm_create(0, g), b.vmm_create(0, 2 * g)
    refused(lambda: b.vmm_map(base + g // 2, g, h1), B.ERROR_INVALID_VALUE)
    b.vmm_map(base, g, h1)
    refused(lambda: b.vmm_map(base, g, h2), B.ERROR_INVALID_VALUE)  # mapped already
    b.vmm_map(base + g, g, h2)
    assert b.memory_type(base) == "device"
    b.vmm_set_access(base, 2 * g, 0)  # one call over two mappings
    b.vmm_map(base + 2 * g, 2 * g, h3)
    b.vmm_set_access(base + 2 * g, 2 * g, 0)
    refused(lambda: b.vmm_unmap(base + 2 * g, g), B.ERROR_INVALID_VALUE)  # half of a mapping
    b.vmm_unmap(base, 2 * g)  # two mappings in one call
    free0 = b.mem_get_info(0)[0]
    b.vmm_release(h3)  # still mapped: the memory stays until the unmap
    assert b.mem_get_info(0)[0] == free0
    b.vmm_unmap(base + 2 * g, 2 * g)
    assert b.mem_get_info(0)[0] == free0 + 2 * g
    for h in (h1, h2):
        b.vmm_release(h)
    b.vmm_free_address(base, 64 * g)


CHECKS = (granularity_and_reserve, create_counts_physical_memory_and_oom_is_not_sticky, map_access_unmap)
