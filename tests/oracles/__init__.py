"""Reference models of what the native extension (transfer._native) implements, in Python.

They are not part of the product: the package has one implementation of each behaviour,
the native one. Here each is the plain statement of what the native code must do, and the
parity and property tests hold the extension to it (tests/unit/ring/test_ring.py,
tests/unit/client/test_submission.py, tests/unit/test_addressing.py, tests/unit/test_protocol.py).
"""
