/* csrc/hotpath/ordered.c: ordered mode (async): cudaMallocFromPoolAsync on the current stream, cudaFreeAsync on the
 * allocating one, the default stream's size-class cache, destroyed streams' caches.
 * Part of the extension's one compilation unit: csrc/hotpath.c includes it. */

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
