"""``transfer-bench``: measure transfer against pyzmq, multiprocessing, iceoryx2, torch and hand-rolled shm.

    transfer-bench                 quick run (< 60 s): embedded daemon, 2 producer
                                   processes, 4 KiB (requests/s), 64 KiB, 1 MiB, 64 MiB,
                                   transfer vs hand-rolled shm, iceoryx2, torch.multiprocessing,
                                   pyzmq copy/zero-copy and the physical limits
    transfer-bench full            the sweep: 4 KiB..256 MiB, producers 1..N, depth,
                                   modes local/compute/remote/gpu/latency/share/registration (remote:
                                   NIXL; gpu: CuPy; skipped when unavailable), every baseline
    transfer-bench --modes gpu     host-to-device from a registered segment vs CuPy
                                   pinned and pageable copies, then 2 producers + compute
    transfer-bench --modes share   tenants sharing one device through one daemon (a
                                   copy, a normalize and an MLP per batch) against a
                                   process each; a latency tenant beside a bulk one
    transfer-bench --modes registration
                                   a producer's memory made a remote segment and let go,
                                   1 MiB..4 GiB, against NIXL's own registration
    transfer-bench --json r.json --plot r.png

Every method does the same work: producers (separate processes) write fresh
contents into each batch; the consumer copies the bytes into a device buffer
and checksums them (for ``transfer`` the daemon does both, reading the
producer's shared memory in place). ``remote`` mode: the producer's own
(non-shared) memory is registered with NIXL; the daemon READs it
(``transfer``) or a consumer process does (``nixl-raw``, the baseline).
Exit status: 0 measured, every check passed; 1 a check failed during the run
(a checksum mismatch); 2 nothing was run: bad arguments, or nothing asked for
can run here (every mode in --modes unavailable, e.g. gpu without a GPU;
--plot without matplotlib), found before measuring; 130 interrupted. An
unavailable mode beside others that run is skipped with a note. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from .._version import __version__

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from transfer._bench.common import Cell, Limits, Record


def _at_least(lo: float, kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` that is at least `lo` (refused before anything runs)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not value >= lo:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {lo}")
        return value

    parse.__name__ = kind.__name__  # (argparse names the type in its errors)
    return parse


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="transfer-bench",
        description="Benchmark transfer against hand-rolled shared memory, iceoryx2, torch.multiprocessing, pyzmq and multiprocessing.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Sizes accept K/M/G suffixes (binary), lists (4K,1M) and ranges in powers of 4 (4K..256M).",
    )
    p.add_argument("preset", nargs="?", choices=("quick", "full"), default="quick",
                   help="quick (default: about a minute, longer with the optional baselines installed) or full sweep (tens of minutes)")
    p.add_argument("--sizes", help="request sizes (quick: 4K,64K,1M,64M; full: 4K..256M)")
    p.add_argument("--producers", help="N (sweep 1..N in full, exactly N in quick) or a list like 1,2,4; "
                   "the share mode's tenants: the largest (default 4)")
    p.add_argument("--depth", help="groups in flight per producer, or a list (default 4)")
    p.add_argument("--batch", type=_at_least(1, int), help="requests per group (default: 64 for 4 KiB, 256 KiB/size, >= 1)")
    p.add_argument("--modes", help="local,compute,remote,gpu,latency,share,registration (quick: local,latency; full: all, unavailable skipped)")
    p.add_argument("--methods", help="transfer,transfer-socket,shm-pipe,iceoryx2,torch-mp,zmq-copy,zmq-zerocopy,mp-queue,mp-pipe,"
                                     "nixl-raw (remote mode: transfer and nixl-raw only; nixl-raw: remote only; skipped with a note "
                                     "when not installed: iceoryx2 (pip install 'transfer[bench]'), torch-mp (PyTorch))")
    p.add_argument("--verify-every", type=_at_least(1, int), help="verify every Nth group (quick: 1 = all; full: 8)")
    p.add_argument("--reps", type=_at_least(1, int), help="measured repetitions per cell (quick: 5, full: 3)")
    p.add_argument("--rep-seconds", type=_at_least(0.01, float), help="duration of one repetition (quick: 0.3, full: 0.4)")
    p.add_argument("--warmup-seconds", type=_at_least(0.0, float), help="warm-up repetition, excluded (default 0.15)")
    p.add_argument("--json", metavar="PATH", help="write machine description and results as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot throughput vs size (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    p.add_argument("--daemon-shm-dir", help=argparse.SUPPRESS)  # tests: where the daemon puts segments
    p.add_argument("--inject-corruption", type=int, default=-1, help=argparse.SUPPRESS)  # tests
    p.add_argument("--no-progress", action="store_true", help="plain progress lines even on a TTY")
    p.add_argument("--version", action="version", version=f"transfer-bench {__version__}")
    return p


def _int_list(text: str, *, sweep: bool, flag: str) -> list[int]:
    """N (1..N when `sweep`), a list like 1,2,4, or a range like 1..4: positive whole numbers."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            out = list(range(lo, hi + 1))
        elif "," in text:
            out = [int(x) for x in text.split(",") if x.strip()]
        else:
            n = int(text)
            out = list(range(1, n + 1)) if sweep else [n]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"{flag} {text!r}: expected N, a list like 1,2,4 or a range like 1..4 (whole numbers >= 1)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:
        print("transfer-bench: interrupted", file=sys.stderr)
        return 130


