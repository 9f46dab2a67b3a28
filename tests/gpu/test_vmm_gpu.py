"""The real backend's virtual memory management does what the simulator does: the same checks
as tests/test_vmm_backend.py (tests/vmm_facts.py), on device 0, and CuPy's kernels on the
mapped memory."""

import pytest
import vmm_facts

MiB = 1 << 20


@pytest.fixture
def real():
    pytest.importorskip("cuda.bindings", reason="cuda.bindings is not installed")
    from cupy_memstrat.backends import RealBackend

    return RealBackend()


@pytest.mark.parametrize("check", vmm_facts.CHECKS, ids=lambda c: c.__name__)
def test_the_gpu_does_what_the_simulator_does(real, check):
    check(real)


def test_cupy_kernels_run_across_two_mapped_pages(real, cp):
    g = real.vmm_granularity(0)
    base = real.vmm_reserve(4 * g)
    handles = [real.vmm_create(0, g) for _ in range(2)]
    try:
        for i, h in enumerate(handles):
            real.vmm_map(base + i * g, g, h)
        real.vmm_set_access(base, 2 * g, 0)
        mem = cp.cuda.UnownedMemory(base, 2 * g, None)
        x = cp.ndarray((2 * g,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        x[:] = 3
        assert int(x.sum(dtype=cp.int64)) == 3 * 2 * g
        del x, mem
        cp.cuda.runtime.deviceSynchronize()
        real.vmm_unmap(base, 2 * g)
    finally:
        for h in handles:
            real.vmm_release(h)
        real.vmm_free_address(base, 4 * g)
