"""What this machine offers: versions, devices, memory, feature support.

Used by ``python -m cupy_memstrat info`` and stamped into every benchmark JSON.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform

from . import __version__
from .errors import MemstratError
from .registry import get_registry
from .sizes import format_size

__all__ = ["collect", "format_report", "package_versions"]


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_versions() -> dict:
    """Versions of Python and the packages that matter here (``None`` if absent)."""
    cupy_version = None
    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        pass
    return {
        "python": platform.python_version(),
        "cupy_memstrat": __version__,
        "cupy": cupy_version,
        "cupy_dist": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "cuda_bindings": _dist_version("cuda-bindings"),
        "pluggy": _dist_version("pluggy"),
        "numpy": _dist_version("numpy"),
        "rmm": _dist_version("rmm-cu13", "rmm-cu12", "rmm"),
        "torch": _dist_version("torch"),
        "numba_cuda": _dist_version("numba-cuda"),
    }


def _kernel_driver_version() -> str | None:
    """The NVIDIA driver's own version (e.g. "580.159.04") through NVML, if
    ``nvidia-ml-py`` is installed; ``None`` otherwise."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - optional information
        return None
    return v.decode() if isinstance(v, bytes) else str(v)


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _hot_path() -> dict:
    from .strategies.base import hot_path_status

    try:
        status = hot_path_status()
    except ValueError as exc:  # a bad CUPY_MEMSTRAT_HOT_PATH
        return {"setting": None, "hot_path": None, "reason": str(exc), "strategies": {}}
    reg = get_registry()
    status["strategies"] = {  # which one each registered strategy runs (track_origins=False)
        name: "c" if status["hot_path"] == "c" and getattr(reg.get(name), "has_c_hot_path", True) else "python"
        for name in reg.names()
    }
    from .strategies.cupy_pool import route_status

    status["pool_route"] = route_status(status["hot_path"])
    return status


def collect(backend=None) -> dict:
    """Machine report as a dict: ``packages``, ``date``, ``hot_path`` (which
    allocation hot path strategies get: :func:`cupy_memstrat.hot_path_status`), and either ``cuda``
    (``driver``, ``runtime``, ``devices``: one dict per device with
    ``total_memory``/``free_memory`` in bytes) or ``error`` (why there is no
    GPU information)."""
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "packages": package_versions(),
        "strategies": get_registry().describe(),
        "page_fault_counters": None,  # filled below
        "hot_path": _hot_path(),
    }
    try:
        if backend is None:
            from .backends import get_backend

            backend = get_backend()
        versions = backend.versions()
        devices = []
        for d in range(backend.device_count()):
            props = backend.device_properties(d)
            free, total = backend.mem_get_info(d)
            devices.append(dict(props, device=d, free_memory=free, total_memory=total))
        report["cuda"] = {
            "backend": backend.name,
            "kernel_driver": _kernel_driver_version() if backend.name == "cuda" else None,
            "driver": versions["driver"],
            "runtime": versions["runtime"],
            "devices": devices,
        }
        if backend.name == "cuda":
            from . import faults

            report["page_fault_counters"] = faults.status()
        else:
            report["page_fault_counters"] = f"the {backend.name} backend's simulated counters (exact)"
            hp = report["hot_path"]
            if hp.get("hot_path"):  # what a pool made here takes: the simulated GPU has no CuPy pool
                from .strategies.cupy_pool import route_status

                hp["pool_route"] = route_status(hp["hot_path"], cuda=False)
    except (MemstratError, ValueError) as exc:  # ValueError: a bad CUPY_MEMSTRAT_BACKEND
        report["error"] = str(exc)
        pr = report["hot_path"].get("pool_route")
        if pr and pr.get("route") == "direct":  # no device here: what a pool would take on one
            pr["reason"] = f"on a CUDA device ({pr['reason']}); there is none here"
        from . import faults

        report["page_fault_counters"] = faults.status()  # never raises; says why not
    return report


def format_report(report: dict) -> str:
    """The human-readable form of :func:`collect`'s dict."""
    pk = report["packages"]
    lines = [
        f"cupy-memstrat {pk['cupy_memstrat']}",
        "packages: "
        + ", ".join(f"{k} {v}" for k, v in pk.items() if k != "cupy_memstrat" and v is not None),
    ]
    missing = [k for k in ("cupy", "cuda_bindings") if pk.get(k) is None]
    if missing:
        lines.append("missing: " + ", ".join(missing) + " (pip install 'cupy-memstrat[cuda13]' or [cuda12])")
    cuda = report.get("cuda")
    if cuda is None:
        lines.append(f"GPU: {report.get('error', 'unknown')}")
    else:
        kd = f"NVIDIA driver {cuda['kernel_driver']}, " if cuda.get("kernel_driver") else ""
        lines.append(
            f"{kd}CUDA driver API {_cuda_version(cuda['driver'])} ({cuda['driver']}), "
            f"runtime {_cuda_version(cuda['runtime'])} ({cuda['runtime']}), backend {cuda['backend']}"
        )
        for dev in cuda["devices"]:
            lines.append(f"device {dev['device']}: {dev['name']}, compute capability {dev['compute_capability']}")
            lines.append(
                f"  memory: {format_size(dev['total_memory'])} total, {format_size(dev['free_memory'])} free"
            )
            lines.append(
                f"  concurrentManagedAccess {dev['concurrent_managed_access']}, "
                f"pageableMemoryAccess {dev['pageable_memory_access']}, "
                f"memoryPoolsSupported {dev['memory_pools_supported']}"
            )
    lines.append(f"page-fault counters: {report['page_fault_counters']}")
    hp = report.get("hot_path") or {}
    if hp.get("hot_path"):
        lines.append(f"allocation hot path: {hp['hot_path']}: {hp.get('reason')}")
        per = hp.get("strategies") or {}
        if per:
            lines.append("  per strategy: " + ", ".join(f"{n} {p}" for n, p in per.items())
                         + (" (python: no C version of that strategy's hot path yet)"
                            if "python" in per.values() and hp["hot_path"] == "c" else ""))
        pr = hp.get("pool_route")
        if pr:
            lines.append(f"  pool's route: {pr['route']}: {pr['reason']}")
    else:
        lines.append(f"allocation hot path: error: {hp.get('reason')}")
    lines.append("strategies:")
    for name, desc in report["strategies"].items():
        lines.append(f"  {name}: {desc}")
    return "\n".join(lines)

