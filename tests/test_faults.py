"""cupy_memstrat.faults without a GPU: the driver's byte layouts, every way
opening a source can fail, source selection, and the counting semantics.

The driver is emulated by ``FakeUvmKernel``, which copies params in and out
the way uvm_api.h's __UVM_ROUTE_CMD_STACK does (sizeof(its own struct) bytes)
and answers as uvm_tools.c does, for each of the three params layouts the
open-gpu-kernel-modules history has had.
"""

import ctypes
import dataclasses
import errno
import mmap
import os
import struct
import types
from typing import ClassVar

import pytest

import cupy_memstrat
from cupy_memstrat import faults
from cupy_memstrat.faults import _cupti, _sources, _uvm  # the sources, internal to the package
from cupy_memstrat.faults._errors import unavailable
from cupy_memstrat.errors import FaultCountersUnavailable, MemstratError

MiB = 1 << 20


# ---------------------------------------------------------------------------
# The emulated driver
# ---------------------------------------------------------------------------


class FakeUvmKernel:
    """``fcntl.ioctl`` stand-in for /dev/nvidia-uvm-tools.

    layout: "unversioned" (<= 550.40.07 and >= 565: rmStatus at 48, struct of
    56 bytes), "requested/granted" (550.40.53-555: rmStatus 48,
    requestedVersion 52, grantedVersion 56; 64 bytes), "version" (560.x:
    version 48, rmStatus 52; 56 bytes).
    """

    SIZES: ClassVar[dict] = {"unversioned": 56, "requested/granted": 64, "version": 56}

    def __init__(self, layout="unversioned", *, init_status=None, enable_status=0, grant=None,
                 init_errno=None, enable_errno=None):
        self.layout = layout
        self.init_status = init_status or {}  # uvm fd -> NV_STATUS (default 0)
        self.enable_status = enable_status
        self.grant = grant  # grantedVersion to answer (default: the requested one)
        self.init_errno = init_errno
        self.enable_errno = enable_errno
        self.requests = []
        self.init_params = []
        self.control = None
        self.uvm_fd = None
        self.flags = None

    def __call__(self, fd, request, buf, mutate_flag=True):
        assert isinstance(buf, bytearray) and mutate_flag is True
        self.requests.append(request)
        if request == 56:
            if self.init_errno:
                raise OSError(self.init_errno, os.strerror(self.init_errno))
            size = self.SIZES[self.layout]
            p = bytearray(buf[:size])  # copy_from_user(&params, arg, sizeof(params))
            self.init_params.append(bytes(p))
            _qb, qsize, control, _proc, _allp, uvm_fd = struct.unpack_from("=QQQ16sII", p)
            if self.layout == "version":
                version, status_at = struct.unpack_from("=I", p, 48)[0], 52
            elif self.layout == "requested/granted":
                version, status_at = struct.unpack_from("=I", p, 52)[0], 48
            else:
                version, status_at = None, 48
            status = self.init_status.get(uvm_fd, 0)
            if version is not None and version not in (1, 2):  # UvmToolsEventQueueVersion_V1/_V2
                status = 0x1F
            struct.pack_into("=I", p, status_at, status)
            if status == 0:
                assert qsize == 0  # counter mode
                self.control, self.uvm_fd = control, uvm_fd
                if self.layout == "requested/granted":
                    struct.pack_into("=I", p, 56, self.grant if self.grant is not None else version)
            buf[:size] = p  # copy_to_user(arg, &params, sizeof(params))
            return 0
        if request == 60:
            if self.enable_errno:
                raise OSError(self.enable_errno, os.strerror(self.enable_errno))
            p = bytearray(buf[:16])
            self.flags = struct.unpack_from("=Q", p)[0]
            struct.pack_into("=I", p, 8, self.enable_status)
            buf[:16] = p
            return 0
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    def set_counters(self, *, htod=0, dtoh=0, cpu=0, gpu=0):
        """Write the control page as the driver's atomic64_add would leave it."""
        c = [0] * 10
        c[0], c[1], c[2], c[9] = htod, dtoh, cpu, gpu
        ctypes.memmove(self.control, struct.pack("=10Q", *c), 80)


@pytest.fixture
def uvm_env(tmp_path):
    """A tools node (a plain file), an fd directory where fds 5 and 7 are
    /dev/nvidia-uvm, and a module version file."""
    tools = tmp_path / "nvidia-uvm-tools"
    tools.write_bytes(b"")
    fd_dir = tmp_path / "fd"
    fd_dir.mkdir()
    for name, target in {"0": "/dev/pts/0", "3": "/dev/nvidiactl", "5": "/dev/nvidia-uvm",
                         "7": "/dev/nvidia-uvm", "9": "/dev/nvidia-uvm-tools"}.items():
        os.symlink(target, fd_dir / name)
    version = tmp_path / "version"
    version.write_text("580.159.04\n")
    opened = []

    def opener(path, flags):
        fd = os.open(path, flags)
        opened.append(fd)
        return fd

    env = types.SimpleNamespace(
        kwargs={"tools_path": str(tools), "fd_dir": str(fd_dir), "module_version_path": str(version),
                "opener": opener},
        opened=opened,
    )
    yield env


