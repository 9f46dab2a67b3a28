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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>
#include <stdint.h>
#include <string.h>

/* A device's counts since the last drain(): the sum of +size / -size, the largest
 * running sum (0 at the drain), the allocations and the frees counted. */
typedef struct {
    long long sum, max, allocs, frees;
} DevCounts;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n_devices;
    DevCounts *counts;        /* one per device; drain(device) hands them to the strategy's counters */
    unsigned long long small_max;
    PyObject *live;           /* list (per device) of dicts ptr -> size */
    PyObject *unknown_free;   /* unknown_free(ptr, stacklevel) -> (device, size or None) */
    PyObject *failed;         /* failed(size, device, exc): raises */
    PyObject *error;          /* the backend's error class */
    PyObject *allocate;       /* hooks: allocate(size) -> ptr */
    PyObject *deallocate;     /* hooks: deallocate(ptr) */
    PyObject *dealloc_failed; /* hooks: dealloc_failed(ptr, size, device, exc, stacklevel) */
    PyObject *arenas;         /* classes: list (device) of dicts stream key -> (small, large) */
    PyObject *owner;          /* classes: dict chunk base -> its arena's (small, large) */
    PyObject *arena_of;       /* classes: arena_of(ptr, device) -> (small, large) */
    PyObject *stream_ptr;     /* classes: stream_ptr(device) -> the current stream's handle */
    PyObject *capsule;        /* classes: the capsule behind stream_fn, or None */
    PyObject *miss;           /* classes: miss(size, device, key) -> ptr */
    PyObject *large_hit;      /* classes: large_hit(ptr, size, device, key) or None */
    PyObject *recorded;       /* dict ptr -> recorded streams (record_stream) */
    PyObject *defer;          /* defer(ptr, size, device) */
    PyObject *pending;        /* list of blocks waiting for recorded streams */
    PyObject *poll;           /* poll() */
    PyObject *watch;          /* [callable or None] */
    PyObject *pool_malloc;    /* ordered: pool_malloc(size, pool, stream) -> ptr */
    PyObject *free_async;     /* ordered: free_async(ptr, stream) */
    PyObject *pools;          /* ordered: list (device) of pool handles, 0 until made */
    PyObject *ensure_pool;    /* ordered: ensure_pool(device) -> pool handle */
    PyObject *current_stream; /* ordered: current_stream(device) -> CuPy's Stream object */
    PyObject *get_device;     /* ordered: get_device() -> the current device */
    PyObject *caches;         /* ordered: list (device) of dicts class size -> list of ptrs */
    PyObject *cache_limits;   /* ordered: list (device) of ints: bytes kept per class */
    PyObject *stream_of;      /* ordered: dict ptr -> None | thread ident | weakref to the stream */
    PyObject *free_off_path;  /* ordered: free_off_path(ptr, size, device, stream or None, stacklevel) */
    PyObject *recover_pool;   /* ordered: recover_pool(size, device, stream, pool, exc, class size or 0) -> ptr */
    PyObject *stream_caches;  /* ordered: list (device) of dicts weakref to a stream -> class size -> ptrs */
    PyObject *new_stream_cache; /* ordered: new_stream_cache(device, stream) -> that stream's new dict */
    PyObject *dead;           /* ordered: list of streams that died with a cache (reap() handles them) */
    PyObject *reap;           /* ordered: reap() */
    int ordered;
    intptr_t (*stream_fn)(int);
    unsigned long long chunk_mask;
    /* classes mode, a cache of the last lookup (not for the per-thread default
     * stream, whose key depends on the thread): handle -> key, (device, key) -> arena */
    intptr_t last_h;
    Py_ssize_t last_d;
    PyObject *last_key;    /* owned, or NULL */
    PyObject *last_arena;  /* owned, or NULL: arenas[last_d][last_key] */
    unsigned long long last_base;  /* the chunk of the last free, and its owner's arena (owned, or NULL) */
    PyObject *last_owner;
    unsigned long long key_n;  /* the last size class looked up by key_of(), and its key (owned, or NULL) */
    PyObject *key_obj;
} Accounting;

#define FIELDS(X) X(live) X(unknown_free) X(failed) X(error) X(allocate) \
    X(deallocate) X(dealloc_failed) X(arenas) X(owner) X(arena_of) X(stream_ptr) X(capsule) X(miss) X(large_hit) \
    X(recorded) X(defer) X(pending) X(poll) X(watch) X(pool_malloc) X(free_async) X(pools) X(ensure_pool) \
    X(current_stream) X(get_device) X(caches) X(cache_limits) X(stream_of) X(free_off_path) X(recover_pool) \
    X(stream_caches) X(new_stream_cache) X(dead) X(reap)

static int
Accounting_traverse(Accounting *self, visitproc visit, void *arg)
{
#define VISIT(f) Py_VISIT(self->f);
    FIELDS(VISIT)
#undef VISIT
    Py_VISIT(self->last_key);
    Py_VISIT(self->last_arena);
    Py_VISIT(self->last_owner);
    Py_VISIT(self->key_obj);
    return 0;
}

static int
Accounting_clear(Accounting *self)
{
#define CLEAR(f) Py_CLEAR(self->f);
    FIELDS(CLEAR)
#undef CLEAR
    Py_CLEAR(self->last_key);
    Py_CLEAR(self->last_arena);
    Py_CLEAR(self->last_owner);
    Py_CLEAR(self->key_obj);
    return 0;
}

static void
Accounting_dealloc(Accounting *self)
{
    PyObject_GC_UnTrack(self);
    Accounting_clear(self);
    PyMem_Free(self->counts);
    self->counts = NULL;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
check_per_device(PyObject *obj, const char *name, Py_ssize_t n, PyTypeObject *item_type)
{
    if (!PyList_CheckExact(obj) || PyList_GET_SIZE(obj) != n) {
        PyErr_Format(PyExc_TypeError, "Accounting: %s must be a list with one entry per device (%zd)", name, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(PyList_GET_ITEM(obj, i)) != item_type) {
            PyErr_Format(PyExc_TypeError, "Accounting: %s[%zd] must be a %s", name, i, item_type->tp_name);
            return -1;
        }
    }
    return 0;
}

/* The C function intptr_t (int) held by a capsule (CuPy's get_stream_ptr); -1 with an error. */
static int
capsule_stream_fn(PyObject *capsule, intptr_t (**fn)(int))
{
    const char *cname = PyCapsule_CheckExact(capsule) ? PyCapsule_GetName(capsule) : NULL;
    if (cname == NULL || strcmp(cname, "intptr_t (int)") != 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "Accounting: capsule must hold a C function intptr_t (int)");
        return -1;
    }
    *fn = (intptr_t (*)(int))PyCapsule_GetPointer(capsule, cname);
    return *fn == NULL ? -1 : 0;
}

static int
Accounting_init(Accounting *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"live", "unknown_free", "failed", "error",
                             "allocate", "deallocate", "dealloc_failed",
                             "arenas", "owner", "arena_of", "chunk_bytes", "stream_ptr", "capsule", "small_max",
                             "miss", "large_hit", "recorded", "defer", "pending", "poll", "watch",
                             "pool_malloc", "free_async", "pools", "ensure_pool", "current_stream", "get_device",
                             "caches", "cache_limits", "stream_of", "free_off_path", "recover_pool",
                             "stream_caches", "new_stream_cache", "dead", "reap", NULL};
    PyObject *live, *unknown_free, *failed, *error;
    PyObject *allocate = Py_None, *deallocate = Py_None, *dealloc_failed = Py_None;
    PyObject *arenas = Py_None, *owner = Py_None, *arena_of = Py_None, *stream_ptr = Py_None, *capsule = Py_None;
    unsigned long long chunk_bytes = 0;
    PyObject *miss = Py_None, *large_hit = Py_None;
    PyObject *recorded = NULL, *defer = NULL, *pending = NULL, *poll = NULL, *watch = NULL;
    PyObject *pool_malloc = Py_None, *free_async = Py_None, *pools = Py_None, *ensure_pool = Py_None;
    PyObject *current_stream = Py_None, *get_device = Py_None, *caches = Py_None, *cache_limits = Py_None;
    PyObject *stream_of = Py_None, *free_off_path = Py_None, *recover_pool = Py_None;
    PyObject *stream_caches = Py_None, *new_stream_cache = Py_None, *dead = Py_None, *reap = Py_None;
    Py_ssize_t small_max = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|$OOOOOOKOOnOOOOOOOOOOOOOOOOOOOOOO", kwlist, &live,
                                     &unknown_free, &failed, &error, &allocate, &deallocate,
                                     &dealloc_failed, &arenas, &owner, &arena_of, &chunk_bytes, &stream_ptr,
                                     &capsule, &small_max, &miss, &large_hit, &recorded, &defer, &pending, &poll,
                                     &watch, &pool_malloc, &free_async, &pools, &ensure_pool, &current_stream,
                                     &get_device, &caches, &cache_limits, &stream_of, &free_off_path,
                                     &recover_pool, &stream_caches, &new_stream_cache, &dead, &reap))
        return -1;
    if (!PyList_CheckExact(live) || PyList_GET_SIZE(live) == 0) {
        PyErr_SetString(PyExc_TypeError, "Accounting: live must be a list with one dict per device");
        return -1;
    }
    if (small_max < 0 || small_max > ((Py_ssize_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "Accounting: small_max must be in [0, 2**40], got %zd", small_max);
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(live);
    if (check_per_device(live, "live", n, &PyDict_Type) < 0)
        return -1;
    /* record_stream and using(): required */
    if (recorded == NULL || pending == NULL || watch == NULL || defer == NULL || poll == NULL) {
        PyErr_SetString(PyExc_TypeError, "Accounting: recorded, defer, pending, poll and watch are required");
        return -1;
    }
    if (!PyDict_CheckExact(recorded) || !PyList_CheckExact(pending) || !PyList_CheckExact(watch) ||
        PyList_GET_SIZE(watch) != 1 || !PyCallable_Check(defer) || !PyCallable_Check(poll)) {
        PyErr_SetString(PyExc_TypeError,
                        "Accounting: recorded must be a dict, pending a list, watch a 1-item list, "
                        "defer and poll callables");
        return -1;
    }
    intptr_t (*stream_fn)(int) = NULL;
    int hooks = allocate != Py_None, ordered = pool_malloc != Py_None;
    if (hooks && ordered) {
        PyErr_SetString(PyExc_TypeError, "Accounting: give allocate (hooks) or pool_malloc (ordered), not both");
        return -1;
    }
    if (ordered) {
        if (check_per_device(pools, "pools", n, &PyLong_Type) < 0 ||
            check_per_device(caches, "caches", n, &PyDict_Type) < 0 ||
            check_per_device(cache_limits, "cache_limits", n, &PyLong_Type) < 0)
            return -1;
        if (!PyDict_CheckExact(stream_of)) {
            PyErr_SetString(PyExc_TypeError, "Accounting: stream_of must be a dict");
            return -1;
        }
        if (check_per_device(stream_caches, "stream_caches", n, &PyDict_Type) < 0)
            return -1;
        if (!PyList_CheckExact(dead) || !PyCallable_Check(new_stream_cache) || !PyCallable_Check(reap)) {
            PyErr_SetString(PyExc_TypeError, "Accounting: dead must be a list, new_stream_cache and reap callables");
            return -1;
        }
        if (!PyCallable_Check(pool_malloc) || !PyCallable_Check(free_async) || !PyCallable_Check(ensure_pool) ||
            !PyCallable_Check(current_stream) || !PyCallable_Check(get_device) ||
            !PyCallable_Check(free_off_path) || !PyCallable_Check(recover_pool)) {
            PyErr_SetString(PyExc_TypeError,
                            "Accounting: pool_malloc, free_async, ensure_pool, current_stream, get_device, "
                            "free_off_path and recover_pool must be callables");
            return -1;
        }
        if (capsule != Py_None && capsule_stream_fn(capsule, &stream_fn) < 0)
            return -1;
    } else if (hooks) {
        if (!PyCallable_Check(allocate) || !PyCallable_Check(deallocate) || !PyCallable_Check(dealloc_failed)) {
            PyErr_SetString(PyExc_TypeError, "Accounting: allocate, deallocate and dealloc_failed must be callables");
            return -1;
        }
    } else {
        if (check_per_device(arenas, "arenas", n, &PyDict_Type) < 0)
            return -1;
        if (!PyDict_CheckExact(owner)) {
            PyErr_SetString(PyExc_TypeError, "Accounting: owner must be a dict");
            return -1;
        }
        if (chunk_bytes == 0 || (chunk_bytes & (chunk_bytes - 1)) != 0) {
            PyErr_SetString(PyExc_ValueError, "Accounting: chunk_bytes must be a power of two");
            return -1;
        }
        if (!PyCallable_Check(miss) || !PyCallable_Check(stream_ptr) || !PyCallable_Check(arena_of) ||
            (large_hit != Py_None && !PyCallable_Check(large_hit))) {
            PyErr_SetString(PyExc_TypeError,
                            "Accounting: miss, arena_of and stream_ptr (and large_hit, if given) must be callables");
            return -1;
        }
        if (capsule != Py_None && capsule_stream_fn(capsule, &stream_fn) < 0)
            return -1;
    }
    if (!PyCallable_Check(unknown_free) || !PyCallable_Check(failed)) {
        PyErr_SetString(PyExc_TypeError, "Accounting: unknown_free and failed must be callables");
        return -1;
    }
    if (!PyExceptionClass_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "Accounting: error must be an exception class");
        return -1;
    }
    if (self->counts != NULL) {
        PyErr_SetString(PyExc_TypeError, "Accounting: already initialised (its counts belong to its tables)");
        return -1;
    }
    self->counts = PyMem_Calloc((size_t)n, sizeof(DevCounts));
    if (self->counts == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->n_devices = n;
    self->ordered = ordered;
    self->small_max = (unsigned long long)small_max;
    self->stream_fn = stream_fn;
    self->chunk_mask = ~(chunk_bytes ? chunk_bytes - 1 : 0ULL);
    self->last_h = -1;
    self->last_d = -1;
    Py_CLEAR(self->last_key);
    Py_CLEAR(self->last_arena);
    Py_CLEAR(self->last_owner);
#define SET(f) Py_INCREF(f); Py_XSETREF(self->f, f);
    FIELDS(SET)
#undef SET
    return 0;
}

/* The device argument as an index into the per-device tables, or -1 (no error set). */
static inline Py_ssize_t
device_index(Accounting *self, PyObject *device)
{
    if (!PyLong_CheckExact(device))
        return -1;
    Py_ssize_t d = PyLong_AsSsize_t(device);
    if (d == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return d < self->n_devices ? d : -1;
}

/* An allocation raised the backend's error: handler(*before, exc, *after) recovers
 * (CuPy's order: give back, collect, retry) and returns the pointer, or raises the
 * error to show (an OutOfMemoryError naming the request, or exc itself), with exc as
 * the exception being handled, as in the Python version's except block. */
static PyObject *
call_on_failure(PyObject *handler, PyObject *const *before, Py_ssize_t nbefore, PyObject *const *after,
                Py_ssize_t nafter)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *otype, *ovalue, *otb;
    PyErr_GetExcInfo(&otype, &ovalue, &otb);
    Py_XINCREF(type);
    Py_XINCREF(value);
    Py_XINCREF(tb);
    PyErr_SetExcInfo(type, value, tb);
    PyObject *args[8];
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < nbefore && n < 7; i++)
        args[n++] = before[i];
    args[n++] = value ? value : Py_None;
    for (Py_ssize_t i = 0; i < nafter && n < 8; i++)
        args[n++] = after[i];
    PyObject *r = PyObject_Vectorcall(handler, args, (size_t)n, NULL);
    PyErr_SetExcInfo(otype, ovalue, otb);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (r != NULL && !PyLong_CheckExact(r)) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_SystemError, "cupy_memstrat: the allocation-failure handler returned a non-int");
        return NULL;
    }
    return r;
}

