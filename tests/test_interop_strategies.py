"""The ``rmm`` and ``torch`` strategies and the dead-stream guard, on the fake backend.

The libraries themselves allocate only on a GPU (tests/gpu/test_interop_gpu.py); here the
adapters' logic runs: accounting, argument checks, the errors without the library, the
guard that makes a handle-keyed cache wait after a stream dies. RMM installs without a
GPU, so its resource check runs against real RMM classes where it is installed.
"""

import gc
import importlib.util

import pytest

import cupy_memstrat
from cupy_memstrat import MemstratError
from cupy_memstrat.strategies import RMMStrategy, TorchStrategy
from cupy_memstrat.strategies.stream_deaths import DeadStreamGuard
from cupy_memstrat.testing import FakeBackend
from helpers import dead_stream_allocation

MiB = 1 << 20
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_RMM = importlib.util.find_spec("rmm") is not None


@pytest.mark.parametrize("cls", [RMMStrategy, TorchStrategy])
def test_allocations_are_counted_listed_and_given_back(fake, cls):
    s = cls(backend=fake, track_origins=True)
    before = fake.mem_get_info(0)[0]
    p = s.raw_malloc(3 * MiB)
    q = s.raw_malloc(1000)
    st = s.stats()
    assert st.bytes_in_use == 3 * MiB + 1000 and st.n_live == 2 and st.peak_bytes_in_use == 3 * MiB + 1000
    assert {a.ptr: a.size for a in s.live_allocations()} == {p: 3 * MiB, q: 1000}
    assert all(a.origin is not None and a.origin.filename == __file__ for a in s.live_allocations())
    assert fake.mem_get_info(0)[0] < before
    s.raw_free(p)
    s.raw_free(q)
    assert s.stats().bytes_in_use == 0 and s.stats().n_frees == 2 and fake.mem_get_info(0)[0] == before
    assert s.trim() == 0  # nothing cached on the fake backend
    s.reset_peak()  # what the pytest plugin calls before each test
    assert s.stats().peak_bytes_in_use == 0 and s.stats().peak_bytes_reserved == 0


@pytest.mark.parametrize("name", ["rmm", "torch", "pytorch"])
def test_the_registry_knows_them_and_says_what_they_need(name):
    cls = cupy_memstrat.registry.get_registry().get(name)
    assert cls.requires in ("rmm", "torch")
    missing = importlib.util.find_spec(cls.requires) is None
    why = cls.unavailable()
    assert (why is not None) == missing
    if missing:
        assert repr(cls.requires) in why and "not installed" in why


def _real_backend(monkeypatch):
    """The next strategy made without a backend gets the CUDA one (on a machine without a GPU
    it cannot start: the missing library is named first)."""
    from cupy_memstrat import backends as C

    monkeypatch.delenv("CUPY_MEMSTRAT_BACKEND", raising=False)
    monkeypatch.setattr(C, "_backend", None)


@pytest.mark.skipif(HAVE_TORCH, reason="PyTorch is installed: its absence cannot be shown here")
def test_torch_without_pytorch_is_a_clear_error_and_the_installed_strategy_stays(fake_cupy, monkeypatch):
    prev = cupy_memstrat.use("device")
    _real_backend(monkeypatch)  # the fake needs no library: the CUDA backend is the one that does
    with pytest.raises(MemstratError, match=r"strategy 'torch' needs PyTorch with CUDA: import torch failed"):
        cupy_memstrat.use("torch")
    assert cupy_memstrat.current() is prev


@pytest.mark.skipif(HAVE_RMM, reason="RMM is installed: its absence cannot be shown here")
def test_rmm_without_rmm_is_a_clear_error_and_the_installed_strategy_stays(fake_cupy, monkeypatch):
    prev = cupy_memstrat.use("device")
    _real_backend(monkeypatch)
    with pytest.raises(MemstratError, match=r"strategy 'rmm' needs RMM.*pip install rmm-cu13"):
        cupy_memstrat.use("rmm")
    assert cupy_memstrat.current() is prev


@pytest.mark.parametrize("bad", ["pool", 5, object(), FakeBackend])
def test_rmm_refuses_a_resource_that_is_not_a_device_memory_resource(fake, bad):
    with pytest.raises(TypeError, match=r"resource: expected an rmm.mr.DeviceMemoryResource") as e:
        RMMStrategy(backend=fake, resource=bad)
    assert repr(bad) in str(e.value)
    if isinstance(bad, str):
        assert "cannot be written in a spec string" in str(e.value)
    if not HAVE_RMM and not isinstance(bad, str):
        assert "RMM is not installed" in str(e.value)


