/* cupy_memstrat._hotpath: the allocation hot path of the built-in strategies, in C.
 *
 * CuPy calls a strategy twice per array, malloc(size, device) when the array is
 * made and free(ptr, device) when it dies, through cupy.cuda.PythonFunctionAllocator.
 * The Python closures of cupy_memstrat.strategies.base (and managed) do a few dict
 * and list operations per call; as Python functions they cost about 0.3 us a pair
 * on an H200 host (docs/benchmarks.md), more than CuPy's whole Cython pool takes.
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
 *   classes  free lists by size class (managed): small sizes index
 *            small[device][(size + 511) >> 9], large ones large[device][size
 *            rounded up to 512 B]; miss(size, device) is the slow path.
 *
 * Accounting, as the Python version (base.py's module docstring): per device, an
 * allocation appends +size to events[device] before inserting ptr -> size into
 * live[device]; a free pops live[device][ptr] before appending -size; when a
 * device's event list grows past fold_at, fold(device) folds it into the
 * counters. All of it runs under the GIL without calling Python code in between
 * (int keys hash and compare in C), so it is as exact under threads as the
 * Python version, and takes no lock (CuPy frees from finalisers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t n_devices;
    Py_ssize_t fold_at;
    unsigned long long small_max;
    PyObject *events;         /* list (per device) of lists of +size / -size */
    PyObject *live;           /* list (per device) of dicts ptr -> size */
    PyObject *fold;           /* fold(device) */
    PyObject *unknown_free;   /* unknown_free(ptr, stacklevel) -> (device, size or None) */
    PyObject *failed;         /* failed(size, device, exc): raises */
    PyObject *error;          /* the backend's error class */
    PyObject *allocate;       /* hooks: allocate(size) -> ptr */
    PyObject *deallocate;     /* hooks: deallocate(ptr) */
    PyObject *dealloc_failed; /* hooks: dealloc_failed(ptr, size, device, exc, stacklevel) */
    PyObject *small;          /* classes: list (device) of lists (512 B unit) of free lists */
    PyObject *large;          /* classes: list (device) of dicts rounded size -> free list */
    PyObject *miss;           /* classes: miss(size, device) -> ptr */
    PyObject *large_hit;      /* classes: large_hit(ptr, size, device) or None */
} Accounting;

#define FIELDS(X) X(events) X(live) X(fold) X(unknown_free) X(failed) X(error) X(allocate) \
    X(deallocate) X(dealloc_failed) X(small) X(large) X(miss) X(large_hit)

static int
Accounting_traverse(Accounting *self, visitproc visit, void *arg)
{
#define VISIT(f) Py_VISIT(self->f);
    FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int
Accounting_clear(Accounting *self)
{
#define CLEAR(f) Py_CLEAR(self->f);
    FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void
Accounting_dealloc(Accounting *self)
{
    PyObject_GC_UnTrack(self);
    Accounting_clear(self);
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

static int
Accounting_init(Accounting *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"events", "live", "fold", "fold_at", "unknown_free", "failed", "error",
                             "allocate", "deallocate", "dealloc_failed",
                             "small", "large", "small_max", "miss", "large_hit", NULL};
    PyObject *events, *live, *fold, *unknown_free, *failed, *error;
    PyObject *allocate = Py_None, *deallocate = Py_None, *dealloc_failed = Py_None;
    PyObject *small = Py_None, *large = Py_None, *miss = Py_None, *large_hit = Py_None;
    Py_ssize_t fold_at;
    Py_ssize_t small_max = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOnOOO|$OOOOOnOO", kwlist, &events, &live, &fold, &fold_at,
                                     &unknown_free, &failed, &error, &allocate, &deallocate, &dealloc_failed,
                                     &small, &large, &small_max, &miss, &large_hit))
        return -1;
    if (!PyList_CheckExact(events)) {
        PyErr_SetString(PyExc_TypeError, "Accounting: events must be a list");
        return -1;
    }
    if (small_max < 0 || small_max > ((Py_ssize_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "Accounting: small_max must be in [0, 2**40], got %zd", small_max);
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(events);
    if (check_per_device(events, "events", n, &PyList_Type) < 0 ||
        check_per_device(live, "live", n, &PyDict_Type) < 0)
        return -1;
    int hooks = allocate != Py_None;
    if (hooks) {
        if (!PyCallable_Check(allocate) || !PyCallable_Check(deallocate) || !PyCallable_Check(dealloc_failed)) {
            PyErr_SetString(PyExc_TypeError, "Accounting: allocate, deallocate and dealloc_failed must be callables");
            return -1;
        }
    } else {
        if (check_per_device(small, "small", n, &PyList_Type) < 0 ||
            check_per_device(large, "large", n, &PyDict_Type) < 0)
            return -1;
        for (Py_ssize_t d = 0; d < n; d++) {
            PyObject *idx = PyList_GET_ITEM(small, d);
            if (PyList_GET_SIZE(idx) <= ((small_max + 511) >> 9)) {
                PyErr_SetString(PyExc_ValueError, "Accounting: small[d] must have an entry per 512 B up to small_max");
                return -1;
            }
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(idx); i++) {
                if (!PyList_CheckExact(PyList_GET_ITEM(idx, i))) {
                    PyErr_SetString(PyExc_TypeError, "Accounting: small[d][i] must be lists");
                    return -1;
                }
            }
        }
        if (!PyCallable_Check(miss) || (large_hit != Py_None && !PyCallable_Check(large_hit))) {
            PyErr_SetString(PyExc_TypeError, "Accounting: miss (and large_hit, if given) must be callables");
            return -1;
        }
    }
    if (!PyCallable_Check(fold) || !PyCallable_Check(unknown_free) || !PyCallable_Check(failed)) {
        PyErr_SetString(PyExc_TypeError, "Accounting: fold, unknown_free and failed must be callables");
        return -1;
    }
    if (!PyExceptionClass_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "Accounting: error must be an exception class");
        return -1;
    }
    self->n_devices = n;
    self->fold_at = fold_at;
    self->small_max = (unsigned long long)small_max;
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

/* allocate() raised the backend's error: failed(size, device, exc) raises the
 * error to show (an OutOfMemoryError naming the request, or exc itself), with exc
 * as the exception being handled, as in the Python version's except block. */
static PyObject *
allocation_failed(Accounting *self, PyObject *size, PyObject *device)
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
    PyObject *r = PyObject_CallFunctionObjArgs(self->failed, size, device, value ? value : Py_None, NULL);
    PyErr_SetExcInfo(otype, ovalue, otb);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (r != NULL) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_SystemError, "cupy_memstrat: the allocation-failure handler returned");
    }
    return NULL;
}

