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


_PLOTS = {"managed": _managed}


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
