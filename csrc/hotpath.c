/* cupy_memstrat._hotpath: the allocation hot path of the built-in strategies, in C.
 *
 * CuPy calls a strategy twice per array, malloc(size, device) when the array is
 * made and free(ptr, device) when it dies, through cupy.cuda.PythonFunctionAllocator.
 * The Python closures of cupy_memstrat.strategies.base (and managed) do a few dict
 * and list operations per call; as Python functions they cost more per pair than
 * CuPy's whole Cython pool takes (docs/benchmarks.md).
 * This module does exactly the same operations, in the same order, without a
 * Python frame. It makes no CUDA call itself: blocks come from Python callables
 * given by the strategy (the backend's malloc, a chunk cache's slow path), so
 * the one seam to CUDA stays cupy_memstrat.cuda.
 *
 * Accounting(...) holds a strategy's tables; its methods malloc and free are the
 * two functions CuPy calls. Two modes:
 *
 *   hooks    allocate(size) -> ptr and deallocate(ptr): the base Strategy's hooks
 *            (the device strategy binds cudaMalloc / cudaFree there);
 *   classes  stream-ordered free lists by size class (managed): one arena per
 *            stream, arenas[device][stream key] = (small, large); small sizes
 *            index small[(size + 511) >> 9], large ones large[size rounded up
 *            to 512 B]; miss(size, device, key) is the slow path. A block goes
 *            back to the arena of the stream it was allocated on, whatever
 *            stream is current at the free, so only later work on that stream
 *            reuses it: each chunk belongs to one arena for good, owner[chunk
 *            base] (the base is ptr rounded down to chunk_bytes; arena_of(ptr,
 *            device) finds it otherwise). The stream key is CuPy's: the
 *            current stream's handle, or for the per-thread default stream
 *            (handle 2 in every thread) minus the thread's ident
 *            (_get_stream_identifier in cupy/cuda/memory.pyx, cupy#5069). The
 *            handle comes from CuPy's own C function get_stream_ptr(device)
 *            (cupy_backends/cuda/stream.pxd) when the backend gives it as a
 *            capsule, else from a callable stream_ptr(device).
 *
 *   ordered  stream-ordered pool allocations (async): pool_malloc(size, pool, stream)
 *            (cudaMallocFromPoolAsync) on the current stream of the device, freed
 *            with free_async(ptr, stream) (cudaFreeAsync) on the stream the block
 *            was allocated on; stream_of[ptr] remembers it: None for the legacy
 *            default stream, the thread's ident for the per-thread default
 *            stream (handle 2), else a weak reference to CuPy's Stream object, so
 *            a block of a destroyed stream is never freed on a handle CUDA may
 *            have given to another stream (free_off_path synchronises instead).
 *            On the legacy default stream, blocks of up to cache_limits[device]
 *            bytes per 512-byte class are kept in caches[device][class] and
 *            reused without a CUDA call. pools[device] is 0 until ensure_pool
 *            (device) makes the pool; recover_pool(size, device, stream, pool,
 *            exc, class size or 0) recovers from a failed allocation.
 *
 * All modes: while blocks freed with record_stream() wait (pending is not
 * empty), malloc first calls poll(); a free of a block in recorded calls
 * defer(ptr, size, device) instead of giving the block back; when watch[0] is
 * not None and the device has no live block left after a free, watch[0]() is
 * called (using() lets go of a strategy). If allocate raises the backend's
 * error, failed(size, device, exc) recovers and returns the pointer, or raises.
 *
 * Accounting: per device, an allocation inserts ptr -> size into live[device],
 * then adds size to the device's counts (the running sum, its largest value,
 * the number of allocations); a free pops live[device][ptr], then subtracts the
 * size and counts the free. The counts are C integers: drain(device) hands them
 * to the strategy's counters and starts them again from 0 (base.py's _fold), so
 * no list of events grows and none is folded. The Python version appends +size /
 * -size to a per-device event list instead, folded by the strategy. All of it
 * runs under the GIL without calling Python code in between (int keys hash and
 * compare in C), so it is exact under threads and takes no lock (CuPy frees from
 * finalisers).
 *
 * The extension is one compilation unit, so that the compiler inlines across its
 * parts as it did when they were one file: each concern is a file of csrc/hotpath/,
 * included below in the order their definitions are used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>
#include <stdint.h>
#include <string.h>

#include "hotpath/accounting.h"
#include "hotpath/common.c"
#include "hotpath/classes.c"
#include "hotpath/ordered.c"
#include "hotpath/accounting.c"
#include "hotpath/pool_direct.c"
#include "hotpath/gc_safe.c"
#include "hotpath/module.c"
