"""The backend seam (cupy_memstrat.backends): RealBackend and FakeBackend
implement every member of every protocol, with the protocol's parameter names."""

import inspect
import sys
import types

import pytest

import cupy_memstrat.backends as B
import cupy_memstrat.backends.cuda as real
import cupy_memstrat.backends.protocols as protocols
from cupy_memstrat.testing import FakeBackend, FakeCheckKernels

ALL = [(p, name) for p in B.PROTOCOLS for name in B.members(p)]


def _params(fn) -> list[str]:
    names = list(inspect.signature(fn).parameters)
    return names[1:] if names and names[0] == "self" else names


def _is_method(protocol, name) -> bool:
    return inspect.isfunction(inspect.getattr_static(protocol, name, None))


def test_the_protocols_cover_the_seam():
    members = B.members(B.Backend)
    assert len(members) == len(set(members)) == len(ALL)
    assert set(members) >= {
        "Error", "malloc", "free", "get_device", "set_device", "device_count", "mem_get_info",
        "device_properties", "versions", "clear_last_error", "device_synchronize", "context_active", "name",
        "current_stream", "current_stream_ptr", "current_stream_ptr_capsule", "stream_owns_handle",
        "stream_destroyed", "pool_create", "pool_destroy", "device_default_pool", "device_current_pool",
        "malloc_from_pool_async", "free_async", "pool_trim_to", "pool_set_access", "device_can_access_peer",
        "pool_get_attribute", "pool_set_attribute", "malloc_managed", "memory_type", "mem_advise",
        "mem_prefetch", "stream_busy", "stream_non_blocking", "event_create", "event_record", "event_done",
        "event_destroy", "memset_async", "check_kernels",
    }
    # what a strategy made with backend= checks, as before the protocols
    assert B.members(B.CoreBackend) == (
        "Error", "malloc", "free", "get_device", "device_count", "mem_get_info", "clear_last_error"
    )


def test_every_method_has_a_docstring():
    for protocol, name in ALL:
        if _is_method(protocol, name):
            assert inspect.getdoc(getattr(protocol, name)), f"{protocol.__name__}.{name}"


@pytest.mark.parametrize("protocol, name", ALL, ids=[f"{p.__name__}.{n}" for p, n in ALL])
def test_fake_backend_implements_it(protocol, name):
    fake = FakeBackend()
    assert hasattr(FakeBackend, name) and hasattr(fake, name)
    if _is_method(protocol, name):
        impl = inspect.getattr_static(FakeBackend, name)
        assert inspect.isfunction(impl), f"FakeBackend.{name} is not a method"
        assert _params(impl) == _params(getattr(protocol, name))


def _declared_on_real(name):
    # a method of the class, or a member declared in its body and bound in __init__ to CuPy's wrappers
    return name in vars(B.RealBackend) or name in inspect.get_annotations(B.RealBackend)


@pytest.mark.parametrize("protocol, name", ALL, ids=[f"{p.__name__}.{n}" for p, n in ALL])
def test_real_backend_class_implements_it(protocol, name):
    assert _declared_on_real(name), f"RealBackend has no {name}"
    impl = inspect.getattr_static(B.RealBackend, name, None)
    if _is_method(protocol, name) and inspect.isfunction(impl):
        assert _params(impl) == _params(getattr(protocol, name))


class _StubRuntime(types.ModuleType):
    """Enough of cupy_backends.cuda.api.runtime for RealBackend() to be made:
    one device, and a distinct function for every other name."""

    class CUDARuntimeError(RuntimeError):
        pass

    @staticmethod
    def getDeviceCount():
        return 1

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args):
            raise AssertionError(f"stub runtime.{name} called")

        call.__name__ = name
        return call


