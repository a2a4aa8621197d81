"""Producer and consumer process entry points: one generic loop for every method.

Control protocol with the coordinator (a duplex Connection ``ctrl``):

- worker -> ``("ready", info)`` once set up
- coordinator -> ``("rep", t_start, t_end, verify_every)``; producer runs
  groups from ``t_start`` until ``t_end`` (shared CLOCK_MONOTONIC), drains
  everything in flight and answers ``("rep", stats)``
- coordinator -> ``("stop",)``; producer says bye to its consumer, closes,
  answers ``("bye", {})``
- consumer -> ``("done", stats)`` after every producer said bye
- on any exception: ``("error", traceback)`` and exit
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

from .channels import BYE, CONSUMERS, PRODUCERS, VERIFY
from .common import Bytes, Cell, Consumer, Producer, Record, Spec, get_checksum, now, stamp


def producer_main(idx: int, cell: Cell, ctrl: Connection, spec: Spec) -> None:
    ch: Producer | None = None
    try:
        cks, _ = get_checksum()
        ch = PRODUCERS[cell.method](cell, idx, spec)
        D, K, S = cell.depth, cell.batch, cell.size
        views: list[list[np.ndarray]]
        words: list[list[np.ndarray]]
        if getattr(ch, "loan", None) is None:  # a fixed buffer of depth slots
            buf = ch.buffer
            assert buf is not None, f"{cell.method}: neither a buffer nor a loan"
            views = [[buf[(d * K + i) * S:(d * K + i + 1) * S] for i in range(K)] for d in range(D)]
            words = [[v.view(np.uint64) for v in slot] for slot in views]
        else:  # iceoryx2: each group is written into memory the channel loans for it
            views = words = []
        ctrl.send(("ready", {"idx": idx}))
        g = 0
        while True:
            cmd = ctrl.recv()
            if cmd[0] == "stop":
                break
            _, t_start, t_end, verify_every = cmd
            stats, g = _run_rep(idx, cell, ch, views, words, cks, g, t_start, t_end, verify_every)
            ctrl.send(("rep", stats))
        ch.bye()
        ch.close()
        ch = None
        ctrl.send(("bye", {}))
    except BaseException:  # noqa: BLE001 - everything is reported to the coordinator
        try:
            ctrl.send(("error", f"producer {idx} ({cell.method}):\n{traceback.format_exc()}"))
        except Exception:
            pass
        if ch is not None:
            try:
                ch.close()
            except Exception:
                pass


def _run_rep(idx: int, cell: Cell, ch: Producer, views: list[list[np.ndarray]], words: list[list[np.ndarray]],
             cks: Callable[[Bytes], int], g: int, t_start: float, t_end: float,
             verify_every: int) -> tuple[Record, int]:
    D, K = cell.depth, cell.batch
    loan = getattr(ch, "loan", None)
    inflight: dict[int, tuple[int, float]] = {}  # slot -> (group, submit time)
    lat: list[float] = []
    done_items = 0
    verified = 0
    mismatches: list[int] = []

    def handle(completions: list[tuple[int, bool]]) -> None:
        nonlocal done_items
        t = now()
        for gg, ok in completions:
            g0, t0 = inflight.pop(gg % D)
            if g0 != gg:
                raise RuntimeError(f"completion for group {gg} but slot holds {g0}")
            lat.append(t - t0)
            done_items += K
            if not ok:
                mismatches.append(gg)

    delay = t_start - now()
    if delay > 0:
        time.sleep(delay)
    t_first = now()
    seed_base = (idx + 1) << 56
    while now() < t_end:
        slot = g % D
        while slot in inflight:
            handle(ch.poll(True))
        # Where this group is written: the slot of the fixed buffer, or memory loaned for it now.
        vs, ws = (views[slot], words[slot]) if loan is None else loan(slot)
        seed = seed_base | (g * K)
        for i in range(K):
            stamp(ws[i], seed + i)
        verify = g % verify_every == 0
        expected = [cks(v) for v in vs] if verify else None
        if verify:
            verified += 1
        if g == cell.corrupt_group:
            vs[0][-1] ^= 0xFF  # after the checksum: every method must notice
        t0 = now()
        ch.submit(g, slot, verify, expected)
        inflight[slot] = (g, t0)
        g += 1
        handle(ch.poll(False))
    while inflight:
        handle(ch.poll(True))
    t_last = now()
    return ({"items": done_items, "bytes": done_items * cell.size, "t_first": t_first,
             "t_last": t_last, "lat": np.asarray(lat, np.float64), "verified_groups": verified,
             "mismatches": mismatches}, g)


def consumer_main(cell: Cell, ctrl: Connection, spec: Spec) -> None:
    ch: Consumer | None = None
    try:
        cks, _ = get_checksum()
        ch = CONSUMERS[cell.method](cell, spec)
        S = cell.size
        # local: copy into a "device" buffer, checksum verified groups; compute:
        # checksum every group in place; remote: the channel already delivered
        # the group into its device buffer (a NIXL READ), checksum verified groups.
        copy_in = cell.mode == "local" and not getattr(ch, "delivers_to_device", False)
        check_all = cell.mode == "compute"
        dev = np.zeros(cell.slot_bytes if copy_in else 0, np.uint8)  # the "device" buffer
        dev_items = [dev[i * S:(i + 1) * S] for i in range(cell.batch)] if copy_in else []
        ctrl.send(("ready", {}))
        byes = groups = checked = 0
        mismatches: list[tuple[int, int]] = []
        while byes < cell.producers:
            idx, g, slot, flags, expected, items = ch.recv()
            if flags & BYE:
                byes += 1
                continue
            verify = bool(flags & VERIFY)
            if verify and expected is None:
                raise RuntimeError(f"producer {idx}'s group {g} is to be verified but carries no checksums")
            ok = True
            for i, v in enumerate(items):
                if copy_in:
                    np.copyto(dev_items[i], v)
                if verify or check_all:
                    c = cks(v)
                    if verify and expected is not None and c != expected[i]:
                        ok = False
            if verify:
                checked += 1
            if not ok:
                mismatches.append((idx, g))
            groups += 1
            ch.ack(idx, g, ok)
        ch.close()
        ch = None
        ctrl.send(("done", {"groups": groups, "verified_groups": checked, "mismatches": mismatches}))
    except BaseException:  # noqa: BLE001
        try:
            ctrl.send(("error", f"consumer ({cell.method}):\n{traceback.format_exc()}"))
        except Exception:
            pass