/* allocate() raised the backend's error: failed(size, device, exc). */
static PyObject *
allocation_failed(Accounting *self, PyObject *size, PyObject *device)
{
    PyObject *before[2] = {size, device};
    return call_on_failure(self->failed, before, 2, NULL, 0);
}

/* Pop the last item of a list (a new reference), or NULL if it is empty (no error set). */
static inline PyObject *
list_pop(PyObject *lst)
{
    Py_ssize_t n = PyList_GET_SIZE(lst);
    if (n == 0)
        return NULL;
    /* as list.pop() does, without its call: the list's reference goes to the caller
     * (every list here is an exact list; its capacity is kept for the next append) */
    PyObject *item = PyList_GET_ITEM(lst, n - 1);
    PyList_SET_ITEM(lst, n - 1, NULL);
    Py_SET_SIZE(lst, n - 1);
    return item;
}

/* table[i] as a new reference, checked: the tables are the strategy's own lists and
 * dicts, which Python code (a hook, an int subclass's __eq__) could change between
 * two calls, or even during one. A wrong shape is a RuntimeError, never a crash. */
static PyObject *
table_item(PyObject *table, Py_ssize_t i, PyTypeObject *type, const char *name)
{
    if (!PyList_CheckExact(table) || i < 0 || i >= PyList_GET_SIZE(table) ||
        Py_TYPE(PyList_GET_ITEM(table, i)) != type) {
        PyErr_Format(PyExc_RuntimeError, "cupy_memstrat: the strategy's table %s[%zd] is not a %s any more",
                     name, i, type->tp_name);
        return NULL;
    }
    PyObject *item = PyList_GET_ITEM(table, i);
    Py_INCREF(item);
    return item;
}

/* The stream handle that r (a new reference, or NULL with an error set) holds as a
 * Python int; r is released. -1 with an error set on failure. */
static intptr_t
handle_of(PyObject *r)
{
    if (r == NULL)
        return -1;
    intptr_t h = (intptr_t)PyLong_AsSsize_t(r);
    Py_DECREF(r);
    return h;
}

/* The handle of device d's current stream; -1 with an error set on failure. */
static intptr_t
stream_handle(Accounting *self, Py_ssize_t d, PyObject *device)
{
    if (self->stream_fn != NULL)
        return self->stream_fn((int)d);  /* -1 with an error set on failure (Cython's except? -1) */
    return handle_of(PyObject_CallOneArg(self->stream_ptr, device));
}

/* The stream key of the current stream (a new reference): its handle, or for the
 * per-thread default stream minus the thread's ident. *h gets the handle. */
static PyObject *
stream_key(Accounting *self, Py_ssize_t d, PyObject *device, intptr_t *h)
{
    *h = stream_handle(self, d, device);
    if (*h == -1 && PyErr_Occurred())
        return NULL;
    if (*h == 2) {  /* cudaStreamPerThread: one stream per thread behind one handle */
        PyObject *tid = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
        if (tid == NULL)
            return NULL;
        PyObject *key = PyNumber_Negative(tid);
        Py_DECREF(tid);
        return key;
    }
    if (*h == self->last_h && self->last_key != NULL) {
        Py_INCREF(self->last_key);
        return self->last_key;
    }
    PyObject *key = PyLong_FromSsize_t((Py_ssize_t)*h);
    if (key != NULL) {
        Py_XSETREF(self->last_key, Py_NewRef(key));
        self->last_h = *h;
        self->last_d = -1;  /* the arena cache was for another key */
        Py_CLEAR(self->last_arena);
    }
    return key;
}

/* arenas[d][key] as (small, large), borrowed references; 0 if there is no such
 * arena yet (no error set), -1 with an error if the tables have a wrong shape. */
static int
arena_lists(Accounting *self, Py_ssize_t d, PyObject *key, PyObject **small, PyObject **large)
{
    PyObject *per_device = table_item(self->arenas, d, &PyDict_Type, "arenas");
    if (per_device == NULL)
        return -1;
    PyObject *arena = PyDict_GetItemWithError(per_device, key);  /* borrowed */
    Py_DECREF(per_device);
    if (arena == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_CheckExact(arena) || PyTuple_GET_SIZE(arena) != 2 ||
        !PyList_CheckExact(PyTuple_GET_ITEM(arena, 0)) || !PyDict_CheckExact(PyTuple_GET_ITEM(arena, 1)) ||
        PyList_GET_SIZE(PyTuple_GET_ITEM(arena, 0)) <= (Py_ssize_t)((self->small_max + 511) >> 9)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cupy_memstrat: an arena of the strategy is not a (list per 512 B, dict) pair any more");
        return -1;
    }
    *small = PyTuple_GET_ITEM(arena, 0);
    *large = PyTuple_GET_ITEM(arena, 1);
    return 1;
}

/* The free list of a size class: small[(n + 511) >> 9], a new reference. */
static PyObject *
small_list(PyObject *small, unsigned long long n)
{
    return table_item(small, (Py_ssize_t)((n + 511) >> 9), &PyList_Type, "arena small");
}

/* A pointer as an unsigned long long, -1 with an error set if it is not an int in
 * [0, 2**64). PyLong_AsUnsignedLongLong takes a generic path for ints of more than
 * one digit (every device pointer); an exact int whose value survives the mask is
 * converted by the masking loop instead. */
static unsigned long long
ptr_value(PyObject *ptr)
{
    if (PyLong_CheckExact(ptr)) {
#if PY_VERSION_HEX >= 0x030D0000
        unsigned long long p = 0;
        Py_ssize_t need = PyLong_AsNativeBytes(ptr, &p, sizeof p, Py_ASNATIVEBYTES_NATIVE_ENDIAN
                                               | Py_ASNATIVEBYTES_UNSIGNED_BUFFER
                                               | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
        if (need >= 0 && (size_t)need <= sizeof p)
            return p;
        PyErr_Clear();
#else
        if (_PyLong_Sign(ptr) >= 0 && _PyLong_NumBits(ptr) <= 64)
            return PyLong_AsUnsignedLongLongMask(ptr);
#endif
    }
    return PyLong_AsUnsignedLongLong(ptr);  /* raises for what is not a pointer */
}

/* The size as an unsigned long long; 0 with no error set if it is an int that does
 * not fit (the strategy's slow path then says why), -1 with an error otherwise. */
static int
size_value(PyObject *size, unsigned long long *n)
{
    *n = PyLong_AsUnsignedLongLong(size);
    if (*n == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    return 1;
}

/* A block's size as a count: a non-negative int of at most 2**63 - 1 bytes
 * (CUDA's size_t requests are at most that in practice); -1 with an error set. */
static long long
count_of(PyObject *size)
{
    long long n = PyLong_AsLongLong(size);
    if (n < 0) {
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "cupy_memstrat: a block of %R bytes is more than the statistics "
                         "count (at most 2**63 - 1 bytes)", size);
        } else if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "cupy_memstrat: a block's size must be >= 0, got %R", size);
        }
        return -1;
    }
    return n;
}

