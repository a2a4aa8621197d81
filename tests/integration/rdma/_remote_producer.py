"""A remote producer for tests/integration/rdma/test_remote.py: its own process, talking to transferd over tcp.

usage: python _remote_producer.py ENDPOINT NBYTES [SERVER_KEY CLIENT_SECRET]

Registers a patterned buffer as a remote segment, prints one JSON line
({"va", "checksum", "pid"}), then copies the whole buffer into a daemon
buffer again and again (a stream of one-sided READs) until killed; verified
copies (`copy_many(checksum=True)`) when TRANSFER_TEST_VERIFIED is set.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import transfer


def main() -> None:
    endpoint, nbytes = sys.argv[1], int(sys.argv[2])
    keys = {}
    if len(sys.argv) > 4:
        keys = {"server_key": sys.argv[3], "client_keys": sys.argv[4]}
    c = transfer.connect(endpoint, name="remote-producer", **keys)
    arr = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    seg = c.register_remote(arr)
    buf = c.alloc(nbytes)
    c.copy(buf, seg).result()
    print(json.dumps({"va": seg.va, "checksum": c.checksum(buf).result(), "pid": os.getpid()}), flush=True)
    if os.environ.get("TRANSFER_TEST_VERIFIED"):
        while True:
            c.copy_many([buf.va], [seg.va], [nbytes], checksum=True).result()
    while True:
        c.copy(buf, seg).result()


if __name__ == "__main__":
    main()
