/* csrc/hotpath/common.c: The Accounting object's life (init, GC support) and the helpers every mode shares: device
 * checks, failure handling, the per-device counts, polling deferred frees, free-list keys.
 * Part of the extension's one compilation unit: csrc/hotpath.c includes it. */

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
                             "stream_caches", "new_stream_cache", "dead", "reap", "origins", "capture", NULL};
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
    PyObject *origins = Py_None, *capture = Py_None;
    Py_ssize_t small_max = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|$OOOOOOKOOnOOOOOOOOOOOOOOOOOOOOOOOO", kwlist, &live,
                                     &unknown_free, &failed, &error, &allocate, &deallocate,
                                     &dealloc_failed, &arenas, &owner, &arena_of, &chunk_bytes, &stream_ptr,
                                     &capsule, &small_max, &miss, &large_hit, &recorded, &defer, &pending, &poll,
                                     &watch, &pool_malloc, &free_async, &pools, &ensure_pool, &current_stream,
                                     &get_device, &caches, &cache_limits, &stream_of, &free_off_path,
                                     &recover_pool, &stream_caches, &new_stream_cache, &dead, &reap, &origins,
                                     &capture))
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
    if (capture != Py_None && (!PyCallable_Check(capture) || !PyDict_CheckExact(origins))) {
        PyErr_SetString(PyExc_TypeError, "Accounting: capture must be a callable, with origins a dict");
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
    if (self->capture != Py_None) {  /* track_origins: before the live insert, as the Python version */
        PyObject *origin = PyObject_CallNoArgs(self->capture);
        if (origin == NULL)
            return -1;
        int r = PyDict_SetItem(self->origins, ptr, origin);
        Py_DECREF(origin);
        if (r < 0)
            return -1;
    }
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

/* track_origins: a freed block's origin goes with it (nothing if it has none). */
static inline void
forget_origin(Accounting *self, PyObject *ptr)
{
    if (self->capture != Py_None && PyDict_GET_SIZE(self->origins) && PyDict_DelItem(self->origins, ptr) < 0)
        PyErr_Clear();
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
