"""The ``"driver"`` source: the NVIDIA UVM driver's tools interface,
``/dev/nvidia-uvm-tools``, in counter mode.

The params layouts (pack/parse functions), the checks of each reply, and
:class:`DriverCounters`, which reads the counters from the page the driver
updates in place. This is the open-source driver's tools interface, not a
documented API: layout from NVIDIA's open-gpu-kernel-modules,
``kernel-open/nvidia-uvm/`` (``uvm_ioctl.h``, ``uvm_linux_ioctl.h``,
``uvm_types.h``, ``uvm_tools.c``, ``uvm_api.h``; tags 515.43.04 to
595.45.04); the steps, and how they are verified on a GPU, are in
docs/faults.md. Internal to :mod:`cupy_memstrat.faults`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass

try:
    import fcntl
except ImportError:  # not Linux: there is no driver interface to open
    fcntl = None

from ._errors import unavailable

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
            raise unavailable("driver", "no fcntl module (the driver interface exists on Linux only)")
        ioctl = fcntl.ioctl
    try:
        tools_fd = opener(tools_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise unavailable(
            "driver",
            f"no device node {tools_path} (the nvidia-uvm kernel module is not loaded, "
            "or this container does not expose the node)",
        ) from None
    except PermissionError as exc:
        raise unavailable(
            "driver", f"permission denied opening {tools_path} ({exc.strerror}): it must be readable and writable"
        ) from None
    except OSError as exc:
        raise unavailable("driver", f"cannot open {tools_path}: {exc}") from None

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
        return unavailable("driver", reason)

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

