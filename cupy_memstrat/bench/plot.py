"""Figures from benchmark JSON and memory snapshots (``python -m cupy_memstrat plot``); needs
matplotlib (``pip install 'cupy-memstrat[plot]'``)."""

from __future__ import annotations

import math

__all__ = ["plot", "plot_side_by_side"]


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
        colors = ["0.55" if lab in ("cupy-default", "no-pool", "cupy-async", "rmm-async") else "#4c72b0"
                  for lab in labels]
        y = list(range(len(labels)))
        ax.barh(y, us, color=colors)
        ax.set_yticks(y, labels)
        if ax is not axes[0]:
            ax.tick_params(labelleft=False)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(base, color="0.3", ls="--", lw=1)
        for i, t in enumerate(us):
            ax.text(t * 1.08, i, f"{t:.2f} µs ({t / base:.2f}x)", va="center", fontsize=7)
        ax.set_xlim(right=max(us) * 20)
        ax.set_title(format_size(int(size)), fontsize=9)
        ax.set_xlabel("alloc+free, µs (log scale)", fontsize=8)


def _alloc(report: dict, plt):
    n = len([k for k in next(iter(report["results_us"].values())) if k.isdigit()])
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 0.4 * len(report["results_us"]) + 1.8))
    _latency_panels(report, list(axes))
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig.suptitle(f"Alloc+free through cupy.cuda.alloc on {_device_name(report)} (median of rounds)", fontsize=10)
    fig.legend(handles=[Patch(color="#4c72b0",
                              label="cupy_memstrat strategy (device+origins: device, track_origins=True)"),
                        Patch(color="0.55", label="CuPy's pool, raw cudaMalloc (no-pool), CuPy / RMM async pools"),
                        Line2D([], [], color="0.3", ls="--", label="CuPy's pool")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
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
        ax1.text(t * 1.08, i, f"{t:.1f} µs", va="center", fontsize=7)
    ax1.set_xlim(right=max(us) * 20)
    loop_mib = report.get("params", {}).get("loop_bytes", 0) >> 20
    ax1.set_title(f"{loop_mib} MiB alloc, free, synchronize: µs per iteration (log scale)", fontsize=9)
    fig.suptitle(f"The async strategy on {_device_name(report)} (median)", fontsize=10)
    fig.tight_layout()
    return fig


def _workload_ratio(row: dict) -> float:
    """The median of the path's ratios to CuPy's pool round by round, or for
    reports written before they were kept, the ratio of the medians."""
    rr = row.get("ratio_in_rounds")
    return float(rr["median"] if isinstance(rr, dict) and "median" in rr else row["ratio_to_first"])


def _workloads(report: dict, plt):
    """Per workload, each path's wall time as a ratio to CuPy's pool (the
    median of the ratios of the samples of each round; grouped bars, log scale); GPU page faults and
    a result that differs
    from the pool's are written by the bar; a workload measured cold says so."""
    res = report["results"]
    names = list(res)
    if not names:
        raise ValueError("no workload in its results")
    cold = set((report.get("params") or {}).get("cold") or ())
    labels = list(dict.fromkeys(lab for rows in res.values() for lab in rows))  # every path, in order
    fig, ax = plt.subplots(figsize=(11, 0.9 * len(names) * max(1, len(labels) / 4) + 1.6))
    h = 0.8 / len(labels)
    cmap = plt.get_cmap("tab10")
    shown = []
    for j, lab in enumerate(labels):
        ys = [i + j * h for i in range(len(names))]
        vals = [_workload_ratio(res[n][lab]) if lab in res[n] else None for n in names]
        drawable = [v if v is not None and math.isfinite(v) and v > 0 else float("nan") for v in vals]
        ax.barh(ys, drawable, height=h, color=cmap(j % 10), label=lab)
        for y, n, v, d in zip(ys, names, vals, drawable):
            if v is None:
                ax.text(1.0, y, " not run", va="center", fontsize=7, color="0.4")
                continue
            if d != d:  # a ratio of 0, inf or NaN: no bar on a log scale, the value said
                ax.text(1.0, y, f" ratio {v}", va="center", fontsize=7, color="0.4")
                continue
            shown.append(v)
            row = res[n].get(lab) or {}
            c = row.get("check") or {}
            mark = "" if c.get("identical") or c.get("reference") else ", result differs"
            faults = (row.get("faults") or {}).get("gpu_faults")
            mark += f", {faults:,} GPU faults" if faults else ""
            ax.text(max(v, 1.0) * 1.03, y, f"{v:.2f}x{mark}", va="center", fontsize=7)  # clear of the 1.0x line
    ax.set_xscale("log")
    if shown:
        ax.set_xlim(min(0.5, min(shown) * 0.8), max(shown) * 2.2)
    ax.set_yticks([i + 0.4 - h / 2 for i in range(len(names))],
                  [f"{n}\n(cold)" if n in cold else n for n in names])
    ax.invert_yaxis()
    ax.axvline(1.0, color="0.3", ls="--", lw=1)
    ax.set_xlabel("wall time per run, ratio to CuPy's default pool in the same round (median over rounds; log scale)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"Real workloads on {_device_name(report)}", fontsize=10)
    fig.tight_layout()
    return fig


def _timeline_panel(ax, doc: dict, d: int, top: int = 8) -> None:
    """Device ``d``'s live memory over the events of snapshot ``doc``, into ``ax``."""
    from ..sizes import format_size

    evs = [e for e in doc.get("events") or [] if e["device"] == d]
    live, by_origin, peak = {}, {}, {}
    t, series = [], []
    for e in evs:
        key = e.get("origin") or "(origin not recorded)"
        if e["action"] == "alloc":
            live[e["ptr"]] = (e["size"], key)
            by_origin[key] = by_origin.get(key, 0) + e["size"]
        else:
            size, key = live.pop(e["ptr"], (e["size"], key))
            by_origin[key] = by_origin.get(key, 0) - size
        peak[key] = max(peak.get(key, 0), by_origin[key])
        t.append(len(t))
        series.append(dict(by_origin))
    t.append(len(t))  # the state after the last event, drawn for one more step
    series.append(series[-1])
    keys = sorted(peak, key=lambda k: -peak[k])
    shown, rest = keys[:top], keys[top:]
    base = (doc.get("baseline_bytes_in_use") or [0] * (d + 1))[d]
    ys = [[base] * len(t)] + [[s.get(k, 0) for s in series] for k in shown]
    labels = [f"before recording ({format_size(base)})"] + [_short(k) for k in shown]
    if rest:
        ys.append([sum(s.get(k, 0) for k in rest) for s in series])
        labels.append(f"{len(rest)} other origins")
    ax.stackplot(t, [[v / 2**20 for v in y] for y in ys], labels=labels, step="post")
    ax.set_xlabel("event (allocations and frees in order)")
    ax.set_ylabel("live MiB")
    n = "1 event" if len(evs) == 1 else f"{len(evs)} events"
    ax.set_title(f"device {d}: {n} over {evs[-1]['t'] - evs[0]['t']:.3g} s", fontsize=9)
    ax.legend(loc="upper left", fontsize=7, framealpha=0.8)


def _devices_with_events(doc: dict) -> list[int]:
    return sorted({e["device"] for e in doc.get("events") or []})


def _timeline(doc: dict, plt, top: int = 8):
    """Live memory over time from a ``cupy_memstrat.snapshot()``, event by
    event (bursts stay readable), stacked by origin: the ``top`` origins with the highest peak, the rest as "other";
    one panel per device with events. Bytes live before recording began are
    the baseline at the bottom."""
    devices = _devices_with_events(doc)
    if not devices:
        raise _NothingToDraw("nothing to draw: the snapshot holds no allocation or free event (record while the "
                             "code allocates)")
    fig, axes = plt.subplots(len(devices), 1, figsize=(10, 3.6 * len(devices)), squeeze=False)
    for ax, d in zip(axes[:, 0], devices):
        _timeline_panel(ax, doc, d, top)
    s = doc.get("strategy") or {}
    events = doc.get("events") or []
    dropped = f", {doc['dropped']} oldest events dropped" if doc.get("dropped") else ""
    title = f"{doc['title']}\n" if isinstance(doc.get("title"), str) else ""  # the test, from a pytest report
    one = "1 event" if len(events) == 1 else f"{len(events)} events"
    fig.suptitle(f"{title}GPU memory over time, strategy {s.get('name')!r}, {one}{dropped}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_side_by_side(docs: list[tuple[str, dict]], path: str, top: int = 6) -> str:
    """Several ``cupy_memstrat.snapshot()`` timelines side by side, one column
    per ``(name, snapshot)`` (for instance each Dask worker's, from
    :func:`cupy_memstrat.dask.snapshot`), one row per device, on one scale
    of bytes, into ``path`` (its extension picks the format; none: ``.png``).

    Returns:
        str: the path written.

    Raises:
        ValueError: fewer than two snapshots, one that is not a snapshot, or
            one without any allocation or free event (each named).
        RuntimeError: matplotlib is not installed.
    """
    import os

    if len(docs) < 2:
        raise ValueError(f"side by side: expected two or more snapshots, got {len(docs)}")
    for name, doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") != "memory-history":
            raise ValueError(f"{name}: not a cupy_memstrat.snapshot() (its 'kind' is "
                             f"{doc.get('kind') if isinstance(doc, dict) else None!r}, expected 'memory-history')")
        if not _devices_with_events(doc):
            raise ValueError(f"{name}: nothing to draw: the snapshot holds no allocation or free event (record "
                             "while the code allocates: cupy_memstrat.record_history(), or "
                             "MemstratPlugin(..., record_history=True) on Dask workers)")
    if not os.path.splitext(path)[1]:
        path += ".png"
    rows = max(len(_devices_with_events(doc)) for _, doc in docs)
    plt = _pyplot()
    fig, axes = plt.subplots(rows, len(docs), figsize=(6.5 * len(docs), 3.6 * rows), squeeze=False, sharey=True)
    try:
        for col, (name, doc) in enumerate(docs):
            devices = _devices_with_events(doc)
            for row in range(rows):
                ax = axes[row, col]
                if row < len(devices):
                    _timeline_panel(ax, doc, devices[row], top)
                    ax.set_title(f"{name}\n{ax.get_title()}", fontsize=9)
                else:
                    ax.set_visible(False)
        strategies = sorted({str((doc.get("strategy") or {}).get("name")) for _, doc in docs})
        fig.suptitle(f"GPU memory over time, {len(docs)} snapshots side by side, strategy "
                     f"{', '.join(strategies)}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, ArithmeticError) as exc:
        raise ValueError(f"side by side: a snapshot lacks or mangles what the figure needs "
                         f"({type(exc).__name__}: {exc})") from exc
    finally:
        plt.close(fig)
    return path


def _short(origin: str, width: int = 70) -> str:
    return origin if len(origin) <= width else "..." + origin[-(width - 3):]


def _streams(report: dict, plt):
    res = report["results"]
    patterns = [p for p in res if p != "other-reader+checks"]
    allocs = []
    for p in patterns:
        for a in res[p]:
            if a not in allocs:
                allocs.append(a)
    fig, ax = plt.subplots(figsize=(1.5 * len(allocs) + 2.5, 0.5 * len(patterns) + 1.6))
    for i, p in enumerate(patterns):
        for j, a in enumerate(allocs):
            v = res[p].get(a)
            color = "0.85" if v is None else "#55a868" if v == 0 else "#c44e52"
            ax.add_patch(plt.Rectangle((j, i), 0.95, 0.9, color=color))
            ax.text(j + 0.47, i + 0.45, "-" if v is None else "safe" if v == 0 else f"{v:,}", ha="center",
                    va="center", fontsize=8, color="white" if v else "black")
    ax.set_xlim(0, len(allocs))
    ax.set_ylim(len(patterns), 0)
    ax.set_xticks([j + 0.47 for j in range(len(allocs))], allocs, rotation=20, ha="right", fontsize=8)
    ax.set_yticks([i + 0.45 for i in range(len(patterns))], patterns, fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"wrong elements over {report['params']['rounds']} rounds of {report['params']['elements']:,} "
                 "(green: 0, safe)", fontsize=9)
    fig.tight_layout()
    return fig


def _plugin(report: dict, plt):
    """The plugin's cost per test over plain pytest, per setting."""
    cost = report["cost_per_test_seconds"]
    names = list(cost)
    fig, ax = plt.subplots(figsize=(5.5, 0.6 * len(names) + 1.6))
    ax.barh(names, [cost[n] * 1e3 for n in names], color="#4c72b0")
    ax.axvline(report["plain_seconds_per_test"] * 1e3, color="0.5", linestyle="--",
               label="plain pytest's time per test (start-up included)")
    ax.set_xlabel("ms per test over plain pytest (median of rounds)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    p = report["params"]
    ax.set_title(f"pytest_gpumem's cost: {p['tests']} small GPU tests, {p['rounds']} rounds", fontsize=9)
    fig.tight_layout()
    return fig


def _fragmentation(report: dict, plt):
    """Peak reserved over peak in use, per program and path (1.0: nothing reserved beyond use)."""
    programs = list(report["results"])
    labels = list(dict.fromkeys(lb for p in programs for lb in report["results"][p]["paths"]))
    if not programs or not labels:
        raise _NothingToDraw("this fragmentation report has no program or no path to draw")
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(programs) * len(labels) + 1.5))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        ys = [i + j * width for i in range(len(programs))]
        vals = [(report["results"][p]["paths"].get(label) or {}).get("reserved_over_in_use") or 0 for p in programs]
        ax.barh(ys, vals, height=width, label=label)
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:.2f}x", va="center", fontsize=7)
    ax.set_yticks([i + 0.4 - width / 2 for i in range(len(programs))], programs)
    ax.invert_yaxis()
    ax.axvline(1.0, color="0.3", ls="--", lw=1)
    ax.set_xlabel("peak reserved / peak in use")
    ax.set_title(f"Fragmentation on {_device_name(report)}: memory reserved for the same program", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def _replay(report: dict, plt):
    """Reserved memory over the replay, one line per path."""
    rows = [(label, r) for label, r in report["results"].items() if r.get("reserved_curve")]
    if not rows:
        raise _NothingToDraw("this replay report has no reserved-memory curve to draw")
    fig, ax = plt.subplots(figsize=(10, 5))
    for label, r in rows:
        xs = [pt[0] for pt in r["reserved_curve"]]
        ys = [pt[1] / 2**30 for pt in r["reserved_curve"]]
        ax.plot(xs, ys, label=f"{label} (peak {r['peak_reserved'] / 2**30:.2f} GiB)", lw=1.2)
    limit = report["params"].get("limit")
    if limit:
        ax.axhline(limit / 2**30, color="0.3", ls="--", lw=1, label="limit")
    ax.set_xlabel("event of the trace")
    ax.set_ylabel("reserved (GiB)")
    ax.set_title(f"Replay of {report['trace']['source']}: reserved memory per path", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


_PLOTS = {"alloc": _alloc, "async": _async, "managed": _managed, "workloads": _workloads, "streams": _streams,
          "plugin": _plugin,
          "memory-history": _timeline, "fragmentation": _fragmentation, "replay": _replay}


class _NothingToDraw(ValueError):
    """A well-formed report without anything in it to draw."""


def plot(report: dict, path: str) -> str:
    """Draw the figure for a benchmark report (the JSON of ``bench ... --json``),
    or the memory timeline of a ``cupy_memstrat.snapshot()``, into ``path``
    (its extension picks the format; none: ``.png`` is added).

    Returns:
        str: the path written.

    Raises:
        ValueError: no figure exists for this benchmark, or the report lacks
            or mangles what its figure needs (the message names what).
        RuntimeError: matplotlib is not installed.
    """
    import os

    kind = (report.get("benchmark") or report.get("kind")) if isinstance(report, dict) else None
    if not isinstance(kind, str) or kind not in _PLOTS:
        what = (f"benchmark {kind!r}" if isinstance(kind, str) else
                "this JSON (it names no benchmark: expected a 'benchmark' or 'kind' field)")
        raise ValueError(f"no figure for {what}; figures exist for: {', '.join(sorted(_PLOTS))}")
    if not os.path.splitext(path)[1]:
        path += ".png"
    plt = _pyplot()
    try:
        fig = _PLOTS[kind](report, plt)
    except _NothingToDraw as exc:
        plt.close("all")
        raise ValueError(str(exc)) from None
    except (KeyError, IndexError, TypeError, AttributeError, StopIteration, ValueError, ArithmeticError) as exc:
        plt.close("all")
        raise ValueError(f"this {kind} report cannot be drawn: it lacks or mangles what the figure needs "
                         f"({type(exc).__name__}: {exc})") from exc
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
