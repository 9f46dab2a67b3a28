/* csrc/hotpath/classes.c: classes mode (managed, expandable): per-stream arenas of size-class free lists; a block goes back to
 * the arena of the stream it was allocated on.
 * Part of the extension's one compilation unit: csrc/hotpath.c includes it. */

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