/* Accounting of an allocation: live[d][ptr] = size, then the counts of device d. */
static int
account_malloc(Accounting *self, Py_ssize_t d, PyObject *device, PyObject *ptr, PyObject *size)
{
    long long n = count_of(size);
    if (n < 0)
        return -1;
    PyObject *live = table_item(self->live, d, &PyDict_Type, "live");
    if (live == NULL)
        return -1;
    int rc = PyDict_SetItem(live, ptr, size);
    Py_DECREF(live);
    if (rc == 0) {  /* no Python code runs from here to the end of the free that pops it */
        DevCounts *c = &self->counts[d];
        c->sum += n;
        if (c->sum > c->max)
            c->max = c->sum;
        c->allocs++;
    }
    return rc;
}

/* Accounting of a free whose size was popped from live[d]. */
static int
account_free(Accounting *self, Py_ssize_t d, PyObject *size)
{
    long long n = count_of(size);
    if (n < 0)
        return -1;
    DevCounts *c = &self->counts[d];
    c->sum -= n;
    c->frees++;
    return 0;
}

/* Blocks freed with record_stream() may be done: poll() gives them back. */
static inline int
poll_pending(Accounting *self)
{
    if (PyList_GET_SIZE(self->pending) == 0)
        return 0;
    PyObject *r = PyObject_CallNoArgs(self->poll);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The key of a free-list dict for a block of n bytes (its size rounded up to
 * 512 B: the large lists of classes mode, the size-class caches of ordered
 * mode), a new reference. The last one is kept: a program that allocates one
 * size again and again makes no int per malloc and free. */
static PyObject *
key_of(Accounting *self, unsigned long long n)
{
    unsigned long long c = (n + 511) & ~511ULL;
    if (self->key_obj != NULL && self->key_n == c)
        return Py_NewRef(self->key_obj);
    PyObject *k = PyLong_FromUnsignedLongLong(c);
    if (k != NULL) {
        Py_XSETREF(self->key_obj, Py_NewRef(k));
        self->key_n = c;
    }
    return k;
}

/* classes mode: a block from the arena of stream `key`, or NULL with no error set
 * (a miss); *hit_large tells a large block was taken. */
static PyObject *
arena_pop(Accounting *self, Py_ssize_t d, PyObject *key, intptr_t h, PyObject *size, int *hit_large)
{
    unsigned long long n;
    int fits = size_value(size, &n);
    if (fits <= 0)
        return NULL;  /* an error (fits < 0), or too large: the slow path says why */
    PyObject *small, *large;
    if (h != 2 && d == self->last_d && key == self->last_key && self->last_arena != NULL) {
        small = PyTuple_GET_ITEM(self->last_arena, 0);  /* checked when it was cached */
        large = PyTuple_GET_ITEM(self->last_arena, 1);
    } else {
        int have = arena_lists(self, d, key, &small, &large);
        if (have <= 0)
            return NULL;
        if (h != 2 && key == self->last_key) {  /* cache it (forget() drops it when an arena leaves) */
            PyObject *per_device = PyList_GET_ITEM(self->arenas, d);
            PyObject *arena = PyDict_GetItemWithError(per_device, key);
            if (arena != NULL) {
                Py_XSETREF(self->last_arena, Py_NewRef(arena));
                self->last_d = d;
            }
        }
    }
    Py_INCREF(small);
    Py_INCREF(large);
    PyObject *ptr = NULL;
    if (n <= self->small_max) {
        PyObject *lst = small_list(small, n);
        if (lst != NULL) {
            ptr = list_pop(lst);
            Py_DECREF(lst);
        }
    } else {
        PyObject *k = key_of(self, n), *lst = NULL;
        if (k != NULL) {
            lst = PyDict_GetItemWithError(large, k);
            Py_XINCREF(lst);
            Py_DECREF(k);
        }
        if (lst != NULL && PyList_CheckExact(lst)) {
            ptr = list_pop(lst);
            *hit_large = ptr != NULL;
        }
        Py_XDECREF(lst);
    }
    Py_DECREF(small);
    Py_DECREF(large);
    return ptr;
}

/* -- ordered mode (async) ------------------------------------------------------------ */

/* A block from a cache's free list of class `cls` (cache: dict class size -> list of
 * ptrs): a new reference, or NULL (with an error set only on failure). */
static PyObject *
class_pop(PyObject *cache, PyObject *cls)
{
    PyObject *lst = PyDict_GetItemWithError(cache, cls);  /* borrowed */
    return lst != NULL && PyList_CheckExact(lst) ? list_pop(lst) : NULL;
}

/* ptr onto a cache's free list of class `cls` if the list then holds at most `limit`
 * bytes: 1 (kept), 0 (no room), -1 (an error). */
static int
class_put(Accounting *self, PyObject *cache, unsigned long long cls, PyObject *ptr, unsigned long long limit)
{
    PyObject *k = key_of(self, cls);  /* cls is a multiple of 512: its own class */
    if (k == NULL)
        return -1;
    PyObject *lst = PyDict_GetItemWithError(cache, k);  /* borrowed */
    if (lst == NULL && !PyErr_Occurred()) {
        PyObject *fresh = PyList_New(0);
        lst = fresh == NULL ? NULL : PyDict_SetDefault(cache, k, fresh);
        Py_XDECREF(fresh);
    }
    int rc = 0;
    if (lst != NULL && PyList_CheckExact(lst) && ((unsigned long long)PyList_GET_SIZE(lst) + 1) * cls <= limit)
        rc = PyList_Append(lst, ptr) < 0 ? -1 : 1;
    else if (PyErr_Occurred())
        rc = -1;
    Py_DECREF(k);
    return rc;
}

static PyObject *S_ptr;  /* "ptr", interned */

/* A CuPy Stream's handle (its .ptr); -1 with an error set on failure. */
static intptr_t
stream_obj_handle(PyObject *stream)
{
    return handle_of(PyObject_GetAttr(stream, S_ptr));
}

/* pools[d], made on first use by ensure_pool(device): a new reference. */
static PyObject *
device_pool(Accounting *self, Py_ssize_t d, PyObject *device)
{
    PyObject *pool = table_item(self->pools, d, &PyLong_Type, "pools");
    if (pool == NULL)
        return NULL;
    int none = PyObject_Not(pool);
    if (none == 0)
        return pool;
    Py_DECREF(pool);
    if (none < 0)
        return NULL;
    return PyObject_CallOneArg(self->ensure_pool, device);
}

/* cache_limits[d] in bytes; -1 with an error set on failure. */
static int
cache_limit(Accounting *self, Py_ssize_t d, unsigned long long *limit)
{
    PyObject *v = table_item(self->cache_limits, d, &PyLong_Type, "cache_limits");
    if (v == NULL)
        return -1;
    *limit = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (*limit == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();  /* negative: nothing is kept */
        *limit = 0;
    }
    return 0;
}

/* pool_malloc(size, pool, stream); on the backend's error, recover_pool(size, device,
 * stream, pool, exc, cls) (cls: the class size the cache path asked for, or 0). */
static PyObject *
pool_alloc(Accounting *self, PyObject *size, PyObject *alloc_size, PyObject *device, PyObject *pool,
           PyObject *stream, PyObject *cls)
{
    PyObject *args[3] = {alloc_size, pool, stream};
    PyObject *ptr = PyObject_Vectorcall(self->pool_malloc, args, 3, NULL);
    if (ptr != NULL || !PyErr_ExceptionMatches(self->error))
        return ptr;
    PyObject *before[4] = {size, device, stream, pool};
    PyObject *after[1] = {cls};
    return call_on_failure(self->recover_pool, before, 4, after, 1);
}

/* An allocation on the current stream of device d: from the cache (legacy default
 * stream, blocks up to the cache limit), else from the device's pool. Sets
 * stream_of[ptr]. A new reference, or NULL with an error set. */
static PyObject *
ordered_malloc(Accounting *self, Py_ssize_t d, PyObject *device, PyObject *size)
{
    if (PyList_GET_SIZE(self->dead)) {  /* streams that died with blocks cached */
        PyObject *x = PyObject_CallNoArgs(self->reap);
        if (x == NULL)
            return NULL;
        Py_DECREF(x);
    }
    unsigned long long n;
    int fits = size_value(size, &n);
    if (fits < 0)
        return NULL;
    PyObject *stream = NULL, *ptr = NULL, *r = NULL, *pool = NULL, *hobj = NULL, *cls = NULL;
    intptr_t h;
    if (self->stream_fn != NULL) {
        h = self->stream_fn((int)d);
        if (h == -1 && PyErr_Occurred())
            return NULL;
    } else {
        stream = PyObject_CallOneArg(self->current_stream, device);
        if (stream == NULL)
            return NULL;
        h = stream_obj_handle(stream);
        if (h == -1 && PyErr_Occurred())
            goto fail;
    }
    unsigned long long limit = 0;
    if (h != 2 && cache_limit(self, d, &limit) < 0)
        goto fail;
    if (h > 2 && fits && n <= limit) {
        /* a stream of its own: its size class, from that stream's cache if it can */
        if (stream == NULL && (stream = PyObject_CallOneArg(self->current_stream, device)) == NULL)
            goto fail;
        r = PyWeakref_NewRef(stream, NULL);
        cls = r == NULL ? NULL : key_of(self, n);
        if (cls == NULL)
            goto fail;
        PyObject *per_device = table_item(self->stream_caches, d, &PyDict_Type, "stream_caches");
        if (per_device == NULL)
            goto fail;
        PyObject *sc = PyDict_GetItemWithError(per_device, r);  /* borrowed */
        if (sc != NULL && PyDict_CheckExact(sc))
            ptr = class_pop(sc, cls);
        Py_DECREF(per_device);
        if (ptr == NULL && PyErr_Occurred())
            goto fail;
        if (ptr == NULL) {
            pool = device_pool(self, d, device);
            hobj = pool == NULL ? NULL : PyLong_FromSsize_t((Py_ssize_t)h);
            if (hobj == NULL)
                goto fail;
            ptr = pool_alloc(self, size, cls, device, pool, hobj, cls);
            if (ptr == NULL)
                goto fail;
        }
    } else if (h == 0 && fits && n <= limit) {
        /* the legacy default stream: its size class, from the cache if it can */
        cls = key_of(self, n);
        if (cls == NULL)
            goto fail;
        PyObject *cache = table_item(self->caches, d, &PyDict_Type, "caches");
        if (cache == NULL)
            goto fail;
        ptr = class_pop(cache, cls);
        Py_DECREF(cache);
        if (ptr == NULL && PyErr_Occurred())
            goto fail;
        if (ptr == NULL) {
            pool = device_pool(self, d, device);
            hobj = pool == NULL ? NULL : PyLong_FromLong(0);
            if (hobj == NULL)
                goto fail;
            ptr = pool_alloc(self, size, cls, device, pool, hobj, cls);
            if (ptr == NULL)
                goto fail;
        }
        r = Py_NewRef(Py_None);
    } else {
        pool = device_pool(self, d, device);
        hobj = pool == NULL ? NULL : PyLong_FromSsize_t((Py_ssize_t)h);
        if (hobj == NULL)
            goto fail;
        PyObject *zero = PyLong_FromLong(0);
        if (zero == NULL)
            goto fail;
        ptr = pool_alloc(self, size, size, device, pool, hobj, zero);
        Py_DECREF(zero);
        if (ptr == NULL)
            goto fail;
        if (h == 0) {
            r = Py_NewRef(Py_None);
        } else if (h == 2) {  /* cudaStreamPerThread is another stream in each thread: remember the thread */
            r = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
        } else {
            if (stream == NULL)
                stream = PyObject_CallOneArg(self->current_stream, device);
            r = stream == NULL ? NULL : PyWeakref_NewRef(stream, NULL);
        }
        if (r == NULL) {  /* the block cannot be remembered: back to the pool on its stream */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject *fa[2] = {ptr, hobj};
            PyObject *x = PyObject_Vectorcall(self->free_async, fa, 2, NULL);
            Py_XDECREF(x);
            PyErr_Clear();
            PyErr_Restore(type, value, tb);
            Py_CLEAR(ptr);
            goto fail;
        }
    }
    if (account_malloc(self, d, device, ptr, size) < 0 || PyDict_SetItem(self->stream_of, ptr, r) < 0)
        Py_CLEAR(ptr);
fail:
    Py_XDECREF(stream);
    Py_XDECREF(r);
    Py_XDECREF(pool);
    Py_XDECREF(hobj);
    Py_XDECREF(cls);
    return ptr;
}

/* free_off_path(ptr, size, device, stream or None, stacklevel): frees the hot path
 * does not do (another device's default stream; a destroyed stream: synchronise). */
static int
off_path(Accounting *self, PyObject *ptr, PyObject *size, Py_ssize_t d, PyObject *stream, Py_ssize_t stacklevel)
{
    PyObject *device = PyLong_FromSsize_t(d), *level = PyLong_FromSsize_t(stacklevel), *r = NULL;
    if (device != NULL && level != NULL) {
        PyObject *args[5] = {ptr, size, device, stream, level};
        r = PyObject_Vectorcall(self->free_off_path, args, 5, NULL);
    }
    Py_XDECREF(device);
    Py_XDECREF(level);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* A block of stream `stream` (weak reference r) into that stream's cache, if it fits
 * and there is room: 1 (cached), 0 (not cached), -1 (an error). */
static int
stream_cache_put(Accounting *self, PyObject *ptr, PyObject *size, Py_ssize_t d, PyObject *r, PyObject *stream)
{
    unsigned long long n, limit;
    int fits = size_value(size, &n);
    if (fits < 0 || cache_limit(self, d, &limit) < 0)
        return -1;
    if (!fits || n > limit)
        return 0;
    unsigned long long cls = (n + 511) & ~511ULL;
    PyObject *per_device = table_item(self->stream_caches, d, &PyDict_Type, "stream_caches");
    if (per_device == NULL)
        return -1;
    PyObject *sc = PyDict_GetItemWithError(per_device, r);  /* borrowed */
    Py_XINCREF(sc);
    Py_DECREF(per_device);
    if (sc == NULL) {
        if (PyErr_Occurred())
            return -1;
        PyObject *dev = PyLong_FromSsize_t(d);
        if (dev == NULL)
            return -1;
        PyObject *args[2] = {dev, stream};
        sc = PyObject_Vectorcall(self->new_stream_cache, args, 2, NULL);
        Py_DECREF(dev);
        if (sc == NULL)
            return -1;
    }
    if (!PyDict_CheckExact(sc)) {
        Py_DECREF(sc);
        PyErr_SetString(PyExc_RuntimeError, "cupy_memstrat: a stream's cache is not a dict any more");
        return -1;
    }
    int rc = class_put(self, sc, cls, ptr, limit);
    Py_DECREF(sc);
    return rc;
}

/* The freed block returns to the pool in the order of the stream it was allocated
 * on, or to the cache (legacy default stream, if there is room). */
static int
ordered_give_back(Accounting *self, PyObject *ptr, PyObject *size, Py_ssize_t d, Py_ssize_t stacklevel)
{
    PyObject *r = PyDict_GetItemWithError(self->stream_of, ptr);  /* borrowed */
    if (r == NULL) {
        if (PyErr_Occurred())
            return -1;
        return off_path(self, ptr, size, d, Py_None, stacklevel);  /* its stream is unknown: wait for all */
    }
    Py_INCREF(r);
    if (PyDict_DelItem(self->stream_of, ptr) < 0) {
        Py_DECREF(r);
        return -1;
    }
    intptr_t h;
    if (r == Py_None) {  /* a default-stream block: cache it if there is room */
        Py_DECREF(r);
        unsigned long long n, limit;
        int fits = size_value(size, &n);
        if (fits < 0 || cache_limit(self, d, &limit) < 0)
            return -1;
        unsigned long long cls = (n + 511) & ~511ULL;
        if (fits && n <= limit) {
            PyObject *cache = table_item(self->caches, d, &PyDict_Type, "caches");
            if (cache == NULL)
                return -1;
            int kept = class_put(self, cache, cls, ptr, limit);
            Py_DECREF(cache);
            if (kept != 0)
                return kept < 0 ? -1 : 0;
        }
        h = 0;
    } else if (PyLong_CheckExact(r)) {  /* the per-thread default stream of thread r */
        unsigned long ident = PyLong_AsUnsignedLong(r);
        Py_DECREF(r);
        if (ident == (unsigned long)-1 && PyErr_Occurred())
            return -1;
        if (ident != PyThread_get_thread_ident())  /* another thread's stream cannot be named from here */
            return off_path(self, ptr, size, d, Py_None, stacklevel);
        h = 2;
    } else {
        PyObject *stream;
#if PY_VERSION_HEX >= 0x030D0000
        if (PyWeakref_GetRef(r, &stream) < 0) {
            Py_DECREF(r);
            return -1;
        }
#else
        stream = PyWeakref_GetObject(r);  /* borrowed; Py_None once dead */
        if (stream == NULL) {
            Py_DECREF(r);
            return -1;
        }
        stream = stream == Py_None ? NULL : Py_NewRef(stream);
#endif
        if (stream == NULL) {  /* destroyed */
            Py_DECREF(r);
            return off_path(self, ptr, size, d, Py_None, stacklevel);
        }
        h = stream_obj_handle(stream);
        if (h == -1 && PyErr_Occurred()) {
            Py_DECREF(stream);
            Py_DECREF(r);
            return -1;
        }
        int cached = h > 2 ? stream_cache_put(self, ptr, size, d, r, stream) : 0;
        Py_DECREF(stream);
        Py_DECREF(r);
        if (cached != 0)
            return cached < 0 ? -1 : 0;
    }
    /* handles 0-2 name the *current* device's default stream */
    int here = h > 2;
    if (!here) {
        PyObject *cur = PyObject_CallNoArgs(self->get_device);
        if (cur == NULL)
            return -1;
        Py_ssize_t c = PyLong_AsSsize_t(cur);
        Py_DECREF(cur);
        if (c == -1 && PyErr_Occurred())
            return -1;
        here = c == d;
    }
    PyObject *hobj = PyLong_FromSsize_t((Py_ssize_t)h);
    if (hobj == NULL)
        return -1;
    if (here) {
        PyObject *args[2] = {ptr, hobj};
        PyObject *x = PyObject_Vectorcall(self->free_async, args, 2, NULL);
        if (x != NULL) {
            Py_DECREF(x);
            Py_DECREF(hobj);
            return 0;
        }
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            Py_DECREF(hobj);
            return -1;
        }
        PyErr_Clear();  /* CUDA refused the handle: treat it as destroyed */
        Py_SETREF(hobj, Py_NewRef(Py_None));
    }
    int rc = off_path(self, ptr, size, d, hobj, stacklevel);
    Py_DECREF(hobj);
    return rc;
}

static PyObject *
Accounting_malloc(Accounting *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "malloc(size, device) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *size = args[0], *device = args[1];
    Py_ssize_t d = device_index(self, device);
    if (d < 0) {
        PyErr_Format(PyExc_ValueError, "malloc: device %R is not a device ordinal in range(%zd)", device,
                     self->n_devices);
        return NULL;
    }
    if (poll_pending(self) < 0)
        return NULL;
    PyObject *ptr = NULL, *key = NULL;
    if (self->ordered)
        return ordered_malloc(self, d, device, size);
    if (self->allocate != Py_None) {
        ptr = PyObject_CallOneArg(self->allocate, size);
        if (ptr == NULL) {
            if (!PyErr_ExceptionMatches(self->error))
                return NULL;
            ptr = allocation_failed(self, size, device);
            if (ptr == NULL)
                return NULL;
        }
    } else {
        intptr_t h;
        key = stream_key(self, d, device, &h);
        if (key == NULL)
            return NULL;
        int hit = 0;
        ptr = arena_pop(self, d, key, h, size, &hit);
        if (ptr == NULL && PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
        if (ptr == NULL) {
            ptr = PyObject_CallFunctionObjArgs(self->miss, size, device, key, NULL);
            if (ptr == NULL) {
                Py_DECREF(key);
                return NULL;
            }
        } else if (hit && self->large_hit != Py_None) {
            PyObject *r = PyObject_CallFunctionObjArgs(self->large_hit, ptr, size, device, key, NULL);
            if (r == NULL) {
                Py_DECREF(ptr);  /* large_hit put the block back in the cache */
                Py_DECREF(key);
                return NULL;
            }
            Py_DECREF(r);
        }
        Py_DECREF(key);
    }
    if (account_malloc(self, d, device, ptr, size) < 0) {
        Py_DECREF(ptr);
        return NULL;
    }
    return ptr;
}

/* A free the live tables do not know under its device hint: unknown_free finds it
 * on another device, or counts and warns an invalid free. Sets *d and returns the
 * size (a new reference), or Py_None (a new reference) if there is nothing to free. */
static PyObject *
free_unknown(Accounting *self, PyObject *ptr, Py_ssize_t stacklevel, Py_ssize_t *d)
{
    /* The Python version's stacklevel counts its own frame, which this one does not have. */
    PyObject *level = PyLong_FromSsize_t(stacklevel - 1);
    if (level == NULL)
        return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(self->unknown_free, ptr, level, NULL);
    Py_DECREF(level);
    if (r == NULL)
        return NULL;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_SystemError, "cupy_memstrat: unknown_free must return (device, size)");
        return NULL;
    }
    PyObject *size = PyTuple_GET_ITEM(r, 1);
    Py_INCREF(size);
    if (size != Py_None) {
        *d = device_index(self, PyTuple_GET_ITEM(r, 0));
        if (*d < 0) {
            Py_DECREF(size);
            Py_DECREF(r);
            PyErr_SetString(PyExc_SystemError, "cupy_memstrat: unknown_free returned a bad device");
            return NULL;
        }
    }
    Py_DECREF(r);
    return size;
}

