"""PyTorch adapter: DataLoader workers write samples straight into shared-memory slots.

`TransferLoader` is a drop-in for `torch.utils.data.DataLoader` over a
map-style dataset whose samples have a fixed shape and dtype. Its workers
write each sample into a batch slot of a registered segment (no pickling of
sample data, no collate copy), and the trainer receives each batch as a
tensor that *is* that slot (CPU), or a device buffer the daemon copied the
slot into, taken through DLPack (GPU). docs/guide.md, "PyTorch", has the
rules; the lifetime rule in one line: a batch stays valid until you ask for
the `hold`-th batch after it (default: the next one).

Importable only with PyTorch installed (the `torch` extra); the core package
never imports torch.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (the check is the point)
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("transfer.torch needs PyTorch: install the extra, pip install 'transfer[torch]'") from exc

from ._loader import TransferLoader
from ._spec import Field, SampleSpec

__all__ = ["TransferLoader", "SampleSpec", "Field"]
