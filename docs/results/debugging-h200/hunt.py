import cupy
import cupy_memstrat

cupy_memstrat.use("managed", oom_snapshot="oom.json", track_origins=8)

def load_batch(n):
    return cupy.empty(n, dtype=cupy.float32)

def train():
    cache = [load_batch(64 << 20) for _ in range(3)]  # 3 x 256 MiB kept by mistake
    big = load_batch(53687091200)                           # too much
    return cache, big

train()
