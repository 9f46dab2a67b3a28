"""The rmm and torch strategies on the GPU: allocate, compute, free, statistics
exact, DLPack both ways, the pytest plugin's leak and budget verdicts, the
stream patterns (with the dead-stream guard's control), and one strategy
measuring a CuPy + PyTorch + Numba program."""

import gc
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import cupy_memstrat
from cupy_memstrat.bench import streams as S

MiB = 1 << 20
HAVE = {n: importlib.util.find_spec(n) is not None for n in ("torch", "rmm", "numba")}
SPECS = [pytest.param(n, marks=pytest.mark.skipif(not HAVE[n], reason=f"{n} is not installed"))
         for n in ("torch", "rmm")]


@pytest.fixture
def kern(cp):
    return S.Kernels(cp)


@pytest.mark.parametrize("name", SPECS)
def test_allocate_compute_free_with_exact_statistics(cp, name):
    s = cupy_memstrat.use(name)
    x = cp.arange(1 << 20, dtype=cp.float32)  # 4 MiB
    y = x * 2
    y += 1
    assert float(y[-1]) == 2 * ((1 << 20) - 1) + 1
    st = s.stats()
    assert st.bytes_in_use == 8 * MiB and st.n_live == 2
    assert x.data.mem.size == 4 * MiB and y.data.ptr in {a.ptr for a in s.live_allocations()}
    z = cp.empty(1000, dtype=cp.uint8)
    assert s.stats().bytes_in_use == 8 * MiB + 1024  # rounded up to 512 B, as CuPy's pool
    del x, y, z
    gc.collect()
    assert s.stats().bytes_in_use == 0 and s.stats().n_frees == 3
    assert s.stats().peak_bytes_in_use == 8 * MiB + 1024


@pytest.mark.skipif(not HAVE["torch"], reason="torch is not installed")
def test_torch_shares_one_pool_and_its_own_statistics_stay_right(cp):
    import torch

    s = cupy_memstrat.use("torch")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    x = cp.ones(3 * MiB, dtype=cp.uint8)
    assert torch.cuda.memory_allocated() == before + 3 * MiB  # PyTorch counts CuPy's block as its own
    assert s.stats().bytes_reserved == torch.cuda.memory_reserved() >= 3 * MiB
    ptr = x.data.ptr
    del x
    gc.collect()
    assert torch.cuda.memory_allocated() == before
    t = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")  # the block CuPy freed, from the same pool
    assert t.data_ptr() == ptr
    del t
    assert s.trim() >= 0 and torch.cuda.memory_reserved() <= s.stats().peak_bytes_reserved


@pytest.mark.skipif(not HAVE["torch"], reason="torch is not installed")
def test_pytorch_refuses_managed_memory_through_dlpack_and_takes_it_through_the_array_interface(cp):
    """CuPy exports managed memory as DLPack's kDLCUDAManaged (13), which PyTorch 2.11 refuses
    (measured on the H200); __cuda_array_interface__ carries the pointer alone and works."""
    import torch

    cupy_memstrat.use("managed")
    x = cp.arange(8, dtype=cp.float32)
    with pytest.raises(BufferError, match="device_type: 13"):
        torch.from_dlpack(x)
    t = torch.as_tensor(x, device="cuda")  # through __cuda_array_interface__, no copy
    assert t.data_ptr() == x.data.ptr
    t.add_(1)
    torch.cuda.synchronize()
    assert float(x[7]) == 8.0


@pytest.mark.skipif(not HAVE["torch"], reason="torch is not installed")
@pytest.mark.parametrize("name", ["torch", "device", "async", "pool"])
def test_dlpack_both_ways(cp, name):
    import torch

    cupy_memstrat.use(name)
    x = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    t = torch.from_dlpack(x)  # no copy
    assert t.data_ptr() == x.data.ptr
    u = torch.nn.functional.relu(t - 5.0) @ torch.ones(4, 2, device="cuda")
    y = cp.from_dlpack(u)
    expect = cp.maximum(cp.arange(12, dtype=cp.float32).reshape(3, 4) - 5, 0) @ cp.ones((4, 2), cp.float32)
    assert bool(cp.allclose(y, expect))
    t.mul_(2)  # written through PyTorch, seen by CuPy
    assert float(x[2, 3]) == 22.0


@pytest.mark.skipif(not HAVE["rmm"], reason="rmm is not installed")
def test_rmm_over_a_pool_resource_reports_the_pools_size(cp):
    import rmm

    mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=64 * MiB)
    s = cupy_memstrat.use("rmm", resource=mr)
    x = cp.zeros(16 * MiB, dtype=cp.uint8)
    st = s.stats()
    assert st.bytes_in_use == 16 * MiB and st.bytes_reserved == mr.pool_size() >= 64 * MiB
    del x
    gc.collect()
    assert s.stats().bytes_in_use == 0


@pytest.mark.parametrize("name", SPECS)
def test_out_of_memory_is_cupys_error_with_the_statistics(cp, name):
    s = cupy_memstrat.use(name)
    keep = cp.ones(MiB, dtype=cp.uint8)
    free = cp.cuda.runtime.memGetInfo()[1]
    with pytest.raises(cp.cuda.memory.OutOfMemoryError) as e:
        cp.empty(free + (1 << 30), dtype=cp.uint8)
    assert isinstance(e.value, cupy_memstrat.errors.OutOfMemoryError)
    assert s.stats().bytes_in_use == MiB and int(keep.sum()) == MiB  # nothing lost


