"""The results tables of docs/benchmarks.md, generated from bench/results/ so they cannot drift.

    python bench/results_doc.py            # rewrite the generated sections in place
    python bench/results_doc.py --check    # exit 1 if the page differs from what the files give

The page holds sections between `<!-- generated: NAME -->` and `<!-- end generated -->`;
each NAME is a function of the recorded files below (one results set per machine class:
`cpu-2vcpu/`, `gpu-h100/`, `gpu-h200/`). Everything else on the page is written by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transfer._bench import report  # noqa: E402
from transfer._bench.common import fmt_size  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
_SECTION = re.compile(r"(<!-- generated: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def _load(rel: str) -> dict[str, Any]:
    return json.loads((RESULTS / rel).read_text())


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _machine(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    bits = [str(m[k]) for k in ("cpu", "python", "numpy") if m.get(k)]
    cores = m.get("cores")
    return ", ".join(([f"{cores} cores"] if cores else []) + bits)


# --- the CPU machine class ---------------------------------------------------------------------
def quick() -> str:
    doc = _load("cpu-2vcpu/quick.json")
    results, limits = report.load_json(str(RESULTS / "cpu-2vcpu/quick.json"))[1:]
    c = doc.get("config", {})
    lines = [f"`transfer-bench` (the quick run: {c.get('reps')} repetitions of {c.get('rep_seconds')} s per cell, "
             f"every group verified; {_machine(doc)}): GB/s delivered by each method, two producers, 4 groups in "
             f"flight (the whole table, with requests/s, latencies and spreads: `bench/results/cpu-2vcpu/quick.md`).", "",
             _pivot(results, limits)]
    lat = doc.get("latency")
    if lat:
        rows = [[f"`{m}`", f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}"] for m, r in lat["rows"].items()]
        lines += ["", "One 64 B request at a time (its round trip, µs):", "", _table(["method", "p50", "p99"], rows)]
    return "\n".join(lines)


def _pivot(results: list[dict[str, Any]], limits: dict[int, Any]) -> str:
    """One row per cell (mode, size): each method's GB/s, transfer's against the best other
    method, and the memcpy limit."""
    methods = list(dict.fromkeys(r["method"] for r in results))
    cells: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        cells.setdefault((r["mode"], r["size"]), {})[r["method"]] = r["gbps"]
    head = ["mode", "size", *[f"`{m}`" for m in methods], "transfer ÷ best other", "memcpy limit"]
    rows = []
    for (mode, size), got in cells.items():
        others = [v for m, v in got.items() if m != "transfer"]
        best = max(others) if others else 0
        lim = limits.get(size, {}).get("limit:memcpy", {}).get("gbps")
        rows.append([mode, fmt_size(size), *[f"{got[m]:.2f}" if m in got else "–" for m in methods],
                     f"{got['transfer'] / best:.2f}x" if best and "transfer" in got else "–", f"{lim:.2f}" if lim else "–"])
    return _table(head, rows)


def graphs_cpu() -> str:
    return _graphs("cpu-2vcpu/graphs.json")


def sharing() -> str:
    doc = _load("cpu-2vcpu/sharing.json")
    out = []
    share = doc.get("share")
    if share:
        cfg = share["config"]
        rows = [[r["method"], f"{r['pipelines_per_s']:,.0f}", f"{r['vs_processes']:.2f}x", f"{r['fairness']:.3f}",
                 ", ".join(f"{x:,.0f}" for x in r["tenant_per_s"])] for r in share["rows"]]
        lat = share["latency"]
        out += [f"`transfer-bench --modes share`: {cfg['tenants']} tenants on one {cfg['device'].upper()}, each copying "
                f"{cfg['batch']}x{cfg['mlp'][0]} float32 to the device, normalizing and running an MLP "
                f"{'->'.join(map(str, cfg['mlp']))}, {cfg['depth']} batches in flight.", "",
                _table(["method", "pipelines/s", "vs processes", "fairness (Jain)", "per tenant"], rows), "",
                f"A {lat['bytes']} B copy, one at a time: p50 {lat['alone']['p50_us']:.1f} µs, p99 {lat['alone']['p99_us']:.1f} µs "
                f"alone; p50 {lat['beside_bulk']['p50_us']:.1f} µs, p99 {lat['beside_bulk']['p99_us']:.1f} µs beside a tenant "
                f"streaming {fmt_size(lat['bulk_bytes'])} copies ({lat['bulk_gbps']:.2f} GB/s)."]
    reg = doc.get("registration")
    if reg:
        rows = [[fmt_size(r["size"]), f"{r['raw_register_us']:,.0f}", f"{r['raw_deregister_us']:,.0f}", f"{r['register_us']:,.0f}",
                 f"{r['free_us']:,.0f}", f"{r['freed_us']:,.0f}" if "freed_us" in r else "–", f"{r['register_vs_raw']:.2f}x",
                 f"{r['again_us']:.1f}", f"{r['again_free_us']:.1f}",
                 f"{r['first_copy_us']:,.0f}" if "first_copy_us" in r else "–", f"{r['copy_us']:,.0f}" if "copy_us" in r else "–"]
                for r in reg["rows"]]
        out += ["", "`transfer-bench --modes registration` (median µs, tcp loopback): a producer's memory made a remote "
                "segment and let go, against NIXL's own registration; `free` returns once the Unregister is sent, "
                "`freed` is until the daemon's answer is read and the registration goes; `again`: the same memory registered while it is; "
                "`first copy`: a 4 KiB copy out of the new segment, which the daemon maps on its way (the registration "
                "travels with it), and `copy` the same copy again.", "",
                _table(["size", "NIXL register", "NIXL deregister", "register_remote", "free", "freed", "vs NIXL", "again", "again free",
                        "first copy", "copy"], rows)]
    return "\n".join(out) + "\n\nFile: `bench/results/cpu-2vcpu/sharing.json`."


# --- the GPU machine classes ------------------------------------------------------------------
def _gpu(rel: str) -> str:
    doc = _load(rel)
    g = doc["gpu"]
    dev = g["device"]
    methods = list(dict.fromkeys(r["method"] for r in g["rows"]))
    cells: dict[tuple[str, int, int], dict[str, str]] = {}
    for r in g["rows"]:
        fig = f"{r['gbps']:.2f}" if "gbps" in r else f"{r['p50_us']:.1f} / {r['p99_us']:.1f} µs"
        if r.get("vs_pinned") is not None and r["method"] != "cupy-pinned":
            fig += f" ({r['vs_pinned']:.2f}x)"
        cells.setdefault((r["part"], r["producers"], r["size"]), {})[r["method"]] = fig
    rows = [[part, str(p), fmt_size(size), *[got.get(m, "–") for m in methods]] for (part, p, size), got in cells.items()]
    return "\n".join([f"{dev['gpu']}, driver {dev['nvidia_smi'].split(', ')[1] if dev.get('nvidia_smi') else '?'}, "
                      f"CUDA runtime {dev['runtime_version']}, CuPy {dev['cupy']}, {dev['cpu_count']} CPUs "
                      f"(`transfer-bench --modes gpu`; file `bench/results/{rel}`): GB/s, and in brackets against "
                      "CuPy's copy from pinned memory; the latency part: one 64 B copy, p50 / p99.", "",
                      _table(["part", "producers", "size", *[f"`{m}`" for m in methods]], rows)])


def _graphs(rel: str) -> str:
    doc = _load(rel)
    rows = [[str(r["batch"]), f"{r['daemon_per_s']:,.0f}", f"{r['in_process_per_s']:,.0f}", f"{r['daemon_vs_in_process']:.2f}x"]
            for r in doc.get("mlp", [])]
    out = [f"`bench/graphs.py` ({doc['machine'].get('backend', '?')}, BLAS threads {doc['machine'].get('blas_threads', '?')}; "
           f"file `bench/results/{rel}`): the MLP 256 -> 512 -> 512 -> 10 through the daemon against the same math in-process.", "",
           _table(["batch", "daemon runs/s", "in-process runs/s", "ratio"], rows)]
    if doc.get("images"):
        irows = [[str(r["images"]), str(r["size"]), f"{r['daemon_per_s']:,.0f}", f"{r['in_process_per_s']:,.0f}",
                  f"{r['daemon_vs_in_process']:.2f}x"] for r in doc["images"]]
        out += ["", "Image preprocessing (flip, normalize to float32 NCHW), images/s:", "",
                _table(["images", "size", "daemon", "in-process", "ratio"], irows)]
    if doc.get("latency"):
        lrows = [[r["request"], f"{r['daemon_p50_us']:.1f}", f"{r['daemon_p99_us']:.1f}"] for r in doc["latency"]]
        out += ["", "One request at a time (µs): a 64-float compute and a 64 B copy:", "", _table(["request", "p50", "p99"], lrows)]
    return "\n".join(out)


def remote() -> str:
    rel = "cpu-2vcpu/remote.json"
    doc = _load(rel)
    rows = [[fmt_size(r["size"]), f"{r['transfer_latency_us']:,.0f} µs", f"{r['raw_latency_us']:,.0f} µs", f"{r['latency_ratio']:.2f}x",
             str(r["burst"]), f"{r['transfer_stream_gbps']:.2f}", f"{r['raw_stream_gbps']:.2f}", f"{r['stream_ratio']:.2f}x"]
            for r in doc["results"]]
    out = [f"Remote copies against raw NIXL, `{doc['command'].strip()}` (tcp control on loopback, NIXL READs by the daemon, `UCX_TLS` "
           f"{doc.get('ucx_tls') or 'unset: cma'}; median of {doc['reps']}; ratio: raw time / transfer time; file "
           f"`bench/results/{rel}`): one copy at a time, and a burst of copies in one frame (raw: one READ per copy).", "",
           _table(["size", "transfer, one copy", "raw READ", "ratio", "burst", "transfer GB/s", "raw GB/s", "ratio"], rows)]
    rt = doc.get("round_trip_64B")
    if rt:
        def pp(k: str) -> str:
            return f"p50 {rt[k]['p50_us']:.1f} µs, p99 {rt[k]['p99_us']:.1f} µs"
        names = {"transfer_copy": "a copy between daemon buffers, on the session's data channel (its worker serves it)",
                 "transfer_copy_socket": "the same copy from a session without one (`ring=False`: the control socket)",
                 "transfer_read": "a READ of the producer's 64 B (the control socket: the loop posts NIXL)",
                 "pyzmq_reqrep": "pyzmq's own REQ/REP echo on loopback tcp",
                 "python_tcp": "a channel candidate: plain TCP echo, Python at both ends",
                 "nixl_notif": "a channel candidate: NIXL notifications echoed, polled from Python"}
        parts = "; ".join(f"{names[k]}: {pp(k)}" for k in names if k in rt)
        out += ["", f"64 B, one request at a time, all in the same rounds: {parts}. pyzmq's p50 over the data channel's "
                    f"copy p50: {rt['copy_vs_pyzmq']:.2f}x."]
    return "\n".join(out)


def gpu_h100() -> str:
    return _gpu("gpu-h100/gpu-mode.json") + "\n\n" + _graphs("gpu-h100/graphs.json")


def gpu_h200() -> str:
    return _gpu("gpu-h200/gpu-mode-python-pass.json") + "\n\n" + _graphs("gpu-h200/graphs-python-pass.json")


SECTIONS: dict[str, Callable[[], str]] = {
    "quick": quick, "graphs-cpu": graphs_cpu, "sharing": sharing, "remote": remote, "gpu-h100": gpu_h100, "gpu-h200": gpu_h200,
}


def render(page: str) -> str:
    """The page with every generated section rewritten from the files."""
    def one(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in SECTIONS:
            raise SystemExit(f"docs/benchmarks.md: no generator for section {name!r} (have {', '.join(SECTIONS)})")
        return m.group(1) + SECTIONS[name]().rstrip("\n") + "\n" + m.group(4)

    return _SECTION.sub(one, page)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not what the files give (change nothing)")
    a = ap.parse_args(argv)
    page = PAGE.read_text()
    new = render(page)
    if a.check:
        if new != page:
            print("docs/benchmarks.md is stale: run python bench/results_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(new.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
