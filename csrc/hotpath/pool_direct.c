/* csrc/hotpath/pool_direct.c: PoolDirect: pool's route "direct" (CuPy gets its pool's own MemoryPointer; the free is seen
 * through a token in the pool's memory object), PoolToken, and GenMap, its table of generations.
 * Part of the extension's one compilation unit: csrc/hotpath.c includes it. */

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
    forget_origin(acc, ptr);
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
