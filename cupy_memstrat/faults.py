"""Page-fault and migration counters for unified (managed) memory.

    from cupy_memstrat import faults

    with faults.count() as c:
        ...                                    # GPU work
    print(c.gpu_faults, c.bytes_htod)          # deltas over the block
    print(c.counts)                            # "12 GPU faults, ... (driver counters, exact)"

Four numbers, each a difference over the counted span, for the whole process
(all devices): ``gpu_faults`` and ``cpu_faults`` (page faults that the
unified-memory driver serviced) and ``bytes_htod`` / ``bytes_dtoh`` (bytes
that the driver migrated host->device / device->host, by faults *and* by
prefetches).

Sources, best first (``source=None`` takes the first that opens):

``"driver"``
    The NVIDIA UVM driver's own counters, read from ``/dev/nvidia-uvm-tools``
    in "counter mode": exact, and nearly free (reading them is a memory load
    from a page the driver updates in place). This is the open-source
    driver's tools interface, not a documented API: it is feature-detected,
    its replies are checked, and any failure falls back cleanly. Layout from
    NVIDIA's open-gpu-kernel-modules, ``kernel-open/nvidia-uvm/``
    (``uvm_ioctl.h``, ``uvm_linux_ioctl.h``, ``uvm_types.h``, ``uvm_tools.c``,
    ``uvm_api.h``; tags 515.43.04 to 595.45.04); verified on the H200
    machine (docs/faults.md).
``"cupti"``
    CUPTI's unified-memory activity records, through ``cupti-python``
    (``pip install 'cupy-memstrat[cupti]'``). Lower bounds only
    (``exact=False``): CUPTI silently drops records under heavy paging
    (measured: 35-55% of the bytes recorded for 256 MiB, 9-15% for 1 GiB, its
    dropped-record counter staying 0), it sees only managed memory allocated
    after the first CUPTI counter started (it then stays on, and
    fault-driven kernels run ~2x slower), and each read costs a flush
    (11-15 ms). Only one CUPTI
    user per process (R580 driver): a profiler attached to the process
    makes it unavailable. docs/faults.md.
``"fake"``
    Chosen when the ``backend`` passed has ``uvm_counters()``
    (:class:`cupy_memstrat.testing.FakeBackend`): the simulator's counters,
    for tests without a GPU.

:func:`status` and :func:`available` say which sources this machine offers
and why the others are not.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
from dataclasses import asdict, dataclass

try:
    import fcntl
except ImportError:  # not Linux: there is no driver interface to open
    fcntl = None

from .errors import FaultCountersUnavailable, MemstratError
from .sizes import format_size

__all__ = [
    "FaultCounts",
    "FaultCounter",
    "FaultCountersUnavailable",
    "count",
    "status",
    "available",
    "SOURCES",
    "DriverCounters",
    "CuptiCounters",
    "open_driver_counters",
    "open_cupti_counters",
    "find_uvm_fds",
    "pack_init_params",
    "parse_init_params",
    "InitReply",
    "pack_enable_counters",
    "parse_enable_status",
    "parse_counters",
    "nv_status_name",
]

#: Values accepted by ``source=`` (``None`` too: the best available).
SOURCES = ("driver", "cupti", "fake")

# ---------------------------------------------------------------------------
# The driver interface (open-gpu-kernel-modules, kernel-open/nvidia-uvm/)
# ---------------------------------------------------------------------------

TOOLS_PATH = "/dev/nvidia-uvm-tools"
UVM_PATH = "/dev/nvidia-uvm"
FD_DIR = "/proc/self/fd"
#: MODULE_VERSION(NV_VERSION_STRING) in uvm.c: e.g. "580.159.04"
MODULE_VERSION_PATH = "/sys/module/nvidia_uvm/version"

# uvm_ioctl.h: "#define UVM_IOCTL_BASE(i) i" on Linux (CTL_CODE only on
# Windows), so the request numbers are the plain numbers, not _IOWR-encoded.
# The kernel copies sizeof(params) bytes in and out itself (uvm_api.h,
# __UVM_ROUTE_CMD_STACK): the size is not in the request number.
UVM_TOOLS_INIT_EVENT_TRACKER = 56
UVM_TOOLS_ENABLE_COUNTERS = 60

# uvm_types.h, UvmCounterName: the index of each counter in the control page
# (the same from 515.43.04 to 595.45.04).
COUNTER_BYTES_HTOD = 0  # UvmCounterNameBytesXferHtD
COUNTER_BYTES_DTOH = 1  # UvmCounterNameBytesXferDtH
COUNTER_CPU_FAULTS = 2  # UvmCounterNameCpuPageFaultCount
COUNTER_GPU_FAULTS = 9  # UvmCounterNameGpuPageFaultCount
UVM_TOTAL_COUNTERS = 10

# uvm_types.h, UVM_COUNTER_NAME_FLAG_*: the bits of counterTypeFlags.
FLAG_BYTES_XFER_HTD = 0x1
FLAG_BYTES_XFER_DTH = 0x2
FLAG_CPU_PAGE_FAULT_COUNT = 0x4
FLAG_GPU_PAGE_FAULT_COUNT = 0x200
COUNTER_FLAGS = FLAG_BYTES_XFER_HTD | FLAG_BYTES_XFER_DTH | FLAG_CPU_PAGE_FAULT_COUNT | FLAG_GPU_PAGE_FAULT_COUNT

#: UvmToolsEventQueueVersion_V1 (uvm_types.h, drivers 550.40.53 to 560.x).
#: The version only picks the event-queue entry format (UvmEventEntry_V1 or
#: _V2, uvm_tools.c); counter mode (queueBufferSize 0) never uses it, and
#: both 1 and 2 are accepted. Drivers >= 565 have no version field at all.
QUEUE_VERSION_V1 = 1

INIT_PARAMS_SIZE = 64
ENABLE_PARAMS_SIZE = 16
# Each ioctl gets a zero-filled buffer larger than any known params struct:
# the kernel reads sizeof(its struct) bytes, and CPython passes a <= 1024-byte
# buffer through an uninitialised stack copy, so a larger future struct would
# otherwise read stack garbage.
_IOCTL_BUF_SIZE = 256

# NV_STATUS values (kernel-open/common/inc/nvstatuscodes.h), for messages:
# those that uvm_tools.c and uvm_api.h can return here.
_NV_STATUS = {
    0x00: "NV_OK",
    0x01: "NV_ERR_BROKEN_FB",
    0x16: "NV_ERR_ILLEGAL_ACTION",
    0x17: "NV_ERR_IN_USE",
    0x1B: "NV_ERR_INSUFFICIENT_PERMISSIONS",
    0x1E: "NV_ERR_INVALID_ADDRESS",
    0x1F: "NV_ERR_INVALID_ARGUMENT",
    0x26: "NV_ERR_INVALID_DEVICE",
    0x40: "NV_ERR_INVALID_STATE",
    0x51: "NV_ERR_NO_MEMORY",
    0x55: "NV_ERR_NOT_READY",
    0x56: "NV_ERR_NOT_SUPPORTED",
    0x59: "NV_ERR_OPERATING_SYSTEM",
    0xFFFF: "NV_ERR_GENERIC",
}
_NV_ERR_ILLEGAL_ACTION = 0x16
_NV_ERR_INSUFFICIENT_PERMISSIONS = 0x1B


def nv_status_name(status: int) -> str:
    """``0x1f -> "rmStatus 0x1f (NV_ERR_INVALID_ARGUMENT)"``."""
    name = _NV_STATUS.get(status)
    return f"rmStatus 0x{status:x}" + (f" ({name})" if name else "")


def pack_init_params(control_buffer: int, uvm_fd: int, *, version: int = QUEUE_VERSION_V1) -> bytes:
    """The 64-byte ``UVM_TOOLS_INIT_EVENT_TRACKER_PARAMS`` for counter mode.

    Offsets (``uvm_ioctl.h``): ``u64 queueBuffer`` 0 (0), ``u64
    queueBufferSize`` 8 (0 selects counter mode, ``uvm_tools.c``), ``u64
    controlBuffer`` 16, ``u8 processor[16]`` 24 (zeros: ignored with
    ``allProcessors``), ``u32 allProcessors`` 40 (1), ``u32 uvmFd`` 44, then
    four words that differ between driver versions:

    ======== ========================= ====================== ============
    offset   <= 550.40.07, >= 565       550.40.53 .. 555.x     560.x
    ======== ========================= ====================== ============
    48       rmStatus (out)            rmStatus (out)         version (in)
    52       padding                   requestedVersion (in)  rmStatus (out)
    56       (beyond the struct)       grantedVersion (out)   (beyond)
    ======== ========================= ====================== ============

    Writing ``version`` at both 48 and 52 makes one buffer valid for all
    three (an out field is overwritten; padding is ignored);
    :func:`parse_init_params` tells them apart from the reply.

    Args:
        control_buffer: page-aligned address of memory that the driver pins
            and updates in place (``u64 counters[10]``).
        uvm_fd: this process's ``/dev/nvidia-uvm`` descriptor (the one CUDA
            opened: the counters belong to its address space).

    Raises:
        ValueError: ``control_buffer`` is not a positive page-aligned
            address, or ``uvm_fd`` is negative.
    """
    if control_buffer <= 0 or control_buffer % mmap.PAGESIZE:
        raise ValueError(
            f"control_buffer must be a page-aligned address ({mmap.PAGESIZE} bytes), got 0x{control_buffer:x}"
        )
    if uvm_fd < 0:
        raise ValueError(f"uvm_fd must be a file descriptor >= 0, got {uvm_fd}")
    return struct.pack(
        "=QQQ16sIIIIII", 0, 0, control_buffer, bytes(16), 1, uvm_fd, version, version, 0, 0
    )


@dataclass(frozen=True)
class InitReply:
    """What ``UVM_TOOLS_INIT_EVENT_TRACKER`` answered (:func:`parse_init_params`).

    ``status`` is the NV_STATUS (0: success); ``layout`` names the params
    layout the driver used (``"unversioned"``, ``"requested/granted"``,
    ``"version"``); ``granted_version`` is the driver's grantedVersion where
    its layout has one (550.40.53 to 555.x), else ``None``.
    """

    status: int
    layout: str
    granted_version: int | None = None


def parse_init_params(buf, *, version: int = QUEUE_VERSION_V1) -> InitReply:
    """Decode the reply of ``UVM_TOOLS_INIT_EVENT_TRACKER`` in ``buf`` (the
    buffer built by :func:`pack_init_params` with the same ``version``, after
    the ioctl). See the table in :func:`pack_init_params`.

    Raises:
        ValueError: ``buf`` is shorter than 64 bytes.
    """
    if len(buf) < INIT_PARAMS_SIZE:
        raise ValueError(f"expected at least {INIT_PARAMS_SIZE} bytes of init params, got {len(buf)}")
    w48, w52, w56 = struct.unpack_from("=III", buf, 48)
    if w48 == 0:  # rmStatus at 48 says NV_OK
        if w56:
            return InitReply(0, "requested/granted", w56)
        return InitReply(0, "unversioned")
    if w48 == version:
        # 560.x: our version kept at 48, rmStatus at 52 (0 on success). Or
        # another layout failed with rmStatus == version: then 52 still holds
        # our version, and that is the status either way.
        return InitReply(w52, "version" if w52 != version else "unknown")
    return InitReply(w48, "unknown")


def pack_enable_counters(flags: int = COUNTER_FLAGS) -> bytes:
    """``UVM_TOOLS_ENABLE_COUNTERS_PARAMS``: ``{u64 counterTypeFlags; u32
    rmStatus}`` padded to 16 bytes (``uvm_ioctl.h``).

    Raises:
        ValueError: ``flags`` is 0 or not a 64-bit value.
    """
    if not 0 < flags < 1 << 64:
        raise ValueError(f"counter flags must be a non-zero 64-bit mask, got {flags!r}")
    return struct.pack("=QI4x", flags, 0)


def parse_enable_status(buf) -> int:
    """The ``rmStatus`` of a ``UVM_TOOLS_ENABLE_COUNTERS`` reply (offset 8)."""
    if len(buf) < ENABLE_PARAMS_SIZE:
        raise ValueError(f"expected at least {ENABLE_PARAMS_SIZE} bytes of enable params, got {len(buf)}")
    return struct.unpack_from("=I", buf, 8)[0]


def parse_counters(data) -> dict:
    """The control page's ``u64 counters[10]`` as a dict: ``bytes_htod``
    (index 0), ``bytes_dtoh`` (1), ``cpu_faults`` (2), ``gpu_faults`` (9);
    cumulative values (``uvm_types.h``, ``UvmCounterName``).

    Raises:
        ValueError: ``data`` is shorter than 80 bytes.
    """
    if len(data) < 8 * UVM_TOTAL_COUNTERS:
        raise ValueError(f"expected at least {8 * UVM_TOTAL_COUNTERS} bytes of counters, got {len(data)}")
    c = struct.unpack_from(f"={UVM_TOTAL_COUNTERS}Q", data, 0)
    return {
        "bytes_htod": c[COUNTER_BYTES_HTOD],
        "bytes_dtoh": c[COUNTER_BYTES_DTOH],
        "cpu_faults": c[COUNTER_CPU_FAULTS],
        "gpu_faults": c[COUNTER_GPU_FAULTS],
    }


def find_uvm_fds(fd_dir: str = FD_DIR, uvm_path: str = UVM_PATH) -> list[int]:
    """This process's descriptors open on ``uvm_path``, in ascending order
    (``readlink`` of each entry of ``fd_dir``)."""
    fds = []
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return fds
    for name in names:
        if not name.isdigit():
            continue
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:  # closed meanwhile (e.g. the listing's own fd)
            continue
        if target == uvm_path:
            fds.append(int(name))
    return sorted(fds)


def _read_module_version(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _unavailable(source: str, reason: str) -> FaultCountersUnavailable:
    return FaultCountersUnavailable(
        f"page-fault counter source {source!r} is unavailable: {reason}", {source: reason}
    )


class DriverCounters:
    """An open ``/dev/nvidia-uvm-tools`` counter tracker (from
    :func:`open_driver_counters`). The driver adds to ``counters[10]`` in a
    page this object keeps mapped; :meth:`read` loads them."""

    name = "driver"
    exact = True

    def __init__(self, tools_fd: int, page: mmap.mmap, anchor, uvm_fd: int, reply: InitReply,
                 module_version: str | None):
        self.tools_fd = tools_fd
        self.uvm_fd = uvm_fd
        self.reply = reply
        self.module_version = module_version
        self._page = page
        self._anchor = anchor  # the ctypes export that pins the page's address
        self._pid = os.getpid()

    def read(self) -> tuple[int, int, int, int]:
        """Cumulative ``(gpu_faults, cpu_faults, bytes_htod, bytes_dtoh)``.
        Native, aligned 8-byte loads: the driver updates each with atomic64_add."""
        c = struct.unpack_from(f"@{UVM_TOTAL_COUNTERS}Q", self._page, 0)
        return c[COUNTER_GPU_FAULTS], c[COUNTER_CPU_FAULTS], c[COUNTER_BYTES_HTOD], c[COUNTER_BYTES_DTOH]

    def acquire(self) -> None:  # always enabled: nothing to do per counter
        pass

    def release(self) -> None:
        pass

    def describe(self) -> str:
        v = f", nvidia-uvm {self.module_version}" if self.module_version else ""
        return f"driver counters (exact; {TOOLS_PATH}{v})"

    def close(self) -> None:
        """Close the tracker (the driver unpins the page). For tests and fork
        children; a process normally keeps it open until exit."""
        if self.tools_fd >= 0:
            try:
                os.close(self.tools_fd)
            except OSError:
                pass
            self.tools_fd = -1
        self._anchor = None
        try:
            self._page.close()
        except (BufferError, ValueError):
            pass


def open_driver_counters(
    *,
    init_cuda=None,
    tools_path: str = TOOLS_PATH,
    uvm_path: str = UVM_PATH,
    fd_dir: str = FD_DIR,
    module_version_path: str = MODULE_VERSION_PATH,
    ioctl=None,
    opener=os.open,
) -> DriverCounters:
    """Open the UVM driver's counters for this process (the steps of
    docs/faults.md, checked against uvm_tools.c).

    1. open ``tools_path`` read-write;
    2. ``init_cuda()`` (so that CUDA has opened ``uvm_path``);
    3. find this process's ``uvm_path`` descriptors in ``fd_dir``;
    4. ``UVM_TOOLS_INIT_EVENT_TRACKER`` (56) in counter mode with a fresh
       anonymous page as control buffer, for each descriptor until one is
       accepted (a descriptor that is not a VA space, e.g. CUDA's second
       ``UVM_FD_MM`` one, gets ``NV_ERR_ILLEGAL_ACTION``);
    5. ``UVM_TOOLS_ENABLE_COUNTERS`` (60) for HtoD, DtoH, CPU and GPU faults.

    ``ioctl`` (default ``fcntl.ioctl``) and ``opener`` (default ``os.open``)
    are seams for tests.

    Raises:
        FaultCountersUnavailable: with the reason (``reasons["driver"]``):
            no device node, permission denied, CUDA not usable, no
            ``/dev/nvidia-uvm`` descriptor, an ioctl that failed (errno) or
            answered a non-zero rmStatus, or a granted version other than
            the one requested. Nothing stays open after a failure.
    """
    if ioctl is None:
        if fcntl is None:
            raise _unavailable("driver", "no fcntl module (the driver interface exists on Linux only)")
        ioctl = fcntl.ioctl
    try:
        tools_fd = opener(tools_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _unavailable(
            "driver",
            f"no device node {tools_path} (the nvidia-uvm kernel module is not loaded, "
            "or this container does not expose the node)",
        ) from None
    except PermissionError as exc:
        raise _unavailable(
            "driver", f"permission denied opening {tools_path} ({exc.strerror}): it must be readable and writable"
        ) from None
    except OSError as exc:
        raise _unavailable("driver", f"cannot open {tools_path}: {exc}") from None

    page = anchor = None

    def fail(reason):
        nonlocal anchor
        try:
            os.close(tools_fd)
        except OSError:
            pass
        anchor = None
        if page is not None:
            page.close()
        return _unavailable("driver", reason)

    if init_cuda is not None:
        try:
            init_cuda()
        except Exception as exc:  # noqa: BLE001 - any CUDA failure is a reason, not a crash
            raise fail(f"CUDA is not usable: {exc}") from None
    fds = find_uvm_fds(fd_dir, uvm_path)
    if not fds:
        raise fail(f"this process has no {uvm_path} open after CUDA initialisation (looked in {fd_dir})")

    page = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous, page-aligned, zero-filled
    anchor = ctypes.c_char.from_buffer(page)
    address = ctypes.addressof(anchor)
    tried = []
    reply = None
    for uvm_fd in fds:
        buf = bytearray(_IOCTL_BUF_SIZE)
        buf[:INIT_PARAMS_SIZE] = pack_init_params(address, uvm_fd)
        try:
            ioctl(tools_fd, UVM_TOOLS_INIT_EVENT_TRACKER, buf, True)
        except OSError as exc:
            raise fail(
                f"ioctl UVM_TOOLS_INIT_EVENT_TRACKER ({UVM_TOOLS_INIT_EVENT_TRACKER}) on {tools_path} failed: {exc}"
            ) from None
        r = parse_init_params(buf)
        if r.status == 0:
            reply = r
            break
        tried.append(f"{uvm_path} fd {uvm_fd}: {nv_status_name(r.status)}")
        if r.status not in (_NV_ERR_ILLEGAL_ACTION, _NV_ERR_INSUFFICIENT_PERMISSIONS):
            break  # not a wrong-descriptor answer: another one will not help
    if reply is None:
        raise fail(
            f"ioctl UVM_TOOLS_INIT_EVENT_TRACKER ({UVM_TOOLS_INIT_EVENT_TRACKER}) failed: " + "; ".join(tried)
        )
    if reply.granted_version is not None and reply.granted_version != QUEUE_VERSION_V1:
        raise fail(
            f"UVM tools version mismatch: the driver granted version {reply.granted_version}, "
            f"requested {QUEUE_VERSION_V1}"
        )

    buf = bytearray(_IOCTL_BUF_SIZE)
    buf[:ENABLE_PARAMS_SIZE] = pack_enable_counters(COUNTER_FLAGS)
    try:
        ioctl(tools_fd, UVM_TOOLS_ENABLE_COUNTERS, buf, True)
    except OSError as exc:
        raise fail(f"ioctl UVM_TOOLS_ENABLE_COUNTERS ({UVM_TOOLS_ENABLE_COUNTERS}) failed: {exc}") from None
    st = parse_enable_status(buf)
    if st != 0:
        raise fail(f"ioctl UVM_TOOLS_ENABLE_COUNTERS ({UVM_TOOLS_ENABLE_COUNTERS}) failed: {nv_status_name(st)}")
    return DriverCounters(tools_fd, page, anchor, uvm_fd, reply, _read_module_version(module_version_path))


# ---------------------------------------------------------------------------
# CUPTI
# ---------------------------------------------------------------------------

_CUPTI_BUFFER_BYTES = 8 << 20  # as NVIDIA's cupti-python samples (cupti_common.py)


class CuptiCounters:
    """CUPTI's ``UNIFIED_MEMORY_COUNTER`` activity records, summed (from
    :func:`open_cupti_counters`). The activity kind is enabled by the first
    counter that starts and stays enabled: CUPTI only sees managed memory
    allocated while it is on."""

    name = "cupti"
    exact = False

    def __init__(self, cupti):
        self._cupti = cupti
        self._lock = threading.Lock()
        self._enabled = False
        self._totals = [0, 0, 0, 0]  # gpu_faults, cpu_faults, bytes_htod, bytes_dtoh
        k = cupti.ActivityUnifiedMemoryCounterKind
        self._kind = int(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
        self._htod = int(k.BYTES_TRANSFER_HTOD)
        self._dtoh = int(k.BYTES_TRANSFER_DTOH)
        self._cpu = int(k.CPU_PAGE_FAULT_COUNT)
        self._gpu = int(k.GPU_PAGE_FAULT)
        try:
            import importlib.metadata

            self.version = importlib.metadata.version("cupti-python")
        except Exception:  # noqa: BLE001 - informational
            self.version = None

    # CUPTI calls these, possibly from its own thread.
    def _buffer_requested(self):
        return _CUPTI_BUFFER_BYTES, 0

    def _buffer_completed(self, activities):
        g = c = h = d = 0
        for a in activities:
            if int(a.kind) != self._kind:
                continue
            ck = int(a.counter_kind)
            if ck == self._htod:
                h += int(a.value)
            elif ck == self._dtoh:
                d += int(a.value)
            elif ck == self._cpu:
                c += 1  # value is the faulting instruction's address: count, never sum
            elif ck == self._gpu:
                g += 1  # one record per fault group (docs/faults.md)
        with self._lock:
            t = self._totals
            t[0] += g
            t[1] += c
            t[2] += h
            t[3] += d

    def _call(self, step, fn, *args):
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - cuptiError, NotSupportedError (no libcupti/libcuda)...
            raise _unavailable("cupti", f"CUPTI {step} failed: {exc}") from None

    def _setup(self) -> None:
        cp = self._cupti
        self._call("activity_register_callbacks", cp.activity_register_callbacks,
                   self._buffer_requested, self._buffer_completed)
        kinds = (self._htod, self._dtoh, self._cpu, self._gpu)
        cfg = cp.ActivityUnifiedMemoryCounterConfig(len(kinds))
        for i, kind in enumerate(kinds):
            cfg[i].scope = int(cp.ActivityUnifiedMemoryCounterScope.PROCESS_ALL_DEVICES)
            cfg[i].kind = kind
            cfg[i].device_id = 0
            cfg[i].enable = 1
        self._config = cfg  # CUPTI reads it during the call; keep it anyway
        self._call("activity_configure_unified_memory_counter",
                   cp.activity_configure_unified_memory_counter, cfg.ptr, len(kinds))
        # Probe once, so that an unusable CUPTI shows at open time, not in a test.
        self._call("activity_enable(UNIFIED_MEMORY_COUNTER)", cp.activity_enable, self._kind)
        self._call("activity_disable(UNIFIED_MEMORY_COUNTER)", cp.activity_disable, self._kind)

    def acquire(self) -> None:
        # Switched on at the first counter and left on: CUPTI reports no
        # migrations of managed memory allocated while the activity kind
        # was off (measured on the H200 with cupti-python 13.0.1:
        # docs/faults.md), so toggling it per counter would lose them.
        with self._lock:
            first = not self._enabled
            self._enabled = True
        if first:
            try:
                self._call("activity_enable(UNIFIED_MEMORY_COUNTER)", self._cupti.activity_enable, self._kind)
            except FaultCountersUnavailable:
                with self._lock:
                    self._enabled = False
                raise

    def release(self) -> None:
        self._cupti.activity_flush_all(1)

    def read(self) -> tuple[int, int, int, int]:
        """Cumulative totals after a forced flush (``activity_flush_all(1)``;
        the caller has synchronised the devices)."""
        self._cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        with self._lock:
            return tuple(self._totals)

    def describe(self) -> str:
        v = f" {self.version}" if self.version else ""
        return f"CUPTI records (lower bounds; cupti-python{v})"


def _import_cupti():
    try:
        from cupti import cupti
    except ImportError as exc:
        raise _unavailable(
            "cupti", f"cupti-python is not installed (pip install 'cupy-memstrat[cupti]'): {exc}"
        ) from None
    return cupti


def open_cupti_counters(*, init_cuda=None, cupti=None) -> CuptiCounters:
    """Set CUPTI up for unified-memory counters: import ``cupti.cupti``,
    initialise CUDA (CUPTI refuses the activity kind before the driver is
    initialised: ``ERROR_NOT_READY``, docs/faults.md), register the buffer
    callbacks, configure the four counters (HtoD, DtoH, CPU page faults, GPU
    page faults; process scope, all devices), and check that the activity
    kind can be enabled. ``cupti`` is a seam for tests.

    Raises:
        FaultCountersUnavailable: with the reason (``reasons["cupti"]``):
            cupti-python not installed, CUDA not usable, or the CUPTI call
            that failed and its error (e.g. ``ERROR_NOT_READY (13)``, or
            ``ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`` when another tool
            already uses CUPTI in this process).
    """
    if cupti is None:
        cupti = _import_cupti()
    if init_cuda is not None:
        try:
            init_cuda()
        except Exception as exc:  # noqa: BLE001
            raise _unavailable("cupti", f"CUDA is not usable: {exc}") from None
    src = CuptiCounters(cupti)
    src._setup()
    return src


# ---------------------------------------------------------------------------
# The fake source
# ---------------------------------------------------------------------------

_FAKE_KEYS = ("gpu_faults", "cpu_faults", "bytes_htod", "bytes_dtoh")


def _is_fake(backend) -> bool:
    return callable(getattr(backend, "uvm_counters", None))


class _FakeSource:
    name = "fake"
    exact = True

    def __init__(self, backend):
        missing = [m for m in ("device_synchronize", "device_count") if not callable(getattr(backend, m, None))]
        if missing:
            raise TypeError(
                f"a fake backend needs uvm_counters(), device_synchronize(device) and device_count(); "
                f"{type(backend).__name__} lacks {', '.join(missing)}"
            )
        self._backend = backend

    def read(self) -> tuple[int, int, int, int]:
        c = self._backend.uvm_counters()
        try:
            return tuple(int(c[k]) for k in _FAKE_KEYS)
        except KeyError as exc:
            raise TypeError(f"uvm_counters() must return the keys {', '.join(_FAKE_KEYS)}; missing {exc}") from None

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def describe(self) -> str:
        return "fake backend counters (exact)"


# ---------------------------------------------------------------------------
# Process-wide sources: opened once, lazily, thread-safe
# ---------------------------------------------------------------------------

_lock = threading.Lock()
_opened: dict = {}  # "driver" / "cupti" -> source object, or the reason string it failed with
_opened_pid = os.getpid()


def _open_driver(init_cuda):
    return open_driver_counters(init_cuda=init_cuda)


def _open_cupti(init_cuda):
    return open_cupti_counters(init_cuda=init_cuda)


_OPENERS = {"driver": _open_driver, "cupti": _open_cupti}


def _real_backend():
    from .cuda import get_backend

    return get_backend()


def _init_cuda_with(get_backend):
    def init():
        backend = get_backend()
        for d in range(backend.device_count()):
            backend.device_synchronize(d)  # creates the context: CUDA opens /dev/nvidia-uvm

    return init


def _check_pid() -> None:
    global _opened_pid
    pid = os.getpid()
    if pid != _opened_pid:  # a fork child: the parent's trackers count the parent
        for v in _opened.values():
            if isinstance(v, DriverCounters):
                v.close()
        _opened.clear()
        _opened_pid = pid


def _source(name: str, get_backend):
    """The process's source ``name``, opened on first use; a failure is
    remembered (the probe runs once per process)."""
    v = _opened.get(name)
    if v is None or os.getpid() != _opened_pid:
        with _lock:
            _check_pid()
            v = _opened.get(name)
            if v is None:
                try:
                    v = _OPENERS[name](_init_cuda_with(get_backend))
                except FaultCountersUnavailable as exc:
                    v = exc.reasons.get(name, str(exc))
                _opened[name] = v
    if isinstance(v, str):
        raise _unavailable(name, v)
    return v


def _select(source, get_backend):
    if source is not None:
        return _source(source, get_backend)
    reasons = {}
    for name in ("driver", "cupti"):
        try:
            return _source(name, get_backend)
        except FaultCountersUnavailable as exc:
            reasons[name] = exc.reasons.get(name, str(exc))
    raise FaultCountersUnavailable(
        "no page-fault counters are available: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()),
        reasons,
    )


def _reset() -> None:
    """Forget the process-wide sources (tests only; closes the driver tracker)."""
    with _lock:
        for v in _opened.values():
            if isinstance(v, DriverCounters):
                v.close()
        _opened.clear()


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

_LABELS = {"driver": "driver counters, exact", "cupti": "CUPTI records, lower bound", "fake": "fake backend, exact"}


def _n(value: int, what: str) -> str:
    s = f"{value:,}".replace(",", " ")
    return f"{s} {what}" + ("" if value == 1 else "s")


@dataclass(frozen=True)
class FaultCounts:
    """Unified-memory activity over a counted span, for the whole process.

    Attributes:
        gpu_faults: GPU page faults serviced by the driver (``cupti``: fault
            records, each a group of faults).
        cpu_faults: CPU page faults on managed memory.
        bytes_htod: bytes migrated host -> device (faults and prefetches).
        bytes_dtoh: bytes migrated device -> host (faults, prefetches, evictions).
        source: ``"driver"``, ``"cupti"`` or ``"fake"``.
        exact: ``True`` for driver and fake counts; ``False`` for CUPTI,
            whose counts are lower bounds (it drops records, docs/faults.md).
    """

    gpu_faults: int
    cpu_faults: int
    bytes_htod: int
    bytes_dtoh: int
    source: str
    exact: bool

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{_n(self.gpu_faults, 'GPU fault')}, {_n(self.cpu_faults, 'CPU fault')}, "
            f"{format_size(self.bytes_htod)} host->device, {format_size(self.bytes_dtoh)} device->host "
            f"({_LABELS.get(self.source, self.source)})"
        )

    def _combine(self, other, sign: int):
        if not isinstance(other, FaultCounts):
            return NotImplemented
        if other.source != self.source:
            raise ValueError(
                f"cannot combine {self.source!r} counts with {other.source!r} counts: "
                "exact counts and lower bounds do not add up to a meaningful number"
            )
        return FaultCounts(
            self.gpu_faults + sign * other.gpu_faults,
            self.cpu_faults + sign * other.cpu_faults,
            self.bytes_htod + sign * other.bytes_htod,
            self.bytes_dtoh + sign * other.bytes_dtoh,
            self.source,
            self.exact and other.exact,
        )

    def __add__(self, other):
        return self._combine(other, 1)

    def __sub__(self, other):
        return self._combine(other, -1)


class FaultCounter:
    """Counts unified-memory page faults and migrations between
    :meth:`start` and :meth:`stop`; a context manager (``with`` starts and
    stops it); restartable.

    Args:
        source: ``None`` (the best available: ``"driver"``, else
            ``"cupti"``), ``"driver"``, ``"cupti"``, or ``"fake"`` (only with
            a fake ``backend``). A fake backend (one with ``uvm_counters()``)
            selects ``"fake"`` by itself.
        device: the device to synchronise at start and stop (``None``: all).
            The counts always cover the whole process: the driver counts per
            address space, not per device.
        backend: the backend used to synchronise (default: the process's
            :func:`cupy_memstrat.cuda.get_backend`; with
            ``CUPY_MEMSTRAT_BACKEND=fake`` that is a fake, whose simulated
            counters are then used).

    Raises:
        ValueError: an unknown ``source``; ``"fake"`` without a fake backend,
            or ``"driver"``/``"cupti"`` with one; ``device`` out of range.
        TypeError: ``device`` is not an int.
        FaultCountersUnavailable: the source asked for (or, with ``None``,
            every source) cannot be opened; the message says why for each.
            Sources are opened once per process and kept open, so creating a
            counter is cheap.

    Costs (CPU time beyond the device synchronisations): driver and fake
    sources, a few microseconds per start/stop; CUPTI, a flush per start and
    stop (11-15 ms each, docs/faults.md). A counter object is not thread-safe; use
    one per thread.
    """

    def __init__(self, source=None, device=None, backend=None):
        if source is not None and source not in SOURCES:
            raise ValueError(
                f"unknown page-fault counter source {source!r}; expected None (the best available) "
                f"or one of {', '.join(repr(s) for s in SOURCES)}"
            )
        if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
            raise TypeError(f"device must be an int device ordinal or None, got {type(device).__name__} {device!r}")
        if backend is None and os.environ.get("CUPY_MEMSTRAT_BACKEND", "").strip().lower().startswith("fake"):
            backend = _real_backend()  # the process-wide fake that CUPY_MEMSTRAT_BACKEND asks for
        if isinstance(backend, type):
            raise TypeError(
                f"backend: expected a backend object, got the class {backend.__name__}; "
                f"pass an instance such as {backend.__name__}()"
            )
        if backend is not None and _is_fake(backend):
            if source not in (None, "fake"):
                raise ValueError(
                    f"source {source!r} counts the real driver's activity and cannot be used with the fake "
                    f"backend {type(backend).__name__}; use source=None or 'fake'"
                )
            self._src = _FakeSource(backend)
            self._backend = backend
        else:
            if source == "fake":
                raise ValueError(
                    "source 'fake' needs a fake backend (one with uvm_counters()), "
                    "e.g. backend=cupy_memstrat.testing.FakeBackend()"
                )
            get_backend = (lambda: backend) if backend is not None else _real_backend
            self._src = _select(source, get_backend)
            self._backend = get_backend()
        n = self._backend.device_count()
        if device is None:
            self._devices = tuple(range(n))
        elif 0 <= device < n:
            self._devices = (device,)
        else:
            raise ValueError(f"device {device} does not exist: expected 0..{n - 1} ({n} device(s))")
        self._base = None
        self._last = None

    # -- properties ---------------------------------------------------------------
    @property
    def source(self) -> str:
        """``"driver"``, ``"cupti"`` or ``"fake"``."""
        return self._src.name

    @property
    def exact(self) -> bool:
        """``False`` for CUPTI (lower bounds), else ``True``."""
        return self._src.exact

    @property
    def running(self) -> bool:
        return self._base is not None

    @property
    def counts(self) -> FaultCounts:
        """The counts of the last :meth:`stop`; while running, :meth:`read`."""
        if self._base is not None:
            return self.read()
        if self._last is None:
            raise RuntimeError("FaultCounter has not counted yet: call start() (or use it in a with block)")
        return self._last

    gpu_faults = property(lambda self: self.counts.gpu_faults, doc="``counts.gpu_faults``")
    cpu_faults = property(lambda self: self.counts.cpu_faults, doc="``counts.cpu_faults``")
    bytes_htod = property(lambda self: self.counts.bytes_htod, doc="``counts.bytes_htod`` (bytes)")
    bytes_dtoh = property(lambda self: self.counts.bytes_dtoh, doc="``counts.bytes_dtoh`` (bytes)")

    # -- counting -----------------------------------------------------------------
    def _sync(self) -> None:
        sync = self._backend.device_synchronize
        for d in self._devices:
            sync(d)

    def _delta(self) -> FaultCounts:
        now = self._src.read()
        b = self._base
        return FaultCounts(now[0] - b[0], now[1] - b[1], now[2] - b[2], now[3] - b[3], self._src.name, self._src.exact)

    def start(self) -> FaultCounter:
        """Synchronise the device(s), so that work queued earlier is not
        counted, and take the starting snapshot. Returns ``self``.

        Raises:
            RuntimeError: already running.
        """
        if self._base is not None:
            raise RuntimeError("FaultCounter.start(): already running; call stop() first")
        self._last = None  # a failed stop() must not leave the previous run's counts behind
        self._src.acquire()
        try:
            self._sync()
            self._base = self._src.read()
        except BaseException:
            self._src.release()
            raise
        return self

    def read(self) -> FaultCounts:
        """The counts since :meth:`start`, without stopping (after a device
        synchronisation); after :meth:`stop`, the final counts.

        Raises:
            RuntimeError: never started.
        """
        if self._base is None:
            if self._last is None:
                raise RuntimeError("FaultCounter.read(): not started; call start() first")
            return self._last
        self._sync()
        return self._delta()

    def stop(self) -> FaultCounts:
        """Synchronise, read, stop; returns the counts since :meth:`start`.

        Raises:
            RuntimeError: not running.
        """
        if self._base is None:
            raise RuntimeError("FaultCounter.stop(): not running; call start() first")
        try:
            self._sync()
            self._last = self._delta()
        finally:
            self._base = None
            self._src.release()
        return self._last

    def __enter__(self) -> FaultCounter:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self.start()

    def __exit__(self, *exc) -> None:
        if self._base is not None:
            self.stop()

    def __str__(self) -> str:
        """The counts (:class:`FaultCounts`) once counted, e.g. after a ``with`` block."""
        if self._base is None and self._last is not None:
            return str(self._last)
        return repr(self)

    def __repr__(self) -> str:
        state = "running" if self._base is not None else ("stopped" if self._last is not None else "new")
        return f"<FaultCounter source={self.source!r} devices={list(self._devices)} {state}>"


def count(source=None, device=None, backend=None) -> FaultCounter:
    """A :class:`FaultCounter` for a ``with`` block::

        with faults.count() as c:
            ...
        c.gpu_faults, c.bytes_htod, c.counts

    Same arguments and errors as :class:`FaultCounter`.
    """
    return FaultCounter(source=source, device=device, backend=backend)


def available() -> dict:
    """Which sources this process can use: ``{"driver": None or the reason it
    is unavailable, "cupti": None or the reason}``. Never raises.

    The driver source is opened to answer (cheap, kept open). CUPTI is only
    probed (cupti-python importable and a CUDA device present) unless it was
    already opened in this process, because setting it up makes this process
    CUPTI's one user; its activity API is first enabled by a counter.
    """
    out = {}
    try:
        _source("driver", _real_backend)
        out["driver"] = None
    except FaultCountersUnavailable as exc:
        out["driver"] = exc.reasons.get("driver", str(exc))
    except Exception as exc:  # noqa: BLE001 - a report must not crash
        out["driver"] = f"probe failed: {exc}"
    v = _opened.get("cupti")
    if isinstance(v, str):
        out["cupti"] = v
    elif v is not None:
        out["cupti"] = None
    else:
        try:
            _import_cupti()
            _real_backend()
            out["cupti"] = None
        except FaultCountersUnavailable as exc:
            out["cupti"] = exc.reasons.get("cupti", str(exc))
        except MemstratError as exc:
            out["cupti"] = f"CUDA is not usable: {exc}"
        except Exception as exc:  # noqa: BLE001
            out["cupti"] = f"probe failed: {exc}"
    return out


def status() -> str:
    """One line for ``python -m cupy_memstrat info``: which counters this
    machine offers, and why not the others. Never raises."""
    try:
        a = available()
    except Exception as exc:  # noqa: BLE001
        return f"unknown (probe failed: {exc})"
    drv, cup = a.get("driver"), a.get("cupti")
    if drv is None:
        src = _opened.get("driver")
        head = src.describe() if isinstance(src, DriverCounters) else "driver counters (exact)"
        tail = "CUPTI fallback available" if cup is None else f"CUPTI unavailable: {cup}"
        return f"{head}; {tail}"
    if cup is None:
        return f"CUPTI records only (lower bounds, ~2x slower faults); driver counters unavailable: {drv}"
    return f"unavailable: driver: {drv}; CUPTI: {cup}"
