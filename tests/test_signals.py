"""Signals landing in zmq calls: pyzmq retries most calls on EINTR, not all of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import zmq

from transfer.transport._zmq import monitor_socket, stop_monitor


def test_monitors_start_and_stop_under_a_flood_of_signals() -> None:
    """zmq_socket_monitor's inproc bind sees EINTR when a handled signal lands in it; pyzmq
    raises that (InterruptedSystemCall) instead of retrying. The daemon's connection guard
    starts a monitor as it starts, so a SIGTERM then crashed it (rc 1, nothing drained)."""
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)  # handled, so calls see EINTR
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.ROUTER) for _ in range(200)]
    flood = subprocess.Popen([sys.executable, "-c", f"import os, signal\nwhile True: os.kill({os.getpid()}, signal.SIGUSR1)"])
    try:
        for _ in range(25):
            for s in socks:
                mon = monitor_socket(s, zmq.EVENT_ACCEPTED)
                stop_monitor(s)
                mon.close(0)
    finally:
        flood.kill()
        flood.wait()
        signal.signal(signal.SIGUSR1, previous)
        ctx.destroy(linger=0)
