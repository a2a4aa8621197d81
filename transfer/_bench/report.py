"""Machine description, result table, JSON and plot."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import textwrap
from typing import TYPE_CHECKING, Any, Iterable

from .common import METHOD_LABELS, Limits, Record, fmt_size

if TYPE_CHECKING:
    from rich.console import JustifyMethod
    from rich.table import Table

#: remote: the READ lands bytes in a buffer, as a memcpy does (cma: process_vm_readv).
LIMIT_FOR_MODE = {"local": "limit:memcpy", "compute": "limit:read", "remote": "limit:memcpy"}
BASELINE_COLS = (("shm-pipe", "x shm-pipe"), ("zmq-copy", "x zmq-copy"), ("zmq-zerocopy", "x zmq-0copy"), ("nixl-raw", "x nixl-raw"))


def _has_remote(results: list[Record]) -> bool:
    """The ``x nixl-raw`` column is shown only when a remote baseline ran."""
    return any(r["method"] == "nixl-raw" for r in results)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    for mod in ("numpy", "zmq", "transfer"):
        try:
            m = __import__(mod)
            info[mod if mod != "zmq" else "pyzmq"] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001
            info[mod if mod != "zmq" else "pyzmq"] = None
    try:
        import zmq

        info["libzmq"] = zmq.zmq_version()
    except Exception:  # noqa: BLE001
        pass
    info["gpu"] = nvidia_smi()
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------------- ratios


def _key(r: Record) -> tuple[Any, ...]:
    return (r["mode"], r["size"], r["producers"], r.get("depth"), r.get("batch"))


def add_ratios(results: list[Record], limits: Limits) -> None:
    """Adds ``vs_<baseline>`` and ``vs_limit`` (same run, same size/producers/depth)."""
    by_key: dict[tuple[Any, ...], dict[str, Record]] = {}
    for r in results:
        by_key.setdefault(_key(r), {})[r["method"]] = r
    for r in results:
        peers = by_key[_key(r)]
        for base, _ in BASELINE_COLS:
            b = peers.get(base)
            r[f"vs_{base}"] = r["gbps"] / b["gbps"] if b and b["gbps"] > 0 else None
        lim_name = LIMIT_FOR_MODE.get(r["mode"])
        lim = limits.get(r["size"], {}).get(lim_name) if lim_name else None
        r["limit"] = lim_name
        r["vs_limit"] = r["gbps"] / lim["gbps"] if lim else None


def limit_rows(limits: Limits) -> list[Record]:
    rows = []
    for size, lims in sorted(limits.items()):
        for name, v in lims.items():
            rows.append({"method": name, "mode": "-", "size": size, "producers": 1, "depth": None,
                         "batch": None, "gbps": v["gbps"], "rps": v["rps"], "p50_us": None,
                         "p99_us": None, "reps": v["reps"], "min_gbps": v["min_gbps"],
                         "max_gbps": v["max_gbps"]})
    return rows


# ---------------------------------------------------------------------- table


def _f(x: float | None, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _rps(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _table_rows(results: list[Record], limits: Limits) -> tuple[list[tuple[str, JustifyMethod]], list[list[str] | None]]:
    """The columns, and the rows as text (None: a section break between sizes)."""
    nixl = _has_remote(results)
    cols: list[tuple[str, JustifyMethod]] = [("method", "left"), ("mode", "left"), ("size", "right"), ("P", "right"),
            ("D", "right"), ("GB/s", "right"), ("min-max", "right"), ("req/s", "right"),
            ("p50 µs", "right"), ("p99 µs", "right"), ("x shm-pipe", "right"), ("x zmq-copy", "right"),
            ("x zmq-0copy", "right")]
    if nixl:
        cols.append(("x nixl-raw", "right"))
    cols.append(("x limit", "right"))
    extra = ("-",) if nixl else ()
    rows: list[list[str] | None] = []
    sizes = sorted({r["size"] for r in results} | set(limits))
    for i, size in enumerate(sizes):
        if i:
            rows.append(None)
        for name, v in limits.get(size, {}).items():
            rows.append([f"[dim]{name}[/]", "-", fmt_size(size), "1", "-", f"[dim]{v['gbps']:.2f}[/]",
                         f"[dim]{v['min_gbps']:.1f}-{v['max_gbps']:.1f}[/]", _rps(v["rps"]),
                         "-", "-", "-", "-", "-", *extra, "-"])
        ordered = sorted((r for r in results if r["size"] == size),
                         key=lambda r: (r["mode"], r["producers"], r.get("depth") or 0,
                                        _METHOD_ORDER.get(r["method"], 99)))
        for r in ordered:
            name = r["method"]
            if name == "transfer":
                name = "[bold cyan]transfer[/]"
            b = f" x{r['batch']}" if r.get("batch", 1) > 1 else ""
            rows.append([name, r["mode"], fmt_size(size) + b, str(r["producers"]), str(r.get("depth", "")),
                         f"{r['gbps']:.2f}", f"{r['min_gbps']:.1f}-{r['max_gbps']:.1f}", _rps(r["rps"]),
                         _us(r["p50_us"]), _us(r["p99_us"]), _f(r.get("vs_shm-pipe"), ".2f"),
                         _f(r.get("vs_zmq-copy"), ".2f"), _f(r.get("vs_zmq-zerocopy"), ".2f"),
                         *((_f(r.get("vs_nixl-raw"), ".2f"),) if nixl else ()),
                         _f(r.get("vs_limit"), ".2f")])
    return cols, rows


def render_tables(results: list[Record], limits: Limits, title: str, width: int) -> list[Table]:
    """The results as tables that fit `width` columns with every digit: one table where it
    fits, else the same rows split by column group (throughput, latency, ratios), each with
    the columns that say which cell a row is. Where even that is too wide, the narrowest
    split is printed whole (the terminal wraps; nothing is elided)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    cols, rows = _table_rows(results, limits)
    key, thru, lat = [0, 1, 2, 3, 4], [5, 6, 7], [8, 9]
    ratios = list(range(10, len(cols)))
    layouts = [[list(range(len(cols)))], [key + thru + lat, key + ratios], [key + thru, key + lat, key + ratios],
               [key + thru, key + lat, key + ratios[:2], key + ratios[2:]]]
    measure = Console(width=10_000, highlight=False)
    chosen: list[Table] = []
    for layout in layouts:
        chosen = []
        for k, picks in enumerate(layout):
            t = Table(title=title if k == 0 else None, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                      pad_edge=False, padding=(0, 1, 0, 0))
            for i in picks:
                t.add_column(cols[i][0], justify=cols[i][1], no_wrap=True)
            for row in rows:
                if row is None:
                    t.add_section()
                else:
                    t.add_row(*(row[i] for i in picks))
            chosen.append(t)
        if all(measure.measure(t).maximum <= width for t in chosen):
            break
    return chosen


