"""The native extension, `transfer._ring_native` (built from native/ by setup.py), or None.

One place finds out whether it is there. The ring (`_ring`: its Queue, the data plane's
Table and Worker), the client's descriptor packing and `checksum64` ask here, and each
keeps a pure-Python twin for a build without it (no compiler at install time, or the .so
removed). A bottom-floor module: it imports nothing of the package.
"""

from __future__ import annotations

import importlib
from typing import Any

_module: Any
try:
    # The extension by its full name: a C leaf module, beneath everything that uses it.
    _module = importlib.import_module(f"{__package__}._ring_native")
    NATIVE_ERROR: BaseException | None = None
except ImportError as exc:  # no compiler at install time, or the .so was removed
    _module = None
    NATIVE_ERROR = exc

__all__ = ["native_module", "NATIVE_ERROR"]


def native_module() -> Any:
    """The native extension (its Queue, pack_vector, checksum64, the data plane's Table and
    Worker), or None."""
    return _module
