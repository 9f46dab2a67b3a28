"""Figures from benchmark JSON (``python -m cupy_memstrat plot``); needs
matplotlib (``pip install 'cupy-memstrat[plot]'``)."""

from __future__ import annotations

__all__ = ["plot"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'cupy-memstrat[plot]'") from exc
    return plt


def _managed(report: dict, plt):
    fp = report["first_pass"]
    rows = list(fp["results"].items())
    labels = [k for k, _ in rows]
    ms = [r["median_ms"] for _, r in rows]
    faults = [(r.get("faults_median") or {}).get("gpu_faults") for _, r in rows]
    pinned_ms = fp["pinned_copy"]["seconds"] * 1e3
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    y = range(len(rows))
    colors = ["#c44e52" if (f or 0) > 0 else "#4c72b0" for f in faults]
    ax.barh(list(y), ms, color=colors)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(pinned_ms, color="0.3", ls="--", lw=1)
    ax.text(pinned_ms, len(rows) - 0.4, f" pinned copy {pinned_ms:.1f} ms", color="0.3", va="bottom", fontsize=8)
    for i, (t, f) in enumerate(zip(ms, faults)):
        note = f"{t:.1f} ms" + (f", {f:,.0f} GPU faults" if f else ", no GPU faults" if f == 0 else "")
        ax.text(t * 1.05, i, note, va="center", fontsize=8)
    ax.set_xlim(right=max(ms) * 12)
    dev = report["machine"].get("cuda", {}).get("devices", [{}])[0].get("name", "GPU")
    ax.set_xlabel("first GPU pass, data movement included (ms, log scale; median)")
    ax.set_title(
        f"Managed memory: {fp['bytes'] >> 30} GiB, {fp['kernel']} on {dev}\n"
        "red: fault-driven; blue: no GPU page faults (driver counters)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def _device_name(report: dict) -> str:
    return (report.get("machine") or {}).get("cuda", {}).get("devices", [{}])[0].get("name", "GPU")


def _latency_panels(lat: dict, axes) -> None:
    """One panel per block size: median alloc+free microseconds per path (log
    scale), CuPy's pool marked, the ratio to it written on each bar."""
    from ..sizes import format_size

    sizes = [k for k in next(iter(lat["results_us"].values())) if k.isdigit()]
    labels = list(lat["results_us"])
    for ax, size in zip(axes, sizes):
        us = [lat["results_us"][lab][size]["median_us"] for lab in labels]
        base = lat["results_us"]["cupy-default"][size]["median_us"]
        colors = ["0.55" if lab in ("cupy-default", "no-pool", "cupy-async", "rmm-async") else "#4c72b0" for lab in labels]
        y = list(range(len(labels)))
        ax.barh(y, us, color=colors)
        ax.set_yticks(y, labels)
        if ax is not axes[0]:
            ax.tick_params(labelleft=False)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(base, color="0.3", ls="--", lw=1)
        for i, t in enumerate(us):
            ax.text(t * 1.08, i, f"{t:.2f} us ({t / base:.2f}x)", va="center", fontsize=7)
        ax.set_xlim(right=max(us) * 20)
        ax.set_title(format_size(int(size)), fontsize=9)
        ax.set_xlabel("alloc+free, us (log)", fontsize=8)


def _alloc(report: dict, plt):
    n = len([k for k in next(iter(report["results_us"].values())) if k.isdigit()])
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 0.4 * len(report["results_us"]) + 1.8))
    _latency_panels(report, list(axes))
    fig.suptitle(f"Alloc+free through cupy.cuda.alloc on {_device_name(report)} "
                 "(median; blue: cupy_memstrat strategies; dashed: CuPy's pool)", fontsize=10)
    fig.tight_layout()
    return fig


def _async(report: dict, plt):
    loop = report["sync_loop"]["results_us"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 0.4 * max(len(report["latency"]["results_us"]), len(loop)) + 1.8))
    _latency_panels(report["latency"], [ax0])
    ax0.set_title("alloc+free, 512 B", fontsize=9)
    labels = list(loop)
    us = [loop[k]["median_us"] for k in labels]
    y = list(range(len(labels)))
    ax1.barh(y, us, color=["#4c72b0" if k.startswith("async") else "0.55" for k in labels])
    ax1.set_yticks(y, labels)
    ax1.invert_yaxis()
    ax1.set_xscale("log")
    for i, t in enumerate(us):
        ax1.text(t * 1.08, i, f"{t:.1f} us", va="center", fontsize=7)
    ax1.set_xlim(right=max(us) * 20)
    loop_mib = report.get("params", {}).get("loop_bytes", 0) >> 20
    ax1.set_title(f"{loop_mib} MiB alloc, free, synchronize: us per iteration (log)", fontsize=9)
    fig.suptitle(f"The async strategy on {_device_name(report)} (median)", fontsize=10)
    fig.tight_layout()
    return fig


_PLOTS = {"alloc": _alloc, "async": _async, "managed": _managed}


def plot(report: dict, path: str) -> None:
    """Draw the figure for a benchmark report (the JSON of ``bench ... --json``) into ``path``.

    Raises:
        ValueError: no figure exists for this benchmark.
        RuntimeError: matplotlib is not installed.
    """
    kind = report.get("benchmark")
    if kind not in _PLOTS:
        raise ValueError(f"no figure for benchmark {kind!r}; figures exist for: {', '.join(sorted(_PLOTS))}")
    plt = _pyplot()
    fig = _PLOTS[kind](report, plt)
    fig.savefig(path, dpi=120)
    plt.close(fig)
