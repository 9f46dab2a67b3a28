"""Probe: arrays that die in a garbage-collected reference cycle under a
PythonFunctionAllocator-based strategy. CuPy 14.2's PythonFunctionAllocatorMemory has no
@cython.no_gc, so the collector may clear its free function before its destructor runs."""
import gc
import cupy, cupy_memstrat

for name in ("device", "pool", "managed", "async"):
    s = cupy_memstrat.use(name)
    gc.collect()
    base = s.stats().n_live

    class Holder:
        pass

    for i in range(200):
        h = Holder()
        h.me = h  # a cycle
        h.x = cupy.ones(1000, dtype=cupy.float32)
        del h
    gc.collect()
    left = s.stats().n_live - base
    print(f"{name}: {left} of 200 arrays that died in cycles were never freed", flush=True)
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