def render_table(results: list[Record], limits: Limits, title: str) -> Table:
    """The results as one table (whatever its width)."""
    return render_tables(results, limits, title, 10_000)[0]


_COLORS = {"transfer": "tab:red", "transfer-socket": "tab:pink", "torch-mp": "tab:olive", "iceoryx2": "tab:cyan", "zmq-copy": "tab:blue", "zmq-zerocopy": "tab:orange",
           "mp-queue": "tab:green", "mp-pipe": "tab:purple", "shm-pipe": "tab:brown",
           "nixl-raw": "tab:gray"}

_METHOD_ORDER = {m: i for i, m in enumerate(
    ("transfer", "transfer-socket", "shm-pipe", "iceoryx2", "torch-mp", "zmq-copy", "zmq-zerocopy", "mp-queue", "mp-pipe",
     "nixl-raw"))}


def markdown_table(results: list[Record], limits: Limits) -> str:
    """The same table as Markdown (for docs/benchmarks.md)."""
    nixl = _has_remote(results)
    head = ("| method | mode | size | P | D | GB/s | min–max | req/s | p50 µs | p99 µs "
            "| × shm-pipe | × zmq copy | × zmq 0-copy |" + (" × nixl-raw |" if nixl else "") + " × limit |")
    lines = [head, "|" + "---|" * (15 if nixl else 14)]
    extra = " – |" if nixl else ""
    sizes = sorted({r["size"] for r in results} | set(limits))
    for size in sizes:
        for name, v in limits.get(size, {}).items():
            lines.append(f"| *{name}* | – | {fmt_size(size)} | 1 | – | {v['gbps']:.2f} | "
                         f"{v['min_gbps']:.1f}–{v['max_gbps']:.1f} | {_rps(v['rps'])} | – | – | – | – | – |{extra} – |")
        rows = sorted((r for r in results if r["size"] == size),
                      key=lambda r: (r["mode"], r["producers"], r.get("depth") or 0,
                                     _METHOD_ORDER.get(r["method"], 99)))
        for r in rows:
            name = f"**{r['method']}**" if r["method"] == "transfer" else r["method"]
            b = f" ×{r['batch']}" if r.get("batch", 1) > 1 else ""
            lines.append(
                f"| {name} | {r['mode']} | {fmt_size(size)}{b} | {r['producers']} | {r.get('depth')} | "
                f"{r['gbps']:.2f} | {r['min_gbps']:.1f}–{r['max_gbps']:.1f} | {_rps(r['rps'])} | "
                f"{_us(r['p50_us'])} | {_us(r['p99_us'])} | {_f(r.get('vs_shm-pipe'), '.2f')} | {_f(r.get('vs_zmq-copy'), '.2f')} | "
                f"{_f(r.get('vs_zmq-zerocopy'), '.2f')} |"
                + (f" {_f(r.get('vs_nixl-raw'), '.2f')} |" if nixl else "")
                + f" {_f(r.get('vs_limit'), '.2f')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- JSON / plot


def write_json(path: str, machine: Record, config: Record, results: list[Record],
               limits: Limits, notes: list[str], gpu: Record | None = None,
               latency: Record | None = None, share: Record | None = None, registration: Record | None = None) -> None:
    doc = {"machine": machine, "config": config, "notes": notes,
           "results": [_clean(r) for r in results] + limit_rows(limits)}
    if gpu is not None:  # the gpu mode's own rows (_bench.gpu): its methods are not the cells'
        doc["gpu"] = gpu
    if latency is not None:  # the latency mode's round trips (_bench.latency)
        doc["latency"] = latency
    if share is not None:  # the share mode's tenants (_bench.share)
        doc["share"] = share
    if registration is not None:  # the registration mode's costs (_bench.registration)
        doc["registration"] = registration
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _clean(r: Record) -> Record:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}


