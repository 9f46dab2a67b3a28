/* csrc/hotpath/gc_safe.c: GcSafeMalloc: CuPy's allocator callable that keeps each array's memory object off the
 * garbage collector.
 * Part of the extension's one compilation unit: csrc/hotpath.c includes it. */

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
