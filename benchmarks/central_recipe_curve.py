"""How fast one SSL recipe learns at CPU scale, centralized: the linear probe and kNN every few epochs.

One trainer (``train_ssl``, the clients' loop) on ``--images`` training images drawn with seed 0 from an .npz
(x_train, y_train, x_test, y_test), scored every ``--every`` epochs with the project's protocol
(``evaluate_backbone``: standardised backbone features, kNN and a linear probe on 5 000 labelled train / 1 000
test images). A fresh optimiser starts every ``--every`` epochs, as a federated round starts one. For choosing a
recipe before a federated comparison (benchmarks/results/fedema_recipe_pilots.md); prints one JSON line per point.

  python benchmarks/central_recipe_curve.py --data /path/cifar10.npz --method byol \\
      --options '{"proj_hidden_dim": 512, "proj_out_dim": 128, "pred_hidden_dim": 512, "momentum": 0.99}' \\
      --train '{"batch_size": 128, "lr": 0.001, "optimizer": "adam"}' --epochs 15 --every 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssl_models.config import ExperimentConfig
from ssl_models.evaluation.protocol import evaluate_backbone
from ssl_models.factory import build_augment, build_ssl_model
from ssl_models.training import train_ssl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--method", default="byol")
    ap.add_argument("--options", default="{}", help="method options (JSON)")
    ap.add_argument(
        "--train",
        default='{"batch_size": 128, "lr": 0.001, "optimizer": "adam"}',
        help="train_ssl arguments (JSON): batch_size, lr, optimizer, momentum, weight_decay",
    )
    ap.add_argument("--augment", default="{}", help="the config's augment section (JSON)")
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    data = np.load(args.data)
    x_train, y_train, x_test, y_test = data["x_train"], data["y_train"], data["x_test"], data["y_test"]
    train_images = x_train[np.random.default_rng(args.seed).permutation(len(x_train))[: args.images]]
    bank = np.random.default_rng(args.seed + 1).permutation(len(x_train))[:5000]
    test = np.random.default_rng(args.seed + 2).permutation(len(x_test))[:1000]
    raw = {
        "model": {"arch": args.arch, "width": args.width},
        "method": {"name": args.method, "options": json.loads(args.options)},
    }
    if json.loads(args.augment):
        raw["augment"] = json.loads(args.augment)
    cfg = ExperimentConfig.from_dict(raw)
    method = build_ssl_model(cfg, seed=args.seed)
    augment = build_augment(cfg, int(train_images.shape[1]))
    num_classes = int(max(y_train.max(), y_test.max())) + 1

    def score(epoch: int, started: float) -> None:
        r = evaluate_backbone(method.backbone, x_train[bank], y_train[bank], x_test[test], y_test[test], num_classes)
        print(
            json.dumps(
                {
                    "method": args.method,
                    "epoch": epoch,
                    "linear_probe_acc": r["linear_probe_acc"],
                    "knn_acc": r["knn_acc"],
                    "seconds": round(time.perf_counter() - started, 1),
                }
            ),
            flush=True,
        )

    started = time.perf_counter()
    score(0, started)  # the random-init reference of this very model
    done = 0
    while done < args.epochs:
        n = min(args.every, args.epochs - done)
        train_ssl(method, train_images, epochs=n, augment=augment, seed=args.seed + done, **json.loads(args.train))
        done += n
        score(done, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
