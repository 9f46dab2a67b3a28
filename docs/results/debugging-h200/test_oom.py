import cupy


def test_loads_too_much():
    keep = cupy.empty(64 << 20, dtype=cupy.float32)
    big = cupy.empty(53687091200, dtype=cupy.float32)
    del keep, big