/* Pop the last item of a list (a new reference), or NULL if it is empty (no error set). */
static inline PyObject *
list_pop(PyObject *lst)
{
    Py_ssize_t n = PyList_GET_SIZE(lst);
    if (n == 0)
        return NULL;
    PyObject *item = PyList_GET_ITEM(lst, n - 1);
    Py_INCREF(item);
    if (PyList_SetSlice(lst, n - 1, n, NULL) < 0) {
        Py_DECREF(item);
        return NULL;
    }
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

/* The free list of a size class: small[d][(n + 511) >> 9], a new reference. */
static PyObject *
small_list(Accounting *self, Py_ssize_t d, unsigned long long n)
{
    PyObject *idx = table_item(self->small, d, &PyList_Type, "small");
    if (idx == NULL)
        return NULL;
    PyObject *lst = table_item(idx, (Py_ssize_t)((n + 511) >> 9), &PyList_Type, "small[d]");
    Py_DECREF(idx);
    return lst;
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

/* Accounting of an allocation: +size to events[d], then live[d][ptr] = size. */
static int
account_malloc(Accounting *self, Py_ssize_t d, PyObject *device, PyObject *ptr, PyObject *size)
{
    PyObject *ev = table_item(self->events, d, &PyList_Type, "events");
    if (ev == NULL)
        return -1;
    PyObject *live = table_item(self->live, d, &PyDict_Type, "live");
    if (live == NULL) {
        Py_DECREF(ev);
        return -1;
    }
    /* before the live insert: the matching -size can only follow it */
    int rc = PyList_Append(ev, size) < 0 || PyDict_SetItem(live, ptr, size) < 0 ? -1 : 0;
    Py_ssize_t queued = PyList_GET_SIZE(ev);
    Py_DECREF(live);
    Py_DECREF(ev);
    if (rc == 0 && queued > self->fold_at) {
        PyObject *r = PyObject_CallOneArg(self->fold, device);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
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
    PyObject *ptr = NULL;
    if (self->allocate != Py_None) {
        ptr = PyObject_CallOneArg(self->allocate, size);
        if (ptr == NULL) {
            if (PyErr_ExceptionMatches(self->error))
                return allocation_failed(self, size, device);
            return NULL;
        }
    } else {
        unsigned long long n;
        int fits = size_value(size, &n), hit = 0;
        if (fits < 0)
            return NULL;
        if (fits && n <= self->small_max) {
            PyObject *lst = small_list(self, d, n);
            if (lst == NULL)
                return NULL;
            ptr = list_pop(lst);
            Py_DECREF(lst);
            if (ptr == NULL && PyErr_Occurred())
                return NULL;
        } else if (fits) {
            PyObject *large = table_item(self->large, d, &PyDict_Type, "large");
            if (large == NULL)
                return NULL;
            PyObject *key = PyLong_FromUnsignedLongLong((n + 511) & ~511ULL), *lst = NULL;
            if (key != NULL) {
                lst = PyDict_GetItemWithError(large, key);
                Py_XINCREF(lst);
                Py_DECREF(key);
            }
            Py_DECREF(large);
            if (lst == NULL && PyErr_Occurred())
                return NULL;
            if (lst != NULL && PyList_CheckExact(lst)) {
                ptr = list_pop(lst);
                hit = ptr != NULL;
            }
            Py_XDECREF(lst);
            if (ptr == NULL && PyErr_Occurred())
                return NULL;
        }
        if (ptr == NULL) {
            ptr = PyObject_CallFunctionObjArgs(self->miss, size, device, NULL);
            if (ptr == NULL)
                return NULL;
        } else if (hit && self->large_hit != Py_None) {
            PyObject *r = PyObject_CallFunctionObjArgs(self->large_hit, ptr, size, device, NULL);
            if (r == NULL) {
                Py_DECREF(ptr);  /* large_hit put the block back in the cache */
                return NULL;
            }
            Py_DECREF(r);
        }
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
    PyObject *size = PyDict_GetItemWithError(live, ptr);  /* borrowed */
    if (size != NULL) {
        Py_INCREF(size);
        if (PyDict_DelItem(live, ptr) < 0) {
            Py_CLEAR(size);
            PyErr_Clear();  /* gone meanwhile (an int subclass's __eq__): not there */
        }
    } else {
        PyErr_Clear();  /* not there, or not hashable: not a pointer of this device */
    }
    Py_DECREF(live);
    return size;
}

/* The freed block goes back to its size class's free list (classes mode). */
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
    int rc = -1;
    if (n <= self->small_max) {
        PyObject *lst = small_list(self, d, n);
        if (lst != NULL) {
            rc = PyList_Append(lst, ptr);
            Py_DECREF(lst);
        }
        return rc;
    }
    /* the run's list, indexed when it was allocated */
    PyObject *large = table_item(self->large, d, &PyDict_Type, "large");
    if (large == NULL)
        return -1;
    PyObject *key = PyLong_FromUnsignedLongLong((n + 511) & ~511ULL);
    if (key != NULL) {
        PyObject *lst = PyDict_GetItemWithError(large, key);
        Py_XINCREF(lst);
        if (lst == NULL && !PyErr_Occurred()) {
            lst = PyList_New(0);
            if (lst != NULL && PyDict_SetItem(large, key, lst) < 0)
                Py_CLEAR(lst);
        }
        if (lst != NULL) {
            rc = PyList_CheckExact(lst) ? PyList_Append(lst, ptr) : -1;
            if (rc < 0 && !PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "cupy_memstrat: the strategy's table large[d] holds a non-list");
            Py_DECREF(lst);
        }
        Py_DECREF(key);
    }
    Py_DECREF(large);
    return rc;
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
    PyObject *minus = PyNumber_Negative(size), *ev = NULL;
    if (minus != NULL)
        ev = table_item(self->events, d, &PyList_Type, "events");
    if (ev == NULL || PyList_Append(ev, minus) < 0) {
        Py_XDECREF(ev);
        Py_XDECREF(minus);
        Py_DECREF(size);
        return NULL;
    }
    Py_DECREF(ev);
    Py_DECREF(minus);
    int rc = 0;
    if (self->allocate != Py_None) {
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
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Accounting_methods[] = {
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

/* GcSafeMalloc(pfa_malloc): CuPy's allocator callable for a strategy, around
 * PythonFunctionAllocator.malloc. CuPy 14.2's PythonFunctionAllocatorMemory is the
 * one memory class of cupy/cuda/memory.pyx that the garbage collector tracks
 * (no @cython.no_gc). When an array dies in a reference cycle and the collector
 * clears its memory object before the object's destructor runs, the destructor
 * finds its free function gone ("TypeError: 'NoneType' object is not callable")
 * and the block is never freed: measured on an H200, 100 of 100 such blocks lost
 * under every strategy (tools/probes/pfa_gc_clear.py). The memory object refers
 * only to the strategy's two functions, so it can never be part of a cycle
 * itself: untracking it keeps the collector off it, and it is then freed by its
 * reference count when the cycle that held its array is broken. */
typedef struct {
    PyObject_HEAD
    PyObject *malloc;    /* PythonFunctionAllocator.malloc, bound */
    PyObject *owner;     /* its __self__: the PythonFunctionAllocator */
    PyObject *mem_name;  /* "mem" */
    vectorcallfunc vectorcall;
} GcSafeMalloc;

static PyObject *
GcSafeMalloc_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    GcSafeMalloc *self = (GcSafeMalloc *)callable;
    PyObject *mp = PyObject_Vectorcall(self->malloc, args, nargsf, kwnames);
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
    if (!PyArg_ParseTuple(args, "O:GcSafeMalloc", &malloc))
        return -1;
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
    .tp_doc = PyDoc_STR("GcSafeMalloc(pfa.malloc): pfa.malloc(size), with the memory object kept "
                        "off the garbage collector (see csrc/hotpath.c)."),
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
    if (PyType_Ready(&AccountingType) < 0 || PyType_Ready(&GcSafeMallocType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&hotpath_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&AccountingType);
    if (PyModule_AddObject(m, "Accounting", (PyObject *)&AccountingType) < 0) {
        Py_DECREF(&AccountingType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GcSafeMallocType);
    if (PyModule_AddObject(m, "GcSafeMalloc", (PyObject *)&GcSafeMallocType) < 0) {
        Py_DECREF(&GcSafeMallocType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
