"""bfloat16 bit patterns in numpy (no torch): the encoding of bfloat16 rank-r factors in a store.

Kept apart from :mod:`traceprop_engine.capture.sketch` (which re-exports them) so that reading a
store (:mod:`.format`, :mod:`.reader`) never imports torch: the app's Runs page reads step times
from the store and must not pay torch's import.
"""

from __future__ import annotations

import numpy as np


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even (no torch needed)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((b >> 16) & 1) + np.uint32(0x7FFF)
    return ((b + rounding) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
