"""What the trainer and its producers agree on: the batch layout, the data, the check.

A real pipeline decodes images here; the example synthesizes them from the step
number, so the trainer can check every batch it receives.
"""

from __future__ import annotations

import numpy as np

MEAN = [123.675, 116.28, 103.53]
STD = [58.395, 57.12, 57.375]


def synthesize(step: int, out: np.ndarray) -> None:
    """The 'decoded' uint8 images of one step, written in place."""
    out[...] = np.random.default_rng(step).integers(0, 256, out.shape, dtype=np.uint8)


def expected(step: int, shape: tuple[int, ...]) -> np.ndarray:
    """What the daemon's normalize must have made of step `step`'s images."""
    images = np.empty(shape, np.uint8)
    synthesize(step, images)
    mean = np.float32(MEAN).reshape(1, 3, 1, 1)
    std = np.float32(STD).reshape(1, 3, 1, 1)
    return (images.astype(np.float32) - mean) / std