/* Pop live[d][ptr]: the size (a new reference), or NULL with no error set if absent. */
static PyObject *
live_pop(Accounting *self, Py_ssize_t d, PyObject *ptr)
{
    PyObject *live = table_item(self->live, d, &PyDict_Type, "live");
    if (live == NULL)
        return NULL;
    /* one lookup: found, absent, or not hashable (not a pointer of this device) */
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *size = NULL;
    if (PyDict_Pop(live, ptr, &size) < 0)
        PyErr_Clear();
#else
    PyObject *size = _PyDict_Pop(live, ptr, Py_Ellipsis);  /* no size is Ellipsis */
    if (size == Py_Ellipsis)
        Py_CLEAR(size);
    else if (size == NULL)
        PyErr_Clear();
#endif
    Py_DECREF(live);
    return size;
}

/* The freed block goes back to the free list of its size class in the arena of the
 * stream it was allocated on (classes mode). */
static int
cache_block(Accounting *self, Py_ssize_t d, PyObject *ptr, PyObject *size)
{
    unsigned long long n;
    int fits = size_value(size, &n);
    if (fits <= 0) {
        if (fits == 0)
            PyErr_SetString(PyExc_OverflowError, "cupy_memstrat: a live block's size does not fit in size_t");
        return -1;
    }
    /* the arena its chunk belongs to: owner[ptr rounded down to a chunk], else arena_of(ptr, device) */
    PyObject *arena = NULL;
    unsigned long long p = ptr_value(ptr);
    if (p == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (self->last_owner != NULL && (p & self->chunk_mask) == self->last_base) {
        arena = self->last_owner;  /* the chunk of the last free (forget() drops it when chunks go back) */
    } else {
        PyObject *base = PyLong_FromUnsignedLongLong(p & self->chunk_mask);
        if (base == NULL)
            return -1;
        arena = PyDict_GetItemWithError(self->owner, base);  /* borrowed */
        Py_DECREF(base);
        if (arena != NULL) {
            self->last_base = p & self->chunk_mask;
            Py_XSETREF(self->last_owner, Py_NewRef(arena));
        }
    }
    if (arena != NULL) {
        Py_INCREF(arena);
    } else {
        if (PyErr_Occurred())
            return -1;
        PyObject *device = PyLong_FromSsize_t(d);
        if (device == NULL)
            return -1;
        arena = PyObject_CallFunctionObjArgs(self->arena_of, ptr, device, NULL);
        Py_DECREF(device);
        if (arena == NULL)
            return -1;
    }
    if (!PyTuple_CheckExact(arena) || PyTuple_GET_SIZE(arena) != 2 ||
        !PyList_CheckExact(PyTuple_GET_ITEM(arena, 0)) || !PyDict_CheckExact(PyTuple_GET_ITEM(arena, 1)) ||
        PyList_GET_SIZE(PyTuple_GET_ITEM(arena, 0)) <= (Py_ssize_t)((self->small_max + 511) >> 9)) {
        Py_DECREF(arena);
        PyErr_SetString(PyExc_RuntimeError,
                        "cupy_memstrat: an arena of the strategy is not a (list per 512 B, dict) pair any more");
        return -1;
    }
    PyObject *small = PyTuple_GET_ITEM(arena, 0), *large = PyTuple_GET_ITEM(arena, 1);
    Py_INCREF(small);
    Py_INCREF(large);
    int rc = -1;
    if (n <= self->small_max) {
        PyObject *lst = small_list(small, n);
        if (lst != NULL) {
            rc = PyList_Append(lst, ptr);
            Py_DECREF(lst);
        }
    } else {
        /* the run's list, indexed when it was allocated */
        PyObject *k = key_of(self, n);
        if (k != NULL) {
            PyObject *lst = PyDict_GetItemWithError(large, k);
            Py_XINCREF(lst);
            if (lst == NULL && !PyErr_Occurred()) {
                lst = PyList_New(0);
                if (lst != NULL && PyDict_SetItem(large, k, lst) < 0)
                    Py_CLEAR(lst);
            }
            if (lst != NULL) {
                rc = PyList_CheckExact(lst) ? PyList_Append(lst, ptr) : -1;
                if (rc < 0 && !PyErr_Occurred())
                    PyErr_SetString(PyExc_RuntimeError, "cupy_memstrat: an arena's large table holds a non-list");
                Py_DECREF(lst);
            }
            Py_DECREF(k);
        }
    }
    Py_DECREF(small);
    Py_DECREF(large);
    Py_DECREF(arena);
    return rc;
}

/* After a free: if watch[0] is set and device d has no live block left, call it. */
static int
check_watch(Accounting *self, Py_ssize_t d)
{
    PyObject *cb = PyList_GET_SIZE(self->watch) == 1 ? PyList_GET_ITEM(self->watch, 0) : Py_None;
    if (cb == Py_None)
        return 0;
    PyObject *live = table_item(self->live, d, &PyDict_Type, "live");
    if (live == NULL)
        return -1;
    Py_ssize_t left = PyDict_GET_SIZE(live);
    Py_DECREF(live);
    if (left)
        return 0;
    Py_INCREF(cb);
    PyObject *r = PyObject_CallNoArgs(cb);
    Py_DECREF(cb);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *
Accounting_free(Accounting *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "free(ptr, device, stacklevel=1) takes 2 or 3 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *ptr = args[0];
    Py_ssize_t stacklevel = 1;
    if (nargs == 3) {
        stacklevel = PyLong_AsSsize_t(args[2]);
        if (stacklevel == -1 && PyErr_Occurred())
            return NULL;
    }
    /* CuPy passes the allocating device */
    Py_ssize_t d = device_index(self, args[1]);
    PyObject *size = NULL;
    if (d >= 0) {
        size = live_pop(self, d, ptr);
        if (size == NULL && PyErr_Occurred())
            return NULL;
    }
    if (size == NULL) {
        size = free_unknown(self, ptr, stacklevel, &d);
        if (size == NULL)
            return NULL;
        if (size == Py_None)
            return size;
    }
    if (account_free(self, d, size) < 0) {
        Py_DECREF(size);
        return NULL;
    }
    int rc = 0;
    int deferred = 0;
    if (PyDict_GET_SIZE(self->recorded)) {
        int has = PyDict_Contains(self->recorded, ptr);
        if (has < 0) {
            PyErr_Clear();
            has = 0;
        }
        if (has) {  /* other streams use it: given back once they are done */
            PyObject *device = PyLong_FromSsize_t(d), *r = NULL;
            if (device != NULL)
                r = PyObject_CallFunctionObjArgs(self->defer, ptr, size, device, NULL);
            Py_XDECREF(device);
            rc = r == NULL ? -1 : 0;
            Py_XDECREF(r);
            deferred = 1;
        }
    }
    if (deferred) {
    } else if (self->ordered) {
        rc = ordered_give_back(self, ptr, size, d, stacklevel + 1);
    } else if (self->allocate != Py_None) {
        PyObject *r = PyObject_CallOneArg(self->deallocate, ptr);
        if (r == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
            /* a finaliser must not raise: dealloc_failed warns */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyObject *device = PyLong_FromSsize_t(d), *level = PyLong_FromSsize_t(stacklevel);
            if (device != NULL && level != NULL)
                r = PyObject_CallFunctionObjArgs(self->dealloc_failed, ptr, size, device, value ? value : Py_None,
                                                 level, NULL);
            Py_XDECREF(device);
            Py_XDECREF(level);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    } else {
        rc = cache_block(self, d, ptr, size);
    }
    Py_DECREF(size);
    if (rc < 0 || check_watch(self, d) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Accounting_forget(Accounting *self, PyObject *Py_UNUSED(ignored))
{
    Py_CLEAR(self->last_owner);
    self->last_base = 0;
    /* and the last stream's arena: a destroyed stream's arena leaves the
     * tables, and CUDA may give its handle to a new stream at once */
    self->last_h = -1;
    self->last_d = -1;
    Py_CLEAR(self->last_key);
    Py_CLEAR(self->last_arena);
    Py_RETURN_NONE;
}

static PyObject *
Accounting_give_back(Accounting *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!self->ordered) {
        PyErr_SetString(PyExc_TypeError, "give_back() is for the ordered mode");
        return NULL;
    }
    if (nargs < 3 || nargs > 4) {
        PyErr_Format(PyExc_TypeError, "give_back(ptr, size, device, stacklevel=1) takes 3 or 4 arguments, got %zd",
                     nargs);
        return NULL;
    }
    Py_ssize_t d = device_index(self, args[2]);
    if (d < 0) {
        PyErr_Format(PyExc_ValueError, "give_back: device %R is not a device ordinal in range(%zd)", args[2],
                     self->n_devices);
        return NULL;
    }
    Py_ssize_t stacklevel = 1;
    if (nargs == 4) {
        stacklevel = PyLong_AsSsize_t(args[3]);
        if (stacklevel == -1 && PyErr_Occurred())
            return NULL;
    }
    if (ordered_give_back(self, args[0], args[1], d, stacklevel) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* drain(device) -> (sum, max, allocs, frees): the counts of device `device` since
 * the last drain (the sum of the sizes allocated minus those freed, the largest
 * running sum, 0 or more, and the numbers of allocations and frees), reset in the
 * same call. The strategy adds them to its counters: peak = max(peak, in_use + max),
 * in_use += sum. One C call under the GIL, so exact whatever threads do. */
static PyObject *
Accounting_drain(Accounting *self, PyObject *device)
{
    if (self->counts == NULL) {
        PyErr_SetString(PyExc_TypeError, "Accounting: not initialised");
        return NULL;
    }
    Py_ssize_t d = device_index(self, device);
    if (d < 0) {
        PyErr_Format(PyExc_ValueError, "drain: device %R is not a device ordinal in range(%zd)", device,
                     self->n_devices);
        return NULL;
    }
    DevCounts *c = &self->counts[d];
    PyObject *r = Py_BuildValue("(LLLL)", c->sum, c->max, c->allocs, c->frees);
    if (r != NULL)  /* nothing ran in between: no count is lost or counted twice */
        memset(c, 0, sizeof(DevCounts));
    return r;
}

static PyMethodDef Accounting_methods[] = {
    {"drain", (PyCFunction)Accounting_drain, METH_O,
     "drain(device) -> (sum, max, allocs, frees): device's counts since the last drain, reset."},
    {"give_back", (PyCFunction)(void (*)(void))Accounting_give_back, METH_FASTCALL,
     "give_back(ptr, size, device, stacklevel=1): ordered mode: return a block whose accounting is done "
     "to its stream's pool (or the cache)."},
    {"forget", (PyCFunction)Accounting_forget, METH_NOARGS,
     "forget(): drop the cached owner of the last freed block's chunk and the last stream's arena (call when a "
     "chunk goes back to CUDA or an arena leaves the tables)."},
    {"malloc", (PyCFunction)(void (*)(void))Accounting_malloc, METH_FASTCALL,
     "malloc(size, device) -> ptr: allocate size bytes (> 0) on device, the current device."},
    {"free", (PyCFunction)(void (*)(void))Accounting_free, METH_FASTCALL,
     "free(ptr, device, stacklevel=1): free ptr; device is the allocating device (a hint)."},
    {NULL}
};

static PyTypeObject AccountingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cupy_memstrat._hotpath.Accounting",
    .tp_doc = PyDoc_STR("A strategy's allocation hot path: malloc / free with the shared accounting."),
    .tp_basicsize = sizeof(Accounting),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Accounting_init,
    .tp_dealloc = (destructor)Accounting_dealloc,
    .tp_traverse = (traverseproc)Accounting_traverse,
    .tp_clear = (inquiry)Accounting_clear,
    .tp_methods = Accounting_methods,
};

/* GenMap: pointer -> generation, an open-addressing table with linear probing
 * (pointer 0, never a block, marks an empty slot; a deletion shifts the entries
 * after it back, so no tombstones). The direct route asks it at every malloc and
 * free: a C table makes no int object and runs no hash of Python ints. */
typedef struct {
    unsigned long long key;
    long long gen;
} GenSlot;

typedef struct {
    GenSlot *slots;
    size_t mask;   /* capacity - 1 (a power of two), or 0 before the first set */
    size_t used;
} GenMap;

static inline size_t
gen_hash(unsigned long long k)
{
    k ^= k >> 33;  /* blocks are 512-byte aligned: mix the high bits down (murmur3's finaliser) */
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (size_t)k;
}

/* The slot of key k, or of the empty slot where it would go. */
static inline GenSlot *
gen_slot(const GenMap *m, unsigned long long k)
{
    size_t i = gen_hash(k) & m->mask;
    while (m->slots[i].key != 0 && m->slots[i].key != k)
        i = (i + 1) & m->mask;
    return &m->slots[i];
}

/* 1 and *gen if k is in the map, else 0. */
static inline int
gen_get(const GenMap *m, unsigned long long k, long long *gen)
{
    if (m->mask == 0)
        return 0;
    GenSlot *e = gen_slot(m, k);
    if (e->key == 0)
        return 0;
    *gen = e->gen;
    return 1;
}

static int
gen_grow(GenMap *m)
{
    size_t cap = m->mask ? (m->mask + 1) * 2 : 64;
    GenSlot *old = m->slots, *slots = PyMem_Calloc(cap, sizeof(GenSlot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t old_cap = m->mask ? m->mask + 1 : 0;
    m->slots = slots;
    m->mask = cap - 1;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].key != 0)
            *gen_slot(m, old[i].key) = old[i];
    PyMem_Free(old);
    return 0;
}

/* map[k] = gen (k != 0); -1 with an error set (out of memory). */
static int
gen_set(GenMap *m, unsigned long long k, long long gen)
{
    if ((m->used + 1) * 2 > (m->mask ? m->mask + 1 : 0) && gen_grow(m) < 0)
        return -1;  /* at most half full */
    GenSlot *e = gen_slot(m, k);
    if (e->key == 0) {
        e->key = k;
        m->used++;
    }
    e->gen = gen;
    return 0;
}

static void
gen_del(GenMap *m, unsigned long long k)
{
    if (m->mask == 0)
        return;
    GenSlot *e = gen_slot(m, k);
    if (e->key == 0)
        return;
    size_t i = (size_t)(e - m->slots), j = i;
    for (;;) {  /* shift back every later entry of the run whose home is not between the hole and it */
        j = (j + 1) & m->mask;
        if (m->slots[j].key == 0)
            break;
        size_t home = gen_hash(m->slots[j].key) & m->mask;
        if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].key = 0;
    m->used--;
}

/* PoolDirect(accounting, pool_malloc, oom, failed, recorded_freed, held[, guard,
 * guard_deaths, guard_synced, capsule]): the pool
 * strategy's route=direct, CuPy's allocator callable without a memory object of
 * ours. malloc(size) returns the MemoryPointer of CuPy's pool itself (pool_malloc:
 * MemoryPool.malloc), as CuPy's default allocator does, and accounts its block
 * (mem.ptr, mem.size: the 512-byte rounded size, mem.device_id) in the hooks-mode
 * Accounting's tables, as every allocation. The free is seen through a PoolToken
 * put in the pool's memory object's __dict__ (CuPy 14.2's PooledMemory has one):
 * when CuPy drops the memory object, its destructor gives the block back to the
 * pool, then its __dict__ is cleared and the token's destructor accounts the free.
 *
 * Between the two, on a build with the GIL, no other thread runs unless a CuPy
 * memory hook is installed (the pool's free takes its lock with try_lock, or
 * stages the chunk, without releasing the GIL; cupy/cuda/memory.pyx v14.2.0). If
 * the pool has handed the block out again before the token ran, the new
 * allocation finds its pointer still in the live table: the old block's free is
 * accounted then, and its token, whose generation is no longer the one counted at
 * that pointer (generations, a GenMap), accounts nothing.
 *
 * On CuPy's OutOfMemoryError (the pool has already freed its cache and collected
 * garbage), failed(size, exc) recovers or raises the strategy's error; it returns
 * the MemoryPointer of a retry that worked. A block freed with recorded streams
 * (record_stream) is already the pool's again when the token runs:
 * recorded_freed(ptr, size, device, False) waits there for the recorded streams.
 *
 * That wait leaves a window under threads, so cupy_memstrat.record_stream holds
 * the recorded block's memory object in `held` (ptr -> memory object; hold(mem)
 * takes only a memory object this route handed out and counts now): the
 * array's death then leaves the object alive, its block out of the pool. While
 * `held` is not empty every allocation polls (the Accounting's poll, as for
 * pending blocks); reap() names the held objects whose only reference is
 * `held`'s (their arrays are gone: no one else can reach them) and whose free is
 * not accounted yet, free_early(ptr) accounts such a block's free at once
 * (checked again: its token will count nothing), and recorded_freed(...,
 * early=True) then defers it as every strategy defers a recorded block; once
 * the recorded streams' work is done the strategy drops the object, and CuPy's
 * pool has the block back.
 *
 * guard(device), if given, is the strategy's dead-stream guard (see
 * direct_guard), guard_deaths and guard_synced its per-device counts, capsule
 * CuPy's get_stream_ptr (without it the guard runs at every malloc). */
#define GUARD_SEEN 8  /* streams a program switches between without a Python call (multi-stream pipelines) */

typedef struct {
    PyObject_HEAD
    Accounting *acc;
    PyObject *pool_malloc;
    PyObject *oom;             /* CuPy's OutOfMemoryError */
    PyObject *failed;          /* failed(size, exc) -> MemoryPointer, or raises */
    PyObject *recorded_freed;  /* recorded_freed(ptr, size, device, early) */
    GenMap generations;        /* ptr -> generation of the block at ptr that the live table counts */
    PyObject *held;            /* dict ptr -> memory object kept for record_stream (see above) */
    PyObject *zero_obj;
    long long generation;      /* of the last block handed out */
    PyObject *guard;           /* guard(device) -> bool: the dead-stream guard's slow path, or NULL */
    PyObject *guard_deaths;    /* the guard's lists (device) of ints: watched streams that died, */
    PyObject *guard_synced;    /* and how many of those deaths a wait covered */
    PyObject *capsule;         /* CuPy's get_stream_ptr, kept while stream_fn is used, or NULL */
    intptr_t (*stream_fn)(int); /* its C function, or NULL: the guard runs at every malloc */
    intptr_t seen[GUARD_SEEN]; /* the last streams the guard said it watches (n_seen of them), their */
    int n_seen, next_seen;     /* device, and the deaths counted on that device before the first of */
    Py_ssize_t seen_d;         /* those calls (a death there since empties the list) */
    long long seen_epoch;
    vectorcallfunc vectorcall;
} PoolDirect;

typedef struct {
    PyObject_HEAD
    PoolDirect *owner;
    PyObject *ptr;
    unsigned long long p;  /* ptr's value */
    Py_ssize_t d;
    long long generation;
} PoolToken;

static PyObject *S_mem, *S_size, *S_device_id, *S_token;

/* The free of the block at ptr on device d, generation g: accounted if the live
 * table still counts that block (not a later one at the same pointer, whose
 * malloc accounted this free already). */
static int
direct_free(PoolDirect *o, PyObject *ptr, unsigned long long pv, Py_ssize_t d, long long g, int early)
{
    Accounting *acc = o->acc;
    long long c;
    if (acc == NULL || !gen_get(&o->generations, pv, &c))
        return 0;  /* not counted (tables cleared): nothing to account */
    if (c != g)
        return 0;  /* a later block at ptr: this one's free was accounted at its malloc */
    gen_del(&o->generations, pv);
    PyObject *size = live_pop(acc, d, ptr);
    if (size == NULL)
        return PyErr_Occurred() ? -1 : 0;
    int rc = account_free(acc, d, size);
    if (rc == 0 && PyDict_GET_SIZE(acc->recorded) && PyDict_Contains(acc->recorded, ptr) == 1) {
        PyObject *device = PyLong_FromSsize_t(d), *r = NULL;
        if (device != NULL)
            r = PyObject_CallFunctionObjArgs(o->recorded_freed, ptr, size, device, early ? Py_True : Py_False,
                                             NULL);
        Py_XDECREF(device);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(size);
    if (rc == 0)
        rc = check_watch(acc, d);
    return rc;
}

static void
PoolToken_dealloc(PoolToken *t)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);  /* a destructor may run while an exception is raised */
    if (t->owner != NULL && t->ptr != NULL && direct_free(t->owner, t->ptr, t->p, t->d, t->generation, 0) < 0)
        PyErr_WriteUnraisable((PyObject *)t->owner);
    PyErr_Restore(type, value, tb);
    Py_XDECREF(t->ptr);
    Py_XDECREF((PyObject *)t->owner);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *
PoolToken_repr(PoolToken *t)
{
    return PyUnicode_FromFormat("<cupy_memstrat pool block %R on device %zd>", t->ptr, t->d);
}

static PyTypeObject PoolTokenType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cupy_memstrat._hotpath.PoolToken",
    .tp_doc = PyDoc_STR("Accounts the free of a block of CuPy's pool when CuPy drops its memory object."),
    .tp_basicsize = sizeof(PoolToken),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)PoolToken_dealloc,
    .tp_repr = (reprfunc)PoolToken_repr,
};

/* deaths[d] or synced[d] of the dead-stream guard; -1 with an error set if the
 * list is not the guard's any more. */
static long long
guard_count(PyObject *list, Py_ssize_t d)
{
    if (!PyList_CheckExact(list) || d >= PyList_GET_SIZE(list) || !PyLong_CheckExact(PyList_GET_ITEM(list, d))) {
        PyErr_SetString(PyExc_RuntimeError, "cupy_memstrat: the dead-stream guard's counts are not a list of ints");
        return -1;
    }
    return PyLong_AsLongLong(PyList_GET_ITEM(list, d));
}

/* The dead-stream guard (strategies/stream_guard.py) for a block just taken on
 * device d, before CuPy gets it: guard(device) waits for the device if a stream
 * the guard watches died since (deaths[d] != synced[d]), and watches the current
 * stream. CuPy's pool finds a stream's free blocks by the stream's handle, which
 * CUDA gives a new stream while the destroyed one's kernels may still run
 * (docs/streams.md): after the wait, those kernels are done before the block is
 * used. The call is skipped only while no watched stream's death is uncovered and
 * the current stream is a built-in one (never destroyed) or one of the last
 * GUARD_SEEN streams the guard said it watches, with no death on that device
 * since (a death there may have been one of theirs, its handle now another's): a
 * program on one stream, or switching between a few, pays one C call per malloc. */
static int
direct_guard(PoolDirect *self, Py_ssize_t d, PyObject *device)
{
    long long deaths = guard_count(self->guard_deaths, d);
    if (deaths == -1 && PyErr_Occurred())
        return -1;
    long long synced = guard_count(self->guard_synced, d);
    if (synced == -1 && PyErr_Occurred())
        return -1;
    intptr_t h = -1;
    if (self->stream_fn != NULL) {
        h = self->stream_fn((int)d);
        if (h == -1 && PyErr_Occurred())
            return -1;
    }
    if (d != self->seen_d || deaths != self->seen_epoch)
        self->n_seen = 0;  /* a death on the device: any of those handles may be another stream's now */
    if (deaths == synced && h >= 0) {
        if (h <= 2)
            return 0;
        for (int i = 0; i < self->n_seen; i++)
            if (self->seen[i] == h)
                return 0;
    }
    PyObject *r = PyObject_CallOneArg(self->guard, device);
    if (r == NULL)
        return -1;
    int watched = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (watched < 0)
        return -1;
    if (watched && h > 2) {
        if (self->n_seen == 0 || d != self->seen_d || deaths != self->seen_epoch) {
            self->n_seen = self->next_seen = 0;
            self->seen_d = d;
            self->seen_epoch = deaths;  /* read before the call: a death during it makes the next malloc ask */
        }
        int i = self->n_seen;
        if (i < GUARD_SEEN) {
            self->n_seen++;
        } else {  /* full: replace the oldest (next_seen stays in [0, GUARD_SEEN)) */
            i = self->next_seen;
            self->next_seen = (i + 1) % GUARD_SEEN;
        }
        self->seen[i] = h;
    }
    return 0;
}

static PyObject *
PoolDirect_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PoolDirect *self = (PoolDirect *)callable;
    if (self->acc == NULL) {
        PyErr_SetString(PyExc_TypeError, "PoolDirect: not initialised");
        return NULL;
    }
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "malloc(size) takes one argument, the size in bytes");
        return NULL;
    }
    Accounting *acc = self->acc;
    if (PyList_GET_SIZE(acc->pending) || PyDict_GET_SIZE(self->held)) {
        /* blocks freed with record_stream() may be done, held ones' arrays gone */
        PyObject *r = PyObject_CallNoArgs(acc->poll);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    PyObject *mp = PyObject_Vectorcall(self->pool_malloc, args, 1, NULL);
    if (mp == NULL) {
        if (!PyErr_ExceptionMatches(self->oom))
            return NULL;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        mp = PyObject_CallFunctionObjArgs(self->failed, args[0], value ? value : Py_None, NULL);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (mp == NULL)
            return NULL;
    }
    PyObject *mem = PyObject_GetAttr(mp, S_mem), *ptr = NULL, *size = NULL, *device = NULL;
    if (mem != NULL)
        ptr = PyObject_GetAttr(mem, S_ptr);
    if (ptr != NULL)
        size = PyObject_GetAttr(mem, S_size);
    if (size != NULL)  /* one device: CuPy's pool has no other (a getattr less per malloc) */
        device = acc->n_devices == 1 ? Py_NewRef(self->zero_obj) : PyObject_GetAttr(mem, S_device_id);
    int rc = device == NULL ? -1 : 0;
    if (rc == 0 && (!PyLong_CheckExact(ptr) || !PyLong_CheckExact(size) || PyObject_RichCompareBool(size, self->zero_obj, Py_LT) != 0)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "pool: the pool's block has ptr %R and size %R, not ints >= 0", ptr, size);
        rc = -1;
    }
    int zero = rc == 0 ? PyObject_Not(ptr) : 0;
    if (rc == 0 && !zero) {  /* a block (CuPy gives size 0 a memory object of no pool) */
        Py_ssize_t d = device_index(acc, device);
        if (d < 0) {
            PyErr_Format(PyExc_ValueError, "pool: block on device %R, not a device ordinal in range(%zd)", device,
                         acc->n_devices);
            rc = -1;
        }
        if (rc == 0 && self->guard != NULL)
            rc = direct_guard(self, d, device);  /* on failure the block goes back with mp */
        unsigned long long pv = rc < 0 ? 0 : ptr_value(ptr);
        if (pv == (unsigned long long)-1 && PyErr_Occurred())
            rc = -1;
        long long cur;
        if (rc == 0 && gen_get(&self->generations, pv, &cur))  /* the last block at ptr went back to the
                                                                  pool, its token has not run yet */
            rc = direct_free(self, ptr, pv, d, cur, 0);
        long long g = ++self->generation;
        if (rc == 0)
            rc = gen_set(&self->generations, pv, g);
        if (rc == 0 && (rc = account_malloc(acc, d, device, ptr, size)) < 0)
            gen_del(&self->generations, pv);
        if (rc == 0) {
            PoolToken *t = PyObject_New(PoolToken, &PoolTokenType);
            if (t == NULL) {
                direct_free(self, ptr, pv, d, g, 0);  /* the block goes back with mp: its free now */
                rc = -1;
            } else {
                Py_INCREF(self);
                Py_INCREF(ptr);
                t->owner = self;
                t->ptr = ptr;
                t->p = pv;
                t->d = d;
                t->generation = g;
                rc = PyObject_SetAttr(mem, S_token, (PyObject *)t);
                Py_DECREF(t);  /* if the pool's memory object took no token, this accounts the free at once */
            }
        }
    }
    Py_XDECREF(mem);
    Py_XDECREF(ptr);
    Py_XDECREF(size);
    Py_XDECREF(device);
    if (rc < 0)
        Py_CLEAR(mp);
    return mp;
}

