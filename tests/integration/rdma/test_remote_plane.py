"""The daemon's NIXL plane, alone: a remote segment declared from the event loop when the
agent is free, and left to a thread (None) when it has not started or a post holds it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from transfer import errors as E
from transfer.server._remote import RemotePlane
from transfer.transport import _nixl

if not _nixl.available():
    pytest.skip("NIXL not installed (pip install --no-deps nixl-cu12==1.5.1)", allow_module_level=True)

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(60)]


def test_a_declaration_waits_for_nothing_on_the_loop() -> None:
    plane = RemotePlane("plane-daemon")
    producer = _nixl.NixlEndpoint("plane-producer", progress="event")
    try:
        arr = np.zeros(1 << 16, np.uint8)
        reg = producer.register(arr)
        md, descs = producer.registration_metadata([reg], include_conn=True), reg.descs_bytes
        assert plane.add_segment(1, md, descs, arr.nbytes, blocking=False) is None  # (no agent yet: a thread starts it)
        with pytest.raises(E.InvalidField, match="nbytes"):  # bad input is refused either way
            plane.add_segment(1, md, descs, arr.nbytes + 1, blocking=False)
        plane.ensure_started()
        held, release = threading.Event(), threading.Event()

        def post() -> None:  # (what a post thread does while a same-host READ copies)
            with plane._lock:
                held.set()
                release.wait()

        t = threading.Thread(target=post)
        t.start()
        held.wait()
        assert plane.add_segment(1, md, descs, arr.nbytes, blocking=False) is None
        release.set()
        t.join()
        handle = plane.add_segment(1, md, descs, arr.nbytes, blocking=False)
        assert handle is not None and handle.peer == "plane-producer" and plane.declares(handle)
        plane.drop_segment(handle)
        assert not plane.declares(handle)
    finally:
        plane.close()
        producer.close()
