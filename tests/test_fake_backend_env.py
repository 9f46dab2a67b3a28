"""CUPY_MEMSTRAT_BACKEND: a process-wide fake backend from the environment."""

import pytest

import cupy_memstrat
import cupy_memstrat.backends as C
from cupy_memstrat.testing import FakeBackend


@pytest.fixture
def fresh(monkeypatch):
    """get_backend() starts from scratch; the process's backend comes back afterwards."""
    monkeypatch.setattr(C, "_backend", None)
    return monkeypatch


def test_fake_gives_one_process_wide_fake_backend(fresh):
    fresh.setenv("CUPY_MEMSTRAT_BACKEND", "fake")
    b = C.get_backend()
    assert isinstance(b, FakeBackend) and b.device_count() == 1
    assert C.get_backend() is b  # created once


def test_fake_with_options(fresh):
    fresh.setenv("CUPY_MEMSTRAT_BACKEND", "fake:devices=2,memory=1GiB,name=Test GPU")
    b = C.get_backend()
    assert b.device_count() == 2
    assert b.device_properties(1) == dict(b.device_properties(1), total_memory=1 << 30, name="Test GPU")


def test_memory_per_device_sets_the_device_count(fresh):
    fresh.setenv("CUPY_MEMSTRAT_BACKEND", " FAKE : memory=1GiB/2GiB ")
    b = C.get_backend()
    assert [b.device_properties(d)["total_memory"] for d in range(2)] == [1 << 30, 2 << 30]


def test_strategies_made_by_name_use_it(fresh):
    fresh.setenv("CUPY_MEMSTRAT_BACKEND", "fake:memory=64MiB")
    s = cupy_memstrat.create("device")
    assert s.backend is C.get_backend()
    p = s.raw_malloc(4096)
    assert s.backend.is_allocated(p)
    s.raw_free(p)


@pytest.mark.parametrize("value", ["", "cuda", "real"])
def test_empty_or_cuda_means_the_real_backend(fresh, value):
    fresh.setenv("CUPY_MEMSTRAT_BACKEND", value)
    fresh.setattr(C, "RealBackend", lambda: "real")
    assert C.get_backend() == "real"


@pytest.mark.parametrize(
    "value, message",
    [
        ("gpu", r"CUPY_MEMSTRAT_BACKEND='gpu': unknown backend; expected 'cuda' \(the default\), 'fake'"),
        ("fake:devices=two", r"CUPY_MEMSTRAT_BACKEND='fake:devices=two': devices: expected an int from 1 to 64"),
        ("fake:devices=0", r"CUPY_MEMSTRAT_BACKEND='fake:devices=0': devices: expected an int from 1 to 64"),
        ("fake:devices=10000000", r"devices: expected an int from 1 to 64, got 10000000"),  # was 60 s and 3 GB
        ("fake:devices=\u0663", r"devices: expected an int from 1 to 64, got '\u0663'"),  # an Arabic-Indic 3
        ("fake:colour=red", r"unknown option 'colour'; valid options: devices, memory, name"),
        ("fake:memory", r"expected key=value, got 'memory'"),
        ("fake:memory=lots", r"CUPY_MEMSTRAT_BACKEND='fake:memory=lots': memory: cannot parse 'lots'"),
        ("fake:devices=3,memory=1GiB/2GiB", r"memory: expected 3 values"),
        ("fake:devices=2,devices=3", r"option 'devices' is given twice"),  # the last one won
    ],
)
def test_bad_values_name_the_variable(fresh, value, message):
    fresh.setenv("CUPY_MEMSTRAT_BACKEND", value)
    with pytest.raises(ValueError, match=message):
        C.get_backend()
    assert C._backend is None  # not cached: fixing the variable fixes the next call


