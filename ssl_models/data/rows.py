"""Some rows of an image array that stays on disk: a client's share of a memory-mapped data set, read a batch at a
time instead of copied into the process's memory.

``array[index]`` on an ``np.memmap`` copies the rows it picks: a simulated client's partition of a large folder's
cache would become a private array as large as the partition, in every client process, every round. ``ImageRows``
keeps the mapping and the index instead; ``train_ssl`` reads it a batch at a time as it reads a memory map.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Partitions of a memory-mapped data set larger than this stay on disk (``ImageRows``); smaller ones are copied, as
# any in-memory array's are, so that training moves them to the device once (a CIFAR-sized client: ~15 MiB).
ON_DISK_ROWS_ABOVE_BYTES = 64 * 2**20


class ImageRows:
    """Rows ``index`` of ``base`` (NHWC), in that order, read on access.

    ``rows[key]`` (an integer array, a slice or an integer) returns those rows as an array, read from ``base`` in
    file order; ``shape``, ``dtype``, ``ndim`` and ``len()`` are the selection's; ``np.asarray(rows)`` reads every row.
    """

    def __init__(self, base: np.ndarray, index: np.ndarray):
        index = np.asarray(index)
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise ValueError(f"index: expected a 1-d integer array, got shape {index.shape} {index.dtype}")
        n = int(np.shape(base)[0])
        if index.size and (int(index.min()) < 0 or int(index.max()) >= n):
            raise IndexError(f"index: rows {int(index.min())}..{int(index.max())} outside 0..{n - 1}")
        self.base = base
        self.index = index.astype(np.int64, copy=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.index.size), *tuple(self.base.shape[1:]))

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return int(self.index.size)

    def __getitem__(self, key: Any) -> np.ndarray:
        wanted = self.index[key]
        if np.ndim(wanted) == 0:
            return np.asarray(self.base[int(wanted)])
        return read_rows(self.base, wanted)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = self[:]
        return rows if dtype is None else rows.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"ImageRows({len(self)} of {int(np.shape(self.base)[0])} rows, shape {self.shape}, {self.dtype})"


def read_rows(images: np.ndarray | ImageRows, wanted: np.ndarray) -> np.ndarray:
    """``images[wanted]`` as a new array in the order asked, read front to back (a mapped file's sequential reads):
    a batch from disk is then the batch an in-memory copy of the images gives."""
    wanted = np.asarray(wanted)
    if isinstance(images, ImageRows):
        return images[wanted]
    order = np.argsort(wanted, kind="stable")
    out = np.empty((len(wanted), *images.shape[1:]), dtype=images.dtype)
    out[order] = images[wanted[order]]
    return out


def select_rows(images: np.ndarray, index: np.ndarray) -> np.ndarray | ImageRows:
    """``images[index]``, except that a large selection of a memory-mapped array stays on disk (``ImageRows``)."""
    index = np.asarray(index)
    row_bytes = int(np.prod(np.shape(images)[1:])) * np.dtype(images.dtype).itemsize
    if isinstance(images, np.memmap) and index.size * row_bytes > ON_DISK_ROWS_ABOVE_BYTES:
        return ImageRows(images, index)
    return images[index]