def _closed(fd):
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


# ---------------------------------------------------------------------------
# Byte layouts
# ---------------------------------------------------------------------------


def test_init_params_are_the_64_byte_counter_mode_struct():
    b = _uvm.pack_init_params(0x7F0000001000, 5)
    assert len(b) == 64
    qbuf, qsize, control, proc, allp, uvm_fd, w48, w52, w56, w60 = struct.unpack("<QQQ16sIIIIII", b)
    assert (qbuf, qsize) == (0, 0)  # queue size 0 selects counter mode (uvm_tools.c)
    assert control == 0x7F0000001000
    assert proc == bytes(16) and allp == 1 and uvm_fd == 5
    # version 1 where 560.x reads `version` and where 550.40.53-555 read `requestedVersion`
    assert (w48, w52, w56, w60) == (1, 1, 0, 0)


@pytest.mark.parametrize("address", [0, 0x1234, -4096])
def test_init_params_refuse_an_unaligned_control_buffer(address):
    with pytest.raises(ValueError, match="page-aligned"):
        _uvm.pack_init_params(address, 5)


def test_init_params_refuse_a_negative_fd():
    with pytest.raises(ValueError, match="uvm_fd must be a file descriptor >= 0, got -1"):
        _uvm.pack_init_params(mmap.PAGESIZE, -1)


@pytest.mark.parametrize("layout", ["unversioned", "requested/granted", "version"])
def test_one_buffer_works_with_every_driver_layout(layout):
    kernel = FakeUvmKernel(layout)
    buf = bytearray(256)
    buf[:64] = _uvm.pack_init_params(mmap.PAGESIZE, 5)
    kernel(3, 56, buf)
    reply = _uvm.parse_init_params(buf)
    assert reply.status == 0
    assert reply.layout == layout
    assert reply.granted_version == (1 if layout == "requested/granted" else None)


@pytest.mark.parametrize("layout", ["unversioned", "requested/granted", "version"])
@pytest.mark.parametrize("status", [0x1F, 0x16, 0x1, 0x51])
def test_a_failure_status_is_read_from_every_layout(layout, status):
    kernel = FakeUvmKernel(layout, init_status={5: status})
    buf = bytearray(256)
    buf[:64] = _uvm.pack_init_params(mmap.PAGESIZE, 5)
    kernel(3, 56, buf)
    assert _uvm.parse_init_params(buf).status == status


def test_parse_init_params_refuses_a_short_buffer():
    with pytest.raises(ValueError, match="expected at least 64 bytes of init params, got 56"):
        _uvm.parse_init_params(bytes(56))


def test_enable_params_and_flags():
    b = _uvm.pack_enable_counters()
    assert len(b) == 16
    assert struct.unpack("<QI4x", b) == (0x1 | 0x2 | 0x4 | 0x200, 0)
    assert _uvm.parse_enable_status(b[:8] + struct.pack("<I", 0x1F) + bytes(4)) == 0x1F
    with pytest.raises(ValueError, match="non-zero 64-bit mask, got 0"):
        _uvm.pack_enable_counters(0)


def test_control_page_indices_follow_uvm_counter_name():
    page = struct.pack("<10Q", 111, 222, 3, 0, 0, 0, 0, 777, 888, 9)
    assert _uvm.parse_counters(page) == {"bytes_htod": 111, "bytes_dtoh": 222, "cpu_faults": 3, "gpu_faults": 9}
    with pytest.raises(ValueError, match="expected at least 80 bytes of counters, got 72"):
        _uvm.parse_counters(page[:72])


def test_nv_status_names_are_in_messages():
    assert _uvm.nv_status_name(0x1F) == "rmStatus 0x1f (NV_ERR_INVALID_ARGUMENT)"
    assert _uvm.nv_status_name(0x4242) == "rmStatus 0x4242"


def test_find_uvm_fds_matches_the_node_exactly(uvm_env):
    assert _uvm.find_uvm_fds(uvm_env.kwargs["fd_dir"]) == [5, 7]  # not nvidia-uvm-tools, not nvidiactl
    assert _uvm.find_uvm_fds("/nonexistent/fd") == []


# ---------------------------------------------------------------------------
# Opening the driver source
# ---------------------------------------------------------------------------


