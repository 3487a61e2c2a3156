"""``fedssl-eval``: score a saved encoder (``model.pt``) with the project's fixed kNN / linear-probe protocol.

Usage::

    fedssl-eval MODEL.pt DATA.npz [--knn-k 200] [--knn-t 0.1] [--probe-epochs 100] [--max-train N]
                [--max-test N] [--device auto|cpu|cuda] [--batch-size 512] [--export-features PATH]
                [--no-linear] [--seed 0] [--semi-supervised 0.01,0.1] [--semi-epochs 100]
                [--semi-mode finetune|head] [--semi-lr 0.001]
    fedssl-eval --random-init ARCH [--width 1.0] [--init-seed S] [--input-mean r,g,b --input-std r,g,b] DATA.npz ...

**A run's own numbers.** A ``model.pt`` written by a run records the run's evaluation protocol
(``extra.eval_protocol``: kNN k and temperature, probe epochs and seed, the sizes and seeds of the class-stratified
train/test subsamples). Every protocol option not given on the command line is taken from there, so
``fedssl-eval outputs/<run>/model.pt <the run's data file>`` scores exactly the subsets the run scored and prints
the run's own kNN and linear-probe accuracies. Options given on the command line win (``--seed`` then also seeds
both subsamples, as for a checkpoint without a recorded protocol); the JSON line's ``protocol.source`` says which.

**The random-init reference.** ``--random-init ARCH`` scores a never-trained encoder of that architecture
(``--width``; weights drawn after ``torch.manual_seed(--init-seed)``, by default the protocol seed, which is how a
run draws its initial model: ``--init-seed`` = the run's ``seed`` gives the run's own reference), with the same
protocol, instead of a checkpoint.

The encoder is fitted on (kNN bank / probe training set) the ``x_train``/``y_train`` arrays of the ``.npz``
and scored on ``x_test``/``y_test``. Exactly one JSON line goes to stdout so the output can be piped or
appended to a results file; progress goes to stderr. Errors in the inputs (missing files, a file that is not
an encoder checkpoint, a malformed ``.npz``) print one message to stderr and exit with status 2.

The protocol is described in :mod:`ssl_models.evaluation.protocol`. New evaluation modes are added as further flags
rather than subcommands. ``--semi-supervised`` adds the FedEMA/EasyFL semi-supervised score (protocol step 5):
for every listed label fraction, an MLP head (with the encoder in ``finetune`` mode, alone in ``head`` mode)
is trained on that class-balanced fraction of the (possibly ``--max-train``-subsampled) train split, and the
test accuracies go to the JSON line as ``"semi_supervised": [{...}, ...]``, one record per fraction, in the
order given (an empty list when the flag is absent).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ssl_models.config import CIFAR_STEM_MAX_SIDE, npz_image_side
from ssl_models.data.datasets import ImageData, load_npz, subsample
from ssl_models.evaluation.checkpoint import load_encoder_checkpoint
from ssl_models.evaluation.protocol import (
    DEFAULT_PROTOCOL,
    SEMI_SUPERVISED_MODES,
    SEMI_SUPERVISED_PROTOCOL,
    evaluate_backbone,
    semi_supervised_accuracy,
)
from ssl_models.networks import build_backbone

PROGRAM = "fedssl-eval"
MAX_ERROR_CHARS = 600


class UsageError(Exception):
    """A problem with the user's inputs: reported as one line on stderr with exit status 2."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _label_fractions(text: str) -> list[float]:
    """Comma-separated label fractions, each in (0, 1], e.g. ``0.01,0.1``."""
    fractions = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be comma-separated numbers in (0, 1], got {text!r}") from None
        if not 0 < value <= 1:  # also rejects nan
            raise argparse.ArgumentTypeError(f"every fraction must lie in (0, 1], got {item.strip()!r}")
        fractions.append(value)
    return fractions


