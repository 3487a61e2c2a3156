"""Rows of an image array that stay on disk (``ssl_models.data.rows``): what they read, in which order, and when a
client's partition stays on disk instead of being copied."""

from __future__ import annotations

import numpy as np
import pytest

from ssl_models.config import ExperimentConfig
from ssl_models.data import rows as rows_module
from ssl_models.data.datasets import ImageData
from ssl_models.data.rows import ImageRows, read_rows, select_rows
from ssl_models.data.splits import client_images, federated_split, union_images


@pytest.fixture
def mapped(tmp_path):
    images = np.arange(10 * 2 * 2 * 3, dtype=np.uint8).reshape(10, 2, 2, 3)
    np.save(tmp_path / "x.npy", images)
    return images, np.load(tmp_path / "x.npy", mmap_mode="r")


def test_image_rows_read_the_asked_rows_in_the_asked_order(mapped):
    images, on_disk = mapped
    index = np.array([1, 4, 5, 8])
    rows = ImageRows(on_disk, index)
    assert rows.shape == (4, 2, 2, 3) and len(rows) == 4 and rows.ndim == 4 and rows.dtype == np.uint8
    assert rows.nbytes == images[index].nbytes and np.shape(rows) == (4, 2, 2, 3)
    np.testing.assert_array_equal(rows[np.array([3, 0, 2])], images[[8, 1, 5]])  # not sorted: asked order kept
    np.testing.assert_array_equal(rows[1:3], images[[4, 5]])
    np.testing.assert_array_equal(rows[2], images[5])
    np.testing.assert_array_equal(np.asarray(rows), images[index])
    assert type(rows[np.array([0, 1])]) is np.ndarray
    np.testing.assert_array_equal(read_rows(on_disk, np.array([9, 0, 3])), images[[9, 0, 3]])


def test_image_rows_refuse_an_index_outside_the_array(mapped):
    _, on_disk = mapped
    with pytest.raises(IndexError, match=r"rows 0\.\.10 outside 0\.\.9"):
        ImageRows(on_disk, np.array([0, 10]))
    with pytest.raises(ValueError, match="1-d integer array"):
        ImageRows(on_disk, np.array([0.5]))


def test_only_a_large_selection_of_a_memory_map_stays_on_disk(mapped, monkeypatch):
    images, on_disk = mapped
    index = np.array([0, 2, 3])
    assert type(select_rows(on_disk, index)) is np.ndarray  # 3 rows of 12 bytes: copied, trained from memory
    monkeypatch.setattr(rows_module, "ON_DISK_ROWS_ABOVE_BYTES", 35)
    assert isinstance(select_rows(on_disk, index), ImageRows)
    assert type(select_rows(images, index)) is np.ndarray  # an array in memory is indexed as always
    monkeypatch.setattr(rows_module, "ON_DISK_ROWS_ABOVE_BYTES", 36)
    assert type(select_rows(on_disk, index)) is np.ndarray  # 36 bytes, the threshold itself: copied


def test_a_clients_large_partition_of_a_mapped_data_set_stays_on_disk(mapped, monkeypatch):
    images, on_disk = mapped
    data = ImageData(on_disk, np.zeros(10, dtype=np.int64), on_disk[:0], np.zeros(0, dtype=np.int64), 1, "folder")
    cfg = ExperimentConfig.from_dict({"federation": {"num_clients": 2}, "data": {"partition": "iid"}})
    split = federated_split(cfg, data.y_train)
    monkeypatch.setattr(rows_module, "ON_DISK_ROWS_ABOVE_BYTES", 0)
    for pid in (0, 1):
        part = client_images(cfg, pid, data)
        assert isinstance(part, ImageRows) and part.base is on_disk
        np.testing.assert_array_equal(np.asarray(part), images[split.client_idx[pid]])
    union = union_images(cfg, data)
    assert isinstance(union, ImageRows)
    np.testing.assert_array_equal(np.asarray(union), images[np.sort(np.concatenate(split.client_idx))])