def test_open_driver_counters_success_reads_deltas_from_the_page(uvm_env):
    kernel = FakeUvmKernel()
    inits = []
    src = _uvm.open_driver_counters(ioctl=kernel, init_cuda=lambda: inits.append(1), **uvm_env.kwargs)
    try:
        assert inits == [1]  # CUDA initialised before looking for /dev/nvidia-uvm
        assert kernel.requests == [56, 60]
        assert kernel.uvm_fd == 5 and src.uvm_fd == 5
        assert kernel.control % mmap.PAGESIZE == 0
        assert kernel.flags == 0x207
        assert src.reply.layout == "unversioned" and src.module_version == "580.159.04"
        assert src.read() == (0, 0, 0, 0)
        kernel.set_counters(htod=64 * MiB, dtoh=2 * MiB, cpu=7, gpu=1024)
        assert src.read() == (1024, 7, 64 * MiB, 2 * MiB)  # (gpu, cpu, htod, dtoh)
        assert "nvidia-uvm 580.159.04" in src.describe()
    finally:
        src.close()
    assert _closed(uvm_env.opened[0])


def test_no_device_node(tmp_path):
    with pytest.raises(FaultCountersUnavailable) as info:
        _uvm.open_driver_counters(tools_path=str(tmp_path / "nvidia-uvm-tools"), ioctl=FakeUvmKernel())
    msg = str(info.value)
    assert f"no device node {tmp_path / 'nvidia-uvm-tools'}" in msg
    assert "source 'driver' is unavailable" in msg
    assert info.value.reasons["driver"].startswith("no device node")
    assert isinstance(info.value, MemstratError)


def test_permission_denied(uvm_env):
    def opener(path, flags):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    kw = dict(uvm_env.kwargs, opener=opener)
    with pytest.raises(FaultCountersUnavailable, match="permission denied opening .*nvidia-uvm-tools"):
        _uvm.open_driver_counters(ioctl=FakeUvmKernel(), **kw)


def test_cuda_failure_is_a_reason_and_closes_the_node(uvm_env):
    def init_cuda():
        raise cupy_memstrat.NoDeviceError("no CUDA device is available: cudaErrorNoDevice")

    with pytest.raises(FaultCountersUnavailable, match="CUDA is not usable: no CUDA device is available"):
        _uvm.open_driver_counters(ioctl=FakeUvmKernel(), init_cuda=init_cuda, **uvm_env.kwargs)
    assert _closed(uvm_env.opened[0])


def test_no_uvm_descriptor_in_this_process(uvm_env, tmp_path):
    empty = tmp_path / "nofd"
    empty.mkdir()
    kw = dict(uvm_env.kwargs, fd_dir=str(empty))
    with pytest.raises(FaultCountersUnavailable, match="this process has no /dev/nvidia-uvm open"):
        _uvm.open_driver_counters(ioctl=FakeUvmKernel(), **kw)
    assert _closed(uvm_env.opened[0])


def test_ioctl_errno_names_the_request(uvm_env):
    kernel = FakeUvmKernel(init_errno=errno.ENOTTY)
    with pytest.raises(FaultCountersUnavailable) as info:
        _uvm.open_driver_counters(ioctl=kernel, **uvm_env.kwargs)
    assert "ioctl UVM_TOOLS_INIT_EVENT_TRACKER (56)" in str(info.value)
    assert os.strerror(errno.ENOTTY) in str(info.value)
    assert _closed(uvm_env.opened[0])


def test_rm_status_is_reported(uvm_env):
    kernel = FakeUvmKernel(init_status={5: 0x1F})
    with pytest.raises(FaultCountersUnavailable) as info:
        _uvm.open_driver_counters(ioctl=kernel, **uvm_env.kwargs)
    msg = str(info.value)
    assert "UVM_TOOLS_INIT_EVENT_TRACKER (56) failed" in msg
    assert "fd 5: rmStatus 0x1f (NV_ERR_INVALID_ARGUMENT)" in msg
    assert kernel.requests == [56]  # an invalid-argument answer is not retried on fd 7


def test_a_wrong_kind_of_uvm_descriptor_is_skipped(uvm_env):
    # CUDA's second /dev/nvidia-uvm fd is an UVM_FD_MM one: NV_ERR_ILLEGAL_ACTION
    kernel = FakeUvmKernel(init_status={5: 0x16})
    src = _uvm.open_driver_counters(ioctl=kernel, **uvm_env.kwargs)
    try:
        assert src.uvm_fd == 7 and kernel.requests == [56, 56, 60]
    finally:
        src.close()


def test_every_descriptor_refused(uvm_env):
    kernel = FakeUvmKernel(init_status={5: 0x16, 7: 0x1B})
    with pytest.raises(FaultCountersUnavailable) as info:
        _uvm.open_driver_counters(ioctl=kernel, **uvm_env.kwargs)
    msg = str(info.value)
    assert "fd 5: rmStatus 0x16 (NV_ERR_ILLEGAL_ACTION)" in msg
    assert "fd 7: rmStatus 0x1b (NV_ERR_INSUFFICIENT_PERMISSIONS)" in msg


