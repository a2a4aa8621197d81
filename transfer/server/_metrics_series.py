"""Per-client metric series with bounded cardinality (`Metrics` exports them).

The heaviest `limit` clients by bytes, named by the client string they gave in
hello (sanitized), have series of their own; every other client shares one
labelled `OTHER`. Folded from the sessions' own counters when someone scrapes,
so the request path pays nothing; a scrape and `ended` take one lock.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

__all__ = ["SessionSeries", "SessionLike", "client_label", "OTHER"]

#: The per-client series that gathers every client without a label of its own. Client names
#: are sanitized to [A-Za-z0-9_.:@/-], so no client can be called this.
OTHER = "(other)"
#: What each series counts, in order.
VALUES = ("bytes_moved", "requests", "errors", "device_ns")
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_.:@/-]")


def client_label(name: str) -> str:
    """A client name (hello's `client`, from the wire) as a label value: safe characters, short."""
    return _LABEL_CHARS.sub("_", name)[:64] or "unnamed"


class SessionStatsLike(Protocol):
    @property
    def bytes_moved(self) -> int: ...
    @property
    def requests(self) -> int: ...
    @property
    def errors(self) -> int: ...
    @property
    def device_ns(self) -> int: ...


class SessionLike(Protocol):
    """What `SessionSeries` reads of a session (`server._session.Session` is one)."""

    @property
    def id(self) -> int: ...
    @property
    def client(self) -> str: ...
    @property
    def stats(self) -> SessionStatsLike: ...
    @property
    def running(self) -> bool: ...


@dataclass
class _Client:
    """A client name with live sessions: their number, its rank, its series if labeled."""

    live: int = 0
    #: Bytes its sessions moved while it had live ones: the rank for a label.
    rank: int = 0
    #: [bytes, requests, errors, device ns] of its series (`VALUES`); None: counted in (other).
    values: list[int] | None = None
    #: `values` as the last scrape showed them (or as the series started).
    shown: list[int] | None = None


class SessionSeries:
    """Per-client counters whose label count stays bounded, however many sessions come and go.

    Sessions are grouped by their client name (hello's `client`: `connect(name=...)`,
    default `pid<N>`). At most `limit` names with a live session hold a label of their
    own: the first ones seen while a slot is free, then, after each scrape, the `limit`
    names whose sessions moved the most bytes. Everything else is counted in the
    `(other)` series. A name whose last session ended keeps its series for one more
    scrape, so its last increments are seen (at most `limit` such: beyond, the
    increments no scrape has shown go to `(other)`). So each family has at most
    2 * limit + 1 series.

    Every increment is counted in exactly one series, and no series ever decreases:
    a name that loses its label stops (what it moves next goes to `(other)`), and
    one that gets a label back goes on from where it stopped (the last `RETIRED`
    names are remembered; an older one starts again at 0, which Prometheus reads
    as a counter reset). So `rate()` and `increase()` summed across the series are
    right; a raw sum is not (a series that stopped no longer adds to it).
    """

    #: Stopped series remembered, so a name that comes back goes on instead of resetting.
    RETIRED = 1024

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        #: session id -> [client label, *VALUES] as last folded
        self._seen: dict[int, list[Any]] = {}
        #: Names with a live session.
        self._clients: dict[str, _Client] = {}
        self._other = [0] * len(VALUES)
        #: Labeled names whose last session ended, oldest first: (final values, values last shown).
        self._lingering: dict[str, tuple[list[int], list[int]]] = {}
        #: Stopped series' last values, oldest first (at most RETIRED).
        self._retired: dict[str, list[int]] = {}
        self._slots = 0  # labeled names with a live session

    # --- the trio thread -----------------------------------------------------------------------
    def ended(self, session: SessionLike) -> None:
        """A session ended (after its last request was accounted): fold what it did last."""
        if self.limit <= 0:
            return
        with self._lock:
            rec = self._seen.get(session.id)
            if rec is None:  # never scraped while it lived
                rec = self._track(session)
            del self._seen[session.id]
            self._fold_one(session, rec)
            label = rec[0]
            c = self._clients[label]
            c.live -= 1
            if c.live:
                return
            del self._clients[label]
            if c.values is not None:
                self._slots -= 1
                assert c.shown is not None
                if len(self._lingering) < self.limit:
                    self._lingering[label] = (c.values, c.shown)
                else:  # a burst of endings between scrapes: (other) takes what no scrape showed
                    for k in range(len(VALUES)):
                        self._other[k] += c.values[k] - c.shown[k]
                    self._retire(label, c.shown)

    # --- the scrape (HTTP thread) ----------------------------------------------------------------
    def collect(self, sessions: Iterable[SessionLike]) -> tuple[list[tuple[str, list[int]]], list[int]]:
        """Fold the live sessions; return ([(label, [values in VALUES' order])], (other)'s);
        then drop the series of ended names and move labels to the heaviest names."""
        with self._lock:
            for s in sessions:
                if not s.running:
                    continue  # ending: `ended` folds it (it may already have)
                rec = self._seen.get(s.id)
                if rec is None:
                    rec = self._track(s)
                self._fold_one(s, rec)
            out: list[tuple[str, list[int]]] = []
            for name, c in self._clients.items():
                if c.values is not None:
                    c.shown = list(c.values)
                    out.append((name, c.shown))
            out.extend((name, list(v)) for name, (v, _) in self._lingering.items())
            for name, (v, _) in self._lingering.items():
                self._retire(name, v)
            self._lingering.clear()
            other = list(self._other)
            self._rebalance()
            return out, other

    # --- inside the lock -------------------------------------------------------------------------
    def _track(self, s: SessionLike) -> list[Any]:
        label = client_label(s.client)
        c = self._clients.get(label)
        if c is None:
            c = self._clients[label] = _Client()
            if self._slots < self.limit:
                if label in self._lingering:  # back before its last values were shown: go on
                    c.values, c.shown = self._lingering.pop(label)
                    self._slots += 1
                else:
                    self._label(c, self._resume(label))
        c.live += 1
        rec = self._seen[s.id] = [label, *(0 for _ in VALUES)]
        return rec

    def _fold_one(self, s: SessionLike, rec: list[Any]) -> None:
        st = s.stats
        c = self._clients[rec[0]]
        v = c.values if c.values is not None else self._other
        for k, name in enumerate(VALUES):
            now = getattr(st, name)
            v[k] += now - rec[k + 1]
            if k == 0:
                c.rank += now - rec[1]
            rec[k + 1] = now

    def _rebalance(self) -> None:
        """Labels go to the `limit` live names that moved the most bytes (holders win ties)."""
        if len(self._clients) <= self._slots:
            return  # every live name holds a label
        ranked = sorted(self._clients.items(), key=lambda nc: (-nc[1].rank, nc[1].values is None, nc[0]))
        keep = {name for name, _ in ranked[: self.limit]}
        for name, c in ranked:
            if c.values is not None and name not in keep:
                self._retire(name, c.values)  # just shown by this scrape
                c.values = c.shown = None
                self._slots -= 1
        for name, c in ranked:
            if c.values is None and name in keep:
                self._label(c, self._resume(name))

    def _label(self, c: _Client, values: list[int]) -> None:
        c.values, c.shown = values, list(values)
        self._slots += 1

    def _retire(self, label: str, values: list[int]) -> None:
        """Remember a stopped series' values (always what a scrape showed last)."""
        self._retired.pop(label, None)
        self._retired[label] = values
        if len(self._retired) > self.RETIRED:
            del self._retired[next(iter(self._retired))]

    def _resume(self, label: str) -> list[int]:
        return self._retired.pop(label) if label in self._retired else [0] * len(VALUES)