@pytest.fixture
def real_without_gpu(monkeypatch):
    runtime = _StubRuntime("cupy_backends.cuda.api.runtime")
    api = types.ModuleType("cupy_backends.cuda.api")
    api.runtime = runtime
    stream = types.ModuleType("cupy.cuda.stream")
    stream.get_current_stream = lambda device_id=-1: None
    for name, mod in {
        "cupy_backends": types.ModuleType("cupy_backends"),
        "cupy_backends.cuda": types.ModuleType("cupy_backends.cuda"),
        "cupy_backends.cuda.api": api,
        "cupy_backends.cuda.api.runtime": runtime,
        "cupy": types.ModuleType("cupy"),
        "cupy.cuda": types.ModuleType("cupy.cuda"),
        "cupy.cuda.stream": stream,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return B.RealBackend()


def test_a_real_backend_object_has_every_member(real_without_gpu):
    real = real_without_gpu
    for protocol in B.PROTOCOLS:
        assert B.missing(real, protocol) == [], protocol.__name__
    # the members bound in __init__ are what the class declares
    bound = set(vars(real)) - {"_runtime", "_get_current_stream", "_check_kernels"}
    assert bound == set(inspect.get_annotations(B.RealBackend))


@pytest.mark.parametrize("kernels", [B.CheckKernels, FakeCheckKernels])
def test_check_kernels_implement_verify_kernels(kernels):
    for name in B.members(B.VerifyKernels):
        assert hasattr(kernels, name), f"{kernels.__name__}.{name}"
        if _is_method(B.VerifyKernels, name):
            assert _params(getattr(kernels, name)) == _params(getattr(B.VerifyKernels, name))


def test_a_missing_method_is_found():
    fake = FakeBackend()
    assert B.missing(fake) == []
    stripped = types.SimpleNamespace(**{n: getattr(fake, n) for n in B.members(B.CoreBackend) if n != "free"})
    assert B.missing(stripped) == ["free"]
    with pytest.raises(TypeError, match=r"it lacks free of cupy_memstrat\.backends\.CoreBackend"):
        B.require(stripped)
    B.require(types.SimpleNamespace(**{n: getattr(fake, n) for n in B.members(B.CoreBackend)}))
    with pytest.raises(TypeError, match="pass an instance, not the class"):
        B.require(FakeBackend)


def test_a_strategy_names_what_its_backend_lacks():
    import cupy_memstrat

    fake = FakeBackend()
    partial = types.SimpleNamespace(**{n: getattr(fake, n) for n in B.members(B.CoreBackend) if n != "mem_get_info"})
    with pytest.raises(TypeError, match=r"backend: expected a CUDA backend object .* it lacks mem_get_info of "
                                        r"cupy_memstrat\.backends\.CoreBackend"):
        cupy_memstrat.create("device", backend=partial)


def test_the_seam_imports_nothing_of_the_fake():
    import ast

    """The real backend and the protocols know nothing of the simulator; only the package's
    selection (backends/__init__.py, CUPY_MEMSTRAT_BACKEND=fake) names it."""
    for path in (real.__file__, protocols.__file__):
        tree = ast.parse(open(path, encoding="utf-8").read())
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in imports for a in n.names]
        names += [n.module or "" for n in imports if isinstance(n, ast.ImportFrom)]
        assert not any("testing" in x or "sim" in x.split(".") for x in names), (path, names)


def test_every_cupy_wrapper_the_real_backend_binds_exists_in_cupys_runtime():
    """The stub runtime above answers any name; CuPy's own module (importable without a GPU) does not."""
    runtime = pytest.importorskip("cupy_backends.cuda.api.runtime", reason="CuPy is not installed")
    missing = [w for w in real._CUPY_RUNTIME.values() if not callable(getattr(runtime, w, None))]
    assert missing == [], f"cupy_backends.cuda.api.runtime has no {missing}"
    assert set(real._CUPY_RUNTIME) | {"current_stream", "Error"} == set(inspect.get_annotations(B.RealBackend))


@pytest.mark.parametrize("call", ["malloc", "malloc_managed", "malloc_from_pool_async"])
def test_the_simulator_refuses_a_size_that_is_not_an_int_before_allocating(call):
    """As CUDA's wrappers take a size_t: a float is a TypeError, and nothing is allocated."""
    fake = FakeBackend(memory="1GiB")
    args = {"malloc": (), "malloc_managed": (), "malloc_from_pool_async": (fake.device_default_pool(0), 0)}[call]
    with pytest.raises(TypeError):
        getattr(fake, call)(4096.0, *args)
    assert fake.used_bytes(0) == 0 and fake.malloc(512) % 256 == 0  # and the next pointer is an int
