"""Write one float32 past the end of a 1000-element array, under a strategy.

    compute-sanitizer --tool memcheck python tools/oob_demo.py [cupy-default|device]

Under CuPy's pool the block is rounded up to 512 bytes and carved from a
larger cudaMalloc, so memcheck sees nothing; under ``device`` each array is
its own cudaMalloc and memcheck reports the write.
"""

import sys

import cupy

import cupy_memstrat

which = sys.argv[1] if len(sys.argv) > 1 else "device"
if which != "cupy-default":
    cupy_memstrat.use(which)
kernel = cupy.RawKernel(
    r"""
extern "C" __global__ void write_past_end(float* x, int n) {
    if (threadIdx.x == 0 && blockIdx.x == 0) x[n] = 1.0f;   // one element too far
}
""",
    "write_past_end",
)
x = cupy.zeros(1000, dtype=cupy.float32)
kernel((1,), (32,), (x, cupy.int32(x.size)))
cupy.cuda.Device().synchronize()
print(f"{which}: kernel ran; sum={float(x.sum())}")
