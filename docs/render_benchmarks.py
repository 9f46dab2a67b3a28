"""Render the measured tables of docs/benchmarks.md and README.md from the result JSON.

    python docs/render_benchmarks.py            # rewrite the generated blocks in place
    python docs/render_benchmarks.py --check    # exit 1 if a page differs from its JSON

Each GPU kind has one current result set, a folder under docs/results/ (``h200/``): the JSON
that ``ci/gpu.sh bench`` writes (``bench-GROUP.json``, with the GPU, driver and package
versions in ``machine``), and the JSON of the measurements made apart from ``bench``
(``cupy-suite-*.json``, ``plugin-overhead.json``, ``checks-overhead.json``). A generated block
sits between ``<!-- render:NAME -->`` and ``<!-- /render -->`` and is never edited by hand.
The bench tables are the groups' own ``format_table`` output, as ``bench`` prints them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
KIND = "h200"  # the result set the pages show
GROUPS = ("alloc", "async", "managed", "workloads", "streams", "fragmentation", "plugin")
REPLAYS = ("cg-poisson", "cupy-tests", "cupy-tests-limit")
WORKLOAD_COLUMNS = ("pool", "async", "managed", "device")
BLOCK = re.compile(r"(<!-- render:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /render -->)", re.S)


def _kind_of(name: str) -> str:
    """The result set that holds ``name``: the pages' own (KIND), else the one other GPU kind
    that has it (a measurement made only there; its machine line names the GPU)."""
    if (RESULTS / KIND / name).exists():
        return KIND
    found = sorted(p.parent.name for p in RESULTS.glob(f"*/{name}"))
    if not found:
        raise SystemExit(f"docs/results/*/{name}: missing; run the measurement that writes it")
    return found[0]


def _load(name: str) -> dict:
    return json.loads((RESULTS / _kind_of(name) / name).read_text())


def _link(name: str, page: Path) -> str:
    kind = _kind_of(name)
    rel = Path("results") / kind / name if page.parent.name == "docs" else Path("docs/results") / kind / name
    return f"[{name}]({rel.as_posix()})"


def machine_line(doc: dict) -> str:
    m = doc["machine"]
    cuda = m.get("cuda") or {}
    names = [d.get("name", "?") for d in cuda.get("devices", [])]
    gpus = f"{len(names)} x {names[0]}" if len(set(names)) == 1 and len(names) > 1 else ", ".join(names) or "?"
    p = m.get("packages", {})
    runtime = cuda.get("runtime")
    rt = f"{runtime // 1000}.{runtime % 1000 // 10}" if isinstance(runtime, int) else "?"
    return (f"{gpus}, driver {cuda.get('kernel_driver', '?')}, CUDA runtime {rt}; CuPy {p.get('cupy')}, "
            f"cupy-memstrat {p.get('cupy_memstrat')}, Python {p.get('python')}; {m.get('date', '?')[:10]}")


def bench_table(group: str, page: Path, name: str | None = None) -> str:
    """A ``bench GROUP`` table from ``name`` (default ``bench-GROUP.json``), as the command prints it."""
    from cupy_memstrat.bench import alloc, async_pool, fragmentation, managed, plugin, streams, workloads

    fmt = {"alloc": alloc, "async": async_pool, "managed": managed, "workloads": workloads,
           "streams": streams, "fragmentation": fragmentation, "plugin": plugin}[group].format_table
    name = name or f"bench-{group}.json"
    doc = _load(name)
    return (f"Measured on {machine_line(doc)} ({_link(name, page)}):\n\n"
            f"```text\n{fmt(doc).rstrip()}\n```\n")


def workloads_table(page: Path) -> str:
    """Workloads x strategies: each strategy's time over CuPy's pool's in the same round (the
    median over rounds); "identical" where every result equals CuPy's pool's bit for bit."""
    doc = _load("bench-workloads.json")
    res = doc["results"]
    head = "| workload | " + " | ".join(f"`{c}`" for c in WORKLOAD_COLUMNS) + " | results |"
    lines = [head, "|---" * (len(WORKLOAD_COLUMNS) + 2) + "|"]
    for name, paths in res.items():
        cells = []
        for c in WORKLOAD_COLUMNS:
            r = paths.get(c)
            cells.append(f"{r['ratio_in_rounds']['median']:.2f}x" if r else "-")
        checks = [p.get("check", {}) for k, p in paths.items() if k != "cupy-default"]
        same = all(c.get("identical") for c in checks if c)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'identical' if same else 'differ'} |")
    a = doc["params"]["rounds"]
    return ("\n".join(lines) + f"\n\nTime over CuPy's own pool's time in the same round (median of {a} rounds; "
            f"below 1 is faster). {machine_line(doc)} ({_link('bench-workloads.json', page)}).\n")


def cupy_suite_table(page: Path) -> str:
    # outcomes only: in these sessions CuPy's pool ran first, with a cold kernel cache, so the
    # JSON's time ratios are not the strategies' cost (bench workloads measures that)
    rows = ["| strategy | CuPy tests | outcomes |", "|---|---|---|"]
    names = sorted({p.name for p in RESULTS.glob("*/cupy-suite*.json")})  # a strategy measured on one kind only too
    for name in names:
        doc = _load(name)
        for key, c in doc["compare"].items():
            cand = c["candidate"]
            suite = "creation + manipulation" if key.startswith("cm_") else "cuda_tests/test_memory.py"
            strategy = key.split("-", 1)[1]
            if strategy == "default":
                continue  # CuPy's pool against itself (a cold kernel cache): the JSON keeps it
            if c["same_outcomes"]:
                outcome = f"{cand['passed']} passed, {cand['failed']} failed: the same tests as under CuPy's pool"
            else:
                new = [t.rsplit("::", 1)[-1] for t in c["new_failures"]]
                outcome = (f"{cand['passed']} passed, {cand['failed']} failed: {len(new)} fail that pass under "
                           f"CuPy's pool ({', '.join(new)})")
            rows.append(f"| `{strategy}` | {suite} | {outcome} |")
    by_machine: dict[str, list[str]] = {}
    for name in names:
        by_machine.setdefault(machine_line(_load(name)), []).append(_link(name, page))
    where = "; ".join(f"{m} ({', '.join(links)})" for m, links in by_machine.items())
    return "\n".join(rows) + f"\n\nCuPy's own tests, CuPy's pool run in the same session: {where}.\n"


def overhead_table(page: Path) -> str:
    plugin, checks = _load("plugin-overhead.json"), _load("checks-overhead.json")
    p, c = plugin["ratio_to_plain_all_rounds"], checks["ratio_to_unchecked_both_rounds"]
    rows = ["| pytest run of CuPy's creation + manipulation tests | wall time over the baseline |", "|---|---|",
            f"| `--gpumem --gpumem-budget=64GiB --gpumem-leaks=fail`, over plain pytest | {p['measure']:.2f}x |",
            f"| the same with `--gpumem-faults`, over plain pytest | {p['faults']:.2f}x |",
            f"| `--gpumem-check=streams`, over the measured run without checks | {c['streams']:.2f}x |",
            f"| `--gpumem-check=all`, over the measured run without checks | {c['all']:.2f}x |"]
    return "\n".join(rows) + (f"\n\nMedians of the rounds of one session each, with pytest-xdist -n 8: "
                              f"{machine_line(plugin)} ({_link('plugin-overhead.json', page)}); "
                              f"{machine_line(checks)} ({_link('checks-overhead.json', page)}).\n")


RENDER = {f"bench-{g}": (lambda g: lambda page: bench_table(g, page))(g) for g in GROUPS}
def replay_table(name: str, page: Path) -> str:
    from cupy_memstrat.replay import format_table

    doc = _load(f"replay-{name}.json")
    return (f"Measured on {machine_line(doc)} ({_link(f'replay-{name}.json', page)}):\n\n"
            f"```text\n{format_table(doc).rstrip()}\n```\n")


RENDER |= {f"replay-{r}": (lambda r: lambda page: replay_table(r, page))(r) for r in REPLAYS}
def _measuring(names: tuple[str, ...], has) -> tuple[str, str, dict]:
    """``(kind, name, doc)``: the first of ``names`` in the result set whose run measured what
    ``has(doc)`` asks for, the pages' own set first (a strategy newer than a set's last run of
    a group is not in its JSON; a run of that strategy alone beside CuPy's pool is in
    ``bench-GROUP-STRATEGY.json``)."""
    kinds = [KIND] + sorted(p.name for p in RESULTS.iterdir() if p.is_dir() and p.name != KIND)
    for kind in kinds:
        for name in names:
            f = RESULTS / kind / name
            if f.exists():
                doc = json.loads(f.read_text())
                if has(doc):
                    return kind, name, doc
    raise SystemExit(f"docs/results/*/{' or '.join(names)}: none has the path measured; run the measurement")


def strategy_summary(path: str, page: Path) -> str:
    """One strategy beside CuPy's pool (``cupy-default``) in each measurement that has it:
    bench alloc, bench fragmentation, bench workloads and the replay under a limit."""
    from cupy_memstrat.sizes import format_size

    rows = [f"| measurement | `{path}` | CuPy's pool |", "|---|---|---|"]
    sources = {}

    def src(name, has):
        group = name[:-len(".json")]
        kind, name, doc = _measuring((name, f"{group}-{path}.json"), has)
        rel = Path("results") / kind / name if page.parent.name == "docs" else Path("docs/results") / kind / name
        sources.setdefault(machine_line(doc), []).append(f"[{name}]({rel.as_posix()})")
        return doc

    a = src("bench-alloc.json", lambda d: path in d["results_us"])
    us = a["results_us"]
    for size, label in (("512", "512 B"), ("1048576", "1 MiB"), ("33554432", "32 MiB")):
        mine, base = us[path][size]["median_us"], us["cupy-default"][size]["median_us"]
        rows.append(f"| bench alloc: allocate and free a cached {label} block | {mine:.2f} us "
                    f"({mine / base:.2f}x) | {base:.2f} us |")
    r = a["ratio_to_cupy_default"][path]["temporaries"]
    rows.append(f"| bench alloc: 30 temporaries, then a synchronisation | {r:.2f}x | 1.00x |")
    f = src("bench-fragmentation.json", lambda d: all(path in p["paths"] for p in d["results"].values()))
    for prog, p in f["results"].items():
        mine, base = p["paths"][path], p["paths"]["cupy-default"]
        rows.append(f"| bench fragmentation, {prog}: peak reserved / peak in use | "
                    f"{mine['reserved_over_in_use']:.2f}x | {base['reserved_over_in_use']:.2f}x |")
    w = src("bench-workloads.json", lambda d: all(path in p for p in d["results"].values()))
    for prog, p in w["results"].items():
        mine = p[path]
        same = "results identical" if mine.get("check", {}).get("identical") else "results differ"
        rows.append(f"| bench workloads, {prog}: time over CuPy's pool's | "
                    f"{mine['ratio_in_rounds']['median']:.2f}x, {same} | 1.00x |")
    rp = src("replay-cupy-tests-limit.json", lambda d: path in d["results"])
    limit = rp["params"]["limit"]
    for_path = rp["results"][path]
    base = rp["results"].get("cupy-default")

    def fits(row):
        return "-" if row is None else (f"fits ({format_size(row['peak_reserved'])} reserved)" if row["fits"]
                                        else f"does not fit ({format_size(row['peak_reserved'])} reserved)")
    rows.append(f"| replay of CuPy's test_basic.py under a limit of {format_size(limit)} | {fits(for_path)} | "
                f"{fits(base)} |")
    where = "; ".join(f"{m} ({', '.join(links)})" for m, links in sources.items())
    return "\n".join(rows) + f"\n\nEach row's two figures come from one run. {where}.\n"


RENDER |= {"expandable-summary": lambda page: strategy_summary("expandable", page)}
# expandable with and without remap, beside CuPy's pool (bench workloads / fragmentation --strategies)
RENDER |= {f"bench-{g}-remap": (lambda g: lambda page: bench_table(g, page, f"bench-{g}-remap.json"))(g)
           for g in ("workloads", "fragmentation")}
RENDER |= {"workloads-summary": workloads_table, "cupy-suite": cupy_suite_table, "overhead": overhead_table}
PAGES = (ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "expandable.md", ROOT / "docs" / "pytest.md",
         ROOT / "README.md")


def render(text: str, page: Path) -> str:
    def one(m):
        name = m.group("name")
        if name not in RENDER:
            raise SystemExit(f"{page}: unknown generated block {name!r}; expected one of {', '.join(RENDER)}")
        return m.group(1) + RENDER[name](page) + m.group(4)

    return BLOCK.sub(one, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page differs from its JSON; change nothing")
    args = ap.parse_args(argv)
    stale = []
    for page in PAGES:
        old = page.read_text()
        new = render(old, page)
        if new != old:
            stale.append((page.relative_to(ROOT) if page.is_relative_to(ROOT) else page).as_posix())
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"out of date with docs/results/{KIND}/: {', '.join(stale)} (run python docs/render_benchmarks.py)",
              file=sys.stderr)
        return 1
    if args.check:
        print("the benchmark tables match the JSON under docs/results/ they are rendered from")
    else:
        print("rendered: " + (", ".join(stale) if stale else "nothing changed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
