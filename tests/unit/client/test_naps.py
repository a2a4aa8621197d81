"""The blocking client's estimate of its waits for graph runs (client/_naps.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer.client._naps import KEPT, MIN_S, SLACK_S, SPIN_S, Naps


def test_only_runs_are_planned_and_each_once() -> None:
    n = Naps()
    assert n.plan(1) is None  # not a run
    n.ran(1, 0xA)
    assert n.plan(1) == (0xA, 0.0, 0.0)  # a run of a graph not learned yet: a plain wait, learned after
    assert n.plan(1) is None


def test_a_learned_long_wait_naps_then_spins_the_rest() -> None:
    n = Naps()
    n.learn(0xA, 600e-6, False)
    n.ran(7, 0xA)
    graph, nap, spin = n.plan(7)  # type: ignore[misc]
    assert graph == 0xA
    assert nap == pytest.approx(600e-6 - SPIN_S - SLACK_S) and spin == pytest.approx(SPIN_S + 2 * SLACK_S)
    assert nap + spin > 600e-6  # the spin reaches past the expected answer


def test_short_waits_never_nap() -> None:
    n = Naps()
    n.learn(0xA, MIN_S / 2, False)
    n.ran(1, 0xA)
    assert n.plan(1) == (0xA, 0.0, 0.0)


def test_oversleeping_shrinks_the_estimate_and_waits_average() -> None:
    n = Naps()
    n.learn(0xA, 1e-3, False)
    n.learn(0xA, 1e-3, True)
    assert n.estimate[0xA] == pytest.approx(0.75e-3)
    n.learn(0xA, 1.75e-3, False)
    assert n.estimate[0xA] == pytest.approx(0.75e-3 + 0.25 * 1e-3)


def test_runs_never_waited_for_are_let_go_in_a_sweep() -> None:
    n = Naps()
    for rid in range(KEPT + 10):
        n.ran(rid, 0xA)
    assert len(n.graph_of) <= KEPT


@given(st.lists(st.tuples(st.floats(0, 10), st.booleans()), min_size=1, max_size=50))
def test_a_nap_never_outlasts_the_estimate(waits: list[tuple[float, bool]]) -> None:
    """Whatever the waits were, a nap ends before the estimated answer, by the spin and the
    timer's slack, and nothing is negative."""
    n = Naps()
    for i, (waited, overslept) in enumerate(waits):
        n.learn(0xA, waited, overslept)
        n.ran(i, 0xA)
        _, nap, spin = n.plan(i)  # type: ignore[misc]
        est = n.estimate[0xA]
        assert nap >= 0 and spin >= 0 and est >= 0
        assert nap == 0 or nap + SLACK_S <= est - min(est / 2, SPIN_S) + 1e-12