def test_use_installs_a_fake_backed_strategy_into_cupy(fresh, restore_cupy_allocator):
    cupy = restore_cupy_allocator
    import numpy as np

    fresh.setenv("CUPY_MEMSTRAT_BACKEND", "fake:memory=1GiB")
    s = cupy_memstrat.use("pool")
    x = cupy.ndarray((1024,), dtype=np.float32)  # through the installed allocator
    assert cupy_memstrat.current() is s
    assert s.stats().bytes_in_use == 4096
    del x
    assert s.stats().bytes_in_use == 0


def test_use_from_env_installs_what_cupy_memstrat_names(fresh, restore_cupy_allocator):
    fresh.setenv("CUPY_MEMSTRAT_BACKEND", "fake:memory=1GiB")
    fresh.delenv("CUPY_MEMSTRAT", raising=False)
    assert cupy_memstrat.use_from_env() is None  # unset: nothing installed
    fresh.setenv("CUPY_MEMSTRAT", "  ")
    assert cupy_memstrat.use_from_env() is None
    fresh.setenv("CUPY_MEMSTRAT", "managed:prefetch=on_alloc")
    s = cupy_memstrat.use_from_env()
    assert cupy_memstrat.current() is s and s.name == "managed" and s.config["prefetch"] == "on_alloc"
    fresh.setenv("MY_STRATEGY", "device:colour=red")
    with pytest.raises(ValueError,
                       match=r"environment variable MY_STRATEGY='device:colour=red': .*unknown option 'colour'"):
        cupy_memstrat.use_from_env("MY_STRATEGY")
    assert cupy_memstrat.current() is s  # nothing changed


def test_backend_from_env_refuses_what_is_not_the_simulated_gpu_by_name():
    from cupy_memstrat.testing import backend_from_env

    with pytest.raises(TypeError, match=r"value: expected a str such as 'fake:devices=2', got int 5"):
        backend_from_env(5)
    with pytest.raises(ValueError, match=r"CUPY_MEMSTRAT_BACKEND='cuda': not the simulated GPU; expected 'fake'"):
        backend_from_env("cuda")
    assert backend_from_env("fake:DEVICES=2, Memory=1GiB").device_count() == 2  # case does not matter


def test_nvml_off_makes_a_fake_whose_process_count_is_unread():
    from cupy_memstrat.backends.sim.env import backend_from_env

    on, off = backend_from_env("fake:memory=1GiB"), backend_from_env("fake: NVML = Off ")
    on.hold_elsewhere(64 << 20)
    assert on.process_used(0) == 0 and on.mem_get_info(0)[0] == (1 << 30) - (64 << 20)
    assert off.process_used(0) is None
    with pytest.raises(ValueError, match=r"nvml: expected 'on' or 'off', got 'maybe'"):
        backend_from_env("fake:nvml=maybe")


@pytest.mark.parametrize("nbytes, device, error, message", [
    (1.5, 0, TypeError, r"nbytes: expected an int \(bytes\), got float 1.5"),
    (True, 0, TypeError, r"nbytes: expected an int \(bytes\), got bool True"),
    (1, -1, ValueError, "device: expected an int from 0 to 1, got -1"),
    (1, True, ValueError, "device: expected an int from 0 to 1, got True"),
    (1, 2, ValueError, "device: expected an int from 0 to 1, got 2"),
    (-1, 0, ValueError, r"other processes hold 0 bytes on device 0: expected a release of at most 0"),
    (2 << 30, 0, ValueError, r"device 0 has 1073741824 bytes free"),
])
def test_a_bad_hold_elsewhere_is_refused_by_name_and_changes_nothing(nbytes, device, error, message):
    from cupy_memstrat.testing import FakeBackend

    b = FakeBackend(devices=2, memory="1GiB")
    with pytest.raises(error, match=message):
        b.hold_elsewhere(nbytes, device)
    assert [b.mem_get_info(d)[0] for d in (0, 1)] == [1 << 30, 1 << 30] and b.process_used(1) == 0


def test_the_fake_s_nvml_switch_is_a_bool():
    from cupy_memstrat.testing import FakeBackend

    with pytest.raises(ValueError, match="nvml: expected True or False, got 'off'"):
        FakeBackend(nvml="off")