def test_version_mismatch(uvm_env):
    kernel = FakeUvmKernel("requested/granted", grant=2)
    with pytest.raises(FaultCountersUnavailable, match="version mismatch: the driver granted version 2, requested 1"):
        _uvm.open_driver_counters(ioctl=kernel, **uvm_env.kwargs)
    assert _closed(uvm_env.opened[0])


@pytest.mark.parametrize("layout", ["requested/granted", "version"])
def test_older_layouts_open(uvm_env, layout):
    kernel = FakeUvmKernel(layout)
    src = _uvm.open_driver_counters(ioctl=kernel, **uvm_env.kwargs)
    try:
        assert src.reply.layout == layout
        kernel.set_counters(gpu=3)
        assert src.read()[0] == 3
    finally:
        src.close()


def test_enable_counters_failure(uvm_env):
    kernel = FakeUvmKernel(enable_status=0x1F)
    with pytest.raises(FaultCountersUnavailable, match=r"UVM_TOOLS_ENABLE_COUNTERS \(60\) failed: rmStatus 0x1f"):
        _uvm.open_driver_counters(ioctl=kernel, **uvm_env.kwargs)
    assert _closed(uvm_env.opened[0])


def test_enable_counters_errno(uvm_env):
    kernel = FakeUvmKernel(enable_errno=errno.EINVAL)
    with pytest.raises(FaultCountersUnavailable, match=r"UVM_TOOLS_ENABLE_COUNTERS \(60\) failed: \[Errno 22\]"):
        _uvm.open_driver_counters(ioctl=kernel, **uvm_env.kwargs)


# ---------------------------------------------------------------------------
# CUPTI, through a fake cupti.cupti module
# ---------------------------------------------------------------------------


class _CuptiError(Exception):
    def __init__(self, status, name):
        super().__init__(f"{name} ({status})")
        self.status = status


class FakeCupti:
    """The parts of cupti.cupti (cupti-python 13.0.1) that faults uses."""

    ActivityKind = types.SimpleNamespace(UNIFIED_MEMORY_COUNTER=25, KERNEL=10)
    ActivityUnifiedMemoryCounterKind = types.SimpleNamespace(
        BYTES_TRANSFER_HTOD=1, BYTES_TRANSFER_DTOH=2, CPU_PAGE_FAULT_COUNT=3, GPU_PAGE_FAULT=4, THRASHING=5
    )
    ActivityUnifiedMemoryCounterScope = types.SimpleNamespace(PROCESS_ALL_DEVICES=2)
    cuptiError = _CuptiError

    def __init__(self, *, fail=None):
        self.fail = fail or {}  # function name -> (status, name)
        self.enabled = False
        self.pending = []
        self.calls = []
        self.configs = None

    def ActivityUnifiedMemoryCounterConfig(self, n):
        cfg = [types.SimpleNamespace(scope=0, kind=0, device_id=0, enable=0) for _ in range(n)]
        self.configs = cfg
        return _Cfg(cfg)

    def _maybe_fail(self, name):
        self.calls.append(name)
        if name in self.fail:
            raise _CuptiError(*self.fail[name])

    def activity_register_callbacks(self, requested, completed):
        self._maybe_fail("activity_register_callbacks")
        self.requested, self.completed = requested, completed

    def activity_configure_unified_memory_counter(self, ptr, n):
        self._maybe_fail("activity_configure_unified_memory_counter")
        assert ptr == 12345 and n == 4

    def activity_enable(self, kind):
        self._maybe_fail("activity_enable")
        assert kind == 25
        self.enabled = True

    def activity_disable(self, kind):
        self._maybe_fail("activity_disable")
        self.enabled = False

    def activity_flush_all(self, flag):
        self.calls.append(f"flush({flag})")
        recs, self.pending = self.pending, []
        if recs:
            self.completed(recs)

    def record(self, counter_kind, value, kind=25):
        if self.enabled:
            self.pending.append(types.SimpleNamespace(kind=kind, counter_kind=counter_kind, value=value))


class _Cfg:
    def __init__(self, items):
        self.items = items
        self.ptr = 12345

    def __getitem__(self, i):
        return self.items[i]


