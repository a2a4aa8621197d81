"""transfer: zero-copy data transfer for GPU data pipelines.

Producers and the daemon share a mapping table of segments addressed by
64-bit virtual addresses (VAs); requests carry VAs and sizes, never payloads.
"""

from __future__ import annotations

__version__ = "0.1.0"
