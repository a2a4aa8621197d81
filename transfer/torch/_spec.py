"""What a sample looks like, and where its fields live inside a batch slot.

A slot holds one batch with no per-sample framing: field `f` of every sample
is packed into one region, so `batch[f]` is a plain contiguous tensor of
shape `(count, *shape)` over the slot's bytes. That is why samples must all
have the same shape and dtype: the layout is computed once, and nothing about
a batch has to travel but its slot number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["Field", "SampleSpec"]

#: Field regions start at this alignment inside a slot (any dtype's element size divides it).
_ALIGN = 64

_TORCH_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)


@dataclass(frozen=True)
class Field:
    """One tensor of a sample: its shape and dtype (the same for every sample)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * int(self.dtype.itemsize)


def _as_tensor(value: Any, where: str) -> torch.Tensor:
    """A sample field as a CPU tensor (no copy for tensors and ndarrays)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(f"{where}: a {value.device} tensor; a dataset for TransferLoader returns CPU tensors or ndarrays")
        return value
    if isinstance(value, np.ndarray):
        try:
            # from_numpy warns on read-only arrays; the adapter only reads them.
            return torch.from_numpy(value) if value.flags.writeable else torch.from_numpy(value.copy())
        except TypeError:
            raise TypeError(f"{where}: NumPy dtype {value.dtype} has no PyTorch equivalent") from None
    if isinstance(value, (bool, int, float, np.generic)):
        return torch.as_tensor(value)  # a label: a 0-d field (int64, float64 or bool)
    raise TypeError(
        f"{where}: a {type(value).__name__}; TransferLoader takes samples that are a tensor, an ndarray, "
        f"a number, or a tuple/list of those, each of fixed shape and dtype"
    )


class SampleSpec:
    """The fixed layout of every sample: one field (a tensor) or a tuple of fields."""

    def __init__(self, fields: Sequence[Field], single: bool = True) -> None:
        if not fields:
            raise ValueError("a sample has at least one field")
        if single and len(fields) != 1:
            raise ValueError("single=True means a sample is one tensor")
        for f in fields:
            if f.dtype not in _TORCH_DTYPES:
                raise TypeError(f"dtype {f.dtype} is not supported in slots (use one of {', '.join(str(d) for d in _TORCH_DTYPES)})")
            if any(d < 0 for d in f.shape):
                raise ValueError(f"negative dimension in shape {f.shape}")
        self.fields = tuple(fields)
        self.single = single

    @classmethod
    def like(cls, sample: Any) -> "SampleSpec":
        """The spec of `sample` (a tensor, ndarray, number, or tuple/list of those)."""
        if isinstance(sample, (tuple, list)):
            ts = [_as_tensor(v, f"sample field {i}") for i, v in enumerate(sample)]
            return cls([Field(tuple(t.shape), t.dtype) for t in ts], single=False)
        t = _as_tensor(sample, "sample")
        return cls([Field(tuple(t.shape), t.dtype)], single=True)

    def offsets(self, batch_size: int) -> list[int]:
        """Byte offset of each field's region inside a slot of `batch_size` samples."""
        out, at = [], 0
        for f in self.fields:
            out.append(at)
            at += -(-(f.nbytes * batch_size) // _ALIGN) * _ALIGN
        return out

    def slot_nbytes(self, batch_size: int) -> int:
        last = self.fields[-1]
        return self.offsets(batch_size)[-1] + last.nbytes * batch_size

    def check(self, sample: Any, index: Any) -> list[torch.Tensor]:
        """The sample's fields as tensors, or a clear error naming the sample and the mismatch."""
        if self.single:
            values = [sample]
        elif isinstance(sample, (tuple, list)) and len(sample) == len(self.fields):
            values = list(sample)
        else:
            raise TypeError(f"sample {index}: expected a tuple of {len(self.fields)} fields, got {type(sample).__name__}")
        out = []
        for k, (f, v) in enumerate(zip(self.fields, values)):
            where = f"sample {index}" + ("" if self.single else f" field {k}")
            t = _as_tensor(v, where)
            if tuple(t.shape) != f.shape or t.dtype != f.dtype:
                raise ValueError(
                    f"{where}: {tuple(t.shape)} {t.dtype}, but every sample must be {f.shape} {f.dtype} "
                    f"(TransferLoader packs samples into fixed slots; pad or crop them in the dataset)"
                )
            out.append(t)
        return out

    def views(self, slot: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
        """Field views `(batch_size, *shape)` over a slot given as a flat uint8 tensor."""
        out = []
        for f, off in zip(self.fields, self.offsets(batch_size)):
            n = f.nbytes * batch_size
            out.append(slot[off : off + n].view(f.dtype).view(batch_size, *f.shape))
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampleSpec) and (self.fields, self.single) == (other.fields, other.single)

    def __repr__(self) -> str:
        body = ", ".join(f"{f.shape} {f.dtype}" for f in self.fields)
        return f"SampleSpec({body})" if self.single else f"SampleSpec(({body}))"
