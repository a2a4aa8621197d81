"""How the blocking client waits for a graph run it has waited for before: nap, then spin.

A wait on the ring spins for a few tens of microseconds, then sleeps on the completion
futex; the daemon's worker that answers a sleeping client wakes it with FUTEX_WAKE, on
its own thread, between one run and the next. On a VM that wake is an inter-processor
interrupt to an idle vCPU: about 20 µs of the worker's time per run, and as long again
before the client runs (a 64-row MLP: 0.96x in-process NumPy for that alone).

A graph run takes about as long each time. So, as the kernel's hybrid polling does for
block devices, the client learns how long its waits for each graph take, sleeps most of
the next one with its futex word unset (nobody has to wake it: it wakes on its own
timer), and spins through the rest. The run's completion finds it spinning: no wake on
either side. A wait that finds its answer in when the nap ends slept too long: the
estimate shrinks. Runs shorter than MIN_S wait as any request does.
"""

from __future__ import annotations

__all__ = ["Naps"]

#: Waits shorter than this are not worth a nap: spin, then sleep, as any request.
MIN_S = 150e-6
#: At most this much of a wait is spun (the rest is the nap), once the estimate is known.
SPIN_S = 200e-6
#: How late a timed sleep may wake (the kernel's default timer slack is 50 µs).
SLACK_S = 60e-6
#: Weight of the newest wait in the estimate.
ALPHA = 0.25
#: Runs remembered until waited for (a client that never waits on them, fence() instead,
#: lets them go in one sweep).
KEPT = 4096


class Naps:
    """Per graph (by VA), how long the client's waits for its runs take."""

    __slots__ = ("graph_of", "estimate")

    def __init__(self) -> None:
        #: The graph of each run not waited for yet, by request id.
        self.graph_of: dict[int, int] = {}
        #: Seconds a wait for the graph's run takes, by graph VA.
        self.estimate: dict[int, float] = {}

    def ran(self, rid: int, graph: int) -> None:
        """A run of `graph` was submitted as request `rid`."""
        if len(self.graph_of) >= KEPT:
            self.graph_of.clear()
        self.graph_of[rid] = graph

    def plan(self, rid: int) -> tuple[int, float, float] | None:
        """For a wait on request `rid`: (graph, nap, spin) in seconds, or None: wait as any
        request (not a run, or a graph not yet learned; still learned after, with graph)."""
        graph = self.graph_of.pop(rid, None)
        if graph is None:
            return None
        est = self.estimate.get(graph, 0.0)
        if est < MIN_S:
            return graph, 0.0, 0.0
        spin = min(est / 2, SPIN_S)
        nap = est - spin - SLACK_S
        return (graph, nap, spin + 2 * SLACK_S) if nap > SLACK_S else (graph, 0.0, 0.0)

    def learn(self, graph: int, waited: float, overslept: bool) -> None:
        """A wait took `waited` seconds; `overslept`: its answer was in when the nap ended."""
        est = self.estimate.get(graph)
        if overslept and est is not None:
            self.estimate[graph] = 0.75 * est
        else:
            self.estimate[graph] = waited if est is None else est + ALPHA * (waited - est)
