"""What Flower counts for an ArrayRecord, learned once here so that byte checks elsewhere can use a hand count
(``tests/wire_bytes.py``): the raw array bytes, a 128-byte ``.npy`` header and the key's length, per array."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedssl_wire import record_bytes, to_array_record
from wire_bytes import NPY_HEADER_BYTES, array_bytes, hand_bytes


@pytest.mark.parametrize(("shape", "dtype"), [((3,), np.float32), ((40, 5), np.float16), ((40, 5), np.uint8),
                                               ((), np.int64), ((1,), np.int64), ((64, 32, 3, 3), np.float32),
                                               ((2048, 4096), np.float32)])
def test_flower_counts_raw_bytes_plus_a_128_byte_header_plus_the_key(shape, dtype):
    array = np.zeros(shape, dtype=dtype)
    for key in ("w", "backbone.layer4.1.conv2.weight"):
        counted = ArrayRecord({key: Array(np.ascontiguousarray(array))}).count_bytes()
        assert counted - array.nbytes - len(key) == NPY_HEADER_BYTES == 128
        assert counted == array_bytes(key, shape, dtype)


def test_hand_count_of_a_record_is_the_sum_over_its_arrays():
    state = {"backbone.w": np.ones((4, 4), np.float32), "meta.last_round": np.array([3], np.int64),
             "values": np.zeros((40, 5), np.float16)}
    # (64 + 128 + 10) + (8 + 128 + 15) + (400 + 128 + 6)
    assert hand_bytes(state) == 202 + 151 + 534 == 887
    assert record_bytes(to_array_record(state)) == 887
    assert record_bytes(to_array_record({})) == 0
