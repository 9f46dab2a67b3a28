/* csrc/hotpath/accounting.h: The Accounting object's layout: a strategy's tables and its per-device C counts (every mode).
 * Part of the extension's one compilation unit: csrc/hotpath.c includes it. */

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
    PyObject *origins;        /* track_origins: dict ptr -> origin, or None */
    PyObject *capture;        /* track_origins: capture() -> the origin of the allocation being made, or None */
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
    X(stream_caches) X(new_stream_cache) X(dead) X(reap) X(origins) X(capture)
