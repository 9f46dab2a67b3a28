"""Per-test records, the terminal table and the JSON report."""

from __future__ import annotations

import datetime
import json
import os
import platform

import cupy_memstrat

__all__ = ["user_properties", "write_json", "table_lines", "JSON_VERSION"]

JSON_VERSION = 1
fmt = cupy_memstrat.format_size


def user_properties(rec: dict) -> list[tuple[str, object]]:
    """``gpumem_*`` properties for ``report.user_properties`` (JUnit XML)."""
    if rec.get("measured") is False:  # the test changed CuPy's allocator: no numbers of its own
        return [("gpumem_not_measured", rec.get("allocator_change"))]
    props = [("gpumem_peak_bytes", rec["peak_bytes"]), ("gpumem_allocations", rec["allocated"])]
    if rec.get("peak_reserved_bytes") is not None:
        props.append(("gpumem_peak_reserved_bytes", rec["peak_reserved_bytes"]))
    if rec.get("leaked_bytes") is not None:
        props += [("gpumem_leaked_bytes", rec["leaked_bytes"]), ("gpumem_leaked_allocations", rec["leaked_count"])]
    f = rec.get("faults")
    if f:
        props += [
            ("gpumem_gpu_faults", f["gpu_faults"]),
            ("gpumem_cpu_faults", f["cpu_faults"]),
            ("gpumem_bytes_htod", f["bytes_htod"]),
            ("gpumem_bytes_dtoh", f["bytes_dtoh"]),
        ]
    return props


def table_lines(records: list[dict], top: int) -> list[str]:
    """The terminal table: the ``top`` tests by peak, with the driver-level peak (where the
    driver was read), reserved (where a fragmentation limit applied), leaks and faults
    columns where any test has them."""
    def judged_peak(r):  # the peak a budget judges: the driver-level one under --gpumem-budget-reading=driver
        if r.get("budget_reading") == "driver" and r.get("driver_peak_bytes_per_device"):
            return max(r["driver_peak_bytes_per_device"])
        return r["peak_bytes"] or 0

    rows = sorted(records, key=lambda r: (r.get("measured") is False, -judged_peak(r), r["nodeid"]))[:top]
    show_leaks = any(r.get("leaked_bytes") is not None for r in records)
    show_faults = any(r.get("faults") for r in records)
    show_reserved = any("fragmentation" in (r.get("limits") or {}) for r in records)
    show_driver = any(r.get("driver_peak_bytes_per_device") for r in records)
    head = [f"{'peak':>10}", f"{'allocs':>7}"]
    if show_driver:
        head.append(f"{'driver peak':>11}")
    if show_reserved:
        head.append(f"{'reserved':>10}")
    if show_leaks:
        head.append(f"{'leaked':>10}")
    if show_faults:
        head += [f"{'GPU faults':>10}", f"{'CPU faults':>10}", f"{'migrated':>10}"]
    lines = ["  ".join(head + ["test"])]
    for r in rows:
        unmeasured = r.get("measured") is False  # its allocator changed during it
        cells = [f"{'-' if unmeasured else fmt(r['peak_bytes']):>10}", f"{'-' if unmeasured else r['allocated']:>7}"]
        if show_driver:
            dp = r.get("driver_peak_bytes_per_device")
            cells.append(f"{'-' if unmeasured or not dp else fmt(max(dp)):>11}")
        if show_reserved:
            rb = r.get("peak_reserved_bytes")
            cells.append(f"{'-' if rb is None else fmt(rb):>10}")
        if show_leaks:
            lb = r.get("leaked_bytes")
            cells.append(f"{'-' if lb is None else fmt(lb):>10}")
        if show_faults:
            f = r.get("faults")
            if f:
                cells += [f"{f['gpu_faults']:>10}", f"{f['cpu_faults']:>10}",
                          f"{fmt(f['bytes_htod'] + f['bytes_dtoh']):>10}"]
            else:
                cells += [f"{'-':>10}"] * 3
        tail = f"  [{r['verdict']}]" if r.get("verdict") else ""
        if unmeasured:
            tail += "  [not measured: it changed CuPy's allocator]"
        elif r.get("checked") is False:
            tail += "  [unchecked]"
        where = f" ({r['worker']})" if r.get("worker") else ""
        if r.get("strategy"):
            where += f" [strategy {r['strategy']}]"
        lines.append("  ".join(cells + [r["nodeid"] + where + tail]))
    return lines


def write_json(path: str, records: list[dict], state_info: dict) -> None:
    doc = {
        "version": JSON_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        **state_info,
        "tests": records,
    }
    path = os.path.realpath(path)  # through a symbolic link to the file it names, never replacing the link
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):  # a failed write leaves nothing behind
            os.unlink(tmp)
