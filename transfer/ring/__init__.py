"""The shared-memory request ring: one package for what a ring is.

- `_layout`: descriptors, completions, opcodes, flags, kinds and the mapping's header,
  declared once for Python and checked against the native extension's at import;
- `_endpoint`: `Ring`, one end of a mapping and its two queues (`transfer._native.Queue`);
- `_server`: the daemon's end, sans I/O: descriptors into requests;
- `_client`: the client's end: requests into descriptors, completions into answers.

The daemon's session integration (`server/_rings.py`, the native workers of
`server/_dataplane.py`) and the clients (`client/`) use it. docs/ring.md has the protocol.
"""

from __future__ import annotations

from ._client import KINDS, PLAIN, RingLink, Sums, descriptors_of
from ._endpoint import Ring, RingCorrupted, RingError
from ._layout import (
    COMPLETION_DETAIL, COMPLETION_DTYPE, FLAG_AFTER, FLAG_CHAIN, FLAG_SUM, KIND_NAMES, LAYOUT_VERSION, MAX_CHAIN,
    REQUEST_DTYPE, Op,
)
from ._server import VECTOR_RUN, CopyRun, answers, join_chains, to_batch

__all__ = [
    "Ring", "RingError", "RingCorrupted", "RingLink", "Sums", "KINDS", "PLAIN", "descriptors_of",
    "Op", "REQUEST_DTYPE", "COMPLETION_DTYPE", "FLAG_CHAIN", "FLAG_AFTER", "FLAG_SUM", "MAX_CHAIN",
    "COMPLETION_DETAIL", "KIND_NAMES", "LAYOUT_VERSION", "CopyRun", "answers", "join_chains", "to_batch", "VECTOR_RUN",
]
