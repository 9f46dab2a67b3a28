"""The simulated GPU: a fake CUDA backend for machines without one.

:class:`FakeBackend` simulates the CUDA behaviour that cupy_memstrat relies on,
as CUDA documents it or as a GPU shows it (docs/claims.md, docs/async.md,
docs/managed.md).
It is a simulator, not a mock: it keeps per-device capacities, a current
device, live allocations and CUDA's sticky last error, and it fails the way
CUDA fails. Third-party strategy authors can test against it too::

    from cupy_memstrat.testing import FakeBackend
    s = cupy_memstrat.strategies.DeviceStrategy(backend=FakeBackend(memory="1GiB"))
    ptr = s.raw_malloc(4096)

What it simulates (``cudaMalloc`` path):

* ``malloc(0)`` succeeds with the null pointer; pointers are 256-byte aligned
  (CUDA's documented minimum for ``cudaMalloc``) and unique per device.
* A request beyond the device's free memory fails with
  ``cudaErrorMemoryAllocation`` *and* leaves it as the last error until
  ``clear_last_error()`` (as CUDA keeps an out-of-memory error).
* ``free`` of an unknown or already-freed pointer fails with
  ``cudaErrorInvalidValue`` (and sets the last error); ``free(0)`` is a no-op.
* ``free`` finds the owning device from the pointer, whatever device is current.
  It does not complete the device's queued work (real ``cudaFree`` waits for
  the device; the checking layer's tests rely on work staying queued).

Streams (CuPy's current stream, per thread and device):

* :meth:`FakeBackend.stream` makes a stream; ``with s:`` makes it current;
  ``s.destroy()`` (or the stream object dying, as CuPy's ``Stream`` does)
  destroys its handle. Each device has a null stream (handle 0).
* The next new stream of that device gets a destroyed stream's handle back
  (latest destroyed first), even while the destroyed stream's work is still
  queued, and is not ordered after that work (docs/streams.md; CUDA does
  not always reuse, the fake always does). :meth:`FakeBackend.busy_destroyed_streams`
  counts destroyed streams whose work is not done.
* Work on a destroyed handle not yet given back fails with
  ``cudaErrorInvalidResourceHandle`` (real CUDA gives undefined behaviour: the
  fake makes it visible).

Stream-ordered pools (``cudaMallocFromPoolAsync`` path, docs/async.md):

* Each device has a default pool (also its current pool until
  :meth:`FakeBackend.device_set_pool`); :meth:`FakeBackend.pool_create` makes
  more. A pool reserves device memory in 32 MiB steps (1 B -> 32 MiB,
  40 MiB + 7 B -> 64 MiB) and ``max_size`` acts as rounded up to 32 MiB.
* A 0-byte request gives the null pointer; a failed one sets the sticky
  last error, as ``cudaMalloc`` does.
* A block freed with ``free_async`` is reused at once by the same stream; by
  other streams only after a synchronisation (``stream_synchronize`` /
  ``device_synchronize``) has ordered the free before them.
* At each synchronisation a pool releases idle memory down to its release
  threshold (CUDA's default threshold is 0: everything idle goes back);
  ``pool_trim_to`` releases idle, synchronised memory down to a floor.
* Attributes: release threshold, reserved and used current/high; a high can
  be reset by setting it to 0.

Managed memory (``cudaMallocManaged`` path, docs/managed.md):

* ``malloc_managed`` returns 2 MiB-aligned pointers (as CUDA does)
  and takes no device memory until pages are populated there.
* Residency is kept per 64 KiB page: unpopulated, host, or a device.
  :meth:`FakeBackend.touch` simulates a processor accessing a range: a GPU
  touch of host-resident pages counts one GPU fault and 64 KiB host-to-device
  per page (the real driver services several faults per page; the fake
  counts one per migration); a CPU touch of device pages
  counts one CPU fault and 64 KiB device-to-host per page. Unpopulated pages
  are populated where they are first touched, with a fault and no transfer.
* ``mem_prefetch`` moves pages without faults, counting the bytes moved;
  prefetching unpopulated pages populates them at the destination.
* Device-resident managed pages count as used device memory
  (``mem_get_info``); when a device is full, other managed pages are evicted
  to the host, as the driver does.
* ``mem_advise`` validates its arguments and records the advice per range
  (:meth:`FakeBackend.advice`); it does not change the fault simulation
  (docs/claims.md: a preferred location alone does not avoid faults).
* :meth:`FakeBackend.uvm_counters` gives the cumulative counters that the
  driver's ``/dev/nvidia-uvm-tools`` interface reports.

Work, events and contents (the checking layer, :mod:`cupy_memstrat.checks`):

* :meth:`FakeBackend.launch` queues simulated work on a stream, which stays
  busy (``stream_busy``) until :meth:`FakeBackend.finish` or a
  synchronisation; an event recorded on a stream is done once the work
  queued before it has finished. Streams may be non-blocking.
* ``memset_async`` and :meth:`FakeBackend.write` set bytes of a contents
  model; the check kernels compare byte ranges with it. Bytes never written
  are unknown and match nothing.

What it does not simulate: the contents of memory other than through
``memset_async`` / ``write``, the driver's page-size rounding of
large ``cudaMalloc`` calls (the fake rounds to 256 bytes), and
how a pool splits and coalesces its blocks: it reuses same-size blocks at
once, and merges all idle blocks into free space only when it cannot grow
(a CUDA pool serves a request from idle blocks of another size;
docs/async.md).

The package's modules follow :mod:`cupy_memstrat.backends.protocols`: ``core``
(device memory, devices, the last error), ``streams``, ``pools``, ``managed`` and
``checks`` (work, events, contents), one mixin of :class:`FakeBackend` each
(``fake``); ``env`` reads ``CUPY_MEMSTRAT_BACKEND=fake[:options]``
(:func:`backend_from_env`). Users import it as :mod:`cupy_memstrat.testing`.
"""

from __future__ import annotations

from .checks import FakeCheckKernels
from .core import MAX_DEVICES, FakeCUDAError
from .env import backend_from_env
from .fake import FakeBackend
from .streams import FakeStream

__all__ = ["FakeBackend", "FakeCUDAError", "FakeCheckKernels", "FakeStream", "MAX_DEVICES", "backend_from_env"]
