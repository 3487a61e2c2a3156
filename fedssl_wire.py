"""What the ServerApp and the ClientApp agree on: one module both sides import.

- the names of message types, records and config keys that travel in messages;
- the encoding of named NumPy arrays as Flower ``ArrayRecord``s, and their byte count;
- where a client keeps its state between rounds (``client_state`` modes and the on-disk store).

Per-client state is a flat mapping of names to NumPy arrays (model entries such as ``target_backbone.*`` plus
scalars under ``meta.*``). Three places can hold it, chosen by the strategy option ``client_state``:

- ``disk`` (default): one ``.npz`` file per client in a state directory on the client's machine; only the
  clients that train in a round have their state in memory, so a federation of many clients runs in the
  memory of the few that train;
- ``memory``: the ClientApp's ``context.state`` (Flower's per-node store; in simulation every client's
  state then sits in one process);
- ``server``: the server keeps every client's state on its disk and sends it with the training message;
  the client returns it updated (for stateless, cross-device clients).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

# ---------------------------------------------------------------------- names on the wire
INFO_MESSAGE_TYPE = "query.info"  # which partition a node holds
TRAIN_MESSAGE_TYPE = "train"  # a local round that uploads weights
SIMILARITY_MESSAGE_TYPE = "train.similarity"  # FLESD: a local round that uploads a similarity matrix
KERNEL_MESSAGE_TYPE = "train.kernel"  # Hetero-SSFL: K_bar down (under "arrays"), the client's RAD kernel up
ENCODER_QUERY_MESSAGE_TYPE = "query.encoder"  # a client's own encoder, up, for the server's evaluation only
LAYERWISE_MESSAGE_TYPE = "train.layerwise"  # LW-FedSSL & co.: a stage's sub-model (part) down, the trained part up

ARRAYS_RECORD = "arrays"  # model weights, both ways
CONFIG_RECORD = "config"  # the round's settings, down
METRICS_RECORD = "metrics"  # the client's figures, up
CLIENT_STATE_RECORD = "client-state"  # a client's own state in "server" client-state mode, both ways
SIMILARITY_RECORD = "similarity"  # FLESD's similarity matrix, up
KERNEL_RECORD = "kernel"  # Hetero-SSFL's RAD kernel K_k, up

CLIENT_STATE_MODES = ("disk", "memory", "server")
MEMORY_STATE_KEY = "local-state"  # context.state key of the "memory" client-state mode


# ---------------------------------------------------------------------- array records
def to_array_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({key: Array(np.ascontiguousarray(value)) for key, value in state.items()})


def from_array_record(record: ArrayRecord) -> OrderedDict:
    return OrderedDict((key, record[key].numpy()) for key in record.keys())


def record_bytes(record: ArrayRecord) -> int:
    """Payload bytes of an ArrayRecord as sent (array data plus its small per-array header)."""
    return int(record.count_bytes())


# ---------------------------------------------------------------------- client state on disk
class DiskStateStore:
    """One uncompressed ``.npz`` per client under ``root``; writes are atomic (temp file + rename)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, client_id: int) -> Path:
        return self.root / f"client_{int(client_id)}.npz"

    def load(self, client_id: int) -> dict[str, np.ndarray] | None:
        path = self.path(client_id)
        if not path.is_file():
            return None
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}

    def save(self, client_id: int, state: Mapping[str, np.ndarray]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **{k: np.ascontiguousarray(v) for k, v in state.items()})
            os.replace(tmp, self.path(client_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def clear(self) -> None:
        """Remove every client file (a new run must not inherit an old run's state)."""
        if self.root.is_dir():
            for path in self.root.glob("client_*.npz"):
                path.unlink()

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("client_*.npz")) if self.root.is_dir() else 0

    def replace_with(self, snapshot: str | Path) -> None:
        """Make this store hold exactly the files of ``snapshot`` (a checkpoint's copy of it: resume)."""
        self.clear()
        self.root.mkdir(parents=True, exist_ok=True)
        snapshot = Path(snapshot)
        if snapshot.is_dir():
            for item in snapshot.glob("client_*.npz"):
                shutil.copy2(item, self.root / item.name)


class RoundStateStore(DiskStateStore):
    """A client's state on its own disk, one version per round it trained (``client_<id>.r<round>.npz``), the last
    ``keep`` kept. A round loads the newest version from an *earlier* round, so a run resumed at round r (after a
    server that died during round r, when some clients had already saved their round-r state) trains every
    client from exactly the state it had after round r - 1, as the uninterrupted run did."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        super().__init__(root)
        self.keep = keep

    def versions(self, client_id: int) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        prefix = f"client_{int(client_id)}.r"
        out = []
        for path in self.root.glob(f"{prefix}*.npz"):
            digits = path.name[len(prefix):-len(".npz")]
            if digits.isdigit():
                out.append((int(digits), path))
        return sorted(out)

    def load_before(self, client_id: int, server_round: int) -> dict[str, np.ndarray] | None:
        """The newest state saved in a round before ``server_round`` (None: the client has none yet)."""
        earlier = [path for rnd, path in self.versions(client_id) if rnd < server_round]
        if not earlier:
            return None
        with np.load(earlier[-1], allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}

    def save_round(self, client_id: int, server_round: int, state: Mapping[str, np.ndarray]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.root / f"client_{int(client_id)}.r{int(server_round):06d}.npz"
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **{k: np.ascontiguousarray(v) for k, v in state.items()})
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for _, old in self.versions(client_id)[:-self.keep]:
            old.unlink(missing_ok=True)

    def load(self, client_id: int) -> dict[str, np.ndarray] | None:
        """The newest saved state (for a query outside training rounds, e.g. the encoder for evaluation)."""
        versions = self.versions(client_id)
        return self.load_before(client_id, versions[-1][0] + 1) if versions else None
