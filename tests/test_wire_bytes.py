"""What Flower counts for an ArrayRecord, learned once here so that byte checks elsewhere can use a hand count
(``tests/wire_bytes.py``): the raw array bytes, a 128-byte ``.npy`` header and the key's length, per array; and the
app's packed record (two arrays: manifest + packed bytes) against that hand count."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedssl_wire import from_array_record, record_bytes, record_manifest, record_names, to_array_record
from wire_bytes import NPY_HEADER_BYTES, array_bytes, hand_bytes


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((3,), np.float32),
        ((40, 5), np.float16),
        ((40, 5), np.uint8),
        ((), np.int64),
        ((1,), np.int64),
        ((64, 32, 3, 3), np.float32),
        ((2048, 4096), np.float32),
    ],
)
def test_flower_counts_raw_bytes_plus_a_128_byte_header_plus_the_key(shape, dtype):
    array = np.zeros(shape, dtype=dtype)
    for key in ("w", "backbone.layer4.1.conv2.weight"):
        counted = ArrayRecord({key: Array(np.ascontiguousarray(array))}).count_bytes()
        assert counted - array.nbytes - len(key) == NPY_HEADER_BYTES == 128
        assert counted == array_bytes(key, shape, dtype)


def test_hand_count_of_a_packed_record():
    state = {
        "backbone.w": np.ones((4, 4), np.float32),
        "meta.last_round": np.array([3], np.int64),
        "values": np.zeros((40, 5), np.float16),
    }
    # raw 64 + 8 + 400; manifest "backbone.w\t<f4\t4,4" (18) "\n" "meta.last_round\t<i8\t1" (21) "\n"
    # "values\t<f2\t40,5" (15) = 56; frame 2 x 128 + len("manifest") + len("packed") = 270
    assert hand_bytes(state) == 472 + 56 + 270 == 798
    assert record_bytes(to_array_record(state)) == 798
    assert record_bytes(to_array_record({})) == 0


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((3,), np.float32),
        ((40, 5), np.float16),
        ((), np.int64),
        ((0, 4), np.float32),
        ((64, 32, 3, 3), np.float32),
        ((2048, 4096), np.float32),
    ],
)
def test_a_packed_record_is_counted_by_hand_and_read_back_exactly(shape, dtype):
    rng = np.random.default_rng(0)
    state = {"a": rng.standard_normal(shape).astype(dtype), "b.c": np.arange(7, dtype=np.uint8)}
    record = to_array_record(state)
    assert list(record.keys()) == ["manifest", "packed"]  # two objects on the wire, whatever the state
    assert record_bytes(record) == hand_bytes(state)
    back = from_array_record(record)
    assert list(back) == ["a", "b.c"] and record_names(record) == ["a", "b.c"]
    for key, value in state.items():
        value = np.ascontiguousarray(value)
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        np.testing.assert_array_equal(back[key], value)
        assert back[key].flags.writeable and back[key].flags.aligned


def test_a_record_without_a_manifest_is_read_array_by_array():
    record = ArrayRecord({"w": Array(np.arange(3, dtype=np.float32))})
    assert record_manifest(record) == [("w", np.dtype(np.float32), (3,))]
    np.testing.assert_array_equal(from_array_record(record)["w"], np.arange(3, dtype=np.float32))


def test_names_that_cannot_travel_and_malformed_records_are_refused_by_name():
    with pytest.raises(ValueError, match="array name 'a.tb' cannot travel"):
        to_array_record({"a\tb": np.zeros(2)})
    record = to_array_record({"w": np.zeros(4, np.float32)})
    short = ArrayRecord({"manifest": record["manifest"], "packed": Array(np.zeros(15, np.uint8))})
    with pytest.raises(ValueError, match="buffer holds 15 bytes.*describes 16"):
        from_array_record(short)
    bad = ArrayRecord({"manifest": Array(np.frombuffer(b"w\t<f4", np.uint8)), "packed": record["packed"]})
    with pytest.raises(ValueError, match="manifest line 1"):
        from_array_record(bad)


def test_a_packed_record_is_a_handful_of_flower_objects_whatever_the_number_of_arrays():
    """The point of packing: Flower moves every object with its own request on every hop."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    rng = np.random.default_rng(0)
    state = {f"layer{i}.weight": rng.standard_normal((8, 8)).astype(np.float32) for i in range(100)}
    per_array = ArrayRecord({k: Array(v) for k, v in state.items()})
    assert len(get_all_nested_objects(per_array)) == 1 + 100 + 100  # the record, each Array and its one chunk
    # the record, the manifest and the buffer, one chunk each (a buffer over 5 MiB would be cut into more chunks)
    assert len(get_all_nested_objects(to_array_record(state))) == 1 + 2 + 2
