"""Images memory-mapped from the decoded cache (a folder, a node's own data, a simulated client's large share of
one) train a batch at a time: the training loop never reads more rows of the mapped file at once than a batch, and
the run is the one the same images in memory give."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from ssl_models.config import ExperimentConfig
from ssl_models.factory import build_ssl_model
from ssl_models.training import train_ssl


class CountingMemmap(np.memmap):
    """A memory-mapped array that records how many rows each read asked for."""

    reads: ClassVar[list[int]] = []

    def __getitem__(self, index):
        if isinstance(index, np.ndarray):
            CountingMemmap.reads.append(len(index))
        return super().__getitem__(index)


def test_memory_mapped_images_are_read_a_batch_at_a_time(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, size=(40, 16, 16, 3), dtype=np.uint8)
    path = tmp_path / "x.npy"
    np.save(path, images)
    mapped = np.load(path, mmap_mode="r").view(CountingMemmap)
    cfg = ExperimentConfig.from_dict(
        {"model": {"arch": "resnet18", "width": 0.125}, "method": {"name": "simclr", "options": {"proj_out_dim": 8}}}
    )
    common = {"epochs": 2, "batch_size": 8, "lr": 1e-3, "optimizer": "adam", "seed": 0, "fast_path": False}
    CountingMemmap.reads = []
    streamed = train_ssl(build_ssl_model(cfg, seed=0), mapped, **common)
    assert CountingMemmap.reads == [8] * 10  # 5 batches per epoch, 2 epochs, never the whole file
    in_memory = train_ssl(build_ssl_model(cfg, seed=0), images, **common)
    assert streamed.steps == in_memory.steps == 10
    # each batch read from disk in the shuffled order the in-memory copy gives: the same run
    assert np.isfinite(streamed.loss) and streamed.loss == in_memory.loss


def test_a_partition_of_a_memory_map_trains_from_disk_exactly_as_its_copy_in_memory(tmp_path):
    """A simulated client's large partition of a folder's cache (``ImageRows``) is read a batch at a time, and the
    batches are the ones its in-memory copy gives: same steps, same loss, same weights."""
    from ssl_models.data.rows import ImageRows

    images = np.random.default_rng(1).integers(0, 256, size=(60, 16, 16, 3), dtype=np.uint8)
    path = tmp_path / "x.npy"
    np.save(path, images)
    mapped = np.load(path, mmap_mode="r").view(CountingMemmap)
    partition = np.sort(np.random.default_rng(2).permutation(60)[:24])
    cfg = ExperimentConfig.from_dict(
        {"model": {"arch": "resnet18", "width": 0.125}, "method": {"name": "simclr", "options": {"proj_out_dim": 8}}}
    )
    common = {"epochs": 1, "batch_size": 8, "lr": 1e-3, "optimizer": "adam", "seed": 3, "fast_path": False}
    CountingMemmap.reads = []
    on_disk, held = build_ssl_model(cfg, seed=0), build_ssl_model(cfg, seed=0)
    streamed = train_ssl(on_disk, ImageRows(mapped, partition), **common)
    assert CountingMemmap.reads == [8] * 3  # 3 batches, never the whole partition
    in_memory = train_ssl(held, images[partition], **common)
    assert streamed.steps == in_memory.steps == 3 and streamed.loss == in_memory.loss
    for (name, a), b in zip(on_disk.state_dict().items(), held.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
