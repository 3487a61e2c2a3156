"""Conversions between named NumPy arrays and Flower records, and byte accounting."""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord


def to_array_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({key: Array(np.ascontiguousarray(value)) for key, value in state.items()})


def from_array_record(record: ArrayRecord) -> OrderedDict:
    return OrderedDict((key, record[key].numpy()) for key in record.keys())


def record_bytes(record: ArrayRecord) -> int:
    """Payload bytes of an ArrayRecord as sent (array data plus its small per-array header)."""
    return int(record.count_bytes())