def _main(args: argparse.Namespace) -> int:
    t_wall = time.perf_counter()
    from transfer._bench import common, report, runner
    from transfer._bench.common import BenchFailure, Cell, fmt_size

    full = args.preset == "full"
    try:
        sizes = common.parse_sizes(args.sizes or ("4K..256M" if full else "4K,64K,1M,64M"))
        cores = os.cpu_count() or 2
        producers = _int_list(args.producers or (str(min(4, max(2, cores))) if full else "2"), sweep=full, flag="--producers")
        depths = _int_list(args.depth or "4", sweep=False, flag="--depth")
        modes = [m.strip() for m in (args.modes or ("local,compute,remote,gpu,latency,share,registration" if full else "local,latency")).split(",")]
        default_methods = list(common.METHODS_ALL if full else common.METHODS_QUICK)
        if "remote" in modes and "nixl-raw" not in default_methods:
            default_methods.append("nixl-raw")  # the remote mode's baseline
        methods = [m.strip() for m in (args.methods or ",".join(default_methods)).split(",")]
    except ValueError as e:
        print(f"transfer-bench: {e}", file=sys.stderr)
        return 2
    for m in methods:
        if m not in common.METHODS_ALL:
            print(f"transfer-bench: unknown method {m!r} (choose from {', '.join(common.METHODS_ALL)})",
                  file=sys.stderr)
            return 2
    for m in modes:
        if m not in common.MODES_ALL:
            print(f"transfer-bench: unknown mode {m!r} (choose from {', '.join(common.MODES_ALL)})", file=sys.stderr)
            return 2
    if any(x < 1 for x in producers + depths) or (args.batch is not None and args.batch < 1):
        print("transfer-bench: producers, depth and batch must be >= 1", file=sys.stderr)
        return 2
    verify_every = args.verify_every or (8 if full else 1)
    reps = args.reps or (3 if full else 5)
    rep_s = args.rep_seconds or (0.4 if full else 0.3)
    warm_s = args.warmup_seconds if args.warmup_seconds is not None else 0.15

    notes: list[str] = []
    for m in list(methods):
        ok, why = common.method_available(m)
        if not ok:
            methods.remove(m)
            notes.append(why)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            print(f"transfer-bench: --plot needs matplotlib ({e}): pip install 'transfer[plot]', or drop --plot "
                  "(nothing was measured)", file=sys.stderr)
            return 2
    run_modes = []
    for m in modes:
        ok, why = runner.mode_available(m)
        if ok:
            run_modes.append(m)
        else:
            notes.append(f"skipped mode {why}")
    uses_daemon = any(m.startswith("transfer") for m in methods)
    if uses_daemon:
        ok, why = runner.transfer_available()
        if not ok:
            print(f"transfer-bench: cannot benchmark transfer: {why}\n"
                  "(use --methods to run only the baselines)", file=sys.stderr)
            return 2
    cks, cks_name = common.get_checksum()

    gpu_sizes = [s for s in sizes if s >= 64 << 10] if args.sizes else common.parse_sizes("64K..256M")
    own_modes = {"gpu", "latency", "share", "registration"}  # their own methods: _bench.gpu, .latency, .share, .registration
    cell_modes = [m for m in run_modes if m not in own_modes]
    cells = [Cell(method=m, mode=mode, size=s, producers=p, depth=d,
                  batch=args.batch or common.default_batch_items(s), verify_every=verify_every,
                  corrupt_group=args.inject_corruption)
             for s in sizes for mode in cell_modes for p in producers for d in depths for m in methods
             if common.method_runs_in(m, mode)]
    for mode in cell_modes:
        left_out = [m for m in methods if not common.method_runs_in(m, mode)]
        if left_out and args.methods:
            notes.append(f"mode {mode}: not run for {', '.join(left_out)} "
                         f"(remote runs {', '.join(common.METHODS_REMOTE)}; nixl-raw is remote only)")
    if "nixl-raw" in methods and "remote" not in run_modes and args.methods:
        notes.append("method nixl-raw: runs in remote mode only, which is not in this run")

    if not cells and not own_modes & set(run_modes):
        # Every mode asked for is unavailable here (or has no method): exiting 0 with an
        # empty table would read as success.
        why = "; ".join(notes) or "no mode has a method to run"
        print(f"transfer-bench: nothing to measure: {why}", file=sys.stderr)
        return 2
    progress = _Progress(len(cells), len(sizes), plain=args.no_progress or not sys.stderr.isatty())
    for n in notes:
        progress.line(f"note: {n}")
    results: list[Record] = []
    limits: Limits = {}
    from transfer._bench.limits import measure_limits

    with progress:
        for s in sizes if cells else []:
            progress.start_limit(s)
            limits[s] = measure_limits(s, cks, budget_s=0.3 if not full else 0.5)
            lm = limits[s]
            progress.line(f"limits {fmt_size(s):>8}: memcpy {lm['limit:memcpy']['gbps']:.2f} GB/s, "
                          f"read {lm['limit:read']['gbps']:.2f} GB/s, checksum {lm['limit:checksum']['gbps']:.2f} GB/s",
                          advance_limit=True)
        try:
            daemon_args = {"shm_dir": args.daemon_shm_dir} if args.daemon_shm_dir else {}
            with runner.Runner(need_daemon=uses_daemon and bool(cells), reps=reps, rep_s=rep_s,
                               warmup_s=warm_s, daemon_args=daemon_args,
                               tcp=any(c.mode == "remote" for c in cells)) as rn:
                for cell in cells:
                    progress.start_cell(cell)
                    r = rn.run_cell(cell, on_rep=progress.rep)
                    results.append(r)
                    progress.line(f"{cell.describe()}: {r['gbps']:7.3f} GB/s  {r['rps']:11,.0f} req/s  "
                                  f"p50 {r['p50_us']:9,.0f} µs  p99 {r['p99_us']:9,.0f} µs", advance_cell=True)
            gpu_result = lat_result = share_result = reg_result = None
            if "latency" in run_modes:
                from transfer._bench import latency

                from transfer.testing import run_daemon

                # With --methods, the latency mode runs those it has (and the async clients with transfer).
                wanted = set(methods) | ({"transfer-trio", "transfer-asyncio"} if "transfer" in methods else set())
                lat_methods = [m for m in latency.METHODS
                               if (not args.methods or m in wanted) and common.method_available(m)[0]]
                with run_daemon(common.HOST_DAEMON_ARGS, **daemon_args) as d:
                    lat_result = latency.run(lat_methods, d.endpoint, line=progress.line)
                notes.extend(lat_result["skipped"])
            if "gpu" in run_modes:
                from transfer._bench import gpu

                # gpu mode: --verify-every N checks N slots after each repetition (default 16),
                # untimed, so that no check drains the pipeline the baselines keep full.
                gpu_result = gpu.run(gpu_sizes, depth=depths[0] if args.depth else 8, reps=reps, rep_s=rep_s,
                                     verify_slots=args.verify_every or 16, line=progress.line, daemon_args=daemon_args)
            if "share" in run_modes:
                from transfer._bench import share

                # share mode: --producers is the number of tenants (default 4).
                share_result = share.run(max(producers) if args.producers else 4, reps=reps, rep_s=max(rep_s, 0.5),
                                         line=progress.line, daemon_args=daemon_args)
            if "registration" in run_modes:
                from transfer._bench import registration

                # registration mode: --sizes are its buffers (default 1M,64M,1G,4G).
                reg_result = registration.run(sizes if args.sizes else None, reps=reps, line=progress.line, daemon_args=daemon_args)
        except BenchFailure as e:
            progress.stop()
            print(f"\ntransfer-bench: FAILED: {e}", file=sys.stderr)
            return 1

    report.add_ratios(results, limits)
    machine = report.machine_info()
    title = (f"transfer-bench {args.preset}: {machine['cpu']}, {machine['cores']} cores, "
             f"verify every {verify_every} group(s), medians of {reps} reps")
    from rich.console import Console

    import shutil

    # Never squeeze the numbers: the table is split by column group to fit the terminal, and
    # where even that is too wide the console is widened (the terminal wraps; no digit is elided).
    width = shutil.get_terminal_size((160, 24)).columns
    con = Console(width=width, highlight=False)
    if results:
        for table in report.render_tables(results, limits, title, width):
            need = Console(width=10_000).measure(table).maximum
            (con if need <= width else Console(width=need, highlight=False)).print(table)
    if gpu_result is not None:
        from transfer._bench import gpu

        con.print(gpu.render(gpu_result))
    if lat_result is not None:
        from transfer._bench import latency

        con.print(latency.render(lat_result))
    if share_result is not None:
        from transfer._bench import share

        con.print(share.render(share_result))
    if reg_result is not None:
        from transfer._bench import registration

        con.print(registration.render(reg_result))
    for n in notes:
        con.print(f"note: {n}", markup=False)  # a note may name an extra, e.g. transfer[bench]
    config = {"preset": args.preset, "sizes": sizes, "producers": producers, "depths": depths,
              "modes": run_modes, "methods": methods, "verify_every": verify_every, "reps": reps,
              "rep_seconds": rep_s, "warmup_seconds": warm_s, "checksum": cks_name,
              "wall_seconds": round(time.perf_counter() - t_wall, 2)}
    if args.json:
        report.write_json(args.json, machine, config, results, limits, notes, gpu=gpu_result, latency=lat_result,
                          share=share_result, registration=reg_result)
        con.print(f"wrote {args.json}")
    if args.plot:
        report.write_plot(args.plot, results, limits, title)
        con.print(f"wrote {args.plot}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown_table(results, limits) + "\n")
        con.print(f"wrote {args.markdown}")
    con.print(f"total wall time {time.perf_counter() - t_wall:.1f} s")
    return 0


class _Progress:
    """rich progress on a TTY, plain lines on stderr otherwise."""

    def __init__(self, ncells: int, nlimits: int, plain: bool) -> None:
        self.plain = plain
        self.ncells = ncells
        self.nlimits = nlimits
        self.done = 0
        self._p: Progress | None = None

    def __enter__(self) -> _Progress:
        if not self.plain:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._p = p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                   console=Console(stderr=True), transient=True)
            p.__enter__()
            self._lim: TaskID = p.add_task("physical limits", total=self.nlimits)
            self._all: TaskID = p.add_task("cells", total=self.ncells)
            self._cur: TaskID = p.add_task("", total=1, visible=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._p is not None:
            self._p.__exit__(None, None, None)
            self._p = None

    def line(self, text: str, advance_cell: bool = False, advance_limit: bool = False) -> None:
        if self._p is None:
            if advance_cell:
                self.done += 1
                text = f"[{self.done}/{self.ncells}] {text}"
            print(text, file=sys.stderr, flush=True)
            return
        self._p.console.print(text, highlight=False, markup=False)
        if advance_cell:
            self._p.advance(self._all)
        if advance_limit:
            self._p.advance(self._lim)

    def start_limit(self, size: int) -> None:
        pass

    def start_cell(self, cell: Cell) -> None:
        if self._p is not None:
            self._p.update(self._cur, description=cell.describe(), completed=0, total=1, visible=True)

    def rep(self, i: int, total: int) -> None:
        if self._p is not None:
            self._p.update(self._cur, completed=i, total=total)


if __name__ == "__main__":
    sys.exit(main())
