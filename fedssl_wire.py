"""What the ServerApp and the ClientApp agree on: one module both sides import.

- the names of message types, records and config keys that travel in messages;
- the encoding of named NumPy arrays as Flower ``ArrayRecord``s (one packed buffer + a manifest), and their
  byte count;
- where a client keeps its state between rounds (``client_state`` modes and the on-disk store);
- which code runs: ``WIRE_VERSION`` (the layout of these records) and ``app_code_digest`` (SHA-256 over the app's
  Python files). The ServerApp sends both with every message (``app-digest``, ``wire-version``); a ClientApp whose
  own differ refuses the message (``check_same_code``) and the ServerApp stops the run with that reason. In a
  simulation Flower's Ray workers import the ClientApp from the working directory of the local SuperLink, not from
  the submitted app, so a SuperLink started in another checkout would otherwise run that checkout's client code
  beside the submitted server code, silently.

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

import functools
import hashlib
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord

# ---------------------------------------------------------------------- which code runs
WIRE_VERSION = 1  # the records' layout below; raise it when a message changes shape
APP_DIGEST_KEY = "app-digest"
WIRE_VERSION_KEY = "wire-version"
APP_ROOT = Path(__file__).resolve().parent
APP_PACKAGES = ("ssl_models", "strategies", "client_app", "server_app", "fedssl_study")
APP_MODULES = ("fedssl_wire.py",)


def app_code_files(app_dir: Path = APP_ROOT) -> list[Path]:
    """The app's own Python files under ``app_dir`` (what a FAB carries of them), in a fixed order."""
    app_dir = Path(app_dir)
    files = [app_dir / m for m in APP_MODULES if (app_dir / m).is_file()]
    for package in APP_PACKAGES:
        files += sorted(p for p in (app_dir / package).rglob("*.py") if "__pycache__" not in p.parts)
    return files