@pytest.mark.parametrize("pattern", ["other-stream", "freed-elsewhere", "dead-stream"])
@pytest.mark.parametrize("spec", [pytest.param("torch", marks=SPECS[0].marks),
                                  pytest.param("rmm-pool", marks=SPECS[1].marks)])
def test_the_stream_patterns_are_safe(cp, kern, spec, pattern):
    fn = {"other-stream": S.other_stream, "freed-elsewhere": S.freed_elsewhere, "dead-stream": S.dead_stream}[pattern]
    s = S.install(cp, spec)
    try:
        assert fn(cp, kern) == 0
    finally:
        S.release(cp, s)


@pytest.mark.parametrize("spec", [pytest.param("torch", marks=SPECS[0].marks),
                                  pytest.param("rmm-pool", marks=SPECS[1].marks)])
def test_after_a_stream_that_allocated_dies_the_next_allocation_waits_once(cp, spec):
    """The guard sees a real cupy.cuda.Stream die and waits once, at the next allocation.
    (Without its wait the dead-stream pattern also gave 0 wrong elements under PyTorch's and
    RMM's pools on the H200, 2026-12-01: the wait is a precaution, docs/interop.md.)"""
    s = S.install(cp, spec)
    try:
        # the guard is the process's one for this cache (earlier tests' strategies shared it):
        # cover the deaths they left, then count from here
        cp.zeros(1, dtype=cp.uint8)  # an allocation: waits for any death left uncovered
        assert s.guard.pending[0] is False
        n = s.guard.n_syncs[0]
        a = cp.cuda.Stream(non_blocking=True)
        with a:
            x = cp.ones(MiB, dtype=cp.uint8)
        del x, a
        gc.collect()
        assert s.guard.pending[0] is True
        y = cp.zeros(MiB, dtype=cp.uint8)
        assert s.guard.n_syncs[0] == n + 1 and s.guard.pending[0] is False
        z = cp.zeros(MiB, dtype=cp.uint8)
        assert s.guard.n_syncs[0] == n + 1 and int(y.sum()) + int(z.sum()) == 0
    finally:
        S.release(cp, s)


@pytest.mark.parametrize("name", SPECS)
def test_the_plugin_catches_a_leak_and_enforces_a_budget(inner, name):
    inner.makepyfile("""
import cupy, pytest
MiB = 1 << 20
KEEP = []
@pytest.mark.limit_gpu_memory("64MiB")
def test_over_budget():
    x = cupy.zeros(128 * MiB, dtype=cupy.uint8)
def test_leak():
    KEEP.append(cupy.zeros(16 * MiB, dtype=cupy.uint8))
def test_clean():
    assert int(cupy.ones(MiB, dtype=cupy.uint8).sum()) == MiB
""")
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", f"--gpumem-strategy={name}", "--gpumem-leaks=fail", "-ra")
    r.assert_outcomes(passed=1, failed=2)
    r.stdout.fnmatch_lines([f"gpumem: measuring every test through strategy '{name}'*"])
    r.stdout.fnmatch_lines(["peak 128.0 MiB* > budget 64.0 MiB (limit_gpu_memory marker)"])
    r.stdout.fnmatch_lines(["leaked 1 allocation, 16.0 MiB > limit 0 B (--gpumem-leaks)"])


@pytest.mark.skipif(not (HAVE["torch"] and HAVE["numba"]), reason="needs torch and numba-cuda")
@pytest.mark.parametrize("name", ["torch", pytest.param("rmm", marks=SPECS[1].marks), "async"])
def test_one_strategy_measures_a_cupy_pytorch_numba_program(tmp_path, name):
    out = tmp_path / "mixed.json"
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixed_interop_program.py")
    compat = os.path.join(os.path.dirname(os.path.abspath(__file__)), "numba_compat")  # see its sitecustomize
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="cupy_memstrat.numba",
               PYTHONPATH=compat + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    env.pop("CUPY_MEMSTRAT_BACKEND", None)
    r = subprocess.run([sys.executable, probe, name, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["results_match"] is True
    # CuPy's array and Numba's block are the strategy's; PyTorch's tensor is PyTorch's own
    assert doc["cupy_array_in_stats"] is True and doc["numba_block_in_stats"] is True
    assert doc["torch_tensor_in_stats"] is False
    assert doc["bytes_in_use_with_arrays"] >= doc["bytes_in_use_before"] + 8 * MiB
    if name == "torch":  # one pool: PyTorch's reserved bytes are the strategy's
        assert doc["strategy_bytes_reserved"] == doc["torch_memory_reserved"]
    assert doc["bytes_in_use_after"] == doc["bytes_in_use_before"]
    dest = os.environ.get("GPUMEM_INTEROP_OUT")
    if dest:
        os.makedirs(dest, exist_ok=True)
        (__import__("pathlib").Path(dest) / f"mixed-{name}.json").write_text(out.read_text())
