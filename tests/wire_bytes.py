"""Bytes of an ArrayRecord counted by hand, from names, shapes and dtypes (never with Flower's count_bytes).

Flower (1.41 and 1.42) stores each array of a record as an ``.npy`` blob and counts, per array, the blob's length plus the
length of its key; the ``.npy`` header of the (at most 4-D) arrays here is 128 bytes (``tests/test_wire_bytes.py``
checks that once against Flower). The app sends a state as one packed record (``fedssl_wire``): a ``manifest``
array (utf-8 text, one ``name<TAB>dtype<TAB>shape`` line per array, lines joined by a newline) and a ``packed``
uint8 array holding every array's raw bytes. So a state costs its raw bytes + the manifest's length
+ 2 x 128 + len("manifest") + len("packed"), and an empty state nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

NPY_HEADER_BYTES = 128
PACKED_FRAME_BYTES = 2 * NPY_HEADER_BYTES + len("manifest") + len("packed")  # = 270


def array_bytes(key: str, shape: tuple[int, ...], dtype) -> int:
    """One array as its own Array in a record (Flower's own layout)."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + NPY_HEADER_BYTES + len(key)


def raw_bytes(state: Mapping[str, np.ndarray]) -> int:
    return sum(int(np.asarray(value).nbytes) for value in state.values())


def manifest_bytes(state: Mapping[str, np.ndarray]) -> int:
    lines = []
    for key, value in state.items():
        value = np.asarray(value)
        shape = value.shape if value.ndim else (1,)  # a 0-d array travels as shape (1,)
        lines.append(len(key) + 1 + len(value.dtype.str) + 1 + len(",".join(str(n) for n in shape)))
    return sum(lines) + max(len(lines) - 1, 0)


def hand_bytes(state: Mapping[str, np.ndarray]) -> int:
    """What a strategy must report for one message carrying ``state`` as one (packed) ArrayRecord."""
    if not state:
        return 0
    return raw_bytes(state) + manifest_bytes(state) + PACKED_FRAME_BYTES
