"""Checkpoints of a run, so that a ServerApp that dies loses no finished round.

After every ``checkpoint.every`` rounds the run writes ``<output-dir>/checkpoints/round-<r>/`` atomically (files
written and fsynced in a temporary folder, then the folder renamed; a crash leaves either the old set or the new
one, never half of one) and keeps the last ``checkpoint.keep``. A checkpoint holds:

- ``meta.json``: the round, the experiment config (the resumed run uses exactly this one), the id of the run whose
  client-state folders the clients keep using, and the strategy's plain state (FedEMA's lambdas, Hetero-SSFL's
  kernel bookkeeping, ...);
- ``global.npz``: the global arrays after that round;
- ``strategy.npz``: the strategy's array state (FLESD's key encoder, ...);
- ``stores/<name>/``: snapshots (hard links where possible) of the strategy's on-disk stores (the server-side
  client states, Hetero-SSFL's kernels and fetched encoders, Min-Local's models).

``resume=<output-dir>`` (run config) restores the newest complete checkpoint and continues with the next round.
What the clients keep on their own disks is versioned per round (``fedssl_wire.RoundStateStore``), so they start
the resumed round from the state they had after the checkpointed one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CHECKPOINTS = "checkpoints"
PREFIX = "round-"


@dataclass
class Checkpoint:
    path: Path
    round: int
    meta: dict[str, Any]
    global_arrays: dict[str, np.ndarray]
    strategy_arrays: dict[str, np.ndarray]
    # Newer checkpoints that did not load (a truncated file, a disk that filled), newest first: "<folder>: <why>".
    damaged: list[str] = field(default_factory=list)

    def store_snapshot(self, name: str) -> Path:
        return self.path / "stores" / name


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    with open(path, "wb") as fh:
        np.savez(fh, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
        fh.flush()
        os.fsync(fh.fileno())


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def _snapshot(source: Path, target: Path) -> None:
    """Copy a store folder's files, by hard link where the file system allows (a store replaces files by rename,
    so a linked file never changes afterwards)."""
    target.mkdir(parents=True, exist_ok=True)
    if not source.is_dir():
        return
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith(".tmp"):
            try:
                os.link(item, target / item.name)
            except OSError:
                shutil.copy2(item, target / item.name)


def save_checkpoint(
    out_dir: Path,
    server_round: int,
    meta: Mapping[str, Any],
    global_arrays: Mapping[str, np.ndarray],
    strategy_arrays: Mapping[str, np.ndarray],
    stores: Mapping[str, Path],
    keep: int,
) -> Path:
    """Write round ``server_round``'s checkpoint atomically, then prune all but the newest ``keep``."""
    root = Path(out_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{server_round:06d}"
    tmp = root / f".tmp-{PREFIX}{server_round:06d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _save_npz(tmp / "global.npz", global_arrays)
        _save_npz(tmp / "strategy.npz", strategy_arrays)
        for name, folder in stores.items():
            _snapshot(Path(folder), tmp / "stores" / name)
        meta_path = tmp / "meta.json"
        meta_path.write_text(json.dumps({**meta, "round": int(server_round)}, indent=1))
        _fsync_file(meta_path)
        _fsync_dir(tmp)
        if final.exists():  # the same round written again (a resumed run repeats no round, but be safe)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in complete_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """The complete checkpoint folders of a run, oldest first (a folder is complete once renamed into place)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and (p / "meta.json").is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


class CheckpointDamaged(FileNotFoundError):
    """Every checkpoint of a run is damaged; the message names each one and what is wrong with it."""


def load_checkpoint(path: Path) -> Checkpoint:
    """One checkpoint folder, read whole (every array decompressed, so a truncated or corrupt file shows here)."""
    meta = json.loads((path / "meta.json").read_text())
    return Checkpoint(path, int(meta["round"]), meta, _load_npz(path / "global.npz"), _load_npz(path / "strategy.npz"))


def load_latest_checkpoint(out_dir: Path) -> Checkpoint:
    """The newest checkpoint of the run in ``out_dir`` that loads; the newer ones that did not are listed in its
    ``damaged`` (a truncated ``global.npz`` after a full disk, a copy cut short: the previous checkpoint,
    ``checkpoint.keep`` >= 2, still holds the run). FileNotFoundError naming the folder if there is none,
    CheckpointDamaged naming every damaged file if none loads."""
    found = complete_checkpoints(out_dir)
    if not found:
        raise FileNotFoundError(
            f"resume: {out_dir} holds no complete checkpoint (looked for "
            f"{Path(out_dir) / CHECKPOINTS / (PREFIX + '<round>')}/meta.json)"
        )
    damaged: list[str] = []
    for path in reversed(found):
        try:
            checkpoint = load_checkpoint(path)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # json errors are ValueErrors
            damaged.append(f"{path}: {type(exc).__name__}: {exc}")
            continue
        checkpoint.damaged = damaged
        return checkpoint
    raise CheckpointDamaged(
        f"resume: every checkpoint of {out_dir} is damaged, nothing to resume from: " + "; ".join(damaged)
    )


def restore_store(checkpoint: Checkpoint, name: str, folder: Path) -> None:
    """Replace the files of a strategy's store folder by the checkpoint's snapshot of it."""
    folder = Path(folder)
    if folder.is_dir():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    snapshot = checkpoint.store_snapshot(name)
    if snapshot.is_dir():
        for item in snapshot.iterdir():
            shutil.copy2(item, folder / item.name)