static int
PoolDirect_init(PoolDirect *self, PyObject *args, PyObject *kwds)
{
    PyObject *acc, *pool_malloc, *oom, *failed, *recorded_freed, *held;
    PyObject *guard = Py_None, *guard_deaths = Py_None, *guard_synced = Py_None, *capsule = Py_None;
    if (!PyArg_ParseTuple(args, "O!OOOOO!|OOOO:PoolDirect", &AccountingType, &acc, &pool_malloc, &oom, &failed,
                          &recorded_freed, &PyDict_Type, &held, &guard, &guard_deaths, &guard_synced, &capsule))
        return -1;
    if (guard != Py_None && (!PyCallable_Check(guard) || !PyList_CheckExact(guard_deaths)
                             || !PyList_CheckExact(guard_synced))) {
        PyErr_Format(PyExc_TypeError, "PoolDirect: expected guard(device) and the guard's lists of deaths and "
                     "waits, got %R, %R, %R", guard, guard_deaths, guard_synced);
        return -1;
    }
    intptr_t (*stream_fn)(int) = NULL;
    if (capsule != Py_None && capsule_stream_fn(capsule, &stream_fn) < 0)
        return -1;
    if (((Accounting *)acc)->ordered || ((Accounting *)acc)->allocate == NULL
        || ((Accounting *)acc)->allocate == Py_None) {
        PyErr_SetString(PyExc_TypeError, "PoolDirect: expected an Accounting in hooks mode");
        return -1;
    }
    if (!PyCallable_Check(pool_malloc) || !PyCallable_Check(failed) || !PyCallable_Check(recorded_freed)
        || !PyExceptionClass_Check(oom)) {
        PyErr_Format(PyExc_TypeError, "PoolDirect: expected (Accounting, pool.malloc, an exception class, "
                     "failed(size, exc), recorded_freed(ptr, size, device, early), held), got %R, %R, %R, %R",
                     pool_malloc, oom, failed, recorded_freed);
        return -1;
    }
    if (self->acc != NULL) {
        PyErr_SetString(PyExc_TypeError, "PoolDirect: already initialised (its blocks' frees go to its tables)");
        return -1;
    }
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL)
        return -1;
    self->zero_obj = zero;
    Py_INCREF(acc);
    Py_INCREF(pool_malloc);
    Py_INCREF(oom);
    Py_INCREF(failed);
    Py_INCREF(recorded_freed);
    Py_INCREF(held);
    Py_XSETREF(self->held, held);
    Py_XSETREF(self->acc, (Accounting *)acc);
    Py_XSETREF(self->pool_malloc, pool_malloc);
    Py_XSETREF(self->oom, oom);
    Py_XSETREF(self->failed, failed);
    Py_XSETREF(self->recorded_freed, recorded_freed);
    if (guard != Py_None) {
        Py_XSETREF(self->guard, Py_NewRef(guard));
        Py_XSETREF(self->guard_deaths, Py_NewRef(guard_deaths));
        Py_XSETREF(self->guard_synced, Py_NewRef(guard_synced));
    }
    if (stream_fn != NULL)
        Py_XSETREF(self->capsule, Py_NewRef(capsule));  /* its function must outlive this route */
    self->stream_fn = stream_fn;
    self->n_seen = self->next_seen = 0;
    self->seen_d = -1;
    self->seen_epoch = -1;
    self->vectorcall = PoolDirect_vectorcall;
    return 0;
}