@functools.lru_cache(maxsize=8)
def app_code_digest(app_dir: Path = APP_ROOT) -> str:
    """SHA-256 over the app's Python files (relative path and bytes of each): the same for a checkout, the copy
    Flower installs from the FAB and a container's copy of the same code. Computed once per process."""
    h = hashlib.sha256()
    for path in app_code_files(app_dir):
        h.update(str(path.relative_to(app_dir)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def code_identity() -> dict[str, str | int]:
    """What the ServerApp sends with every message so the clients can check they run the same code."""
    return {APP_DIGEST_KEY: app_code_digest(), WIRE_VERSION_KEY: WIRE_VERSION}


class CodeMismatch(RuntimeError):
    """The ClientApp's code is not the ServerApp's: the message is refused (and the run stops)."""


CODE_MISMATCH = "code mismatch"  # in the refusal's text, for the server to recognise it in an error reply


def code_mismatch_reason(text: str) -> str | None:
    """The refusal's own sentence (from ``code mismatch:`` to the end of its line) in an error reply's text, which
    in a simulation is wrapped in Ray's multi-line exception report; None when the text holds no refusal."""
    for line in str(text).splitlines():
        if f"{CODE_MISMATCH}:" in line:
            return line[line.index(f"{CODE_MISMATCH}:") :].strip().rstrip("'\">)")
    return None


def readable_reason(text: str | None, limit: int = 300) -> str:
    """An error reply's reason in one line: a simulation wraps a ClientApp's exception in Ray's multi-line report
    (ANSI colours, tracebacks); keep the exception's own message (after the last ``Message:``, or the last line
    that names an exception), shortened to ``limit`` characters."""
    text = str(text)
    if "Message:" in text:
        text = text.rsplit("Message:", 1)[1]
    elif "Traceback" in text or "\n" in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        named = [ln for ln in lines if ":" in ln and not ln.startswith(("File ", "^", "~"))]
        text = named[-1] if named else (lines[-1] if lines else text)
    text = " ".join(text.replace("\x1b[36m", "").replace("\x1b[39m", "").split()).strip(" '\">")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_same_code(config) -> None:
    """Refuse a message whose sender runs other code: ``config`` (the message's ConfigRecord) holds the ServerApp's
    digest and wire version. A message without them (a hand-made test message) is not checked."""
    theirs = config.get(APP_DIGEST_KEY) if config is not None else None
    if theirs is None:
        return
    mine, version = app_code_digest(), int(config.get(WIRE_VERSION_KEY, -1))
    if str(theirs) != mine or version != WIRE_VERSION:
        raise CodeMismatch(
            f"{CODE_MISMATCH}: this ClientApp runs code {mine[:16]} (wire format v{WIRE_VERSION}) loaded from "
            f"{APP_ROOT}, the ServerApp code {str(theirs)[:16]} (wire format v{version}). Every client must run the "
            "submitted app: in a simulation, the local SuperLink imports the ClientApp from the folder it was first "
            "started in; stop that SuperLink (or give this checkout its own FLWR_HOME and ports) and run again"
        )


# ---------------------------------------------------------------------- a stopped run
RUN_STOPPED_MARKER = "RUN-STOPPED"  # in a run's client-state folder: the ServerApp is gone, clients stop


class RunStopped(RuntimeError):
    """The run this message belongs to was stopped (``flwr stop``, an interrupted ServerApp): nothing more trains or
    is written for it."""


def mark_run_stopped(state_root: Path, reason: str) -> None:
    """Leave the marker the clients of a simulation (whose state folders lie under the run's) check before they
    train an epoch or write state."""
    try:
        Path(state_root).mkdir(parents=True, exist_ok=True)
        (Path(state_root) / RUN_STOPPED_MARKER).write_text(reason + "\n")
    except OSError:
        pass  # an unwritable folder: the clients cannot be told; nothing else to do


def clear_run_stopped(state_root: Path) -> None:
    (Path(state_root) / RUN_STOPPED_MARKER).unlink(missing_ok=True)


def run_stopped(state_root: Path | None) -> str | None:
    """The marker's reason when the run whose client state lies under ``state_root`` was stopped, else None."""
    if state_root is None:
        return None
    marker = Path(state_root) / RUN_STOPPED_MARKER
    try:
        return marker.read_text().strip() or "stopped" if marker.is_file() else None
    except OSError:
        return None


# ---------------------------------------------------------------------- names on the wire
INFO_MESSAGE_TYPE = "query.info"  # which partition a node holds
TRAIN_MESSAGE_TYPE = "train"  # a local round that uploads weights
SIMILARITY_MESSAGE_TYPE = "train.similarity"  # FLESD: a local round that uploads a similarity matrix
KERNEL_MESSAGE_TYPE = "train.kernel"  # Hetero-SSFL: K_bar down (under "arrays"), the client's RAD kernel up
ENCODER_QUERY_MESSAGE_TYPE = "query.encoder"  # a client's own encoder, up, for the server's evaluation only
KERNEL_QUERY_MESSAGE_TYPE = "query.kernel"  # Hetero-SSFL: a client's K_k(0) of its initial model, up, before round 1
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
# Flower 1.41 moves every Array of a message as its own object, with one request per object on every hop
# (ServerApp -> SuperLink -> SuperNode -> ClientApp and back): the smoke config's BYOL model, 136 tensors, made a
# message of 234 objects, and those requests, not the bytes, made most of a deployed round's fixed cost. A state therefore travels
# as two Arrays: every array's bytes back to back in one uint8 buffer, and a manifest (one line per array,
# ``name<TAB>dtype<TAB>shape``) that says how to cut it. Records without a manifest (built by hand, or by another
# app) are still read array by array.
PACKED_KEY = "packed"  # every array's raw bytes, in manifest order, no padding
MANIFEST_KEY = "manifest"  # utf-8 text: "name\tdtype\tshape" per array, "\n"-separated; shape "2,3" ("" for 0-d)


def manifest_line(name: str, value: np.ndarray) -> str:
    return f"{name}\t{value.dtype.str}\t{','.join(str(n) for n in value.shape)}"


def to_array_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Named arrays as one packed ``ArrayRecord`` (see above); an empty mapping gives an empty record."""
    if not state:
        return ArrayRecord()
    arrays = []
    for name, value in state.items():
        if not isinstance(name, str) or not name or "\t" in name or "\n" in name:
            raise ValueError(
                f"array name {name!r} cannot travel: names must be non-empty text without tabs or newlines"
            )
        value = np.ascontiguousarray(value)
        if value.dtype.hasobject:
            raise ValueError(f"array {name!r} has dtype {value.dtype}: only plain numeric arrays travel")
        arrays.append((name, value))
    manifest = "\n".join(manifest_line(name, value) for name, value in arrays).encode("utf-8")
    packed = np.empty(sum(value.nbytes for _, value in arrays), dtype=np.uint8)
    offset = 0
    for _, value in arrays:
        packed[offset : offset + value.nbytes] = value.reshape(-1).view(np.uint8)
        offset += value.nbytes
    return ArrayRecord({MANIFEST_KEY: Array(np.frombuffer(manifest, dtype=np.uint8)), PACKED_KEY: Array(packed)})


def is_packed(record: ArrayRecord) -> bool:
    return MANIFEST_KEY in record and PACKED_KEY in record and len(record) == 2


def record_manifest(record: ArrayRecord) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every array a record holds, in order, without decoding the data. Raises
    ``ValueError`` naming the problem when a packed record's manifest is malformed."""
    if not is_packed(record):
        return [(key, np.dtype(record[key].dtype), tuple(record[key].shape)) for key in record]
    try:
        text = record[MANIFEST_KEY].numpy().tobytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"packed record: manifest is not utf-8 ({exc})") from None
    entries = []
    for number, line in enumerate(text.split("\n"), start=1):
        parts = line.split("\t")
        if len(parts) != 3:
            raise ValueError(f"packed record: manifest line {number} {line[:80]!r} is not name<TAB>dtype<TAB>shape")
        name, dtype_name, shape = parts
        try:
            dtype = np.dtype(dtype_name)
            dims = tuple(int(n) for n in shape.split(",")) if shape else ()
        except (TypeError, ValueError):
            raise ValueError(f"packed record: manifest line {number} has a bad dtype or shape: {line[:80]!r}") from None
        if dtype.hasobject or any(n < 0 for n in dims):
            raise ValueError(f"packed record: manifest line {number} has a bad dtype or shape: {line[:80]!r}")
        entries.append((name, dtype, dims))
    return entries


def record_names(record: ArrayRecord) -> list[str]:
    """The names of the arrays a record holds (packed or not), in order."""
    return [name for name, _, _ in record_manifest(record)]


def entry_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def from_array_record(record: ArrayRecord) -> OrderedDict:
    """The named arrays of a record (each its own writable array). Raises ``ValueError`` when a packed record's
    buffer does not hold exactly what its manifest describes."""
    if not is_packed(record):
        return OrderedDict((key, record[key].numpy()) for key in record)
    entries = record_manifest(record)
    packed = record[PACKED_KEY].numpy()
    expected = sum(entry_nbytes(dtype, shape) for _, dtype, shape in entries)
    if packed.dtype != np.uint8 or packed.ndim != 1 or packed.size != expected:
        raise ValueError(
            f"packed record: buffer holds {packed.nbytes} bytes ({packed.dtype}, shape {packed.shape}), "
            f"its manifest describes {expected} bytes of uint8"
        )
    out, offset = OrderedDict(), 0
    for name, dtype, shape in entries:
        size = entry_nbytes(dtype, shape)
        # a copy per array: aligned for its dtype, writable, and not keeping the whole buffer alive
        out[name] = packed[offset : offset + size].view(dtype).reshape(shape).copy() if size else np.empty(shape, dtype)
        offset += size
    return out


def record_bytes(record: ArrayRecord) -> int:
    """Bytes of an ArrayRecord as Flower counts them: per Array its ``.npy`` blob plus its key (for a packed record:
    the arrays' raw bytes, the manifest, two ``.npy`` headers and the two keys)."""
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
                np.savez(fh, **{k: np.ascontiguousarray(v) for k, v in state.items()})  # type: ignore[arg-type]  # names, never allow_pickle
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
            digits = path.name[len(prefix) : -len(".npz")]
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
                np.savez(fh, **{k: np.ascontiguousarray(v) for k, v in state.items()})  # type: ignore[arg-type]  # names, never allow_pickle
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for _, old in self.versions(client_id)[: -self.keep]:
            old.unlink(missing_ok=True)

    def load(self, client_id: int) -> dict[str, np.ndarray] | None:
        """The newest saved state (for a query outside training rounds, e.g. the encoder for evaluation)."""
        versions = self.versions(client_id)
        return self.load_before(client_id, versions[-1][0] + 1) if versions else None
