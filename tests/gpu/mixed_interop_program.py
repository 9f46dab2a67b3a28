"""One strategy measuring a program that mixes CuPy, PyTorch and Numba (run by
test_interop_gpu.py in a fresh process):

    NUMBA_CUDA_MEMORY_MANAGER=cupy_memstrat.numba python tests/gpu/mixed_interop_program.py STRATEGY OUT.json

A CuPy array goes to PyTorch through DLPack (no copy), a PyTorch op makes a
tensor that comes back to CuPy through DLPack, and a Numba kernel writes a
Numba device array (allocated through the strategy, cupy_memstrat.numba) from
both. The result is checked against NumPy. Writes what the strategy saw:
bytes in use before, with the arrays, and after; whether the Numba block is
in its live table; where PyTorch's tensor came from (PyTorch's own pool: under
the torch strategy that is the pool CuPy shares, and its reserved bytes).
"""

import gc
import json
import sys

import numpy as np


def main(name: str, out: str) -> int:
    import cupy as cp
    import torch
    from numba import cuda

    import cupy_memstrat
    from cupy_memstrat.info import package_versions

    s = cupy_memstrat.use(name)
    n = 1 << 20
    cp.cuda.Device().synchronize()
    before = s.stats().bytes_in_use

    x = cp.arange(n, dtype=cp.float32) / n  # CuPy, through the strategy
    t = torch.from_dlpack(x)  # the same memory, seen by PyTorch
    u = torch.sin(t) * 2.0  # PyTorch's op, PyTorch's allocator
    y = cp.from_dlpack(u)  # back to CuPy, no copy
    d = cuda.device_array(n, dtype=np.float32)  # Numba, through the strategy (cupy_memstrat.numba)

    @cuda.jit
    def add(a, b, c):
        i = cuda.grid(1)
        if i < c.size:
            c[i] = a[i] + b[i]

    add[(n + 255) // 256, 256](cuda.as_cuda_array(x), cuda.as_cuda_array(y), d)
    cuda.synchronize()
    with_arrays = s.stats()
    live = {a.ptr: a.size for a in s.live_allocations()}
    host_x = np.arange(n, dtype=np.float32) / n
    expect = host_x + np.sin(host_x) * np.float32(2.0)
    got = d.copy_to_host()
    match = bool(np.allclose(got, expect, rtol=1e-6, atol=1e-6))
    numba_ptr = int(d.device_ctypes_pointer.value or 0)
    report = {
        "strategy": name,
        "packages": package_versions(),
        "torch": torch.__version__,
        "numba_cuda": __import__("importlib.metadata").metadata.version("numba-cuda"),
        "device": torch.cuda.get_device_name(),
        "elements": n,
        "results_match": match,
        "max_abs_diff": float(np.max(np.abs(got - expect))),
        "bytes_in_use_before": before,
        "bytes_in_use_with_arrays": with_arrays.bytes_in_use,
        "cupy_array_in_stats": x.data.ptr in live,
        "numba_block_in_stats": numba_ptr in live and live[numba_ptr] >= 4 * n,
        "torch_tensor_in_stats": u.data_ptr() in live,
        "torch_memory_allocated": torch.cuda.memory_allocated(),
        "torch_memory_reserved": torch.cuda.memory_reserved(),
        "strategy_bytes_reserved": with_arrays.bytes_reserved,
    }
    del x, t, u, y, d
    gc.collect()
    cuda.synchronize()
    report["bytes_in_use_after"] = s.stats().bytes_in_use
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