def write_plot(path: str, results: list[Record], limits: Limits, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib (pip install 'transfer[plot]'): {e}") from None
    modes = [m for m in ("local", "compute", "remote") if any(r["mode"] == m for r in results)] or ["local"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in results if r["mode"] == mode]
        if rows:
            pmax = max(r["producers"] for r in rows)
            depths = sorted({r["depth"] for r in rows if r["producers"] == pmax and r.get("depth") is not None})
            dsel = max(depths) if depths else None
            rows = [r for r in rows if r["producers"] == pmax and r.get("depth") == dsel]
        for m in _METHOD_ORDER:
            pts = sorted((r["size"], r["gbps"], r["min_gbps"], r["max_gbps"]) for r in rows if r["method"] == m)
            if not pts:
                continue
            xs, ys, lo, hi = zip(*pts)
            kw = {"linewidth": 2.8 if m == "transfer" else 1.2, "color": _COLORS.get(m),
                  "zorder": 3 if m == "transfer" else 2}
            ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]],
                        marker="o", markersize=3.5, capsize=2, label=m, **kw)
        lim = LIMIT_FOR_MODE[mode]
        lim_pts = sorted((s, v[lim]["gbps"]) for s, v in limits.items() if lim in v)
        if lim_pts:
            xs, ys = zip(*lim_pts)
            ax.plot(xs, ys, "k--", linewidth=1.5, label=f"{lim} (1 core)")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: fmt_size(int(x)) if x >= 1 else ""))  # 4 KiB, not 2^12
        ax.set_yscale("log")
        ax.set_xlabel("request size")
        ax.set_ylabel("delivered GB/s")
        sub = f"P={pmax}, depth={dsel}" if rows else ""
        ax.set_title(f"mode={mode}  {sub}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best", framealpha=0.8)
    fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe_methods(methods: Iterable[str]) -> list[str]:
    return [f"{m}: {METHOD_LABELS.get(m, m)}" for m in methods]


def load_json(path: str) -> tuple[Record, list[Record], Limits]:
    """(document, results, limits) from a file written by :func:`write_json`."""
    with open(path) as f:
        doc = json.load(f)
    results = [r for r in doc["results"] if not r["method"].startswith("limit:")]
    limits: Limits = {}
    for r in doc["results"]:
        if r["method"].startswith("limit:"):
            limits.setdefault(r["size"], {})[r["method"]] = r
    return doc, results, limits