static int
PoolDirect_traverse(PoolDirect *self, visitproc visit, void *arg)
{
    Py_VISIT((PyObject *)self->acc);
    Py_VISIT(self->pool_malloc);
    Py_VISIT(self->oom);
    Py_VISIT(self->failed);
    Py_VISIT(self->recorded_freed);
    Py_VISIT(self->held);
    Py_VISIT(self->guard);
    Py_VISIT(self->guard_deaths);
    Py_VISIT(self->guard_synced);
    Py_VISIT(self->capsule);
    return 0;
}

static int
PoolDirect_clear(PoolDirect *self)
{
    Py_CLEAR(self->acc);
    Py_CLEAR(self->pool_malloc);
    Py_CLEAR(self->oom);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->recorded_freed);
    Py_CLEAR(self->held);
    Py_CLEAR(self->zero_obj);
    Py_CLEAR(self->guard);
    Py_CLEAR(self->guard_deaths);
    Py_CLEAR(self->guard_synced);
    Py_CLEAR(self->capsule);
    self->stream_fn = NULL;
    return 0;
}

static void
PoolDirect_dealloc(PoolDirect *self)
{
    PyObject_GC_UnTrack(self);
    PoolDirect_clear(self);
    PyMem_Free(self->generations.slots);
    self->generations = (GenMap){NULL, 0, 0};
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
PoolDirect_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

static int
PoolDirect_ready(PoolDirect *o)
{
    if (o->acc == NULL || o->recorded_freed == NULL || o->held == NULL) {
        PyErr_SetString(PyExc_TypeError, "PoolDirect: not initialised");
        return 0;
    }
    return 1;
}

static PyObject *
PoolDirect_generations(PoolDirect *self, void *Py_UNUSED(closure))
{
    if (!PoolDirect_ready(self))
        return NULL;
    PyObject *out = PyDict_New();
    for (size_t i = 0; out != NULL && self->generations.mask && i <= self->generations.mask; i++) {
        GenSlot e = self->generations.slots[i];
        if (e.key == 0)
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(e.key), *v = k ? PyLong_FromLongLong(e.gen) : NULL;
        if (v == NULL || PyDict_SetItem(out, k, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return out;
}

/* The token of this PoolDirect in memory object mem's __dict__, if it is the one
 * of the block the live table counts at its pointer now: a new reference; NULL
 * with no error set if not; NULL with an error only on failure. The lookup can run
 * Python code (a key of the __dict__ with the token name's hash), which may drop
 * the last other reference to mem: mem and the token are held while it runs. */
static PoolToken *
current_token(PoolDirect *self, PyObject *mem)
{
    Py_INCREF(mem);
    PyObject *dict = PyObject_GenericGetDict(mem, NULL);
    if (dict == NULL) {
        Py_DECREF(mem);
        if (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_TypeError))
            PyErr_Clear();  /* no __dict__: not a memory object of the direct route */
        return NULL;
    }
    PyObject *tok = PyDict_CheckExact(dict) ? PyDict_GetItemWithError(dict, S_token) : NULL;  /* borrowed */
    Py_XINCREF(tok);
    Py_DECREF(dict);
    Py_DECREF(mem);
    if (tok == NULL)
        return NULL;
    PoolToken *t = (PoolToken *)tok;
    long long g;
    if (Py_IS_TYPE(tok, &PoolTokenType) && t->owner == self && gen_get(&self->generations, t->p, &g) &&
            g == t->generation)
        return t;
    Py_DECREF(tok);
    return NULL;
}

/* hold(mem): keep CuPy's memory object mem in `held` if it is one this route
 * handed out and counts now; True if held (already, or now). */
static PyObject *
PoolDirect_hold(PoolDirect *self, PyObject *mem)
{
    if (!PoolDirect_ready(self))
        return NULL;
    PoolToken *t = current_token(self, mem);
    if (t == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_FALSE;
    }
    PyObject *kept = PyDict_SetDefault(self->held, t->ptr, mem);  /* borrowed */
    Py_DECREF(t);
    if (kept == NULL)
        return NULL;
    return PyBool_FromLong(kept == mem);
}

/* 1 if `held` alone refers to the memory object held at ptr and its token is the
 * one counted at ptr now (*tok: a new reference to it), 0 if not, -1 (error set)
 * on failure. */
static int
held_dead(PoolDirect *self, PyObject *ptr, PoolToken **tok)
{
    PyObject *mem = PyDict_GetItemWithError(self->held, ptr);  /* borrowed */
    if (mem == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (Py_REFCNT(mem) != 1)
        return 0;
    *tok = current_token(self, mem);
    if (*tok == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return 1;
}

/* The pointers in `held` (from a copy of its keys) for which pred(self, key) is 1;
 * 0 skips one, -1 (error set) fails. A copy of the keys, not of the items: reap's
 * test counts the references to the memory objects. */
static PyObject *
held_select(PoolDirect *self, int (*pred)(PoolDirect *, PyObject *))
{
    if (!PoolDirect_ready(self))
        return NULL;
    PyObject *keys = PyDict_Keys(self->held), *out = PyList_New(0);
    if (keys == NULL || out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        int r = pred(self, key);
        if (r < 0 || (r > 0 && PyList_Append(out, key) < 0))
            goto fail;
    }
    Py_DECREF(keys);
    return out;
fail:
    Py_XDECREF(keys);
    Py_XDECREF(out);
    return NULL;
}

/* held_select's test of reap(): `held` alone refers to the memory object and its
 * free is not accounted yet. */
static int
held_is_dead(PoolDirect *self, PyObject *key)
{
    PoolToken *t = NULL;
    int r = held_dead(self, key, &t);
    if (r > 0)
        Py_DECREF(t);
    return r;
}

/* held_select's test of stale(): the memory object's block is not the one counted
 * at its pointer. */
static int
held_is_stale(PoolDirect *self, PyObject *key)
{
    PyObject *mem = PyDict_GetItemWithError(self->held, key);  /* borrowed */
    if (mem == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PoolToken *t = current_token(self, mem);
    if (t != NULL) {
        Py_DECREF(t);
        return 0;
    }
    return PyErr_Occurred() ? -1 : 1;
}

/* reap(): the pointers in `held` whose memory object `held` alone refers to (its
 * arrays are gone) and whose free is not accounted yet. */
static PyObject *
PoolDirect_reap(PoolDirect *self, PyObject *Py_UNUSED(ignored))
{
    return held_select(self, held_is_dead);
}

/* stale(): the pointers in `held` whose memory object's block is no longer the
 * one counted at its pointer (its free was seen another way: PooledMemory.free()
 * called by hand): nothing to keep it for. */
static PyObject *
PoolDirect_stale(PoolDirect *self, PyObject *Py_UNUSED(ignored))
{
    return held_select(self, held_is_stale);
}

/* free_early(ptr): account now the free of the block held at ptr, if `held`
 * alone refers to its memory object and its free is not accounted yet (its
 * token then counts nothing); the recorded streams' wait follows
 * (recorded_freed with early=True). True if accounted. */
static PyObject *
PoolDirect_free_early(PoolDirect *self, PyObject *ptr)
{
    if (!PoolDirect_ready(self))
        return NULL;
    if (!PyLong_CheckExact(ptr)) {
        PyErr_Format(PyExc_TypeError, "free_early(ptr): expected an int pointer, got %R", ptr);
        return NULL;
    }
    PoolToken *t = NULL;
    int dead = held_dead(self, ptr, &t);  /* t: a new reference (direct_free runs Python code) */
    if (dead < 0)
        return NULL;
    if (dead == 0)
        Py_RETURN_FALSE;
    int rc = direct_free(self, t->ptr, t->p, t->d, t->generation, 1);
    Py_DECREF(t);
    if (rc < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyMethodDef PoolDirect_methods[] = {
    {"hold", (PyCFunction)PoolDirect_hold, METH_O,
     "hold(mem) -> bool: keep a memory object this route handed out (and counts now) in the held table"},
    {"stale", (PyCFunction)PoolDirect_stale, METH_NOARGS,
     "stale() -> [ptr]: the held memory objects whose block is no longer the one counted at their pointer"},
    {"reap", (PyCFunction)PoolDirect_reap, METH_NOARGS,
     "reap() -> [ptr]: the held memory objects that nothing but the held table refers to any more"},
    {"free_early", (PyCFunction)PoolDirect_free_early, METH_O,
     "free_early(ptr) -> bool: account the free of the block counted at ptr now; its token counts nothing"},
    {NULL}
};

static PyGetSetDef PoolDirect_getset[] = {
    {"generations", (getter)PoolDirect_generations, NULL,
     "a copy of {ptr: generation}: the block at each pointer that the live table counts", NULL},
    {NULL}
};

static PyMemberDef PoolDirect_members[] = {
    {"__self__", T_OBJECT, offsetof(PoolDirect, acc), READONLY, "the Accounting whose tables this keeps"},
    {NULL}
};

static PyTypeObject PoolDirectType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cupy_memstrat._hotpath.PoolDirect",
    .tp_doc = PyDoc_STR("PoolDirect(accounting, pool_malloc, oom, failed, recorded_freed, held[, guard, "
                        "guard_deaths, guard_synced, capsule]): malloc(size) -> "
                        "CuPy's pool's MemoryPointer, accounted (see csrc/hotpath.c)."),
    .tp_basicsize = sizeof(PoolDirect),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(PoolDirect, vectorcall),
    .tp_call = PoolDirect_call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PoolDirect_init,
    .tp_dealloc = (destructor)PoolDirect_dealloc,
    .tp_traverse = (traverseproc)PoolDirect_traverse,
    .tp_clear = (inquiry)PoolDirect_clear,
    .tp_getset = PoolDirect_getset,
    .tp_members = PoolDirect_members,
    .tp_methods = PoolDirect_methods,
};

/* GcSafeMalloc(pfa_malloc): CuPy's allocator callable for a strategy, around
 * PythonFunctionAllocator.malloc. CuPy 14.2's PythonFunctionAllocatorMemory is the
 * one memory class of cupy/cuda/memory.pyx that the garbage collector tracks
 * (no @cython.no_gc). When an array dies in a reference cycle and the collector
 * clears its memory object before the object's destructor runs, the destructor
 * finds its free function gone ("TypeError: 'NoneType' object is not callable")
 * and the block is never freed, under every strategy; tests/gpu/test_hot_path_gpu.py
 * has the control that shows it. The memory object refers
 * only to the strategy's two functions, so it can never be part of a cycle
 * itself: untracking it keeps the collector off it, and it is then freed by its
 * reference count when the cycle that held its array is broken. */
typedef struct {
    PyObject_HEAD
    PyObject *malloc;    /* PythonFunctionAllocator.malloc, bound */
    PyObject *owner;     /* its __self__: the PythonFunctionAllocator */
    PyObject *mem_name;  /* "mem" */
    vectorcallfunc vectorcall;
    unsigned long long granule;  /* sizes rounded up to a multiple of this (a power of two) */
} GcSafeMalloc;

static PyObject *
GcSafeMalloc_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    GcSafeMalloc *self = (GcSafeMalloc *)callable;
    PyObject *mp;
    if (self->granule > 1 && PyVectorcall_NARGS(nargsf) == 1 && kwnames == NULL && PyLong_CheckExact(args[0])) {
        /* the block's size as CuPy's pool reports it (memptr.mem.size) */
        unsigned long long n = PyLong_AsUnsignedLongLong(args[0]), g = self->granule;
        if (n == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();  /* negative or too large: CuPy's own check raises */
            mp = PyObject_Vectorcall(self->malloc, args, nargsf, kwnames);
        } else if (n % g == 0 || n > ~0ULL - g) {
            mp = PyObject_Vectorcall(self->malloc, args, nargsf, kwnames);
        } else {
            PyObject *rounded = PyLong_FromUnsignedLongLong((n + g - 1) & ~(g - 1));
            if (rounded == NULL)
                return NULL;
            mp = PyObject_CallOneArg(self->malloc, rounded);
            Py_DECREF(rounded);
        }
    } else {
        mp = PyObject_Vectorcall(self->malloc, args, nargsf, kwnames);
    }
    if (mp == NULL)
        return NULL;
    PyObject *mem = PyObject_GetAttr(mp, self->mem_name);
    if (mem == NULL) {
        Py_DECREF(mp);
        return NULL;
    }
    if (PyObject_IS_GC(mem) && PyObject_GC_IsTracked(mem))
        PyObject_GC_UnTrack(mem);
    Py_DECREF(mem);
    return mp;
}

static int
GcSafeMalloc_init(GcSafeMalloc *self, PyObject *args, PyObject *kwds)
{
    PyObject *malloc;
    unsigned long long granule = 1;
    if (!PyArg_ParseTuple(args, "O|K:GcSafeMalloc", &malloc, &granule))
        return -1;
    if (granule == 0 || (granule & (granule - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "GcSafeMalloc: granule must be a power of two, got %llu", granule);
        return -1;
    }
    if (!PyCallable_Check(malloc)) {
        PyErr_SetString(PyExc_TypeError, "GcSafeMalloc: expected PythonFunctionAllocator.malloc");
        return -1;
    }
    PyObject *owner = PyObject_GetAttrString(malloc, "__self__");
    if (owner == NULL)
        return -1;
    PyObject *name = PyUnicode_InternFromString("mem");
    if (name == NULL) {
        Py_DECREF(owner);
        return -1;
    }
    Py_INCREF(malloc);
    Py_XSETREF(self->malloc, malloc);
    Py_XSETREF(self->owner, owner);
    Py_XSETREF(self->mem_name, name);
    self->vectorcall = GcSafeMalloc_vectorcall;
    self->granule = granule;
    return 0;
}

static int
GcSafeMalloc_traverse(GcSafeMalloc *self, visitproc visit, void *arg)
{
    Py_VISIT(self->malloc);
    Py_VISIT(self->owner);
    return 0;
}

static int
GcSafeMalloc_clear(GcSafeMalloc *self)
{
    Py_CLEAR(self->malloc);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->mem_name);
    return 0;
}

static void
GcSafeMalloc_dealloc(GcSafeMalloc *self)
{
    PyObject_GC_UnTrack(self);
    GcSafeMalloc_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
GcSafeMalloc_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    if (((GcSafeMalloc *)self)->malloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "GcSafeMalloc: not initialised");
        return NULL;
    }
    return PyVectorcall_Call(self, args, kwargs);
}

static PyObject *
GcSafeMalloc_repr(GcSafeMalloc *self)
{
    return PyUnicode_FromFormat("<cupy_memstrat GC-safe allocator around %R>", self->malloc);
}

static PyMemberDef GcSafeMalloc_members[] = {
    {"__self__", T_OBJECT, offsetof(GcSafeMalloc, owner), READONLY,
     "the PythonFunctionAllocator whose malloc this calls"},
    {"__wrapped__", T_OBJECT, offsetof(GcSafeMalloc, malloc), READONLY,
     "PythonFunctionAllocator.malloc"},
    {NULL}
};

static PyTypeObject GcSafeMallocType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cupy_memstrat._hotpath.GcSafeMalloc",
    .tp_doc = PyDoc_STR("GcSafeMalloc(pfa.malloc, granule=1): pfa.malloc(size rounded up to a multiple of "
                        "granule), with the memory object kept off the garbage collector (see csrc/hotpath.c)."),
    .tp_basicsize = sizeof(GcSafeMalloc),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(GcSafeMalloc, vectorcall),
    .tp_call = GcSafeMalloc_call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)GcSafeMalloc_init,
    .tp_dealloc = (destructor)GcSafeMalloc_dealloc,
    .tp_traverse = (traverseproc)GcSafeMalloc_traverse,
    .tp_clear = (inquiry)GcSafeMalloc_clear,
    .tp_repr = (reprfunc)GcSafeMalloc_repr,
    .tp_members = GcSafeMalloc_members,
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cupy_memstrat._hotpath",
    .m_doc = PyDoc_STR("The allocation hot path of cupy_memstrat's strategies, in C (see csrc/hotpath.c)."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    PyTypeObject *types[] = {&AccountingType, &GcSafeMallocType, &PoolDirectType, &PoolTokenType};
    const char *names[] = {"Accounting", "GcSafeMalloc", "PoolDirect", "PoolToken"};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    S_ptr = PyUnicode_InternFromString("ptr");
    S_mem = PyUnicode_InternFromString("mem");
    S_size = PyUnicode_InternFromString("size");
    S_device_id = PyUnicode_InternFromString("device_id");
    S_token = PyUnicode_InternFromString("_cupy_memstrat_block");
    if (S_ptr == NULL || S_mem == NULL || S_size == NULL || S_device_id == NULL || S_token == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&hotpath_module);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
