/* csrc/hotpath/accounting.c: Accounting.malloc and .free, the two functions CuPy calls (dispatching to the modes),
 * forget, give_back, drain, and the Python type.
 * Part of the extension's one compilation unit: csrc/hotpath.c includes it. */

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
    forget_origin(self, ptr);
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
