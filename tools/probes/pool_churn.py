"""Probe: create / use / destroy CUDA memory pools in a tight loop, bare and
through using("async"), to see whether the driver itself fails (a SIGFPE was
seen once inside cudaMallocFromPoolAsync in test_using_async_in_a_loop_leaves_no_pools_behind,
and a hang once in an earlier session). Prints how far each loop got."""

import sys

import cupy as cp

import cupy_memstrat
from cupy_memstrat.cuda import get_backend

b = get_backend()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
for i in range(n):
    pool = b.pool_create(0, 0)
    p = b.malloc_from_pool_async(4 << 20, pool, 0)
    b.free_async(p, 0)
    b.device_synchronize(0)
    b.pool_destroy(pool)
print(f"bare pools: {n} create/alloc/free/destroy cycles done", flush=True)
for i in range(n):
    with cupy_memstrat.using("async"):
        y = cp.ones(1 << 20, dtype=cp.float32) * 2
        assert float(y[0]) == 2.0
        del y
print(f"using('async'): {n} loops done", flush=True)