def test_cupti_counts_records_and_never_sums_program_counters():
    cp = FakeCupti()
    src = _cupti.open_cupti_counters(cupti=cp)
    k = cp.ActivityUnifiedMemoryCounterKind
    assert [(c.kind, c.scope, c.enable) for c in cp.configs] == [(1, 2, 1), (2, 2, 1), (3, 2, 1), (4, 2, 1)]
    assert cp.calls[:4] == ["activity_register_callbacks", "activity_configure_unified_memory_counter",
                            "activity_enable", "activity_disable"]  # probed at open, then off
    cp.record(k.GPU_PAGE_FAULT, 5)  # not enabled: CUPTI records nothing
    src.acquire()
    assert cp.enabled
    cp.record(k.BYTES_TRANSFER_HTOD, 2 * MiB)
    cp.record(k.BYTES_TRANSFER_HTOD, 2 * MiB)
    cp.record(k.BYTES_TRANSFER_DTOH, 64 * 1024)
    cp.record(k.CPU_PAGE_FAULT_COUNT, 0x7F00DEADBEEF)  # a program counter
    cp.record(k.CPU_PAGE_FAULT_COUNT, 0x7F00DEADBEF3)
    cp.record(k.GPU_PAGE_FAULT, 3)
    cp.record(k.THRASHING, 4096)
    cp.record(k.BYTES_TRANSFER_HTOD, 999, kind=10)  # another activity kind
    assert src.read() == (1, 2, 4 * MiB, 64 * 1024)
    src.release()
    assert cp.enabled  # stays on: CUPTI sees only memory allocated while it is on


def test_cupti_is_switched_on_by_the_first_counter_and_stays_on():
    cp = FakeCupti()
    src = _cupti.open_cupti_counters(cupti=cp)
    assert not cp.enabled
    src.acquire()
    src.acquire()
    src.release()
    src.release()
    assert cp.enabled and cp.calls.count("activity_enable") == 2  # the probe at open, then once
    assert cp.calls[-1] == "flush(1)" and "activity_disable" not in cp.calls[4:]


