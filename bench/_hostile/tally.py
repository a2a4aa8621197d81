"""Per-process counters that survive SIGKILL: a small JSON file rewritten atomically.

Every worker (attack or good client) owns one file; the orchestrator sums them. A
SIGKILLed worker loses at most its last `every` seconds of counts.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path
from typing import Any

from transfer import errors as E


def error_name(exc: BaseException) -> str:
    """A stable class for an exception: the transfer error's class, else the Python type."""
    return type(exc).__name__


def code_name(code: int) -> str:
    if code == 0:
        return "ok"
    try:
        return type(E.error_for_code(code, "")).__name__
    except Exception:  # noqa: BLE001 - an unknown code is itself worth counting
        return f"code{code}"


class Tally:
    """Counts (str -> int), a few notes, and the worker's pid; flushed to `path`."""

    def __init__(self, path: Path, kind: str, every: float = 0.5) -> None:
        self.path = path
        self.kind = kind
        self.every = every
        self.counts: collections.Counter[str] = collections.Counter()
        self.notes: list[str] = []
        self.pid = os.getpid()
        self.started = time.time()
        self._last_flush = 0.0
        self.flush(force=True)

    def inc(self, key: str, n: int = 1) -> None:
        self.counts[key] += n
        self.flush()

    def error(self, exc: BaseException, prefix: str = "err") -> None:
        self.inc(f"{prefix}:{error_name(exc)}")

    def note(self, text: str) -> None:
        """Something worth reporting verbatim (a violation, a defended attack), kept short."""
        if len(self.notes) < 20:
            self.notes.append(f"{time.time():.3f} {text}")
        self.flush(force=True)

    def flush(self, force: bool = False, done: bool = False) -> None:
        now = time.monotonic()
        if not force and not done and now - self._last_flush < self.every:
            return
        self._last_flush = now
        data: dict[str, Any] = {
            "kind": self.kind,
            "pid": self.pid,
            "started": self.started,
            "updated": time.time(),
            "done": done,
            "counts": dict(self.counts),
            "notes": self.notes,
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)


def read_tallies(directory: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(directory.glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out
