"""Probe (not yet run on a GPU): does the garbage collector clear CuPy 14.2's
PythonFunctionAllocatorMemory before its destructor runs, so that the destructor
calls a free function that is already None and the block is never freed?

The suspicion comes from CuPy's own test_join.py tests under any cupy_memstrat
strategy: blocks never freed, and "TypeError: 'NoneType' object is not
callable" raised from destructors the collector ran (docs/pytest.md).
PythonFunctionAllocatorMemory is the one memory class in cupy/cuda/memory.pyx
without @cython.no_gc.

The collector clears the unreachable objects in the order they sit in its
list, which is roughly the order they were made. The earlier probe
(gc_cycles.py) made the cycle's object first, so clearing it broke the cycle
and everything was freed normally. Here the memory object is made first and
the cycle after it, which should make the collector clear the memory object
first.

Run on the GPU machine:  python3 tools/probes/pfa_gc_clear.py
"""
import gc
import sys

import cupy

import cupy_memstrat

errors = []
sys.unraisablehook = lambda u: errors.append(f"{type(u.exc_value).__name__}: {u.exc_value}")


class Holder:
    pass


def memory_first(n):
    for _ in range(n):
        mp = cupy.cuda.alloc(4096)  # PythonFunctionAllocatorMemory, then the MemoryPointer
        h = Holder()  # the cycle is made after the memory object
        h.me, h.mp = h, mp
        del mp, h


def cycle_first(n):
    for _ in range(n):
        h = Holder()
        h.me = h
        h.mp = cupy.cuda.alloc(4096)
        del h


for name in ("device", "pool"):
    for variant in (memory_first, cycle_first):
        s = cupy_memstrat.use(name)
        gc.collect()
        base, errors[:] = s.stats().n_live, []
        gc.disable()
        variant(100)
        gc.enable()
        gc.collect()
        left = s.stats().n_live - base
        print(f"{name:7s} {variant.__name__:12s}: {left:3d} of 100 blocks never freed; "
              f"{len(errors)} destructor errors {sorted(set(errors))[:1]}", flush=True)
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