def test_cupti_not_installed(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupti(name, *args, **kw):
        if name == "cupti" or name.startswith("cupti."):
            raise ImportError("No module named 'cupti'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cupti)
    with pytest.raises(FaultCountersUnavailable,
                       match=r"cupti-python is not installed \(pip install 'cupy-memstrat\[cupti\]'\)"):
        _cupti.open_cupti_counters()


@pytest.mark.parametrize(
    "step", ["activity_register_callbacks", "activity_configure_unified_memory_counter", "activity_enable"]
)
def test_cupti_failures_name_the_call_and_error(step):
    cp = FakeCupti(fail={step: (13, "ERROR_NOT_READY")})
    with pytest.raises(FaultCountersUnavailable) as info:
        _cupti.open_cupti_counters(cupti=cp)
    assert f"CUPTI {step}" in str(info.value) and "ERROR_NOT_READY (13)" in str(info.value)
    assert "cupti" in info.value.reasons


def test_cupti_waits_for_cuda():
    calls = []
    cp = FakeCupti()

    def init_cuda():
        calls.append("cuda")
        assert cp.calls == []  # CUPTI untouched before the driver is initialised

    _cupti.open_cupti_counters(cupti=cp, init_cuda=init_cuda)
    assert calls == ["cuda"]


# ---------------------------------------------------------------------------
# Counters on a fake backend
# ---------------------------------------------------------------------------


class StandIn:
    """A fake backend with just the three methods the fake source needs."""

    def __init__(self, devices=2):
        self.n = devices
        self.c = {"bytes_htod": 0, "bytes_dtoh": 0, "cpu_faults": 0, "gpu_faults": 0}
        self.log = []
        self.queued = dict.fromkeys(self.c, 0)  # "work" that lands at the next sync

    def uvm_counters(self):
        self.log.append("read")
        return dict(self.c)

    def device_synchronize(self, device):
        self.log.append(f"sync{device}")
        for k, v in self.queued.items():
            self.c[k] += v
        self.queued = dict.fromkeys(self.c, 0)

    def device_count(self):
        return self.n

    def work(self, **kw):
        for k, v in kw.items():
            self.c[k] += v


def test_context_manager_counts_the_block_only():
    b = StandIn()
    b.work(gpu_faults=100, bytes_htod=5 * MiB)  # before: not counted
    with faults.count(backend=b) as c:
        b.work(gpu_faults=16, cpu_faults=2, bytes_htod=MiB, bytes_dtoh=128 * 1024)
    b.work(gpu_faults=7)  # after: not counted
    assert (c.gpu_faults, c.cpu_faults, c.bytes_htod, c.bytes_dtoh) == (16, 2, MiB, 128 * 1024)
    assert c.source == "fake" and c.exact is True and not c.running
    assert c.counts == faults.FaultCounts(16, 2, MiB, 128 * 1024, "fake", True)


def test_start_synchronises_before_the_snapshot_so_queued_work_is_not_counted():
    b = StandIn(devices=2)
    b.queued["gpu_faults"] = 50  # queued before start: lands at start's sync
    c = faults.FaultCounter(backend=b).start()
    assert b.log == ["sync0", "sync1", "read"]
    b.queued["gpu_faults"] = 3  # queued inside: lands at stop's sync, counted
    assert c.stop().gpu_faults == 3
    assert b.log[-3:] == ["sync0", "sync1", "read"]


def test_device_picks_the_device_to_synchronise():
    b = StandIn(devices=3)
    c = faults.FaultCounter(device=2, backend=b)
    c.start()
    c.stop()
    assert [e for e in b.log if e.startswith("sync")] == ["sync2", "sync2"]


def test_read_gives_the_running_delta_and_restart_resets():
    b = StandIn()
    c = faults.FaultCounter(backend=b)
    c.start()
    b.work(cpu_faults=4)
    assert c.read().cpu_faults == 4 and c.running
    b.queued["cpu_faults"] = 1  # queued work: read() synchronises first
    assert c.read().cpu_faults == 5
    b.work(cpu_faults=1)
    assert c.stop().cpu_faults == 6
    assert c.read().cpu_faults == 6  # after stop: the final counts
    b.work(cpu_faults=10)
    c.start()  # restart: a new baseline
    b.work(cpu_faults=2)
    assert c.stop().cpu_faults == 2


def test_misuse_is_refused_clearly():
    c = faults.FaultCounter(backend=StandIn())
    with pytest.raises(RuntimeError, match="not started"):
        c.read()
    with pytest.raises(RuntimeError, match="not running"):
        c.stop()
    with pytest.raises(RuntimeError, match="has not counted yet"):
        _ = c.gpu_faults
    c.start()
    with pytest.raises(RuntimeError, match="already running"):
        c.start()


def test_the_block_is_stopped_even_when_it_raises():
    b = StandIn()
    with pytest.raises(KeyError), faults.count(backend=b) as c:
        b.work(gpu_faults=9)
        raise KeyError("boom")
    assert not c.running and c.gpu_faults == 9


def test_the_project_fake_backend_simulates_managed_memory():
    from cupy_memstrat.testing import FakeBackend

    b = FakeBackend()
    if not hasattr(b, "uvm_counters") or not hasattr(b, "touch"):
        pytest.skip("FakeBackend has no managed-memory simulation yet")
    ptr = b.malloc_managed(MiB)
    b.touch(ptr, MiB, "host")
    with faults.count(backend=b) as c:
        b.touch(ptr, MiB, "device")
    assert c.counts == faults.FaultCounts(16, 0, MiB, 0, "fake", True)  # 16 pages of 64 KiB
    with faults.count(backend=b) as c:
        b.touch(ptr, MiB, "device")
    assert c.gpu_faults == 0  # resident: the second pass does not fault


# ---------------------------------------------------------------------------
# Arguments and source selection
# ---------------------------------------------------------------------------


@pytest.fixture
def fresh_sources(monkeypatch):
    """Process-wide sources replaced by fakes; forgotten before and after."""
    _sources.reset()
    calls = {"driver": 0, "cupti": 0}
    state = {"driver": None, "cupti": None}  # None: opens; a str: fails with that reason

    def opener(name, src):
        def open_(init_cuda):
            calls[name] += 1
            try:  # as the real openers do
                init_cuda()
            except Exception as exc:  # noqa: BLE001
                raise unavailable(name, f"CUDA is not usable: {exc}") from None
            if state[name] is not None:
                raise unavailable(name, state[name])
            return src
        return open_

    drv = types.SimpleNamespace(name="driver", exact=True, read=lambda: (0, 0, 0, 0),
                                acquire=lambda: None, release=lambda: None, describe=lambda: "driver counters (x)")
    cup = types.SimpleNamespace(name="cupti", exact=False, read=lambda: (0, 0, 0, 0),
                                acquire=lambda: None, release=lambda: None, describe=lambda: "CUPTI (x)")
    monkeypatch.setitem(_sources.OPENERS, "driver", opener("driver", drv))
    monkeypatch.setitem(_sources.OPENERS, "cupti", opener("cupti", cup))
    yield types.SimpleNamespace(calls=calls, state=state)
    _sources.reset()


class RealLike:
    """A backend without uvm_counters: the real sources are used."""

    name = "cuda"

    def __init__(self, devices=1):
        self.n = devices
        self.synced = []

    def device_count(self):
        return self.n

    def device_synchronize(self, d):
        self.synced.append(d)


@pytest.mark.parametrize("bad", ["nvml", "DRIVER", "", 1])
def test_unknown_source_is_a_value_error_naming_the_valid_ones(bad):
    with pytest.raises(ValueError) as info:
        faults.FaultCounter(source=bad, backend=StandIn())
    assert repr(bad) in str(info.value) and "'driver', 'cupti', 'fake'" in str(info.value)


def test_fake_source_needs_a_fake_backend(fresh_sources):
    with pytest.raises(ValueError, match="source 'fake' needs a fake backend"):
        faults.FaultCounter(source="fake", backend=RealLike())


@pytest.mark.parametrize("source", ["driver", "cupti"])
def test_real_sources_refuse_a_fake_backend(source):
    with pytest.raises(ValueError, match=f"source '{source}' counts the real driver"):
        faults.FaultCounter(source=source, backend=StandIn())


def test_device_is_checked():
    with pytest.raises(ValueError, match=r"device 2 does not exist: expected 0\.\.1 \(2 device\(s\)\)"):
        faults.FaultCounter(device=2, backend=StandIn(devices=2))
    with pytest.raises(ValueError, match="device -1 does not exist"):
        faults.FaultCounter(device=-1, backend=StandIn())
    with pytest.raises(TypeError, match="device must be an int device ordinal or None, got bool True"):
        faults.FaultCounter(device=True, backend=StandIn())


def test_best_source_is_the_driver_and_is_opened_once(fresh_sources):
    b = RealLike()
    for _ in range(5):
        c = faults.FaultCounter(backend=b)
        assert c.source == "driver" and c.exact
    assert fresh_sources.calls == {"driver": 1, "cupti": 0}
    assert b.synced == [0]  # opening initialised CUDA once


def test_falls_back_to_cupti_with_exact_false(fresh_sources):
    fresh_sources.state["driver"] = "no device node /dev/nvidia-uvm-tools"
    c = faults.FaultCounter(backend=RealLike())
    assert c.source == "cupti" and c.exact is False
    faults.FaultCounter(backend=RealLike())
    assert fresh_sources.calls == {"driver": 1, "cupti": 1}  # the failure is remembered too


def test_explicit_unavailable_source_says_why(fresh_sources):
    fresh_sources.state["driver"] = "permission denied opening /dev/nvidia-uvm-tools"
    with pytest.raises(FaultCountersUnavailable) as info:
        faults.FaultCounter(source="driver", backend=RealLike())
    assert "source 'driver' is unavailable: permission denied opening /dev/nvidia-uvm-tools" in str(info.value)
    assert fresh_sources.calls["cupti"] == 0  # asked for the driver: no fallback


def test_no_source_names_every_reason(fresh_sources):
    fresh_sources.state["driver"] = "no device node /dev/nvidia-uvm-tools"
    fresh_sources.state["cupti"] = "cupti-python is not installed"
    with pytest.raises(FaultCountersUnavailable) as info:
        faults.count(backend=RealLike())
    msg = str(info.value)
    assert msg.startswith("no page-fault counters are available: ")
    assert "driver: no device node /dev/nvidia-uvm-tools" in msg and "cupti: cupti-python is not installed" in msg
    assert info.value.reasons == {"driver": "no device node /dev/nvidia-uvm-tools",
                                  "cupti": "cupti-python is not installed"}
    assert isinstance(info.value, cupy_memstrat.FaultCountersUnavailable)


def test_a_cupti_counter_counts_only_its_block(fresh_sources, monkeypatch):
    cp = FakeCupti()
    src = _cupti.open_cupti_counters(cupti=cp)
    monkeypatch.setitem(_sources.OPENERS, "cupti", lambda init_cuda: src)
    k = cp.ActivityUnifiedMemoryCounterKind
    c = faults.FaultCounter(source="cupti", backend=RealLike())
    cp.record(k.BYTES_TRANSFER_HTOD, MiB)  # before the first counter: CUPTI is off
    with c:
        assert cp.enabled
        cp.record(k.BYTES_TRANSFER_HTOD, 2 * MiB)
        cp.record(k.GPU_PAGE_FAULT, 1)
    cp.record(k.BYTES_TRANSFER_HTOD, 4 * MiB)  # after it: recorded, but outside the block
    assert c.counts == faults.FaultCounts(1, 0, 2 * MiB, 0, "cupti", False)
    assert "flush(1)" in cp.calls  # each read forces a flush


def test_available_and_status(fresh_sources, monkeypatch):
    monkeypatch.setattr(faults, "_real_backend", lambda: RealLike())
    monkeypatch.setattr(_cupti, "import_cupti", lambda: FakeCupti())
    assert faults.available() == {"driver": None, "cupti": None}
    assert faults.status() == "driver counters (exact); CUPTI fallback available"
    assert fresh_sources.calls["cupti"] == 0  # only probed: CUPTI allows one user per process


def test_status_without_driver(fresh_sources, monkeypatch):
    monkeypatch.setattr(faults, "_real_backend", lambda: RealLike())
    monkeypatch.setattr(_cupti, "import_cupti", lambda: FakeCupti())
    fresh_sources.state["driver"] = "no device node /dev/nvidia-uvm-tools"
    assert faults.available() == {"driver": "no device node /dev/nvidia-uvm-tools", "cupti": None}
    s = faults.status()
    assert s.startswith("CUPTI records only (lower bounds")
    assert s.endswith("driver counters unavailable: no device node /dev/nvidia-uvm-tools")


def test_status_without_any_source(fresh_sources, monkeypatch):
    def no_cuda():
        raise cupy_memstrat.NoDeviceError("no CUDA device is available")

    monkeypatch.setattr(faults, "_real_backend", no_cuda)
    monkeypatch.setattr(_cupti, "import_cupti", lambda: FakeCupti())
    a = faults.available()
    assert a == {"driver": "CUDA is not usable: no CUDA device is available",
                 "cupti": "CUDA is not usable: no CUDA device is available"}
    assert faults.status().startswith("unavailable: driver: CUDA is not usable")


@pytest.mark.skipif(os.path.exists("/dev/nvidia-uvm-tools"), reason="this machine has the UVM tools node")
def test_this_machine_without_the_driver_says_so():
    _sources.reset()
    try:
        a = faults.available()
        assert a["driver"].startswith("no device node /dev/nvidia-uvm-tools")
        assert isinstance(a["cupti"], str)
        assert faults.status().startswith("unavailable: driver: no device node")
    finally:
        _sources.reset()


def test_info_reports_the_fault_counters_of_each_backend(monkeypatch):
    from cupy_memstrat.info import collect
    from cupy_memstrat.testing import FakeBackend

    assert collect(FakeBackend())["page_fault_counters"] == "the fake backend's simulated counters (exact)"

    class RealNamed(FakeBackend):
        name = "cuda"

    monkeypatch.setattr(faults, "status", lambda: "driver counters (exact; /dev/nvidia-uvm-tools)")
    monkeypatch.setattr("cupy_memstrat.info._kernel_driver_version", lambda: None)
    assert collect(RealNamed())["page_fault_counters"] == "driver counters (exact; /dev/nvidia-uvm-tools)"


# ---------------------------------------------------------------------------
# FaultCounts
# ---------------------------------------------------------------------------


def test_fault_counts_str():
    c = faults.FaultCounts(1024, 0, 64 * MiB, 0, "driver", True)
    assert str(c) == "1 024 GPU faults, 0 CPU faults, 64.0 MiB host->device, 0 B device->host (driver counters, exact)"
    one = faults.FaultCounts(1, 1, 512, 2048, "cupti", False)
    assert str(one) == "1 GPU fault, 1 CPU fault, 512 B host->device, 2.0 KiB device->host (CUPTI records, lower bound)"


def test_fault_counts_arithmetic_and_immutability():
    a = faults.FaultCounts(10, 1, 100, 5, "driver", True)
    b = faults.FaultCounts(3, 1, 40, 5, "driver", True)
    assert a + b == faults.FaultCounts(13, 2, 140, 10, "driver", True)
    assert a - b == faults.FaultCounts(7, 0, 60, 0, "driver", True)
    with pytest.raises(ValueError, match="cannot combine 'driver' counts with 'cupti' counts"):
        a + faults.FaultCounts(0, 0, 0, 0, "cupti", False)
    with pytest.raises(TypeError):
        a + 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.gpu_faults = 0
    assert a.as_dict() == {"gpu_faults": 10, "cpu_faults": 1, "bytes_htod": 100, "bytes_dtoh": 5,
                           "source": "driver", "exact": True}


def test_public_names():
    assert cupy_memstrat.faults is faults
    assert issubclass(cupy_memstrat.FaultCountersUnavailable, cupy_memstrat.MemstratError)
    assert faults.FaultCountersUnavailable is cupy_memstrat.FaultCountersUnavailable


def test_a_failed_stop_leaves_no_stale_counts():
    class Failing(StandIn):
        fail = False

        def device_synchronize(self, device):
            if self.fail:
                raise RuntimeError("cudaErrorIllegalAddress")

    b = Failing()
    c = faults.FaultCounter(backend=b)
    c.start()
    c.stop()
    c.start()
    b.fail = True
    with pytest.raises(RuntimeError, match="IllegalAddress"):
        c.stop()
    assert not c.running
    with pytest.raises(RuntimeError, match="has not counted yet"):
        c.counts


def test_a_backend_class_instead_of_an_instance_is_named():
    from cupy_memstrat.testing import FakeBackend

    with pytest.raises(TypeError, match="got the class FakeBackend; pass an instance such as FakeBackend()"):
        faults.FaultCounter(backend=FakeBackend)


def test_cupy_memstrat_backend_fake_gives_the_fake_counters(monkeypatch):
    from cupy_memstrat import backends as C

    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake")
    monkeypatch.setattr(C, "_backend", None)
    fake = C.get_backend()
    p = fake.malloc_managed(1 << 20)
    with faults.count() as c:
        fake.touch(p, 1 << 20, 0)
    assert c.source == "fake" and c.gpu_faults == 16
    assert str(c).startswith("16 GPU faults, 0 CPU faults")  # print(c) shows the counts
