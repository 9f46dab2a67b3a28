"""The simulated GPU's virtual memory management follows what the GPU does: the same checks as
tests/gpu/test_vmm_gpu.py (tests/vmm_facts.py), and the simulator's own view of access."""

import pytest
import vmm_facts

from cupy_memstrat.testing import FakeBackend

MiB = 1 << 20


@pytest.mark.parametrize("check", vmm_facts.CHECKS, ids=lambda c: c.__name__)
def test_the_simulator_does_what_the_gpu_does(check):
    b = FakeBackend(memory="8GiB")
    check(b)
    assert b.used_bytes(0) == 0 and b.vmm_mapped_bytes() == 0


def test_memory_is_usable_only_with_access_set_after_each_map():
    b = FakeBackend(memory="1GiB")
    base = b.vmm_reserve(8 * MiB)
    h = b.vmm_create(0, 2 * MiB)
    b.vmm_map(base, 2 * MiB, h)
    assert not b.vmm_accessible(base)
    b.vmm_set_access(base, 2 * MiB, 0)
    assert b.vmm_accessible(base, 2 * MiB) and not b.vmm_accessible(base, 4 * MiB)
    b.vmm_unmap(base, 2 * MiB)
    b.vmm_map(base, 2 * MiB, h)
    assert not b.vmm_accessible(base)  # mapped anew: access is set again


def test_a_reservation_with_mappings_cannot_be_freed_and_bad_devices_are_refused():
    b = FakeBackend(memory="1GiB")
    base = b.vmm_reserve(8 * MiB)
    h = b.vmm_create(0, 2 * MiB)
    b.vmm_map(base, 2 * MiB, h)
    with pytest.raises(b.Error):
        b.vmm_free_address(base, 8 * MiB)
    with pytest.raises(b.Error):
        b.vmm_create(3, 2 * MiB)
    with pytest.raises(b.Error):
        b.vmm_map(base + 64 * MiB, 2 * MiB, h)  # outside the reservation