def _three_floats(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be three comma-separated numbers r,g,b, got {text!r}") from None
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"must be three comma-separated numbers r,g,b, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Evaluate a saved SSL encoder with weighted kNN and a linear probe on frozen features, and "
        "optionally by semi-supervised fine-tuning on a fraction of the labels.",
    )
    parser.add_argument(
        "model", help="encoder checkpoint written by save_encoder_checkpoint (model.pt); omitted with --random-init"
    )
    parser.add_argument(
        "data", nargs="?", default=None, help=".npz with x_train, y_train, x_test, y_test (NHWC uint8 images)"
    )
    parser.add_argument(
        "--random-init",
        metavar="ARCH",
        default=None,
        help="score a randomly initialised encoder of this architecture instead of a checkpoint",
    )
    parser.add_argument(
        "--width",
        type=_positive_float,
        default=1.0,
        help="channel width multiplier of --random-init (default %(default)s)",
    )
    parser.add_argument(
        "--stem",
        choices=("auto", "cifar", "imagenet"),
        default="auto",
        help="--random-init of a ResNet: its stem (default auto: cifar for images up to 64 px, imagenet above, as "
        "model.stem: auto chooses for a run)",
    )
    parser.add_argument(
        "--init-seed", type=int, default=None, help="torch seed of --random-init's weights (default: the protocol seed)"
    )
    parser.add_argument(
        "--input-mean",
        type=_three_floats,
        default=None,
        help="--random-init: input normalisation mean r,g,b (with --input-std)",
    )
    parser.add_argument(
        "--input-std",
        type=_three_floats,
        default=None,
        help="--random-init: input normalisation std r,g,b (with --input-mean)",
    )
    parser.add_argument(
        "--knn-k",
        type=_positive_int,
        default=None,
        help=f"neighbours in the weighted kNN vote (default: the checkpoint's protocol, else "
        f"{DEFAULT_PROTOCOL['knn_k']})",
    )
    parser.add_argument(
        "--knn-t",
        type=_positive_float,
        default=None,
        help=f"kNN temperature (default: the checkpoint's, else {DEFAULT_PROTOCOL['knn_temperature']})",
    )
    parser.add_argument(
        "--probe-epochs",
        type=_positive_int,
        default=None,
        help=f"linear-probe epochs (default: the checkpoint's, else {DEFAULT_PROTOCOL['probe_epochs']})",
    )
    parser.add_argument(
        "--max-train",
        type=_positive_int,
        default=None,
        help="class-stratified, seeded subsample of the train split (default: the checkpoint's, else all)",
    )
    parser.add_argument(
        "--max-test",
        type=_positive_int,
        default=None,
        help="class-stratified, seeded subsample of the test split (default: the checkpoint's, else all)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto picks cuda when available (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=DEFAULT_PROTOCOL["feature_batch_size"],
        help="feature-extraction batch size (default %(default)s)",
    )
    parser.add_argument(
        "--export-features", metavar="PATH", default=None, help="also write train/test features and labels to this .npz"
    )
    parser.add_argument("--no-linear", action="store_true", help="skip the linear probe (kNN only)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the subsampling and the probe's shuffling (default: the checkpoint's, else "
        f"{DEFAULT_PROTOCOL['seed']})",
    )
    parser.add_argument(
        "--semi-supervised",
        metavar="FRACTIONS",
        type=_label_fractions,
        default=[],
        help="also fine-tune on these class-balanced label fractions, comma-separated "
        "(e.g. 0.01,0.1) and report their test accuracies",
    )
    parser.add_argument(
        "--semi-epochs",
        type=_positive_int,
        default=SEMI_SUPERVISED_PROTOCOL["epochs"],
        help="semi-supervised training epochs (default %(default)s)",
    )
    parser.add_argument(
        "--semi-mode",
        choices=SEMI_SUPERVISED_MODES,
        default=SEMI_SUPERVISED_PROTOCOL["mode"],
        help="finetune: train encoder + MLP head; head: frozen encoder in eval mode, train the "
        "head only (default %(default)s)",
    )
    parser.add_argument(
        "--semi-lr",
        type=_positive_float,
        default=SEMI_SUPERVISED_PROTOCOL["lr"],
        help="semi-supervised Adam learning rate (default %(default)s)",
    )
    return parser


