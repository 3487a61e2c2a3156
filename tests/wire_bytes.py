"""Bytes of an ArrayRecord counted by hand, from shapes and dtypes (never with Flower's count_bytes).

Flower 1.41 stores each array as an ``.npy`` blob and counts, per array, the blob's length plus the length of its
key. The ``.npy`` header of the (at most 4-D) arrays exchanged here is 128 bytes (``tests/test_wire_bytes.py``
checks that once against Flower), so one array costs ``prod(shape) * itemsize + 128 + len(key)``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

NPY_HEADER_BYTES = 128


def array_bytes(key: str, shape: tuple[int, ...], dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + NPY_HEADER_BYTES + len(key)


def hand_bytes(state: Mapping[str, np.ndarray]) -> int:
    """What a strategy must report for one message carrying ``state`` as one ArrayRecord."""
    return sum(array_bytes(key, np.shape(value), np.asarray(value).dtype) for key, value in state.items())
