"""A short soak (bench/soak.py): clients SIGKILLed at random while others verify every byte.

The full version is `python bench/soak.py --clients 4 --seconds 300 --kill-every 2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import soak  # noqa: E402

pytestmark = pytest.mark.slow  # (a soak: `pytest -m slow`, which CI runs after the default suite)


def test_soak_short() -> None:
    s = soak.run(clients=3, seconds=12, kill_every=1.5, seed=7, cap=512 << 10, pace=0.002)
    print("\n" + s.table())
    assert s.kills >= 5 and s.spawned == 3 + s.kills
    assert s.transfers > 100 and s.survivors == 3
    assert s.failures == 0, "checksum or byte mismatch in a surviving client"
    assert s.bad_exits == 0
    assert s.leaked_files == [] and s.daemon_segments == 0 and s.daemon_device_bytes == 0
    assert s.daemon_sessions == 0
    assert s.daemon_exit == 0
    assert s.rss_final <= s.rss_baseline + s.rss_slack, (s.rss_baseline, s.rss_peak, s.rss_final)
    assert s.ok
