"""The remedy an allocator can try for cross-device copies of pool memory (issue 22, docs/async.md
"Caveat: copies between devices on the default stream"): an event recorded at allocation.

CUDA orders a copy between two devices on the legacy default stream after the source device's
earlier work for ``cudaMalloc`` memory, not for pool memory. An allocator sees no copy, but CuPy
allocates the destination just before it copies into it (``cupy.array(a)``, ``copyto`` on another
device). :class:`OrderAfterOtherDevices` wraps an allocator: at each allocation made on a device's
legacy stream, it records an event on the legacy stream of every other device it has allocated on
and makes this device's legacy stream wait for it (``cudaEventRecord`` + ``cudaStreamWaitEvent``),
so work queued after the allocation on this device follows what the other devices had queued.

Not a probe by itself: tools/probes/cross_device_copy.py measures it, and as a pytest plugin
(``-p cross_device_order``, ``PYTHONPATH=tools/probes``) it installs ``async`` wrapped this way,
to run CuPy's multi-GPU copy tests under it.
"""

import cupy


class OrderAfterOtherDevices:
    """``malloc(size)`` of ``inner`` (a CuPy allocator: size -> MemoryPointer), after the wait.

    Args:
        inner: the allocator to wrap, e.g. ``cupy_memstrat.create("async").cupy_allocator()``.
    """

    def __init__(self, inner):
        self.inner = inner
        self.used = set()  # the devices allocated on
        self.n_waits = 0

    def malloc(self, size):
        d = cupy.cuda.runtime.getDevice()
        if self.used - {d} and cupy.cuda.get_current_stream().ptr == 0:
            for e in sorted(self.used - {d}):
                with cupy.cuda.Device(e):
                    ev = cupy.cuda.Event(disable_timing=True)
                    ev.record(cupy.cuda.Stream.null)  # e's legacy stream
                cupy.cuda.Stream.null.wait_event(ev)  # d's legacy stream (d is current again)
                self.n_waits += 1
        self.used.add(d)
        return self.inner(size)


_installed = []  # the strategy and its wrapper, kept alive for the session


def pytest_configure(config):
    import cupy_memstrat

    s = cupy_memstrat.create("async")
    _installed[:] = [s, OrderAfterOtherDevices(s.cupy_allocator())]
    cupy.cuda.set_allocator(_installed[1].malloc)
