"""`SocketPump`: a zmq socket owned by one trio task, over real zmq sockets.

The pump parks on an epoll set of the socket's FD and a bell; `send_nowait` from another
task sends at once and rings the bell when zmq holds something the FD no longer signals.
These tests would hang (and fail on their deadline) if a message could sit unseen.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio
import zmq

from transfer.transport._zmq import SocketPump


def _peer(endpoint: str, n: int, window: int, got: list[bytes]) -> None:
    """A DEALER that keeps `window` requests in flight until `n` replies are in."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(endpoint)
    sent = 0
    try:
        while len(got) < n:
            while sent < n and sent - len(got) < window:
                s.send(b"%d" % sent)
                sent += 1
            got.append(s.recv())
    except zmq.Again:
        pass  # (the test sees too few replies)
    finally:
        s.close()
        ctx.term()


def _echo(tmp_path: Path, n: int, window: int) -> tuple[list[bytes], None]:
    """A pump on a ROUTER answering a peer's `n` requests from a second task, each reply sent
    after a checkpoint, so while the pump is parked (as the daemon's session tasks send theirs).
    Returns the replies the peer got."""
    endpoint = f"ipc://{tmp_path}/pump.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    got: list[bytes] = []
    peer = threading.Thread(target=_peer, args=(endpoint, n, window, got), daemon=True)

    async def main() -> None:
        pump = SocketPump(sock)
        to_answer, answers = trio.open_memory_channel[list[bytes]](n)

        async def answer() -> None:
            async for parts in answers:
                await trio.sleep(0)
                pump.send_nowait(parts)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run, to_answer.send_nowait)
            nursery.start_soon(answer)
            peer.start()
            with trio.fail_after(60):
                while peer.is_alive():
                    await trio.sleep(0.01)
                await pump.wait_drained()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        peer.join(5)
    finally:
        sock.close()
        ctx.term()
    return got, None


@pytest.mark.parametrize("window", [1, 8])
def test_replies_sent_from_another_task_never_strand_a_request(tmp_path: Path, window: int) -> None:
    """Requests keep arriving while replies leave from another task: every request gets its reply."""
    n = 3000
    got, _ = _echo(tmp_path, n, window)
    assert sorted(got, key=int) == [b"%d" % i for i in range(n)]