def resolve_device(choice: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; an explicit ``cuda`` without a GPU is a usage error."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was requested but no CUDA device is available")
    return torch.device(choice)


def _progress(message: str) -> None:
    print(f"[{PROGRAM}] {message}", file=sys.stderr, flush=True)


def _load_data(path: str) -> ImageData:
    try:
        return load_npz(path)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from error
    except (ValueError, OSError, KeyError, EOFError) as error:  # wrong keys/shapes, not a zip, truncated
        raise UsageError(f"cannot read data file {path}: {error}") from error


def _load_model(path: str, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    try:
        return load_encoder_checkpoint(path, map_location=device)
    except (FileNotFoundError, ValueError) as error:  # CheckpointError is a ValueError
        raise UsageError(str(error)) from error


def _subsample_split(
    images: np.ndarray, labels: np.ndarray, limit: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Class-stratified, seeded subsample (``ssl_models.data.datasets.subsample``); everything when ``limit`` is None."""
    index = subsample(labels, limit, seed=seed)
    if len(index) == len(labels):
        return images, labels
    return images[index], labels[index]


def export_features(path: str, result: dict[str, Any], y_train: np.ndarray, y_test: np.ndarray) -> None:
    """Write features and labels to ``path`` (.npz): train_features, train_labels, test_features, test_labels."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as handle:  # a file handle keeps numpy from appending ".npz" to other suffixes
        np.savez(
            handle,
            train_features=result["train_features"].numpy(),
            train_labels=np.asarray(y_train, dtype=np.int64),
            test_features=result["test_features"].numpy(),
            test_labels=np.asarray(y_test, dtype=np.int64),
        )


def semi_supervised_records(
    backbone: torch.nn.Module,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
    device: torch.device,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """One ``semi_supervised_accuracy`` record per ``--semi-supervised`` fraction, seconds rounded."""
    records = []
    for fraction in args.semi_supervised:
        try:
            record = semi_supervised_accuracy(
                backbone,
                x_train,
                y_train,
                x_test,
                y_test,
                num_classes,
                fraction,
                epochs=args.semi_epochs,
                lr=args.semi_lr,
                mode=args.semi_mode,
                device=device,
                seed=args.seed,
                feature_batch_size=args.batch_size,
            )
        except ValueError as error:  # e.g. a class missing from a tiny --max-train subsample
            raise UsageError(f"--semi-supervised {fraction}: {error}") from error
        record["seconds"] = round(record["seconds"], 3)
        _progress(
            f"semi-supervised {args.semi_mode} on {record['num_labelled']} labels "
            f"(fraction {fraction}): accuracy={record['accuracy']}"
        )
        records.append(record)
    return records


def _random_init_model(
    args: argparse.Namespace, seed: int, device: torch.device
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A never-trained encoder of ``--random-init ARCH``: ``torch.manual_seed`` then ``build_backbone``, which is
    how a run draws its initial model (``ssl_models.factory.build_ssl_model`` builds the backbone first)."""
    if (args.input_mean is None) != (args.input_std is None):
        raise UsageError("--input-mean and --input-std go together")
    if args.input_std is not None and not all(v > 0 for v in args.input_std):
        raise UsageError(f"--input-std: every value must be > 0, got {args.input_std}")
    normalization = None if args.input_mean is None else (args.input_mean, args.input_std)
    init_seed = seed if args.init_seed is None else args.init_seed
    # the images' side shapes the encoder as it shaped the run's: a ResNet's stem (auto), a ViT's patch size
    side = npz_image_side(str(Path(args.data).expanduser().resolve())) if args.data else 32
    stem = args.stem if args.stem != "auto" else ("cifar" if side <= CIFAR_STEM_MAX_SIDE else "imagenet")
    torch.manual_seed(init_seed)
    try:
        backbone, feature_dim = build_backbone(args.random_init, args.width, normalization, stem=stem, image_size=side)
    except ValueError as error:
        raise UsageError(f"--random-init: {error}") from error
    backbone.to(device).eval()
    return backbone, {
        "arch": args.random_init,
        "width": float(args.width),
        "feature_dim": feature_dim,
        "input_normalization": None
        if normalization is None
        else {"mean": list(normalization[0]), "std": list(normalization[1])},
        "extra": {},
        "random_init_seed": init_seed,
    }


def resolve_protocol(args: argparse.Namespace, recorded: dict[str, Any] | None) -> dict[str, Any]:
    """The protocol to apply: each option from the command line, else the checkpoint's recorded protocol (the
    run's own), else the defaults. Returns the options plus the subsample seeds and where they came from."""
    recorded = recorded or {}
    given = {
        "knn_k": args.knn_k,
        "knn_temperature": args.knn_t,
        "probe_epochs": args.probe_epochs,
        "max_train": args.max_train,
        "max_test": args.max_test,
        "seed": args.seed,
    }
    defaults = {
        **{k: DEFAULT_PROTOCOL[k] for k in ("knn_k", "knn_temperature", "probe_epochs", "seed")},
        "max_train": None,
        "max_test": None,
    }
    out, source = {}, {}
    for key, value in given.items():
        if value is not None:
            out[key], source[key] = value, "command line"
        elif key in recorded:
            out[key], source[key] = recorded[key], "checkpoint"
        else:
            out[key], source[key] = defaults[key], "default"
    # The run drew its train/test subsamples with their own seeds; an explicit --seed seeds both, as before.
    if args.seed is None and "train_subset_seed" in recorded and "test_subset_seed" in recorded:
        out["train_subset_seed"], out["test_subset_seed"] = recorded["train_subset_seed"], recorded["test_subset_seed"]
    else:
        out["train_subset_seed"] = out["test_subset_seed"] = out["seed"]
    out["source"] = (
        "checkpoint"
        if set(source.values()) <= {"checkpoint"}
        else "command line"
        if "checkpoint" not in source.values() and "command line" in source.values()
        else "defaults"
        if set(source.values()) == {"default"}
        else "mixed"
    )
    out["source_by_option"] = source
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Do the evaluation described by parsed ``args`` and return the JSON-ready record."""
    started = time.perf_counter()
    device = resolve_device(args.device)
    if args.random_init is not None:
        if args.data is not None:
            raise UsageError("with --random-init give only the data file (no checkpoint)")
        args.data, args.model = args.model, None
        chosen = resolve_protocol(args, None)
        backbone, info = _random_init_model(args, chosen["seed"], device)
        _progress(
            f"random init of {info['arch']} (width {info['width']}, torch seed {info['random_init_seed']}, "
            f"{info['feature_dim']}-d features) on {device}"
        )
    else:
        if args.data is None:
            raise UsageError("give a checkpoint and a data file (or --random-init ARCH and a data file)")
        backbone, info = _load_model(args.model, device)
        chosen = resolve_protocol(args, (info.get("extra") or {}).get("eval_protocol"))
        _progress(f"loaded {info['arch']} (width {info['width']}, {info['feature_dim']}-d features) on {device}")
    if chosen["source"] != "defaults":
        _progress("protocol: " + ", ".join(f"{k} {chosen[k]} ({v})" for k, v in chosen["source_by_option"].items()))
    data = _load_data(args.data)
    x_train, y_train = _subsample_split(data.x_train, data.y_train, chosen["max_train"], chosen["train_subset_seed"])
    x_test, y_test = _subsample_split(data.x_test, data.y_test, chosen["max_test"], chosen["test_subset_seed"])
    if len(x_train) == 0 or len(x_test) == 0:
        raise UsageError(f"data file {args.data} has an empty train or test split")
    present = np.unique(np.asarray(y_train)).size
    if data.num_classes < 2 or present < 2:  # kNN and the linear probe score a choice between classes
        raise UsageError(
            f"data file {args.data}: its training labels hold {present} class(es) "
            f"({data.num_classes} in the file); scoring an encoder needs labelled images of at least 2"
        )
    _progress(f"{len(x_train)} train / {len(x_test)} test images, {data.num_classes} classes")
    args.seed = chosen["seed"]  # the semi-supervised step uses the same seed
    protocol = {
        "feature_batch_size": args.batch_size,
        "knn_k": chosen["knn_k"],
        "knn_temperature": chosen["knn_temperature"],
        "probe_epochs": chosen["probe_epochs"],
        "probe_lr": DEFAULT_PROTOCOL["probe_lr"],
        "probe_batch_size": DEFAULT_PROTOCOL["probe_batch_size"],
        "probe_weight_decay": DEFAULT_PROTOCOL["probe_weight_decay"],
        "seed": chosen["seed"],
    }
    result = evaluate_backbone(
        backbone,
        x_train,
        y_train,
        x_test,
        y_test,
        data.num_classes,
        device,
        knn=True,
        linear=not args.no_linear,
        return_features=args.export_features is not None,
        **protocol,
    )
    _progress(f"knn_acc={result['knn_acc']} linear_probe_acc={result['linear_probe_acc']}")
    if args.export_features is not None:
        try:
            export_features(args.export_features, result, y_train, y_test)
        except OSError as error:
            raise UsageError(f"cannot write --export-features file {args.export_features}: {error}") from error
        _progress(f"features written to {args.export_features}")
    semi_started = time.perf_counter()
    semi_supervised = semi_supervised_records(
        backbone, x_train, y_train, x_test, y_test, data.num_classes, device, args
    )
    seconds_by_step = dict(result["seconds"])
    if semi_supervised:
        seconds_by_step["semi_supervised"] = time.perf_counter() - semi_started
    return {
        "model_path": args.model,
        "data_path": args.data,
        "arch": info["arch"],
        "width": info["width"],
        "input_normalization": info.get("input_normalization"),  # the encoder's own (x - mean) / std layer
        "knn_acc": result["knn_acc"],
        "linear_probe_acc": result["linear_probe_acc"],
        "num_train": result["num_train"],
        "num_test": result["num_test"],
        "num_classes": data.num_classes,
        "feature_dim": result["feature_dim"],
        "device": str(device),
        "semi_supervised": semi_supervised,
        "random_init": args.random_init is not None,
        "protocol": {
            **protocol,
            "max_train": chosen["max_train"],
            "max_test": chosen["max_test"],
            "train_subset_seed": chosen["train_subset_seed"],
            "test_subset_seed": chosen["test_subset_seed"],
            "source": chosen["source"],
            "linear": not args.no_linear,
            "semi_epochs": args.semi_epochs,
            "semi_lr": args.semi_lr,
            "semi_mode": args.semi_mode,
            "semi_batch_size": SEMI_SUPERVISED_PROTOCOL["batch_size"],
        },
        "seconds": round(time.perf_counter() - started, 3),
        "seconds_by_step": {step: round(value, 3) for step, value in seconds_by_step.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 ok, 2 bad arguments or inputs)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # argparse already printed usage/help; keep main() returning a code
        return int(exit_request.code or 0)
    try:
        record = run(args)
    except UsageError as error:
        message = str(error)
        if len(message) > MAX_ERROR_CHARS:  # e.g. a listing of every member of a wrong archive
            message = message[: MAX_ERROR_CHARS - 3] + "..."
        print(f"{PROGRAM}: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
