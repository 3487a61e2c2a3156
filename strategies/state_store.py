"""Per-client state that survives between rounds, kept where memory stays flat.

A client state is a flat mapping of names to NumPy arrays (model entries such as ``target_backbone.*`` plus
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
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np

CLIENT_STATE_MODES = ("disk", "memory", "server")


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
