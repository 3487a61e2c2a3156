"""The decoded-data cache on the machine's disk: later processes memory-map what the first one decoded, and a changed
data file is never served stale."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ssl_models.data import datasets


def write_npz(path, value: int, n: int = 6):
    x = np.full((n, 4, 4, 3), value, np.uint8)
    y = np.arange(n) % 2
    np.savez_compressed(path, x_train=x, y_train=y, x_test=x[:2], y_test=y[:2])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(datasets.DECODED_CACHE_VARIABLE, str(tmp_path / "cache"))
    datasets._load_npz_cached.cache_clear()
    yield tmp_path / "cache"
    datasets._load_npz_cached.cache_clear()


def test_a_second_process_memory_maps_the_decoded_arrays(tmp_path, cache):
    write_npz(tmp_path / "d.npz", 7)
    first = datasets.load_npz(tmp_path / "d.npz")
    assert not isinstance(first.x_train, np.memmap) and int(first.x_train[0, 0, 0, 0]) == 7
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".tmp-")]
    assert sorted(p.name for p in entry.iterdir()) == [
        "complete.json",
        "labelled.npy",  # whether the file held labels (an .npz of x_train alone is unlabelled)
        "x_test.npy",
        "x_train.npy",
        "y_test.npy",
        "y_train.npy",
    ]
    code = (
        "import numpy as np; from ssl_models.data.datasets import load_npz; d = load_npz(r'%s'); "
        "print(type(d.x_train).__name__, int(d.x_train.sum()), d.num_classes)" % (tmp_path / "d.npz")
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, datasets.DECODED_CACHE_VARIABLE: str(cache)},
    ).stdout.split()
    assert out == ["memmap", str(7 * 6 * 4 * 4 * 3), "2"]


def test_a_changed_file_is_decoded_again_and_its_old_copy_removed(tmp_path, cache):
    path = tmp_path / "d.npz"
    write_npz(path, 1)
    assert int(datasets.load_npz(path).x_train.max()) == 1
    write_npz(path, 2)  # same name, new content (and mtime)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    datasets._load_npz_cached.cache_clear()  # a new process
    assert int(datasets.load_npz(path).x_train.max()) == 2
    entries = [p for p in cache.iterdir() if not p.name.startswith(".tmp-")]
    assert len(entries) == 1  # the stale version's copy is gone


def test_a_copy_of_another_version_is_never_served(tmp_path, cache):
    """Even an entry whose marker names another version of the file (a hash collision, a copied cache) is refused."""
    path = tmp_path / "d.npz"
    write_npz(path, 3)
    datasets.load_npz(path)
    (entry,) = list(cache.iterdir())
    stat = path.stat()
    assert datasets._read_decoded(entry, str(path.resolve()), stat.st_mtime_ns + 1, stat.st_size) is None
    assert datasets._read_decoded(entry, str(path.resolve()), stat.st_mtime_ns, stat.st_size) is not None


def test_the_cache_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv(datasets.DECODED_CACHE_VARIABLE, "off")
    datasets._load_npz_cached.cache_clear()
    write_npz(tmp_path / "d.npz", 5)
    assert int(datasets.load_npz(tmp_path / "d.npz").x_train.max()) == 5
    assert datasets.decoded_cache_root() is None
    datasets._load_npz_cached.cache_clear()