def test_a_resource_in_a_spec_string_is_refused_with_how_to_pass_one(fake):
    with pytest.raises(TypeError, match=r"got str 'pool' \(a resource cannot be written in a spec string"):
        cupy_memstrat.create("rmm:resource=pool", backend=fake)


@pytest.mark.skipif(not HAVE_RMM, reason="RMM is not installed")
def test_rmm_takes_a_real_resource_object(fake):
    import rmm

    mr = rmm.mr.CudaMemoryResource()
    s = RMMStrategy(backend=fake, resource=mr)
    assert s.config["resource"] is mr
    p = s.raw_malloc(4096)
    s.raw_free(p)


def test_a_bad_free_loses_nothing_allocated(fake):
    s = TorchStrategy(backend=fake)
    p = s.raw_malloc(MiB)
    with pytest.warns(cupy_memstrat.InvalidFreeWarning):
        s.raw_free(p + 1)
    assert s.stats().bytes_in_use == MiB and [a.ptr for a in s.live_allocations()] == [p]
    s.raw_free(p)


# -- the dead-stream guard ---------------------------------------------------------------------

def test_after_a_stream_that_allocated_dies_the_next_allocation_waits_for_its_work(fake):
    """CUDA gives a destroyed stream's handle to the next stream while the old one's kernel
    still runs (the fake does the same): a cache keyed by handle must not hand out the old
    stream's block before that work is done."""
    s = TorchStrategy(backend=fake)
    _p, q, B = dead_stream_allocation(fake, s, MiB)
    assert fake.busy_destroyed_streams() == 0  # the allocation waited for A's kernel
    assert s.guard.n_syncs == [1]
    with B:
        s.raw_free(q)
    with B:  # B lives: no more waiting
        s.raw_free(s.raw_malloc(MiB))
    assert s.guard.n_syncs == [1]


def test_without_the_guard_the_dead_streams_work_would_still_run(fake):
    """The control: the same steps with the guard's check skipped leave A's kernel running
    when B allocates."""
    guard = DeadStreamGuard(fake, 1)
    A = fake.stream(non_blocking=True)
    guard.before_allocation(A, 0)
    fake.launch(A)
    del A
    gc.collect()
    B = fake.stream(non_blocking=True)
    assert guard.pending == [True]
    assert fake.busy_destroyed_streams() == 1  # what a handle-keyed cache would race with
    guard.before_allocation(B, 0)
    assert fake.busy_destroyed_streams() == 0 and guard.pending == [False]


def test_the_guard_ignores_the_default_streams_and_wrappers_of_streams_owned_elsewhere(fake):
    guard = DeadStreamGuard(fake, 1)
    guard.before_allocation(fake.current_stream(0), 0)  # the null stream: never destroyed
    owner = fake.stream(non_blocking=True)
    for _ in range(3):  # a wrapper made anew at every step (ExternalStream around a PyTorch stream)
        w = fake.external_stream(owner)
        guard.before_allocation(w, 0)
        del w
        gc.collect()
    assert guard.pending == [False] and guard.n_syncs == [0]
    guard.before_allocation(owner, 0)
    guard.before_allocation(owner, 0)  # watched once
    del owner
    gc.collect()
    assert guard.pending == [True]


# -- from the adversarial trial --------------------------------------------------------------

@pytest.mark.skipif(not HAVE_RMM, reason="RMM is not installed")
def test_rmm_refuses_the_abstract_resource_and_python_subclasses(fake):
    """rmm.mr.DeviceMemoryResource() holds no resource: RMM aborted the process
    (std::bad_optional_access) at the first allocation from it."""
    import rmm

    class Mine(rmm.mr.DeviceMemoryResource):
        pass

    for bad in (rmm.mr.DeviceMemoryResource(), Mine()):
        with pytest.raises(TypeError, match=r"which is not one of RMM's resources .*CallbackMemoryResource"):
            RMMStrategy(backend=fake, resource=bad)


@pytest.mark.parametrize("requires", ["nosuch_pkg_memstrat.sub", "__main__", "nosuch_pkg_memstrat"])
def test_unavailable_gives_a_reason_and_never_raises(requires):
    cls = type("Needs", (cupy_memstrat.Strategy,), {"name": "needs-x", "requires": requires})
    why = cls.unavailable()
    if requires != "__main__":
        assert why is not None and repr(requires) in why


@pytest.mark.parametrize("bad", [5, True, ["torch"], "", "torch cuda"])
def test_the_registry_refuses_a_requires_that_is_no_module_name(bad):
    cls = type("Needs", (cupy_memstrat.Strategy,), {"name": "needs-y", "requires": bad})
    with pytest.raises(TypeError, match=r"requires must be None or a module name such as 'torch', got"):
        cupy_memstrat.registry.Registry().add(cls)
