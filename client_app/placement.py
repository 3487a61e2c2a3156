"""Where a ClientApp trains: the CPU or a GPU, decided from explicit facts, never a silent CPU fallback.

Flower's simulation asks Ray for ``client-resources-num-gpus`` GPUs per client, 0 unless told otherwise, and Ray then
hides every GPU from the client's process (``CUDA_VISIBLE_DEVICES=''``): ``train.device: auto`` would train on the
CPU of a GPU machine without a word. The rules (``decide_client_device``):

- ``train.device: cpu``: the CPU.
- In a Ray worker whose GPUs Ray hid (``CUDA_VISIBLE_DEVICES=''`` while the machine has NVIDIA GPUs): the ClientApp
  removes the mask when it is imported, before anything initialises CUDA in the process (``unhide_gpus_hidden_by_ray``),
  and ``auto`` and ``cuda`` train on the GPU, shared by every client that runs at once (Ray does not schedule it);
  ``--federation-config "client-resources-num-gpus=F"`` makes Ray schedule it (at most 1/F clients on one GPU at
  once, Ray's assigned GPU in ``CUDA_VISIBLE_DEVICES``). ``FEDSSL_KEEP_RAY_GPU_MASK=1`` keeps Ray's mask: ``auto``
  then trains on the CPU (the reason says why) and ``cuda`` fails.
- ``cuda`` (or ``cuda:N``) without a usable GPU: ``DevicePlacementError`` naming ``train.device``, the machine and
  the cause (Ray's mask, ``CUDA_VISIBLE_DEVICES``, no NVIDIA GPU, torch without CUDA).
- ``auto``: CUDA when torch can use it, else the CPU, with the reason.

The GPUs of the machine are counted from the driver's files (``physical_gpu_count``), not through CUDA: counting
through CUDA would initialise it and fix the mask for the life of the process. No Flower and no torch import here.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

KEEP_RAY_GPU_MASK = "FEDSSL_KEEP_RAY_GPU_MASK"  # set to 1: a simulated client keeps the GPU mask Ray gave it
NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the NVIDIA driver sees
DEVICE_FILES = Path("/dev")


class DevicePlacementError(RuntimeError):
    """``train.device`` asks for a GPU that this client cannot use."""


@dataclass(frozen=True)
class Placement:
    device: str  # the torch device to train on: "cpu", "cuda" or "cuda:N"
    unhide: bool  # this process removes Ray's empty CUDA_VISIBLE_DEVICES (at the ClientApp's import)
    reason: str  # why, in words (metrics.jsonl's device_reason)


def physical_gpu_count(proc_gpus: Path = NVIDIA_PROC_GPUS, device_files: Path = DEVICE_FILES) -> int:
    """NVIDIA GPUs of this machine, whatever CUDA_VISIBLE_DEVICES says, without initialising CUDA: the entries of
    ``/proc/driver/nvidia/gpus``, else the ``/dev/nvidia<N>`` device files (a container may have those only)."""
    try:
        entries = [entry for entry in proc_gpus.iterdir()]
    except OSError:
        entries = []
    if entries:
        return len(entries)
    try:
        return sum(1 for entry in device_files.glob("nvidia[0-9]*") if entry.name[len("nvidia") :].isdigit())
    except OSError:
        return 0


def in_ray_worker(environ: MutableMapping[str, str] = os.environ) -> bool:
    """True in a Ray worker (a simulation's ClientApp): Ray puts its raylet's pid in its workers' environment."""
    return "RAY_RAYLET_PID" in environ


def keeps_ray_gpu_mask(environ: MutableMapping[str, str] = os.environ) -> bool:
    return environ.get(KEEP_RAY_GPU_MASK, "") not in ("", "0")


def ray_hid_gpus(*, cuda_visible_devices: str | None, in_ray_worker: bool, gpus_on_machine: int) -> bool:
    """Ray's mask for a client that was given 0 GPUs: an empty CUDA_VISIBLE_DEVICES in a Ray worker on a machine
    that has GPUs."""
    return in_ray_worker and cuda_visible_devices == "" and gpus_on_machine > 0


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("s" if n != 1 else "")


SHARE_HINT = "client-resources-num-gpus=F makes Ray schedule the GPU (at most 1/F clients on one at once)"


def decide_client_device(
    requested: str,
    *,
    cuda_visible_devices: str | None,
    in_ray_worker: bool,
    gpus_on_machine: int,
    cuda_available: bool,
    keep_ray_mask: bool = False,
    host: str | None = None,
) -> Placement:
    """Where a client trains (the rules in the module's docstring). ``cuda_visible_devices``: the variable as the
    process was started with it (Ray's mask before ``unhide_gpus_hidden_by_ray`` removed it; None: unset);
    ``cuda_available``: what torch says now (after the unhiding); ``host`` names the machine in an error. Raises
    ``DevicePlacementError`` for ``cuda`` without a usable GPU."""
    hidden = ray_hid_gpus(
        cuda_visible_devices=cuda_visible_devices, in_ray_worker=in_ray_worker, gpus_on_machine=gpus_on_machine
    )
    unhide = hidden and not keep_ray_mask
    wants_cuda = requested == "cuda" or requested.startswith("cuda:")
    if requested == "cpu":
        return Placement("cpu", unhide, "train.device: cpu")
    if requested != "auto" and not wants_cuda:
        raise DevicePlacementError(f"train.device: {requested!r} is not a device (auto, cpu or cuda)")
    if cuda_available:
        device = requested if wants_cuda else "cuda"
        if unhide:
            reason = (
                "Ray hid the GPU (0 GPUs per client); unhidden: shared by every client running at once; " + SHARE_HINT
            )
        elif in_ray_worker and cuda_visible_devices:
            reason = f"Ray assigned GPU {cuda_visible_devices} (client-resources-num-gpus)"
        else:
            reason = "CUDA available" + (
                f" (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r})" if cuda_visible_devices is not None else ""
            )
        return Placement(device, unhide, reason)
    # No usable GPU: why, in words.
    if hidden and keep_ray_mask:
        why = (
            f"Ray hid the machine's {_gpus(gpus_on_machine)} (the federation asks 0 GPUs per client: "
            f"CUDA_VISIBLE_DEVICES='') and {KEEP_RAY_GPU_MASK}=1 keeps them hidden; {SHARE_HINT}"
        )
    elif hidden:
        why = (
            f"Ray hid the machine's {_gpus(gpus_on_machine)} (0 GPUs per client) and unhiding failed: CUDA was "
            f"initialised in this process before the ClientApp was imported, or torch has no CUDA; {SHARE_HINT}"
        )
    elif gpus_on_machine == 0:
        why = "no NVIDIA GPU on this machine (no /proc/driver/nvidia/gpus, no /dev/nvidia<N>)"
    elif cuda_visible_devices is not None:
        why = (
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} leaves torch no usable GPU of the machine's "
            f"{_gpus(gpus_on_machine)}"
        )
    else:
        why = (
            f"the machine has {_gpus(gpus_on_machine)} but torch cannot use CUDA (a torch build without CUDA, or "
            "a driver too old for it)"
        )
    if wants_cuda:
        raise DevicePlacementError(
            f"train.device: {requested} but this client cannot use a GPU on "
            f"{host or platform.node()}: {why}; train.device: auto or cpu trains on the CPU"
        )
    return Placement("cpu", unhide, why)


def unhide_gpus_hidden_by_ray(
    environ: MutableMapping[str, str] = os.environ, gpus_on_machine: int | None = None
) -> bool:
    """Remove Ray's empty CUDA_VISIBLE_DEVICES from ``environ`` (a simulated client given 0 GPUs on a GPU machine),
    unless ``FEDSSL_KEEP_RAY_GPU_MASK`` is set; True when it did. Must run before anything initialises CUDA in the
    process (CUDA reads the variable once): the ClientApp calls it first thing when it is imported."""
    gpus = physical_gpu_count() if gpus_on_machine is None else gpus_on_machine
    if keeps_ray_gpu_mask(environ) or not ray_hid_gpus(
        cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        in_ray_worker=in_ray_worker(environ),
        gpus_on_machine=gpus,
    ):
        return False
    del environ["CUDA_VISIBLE_DEVICES"]
    return True


def device_label(device) -> str:
    """The device a client trained on, for its records: ``cpu``, or ``cuda:<index> (<GPU name>)``."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
