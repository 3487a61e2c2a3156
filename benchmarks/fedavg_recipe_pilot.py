"""How fast one SSL recipe learns under FedAvg at CPU scale, in one process: a recipe pilot before a comparison.

FedBYOL (or FedMoCoV3, any method and encoder of the registries: ``--method``, ``--arch``) as `strategy: fedssl`
runs it (the server's ``weighted_average`` of the method's shared state: the online backbone, projector and
predictor, BatchNorm statistics included, weighted by partition size; the app's per-round learning rate; every
client keeps its own target branch, a copy of the global online branch at its first round), but without Flower:
K client models in this process, trained one after the other with the clients' own loop (``train_ssl``). No
messages, no subprocesses, no per-round evaluation unless asked, so a pilot costs its training time and little
more. The data are drawn as the app draws them in spirit, not bit for bit (a class-stratified subset, a Dirichlet
split), so a pilot's figures are for choosing a recipe; the comparison itself runs through `flwr run`
(configs/studies/cpu/fedema-family.yaml).

Scored with the project's protocol (``evaluate_backbone``: standardised backbone features, kNN and a 100-epoch
linear probe) on 5 000 labelled train images and all test images, before training (the random-init reference
of this very model) and after the last round; kNN alone every ``--every`` rounds. One JSON line per point.

  python benchmarks/fedavg_recipe_pilot.py --data /path/cifar10.npz --clients 3 --rounds 8 --epochs 5 \\
      --train '{"batch_size": 32, "lr": 0.001, "optimizer": "adam"}' --lr-schedule constant
  python benchmarks/fedavg_recipe_pilot.py --data /path/cifar10.npz --arch vit_tiny --arch-options '{"depth": 6}' \\
      --method mocov3 --options '{"proj_hidden_dim": 512, "proj_out_dim": 128, "pred_hidden_dim": 512}' \\
      --clients 4 --alpha 1000 --rounds 24 --epochs 1 --augment '{"crop_scale": [0.2, 1.0]}' \\
      --train '{"batch_size": 64, "lr": 0.001, "optimizer": "adamw", "weight_decay": 0.05}' --lr-schedule constant
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssl_models.config import ExperimentConfig
from ssl_models.data.partition import dirichlet_partition, stratified_choice
from ssl_models.evaluation.protocol import evaluate_backbone
from ssl_models.factory import build_augment, build_ssl_model, load_partial_state, split_state, state_to_numpy
from ssl_models.training import train_ssl
from strategies.aggregation import weighted_average

BYOL_CPU_HEADS = '{"proj_hidden_dim": 512, "proj_out_dim": 128, "pred_hidden_dim": 512, "momentum": 0.99}'


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help=".npz with x_train, y_train, x_test, y_test")
    ap.add_argument("--method", default="byol")
    ap.add_argument("--options", default=BYOL_CPU_HEADS, help="method options (JSON)")
    ap.add_argument(
        "--train",
        default='{"batch_size": 64, "lr": 0.001, "optimizer": "adam"}',
        help="train_ssl arguments (JSON): batch_size, lr, optimizer, momentum, weight_decay",
    )
    ap.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine")
    ap.add_argument("--augment", default="{}", help="the config's augment section (JSON)")
    ap.add_argument("--arch", default="resnet18", help="encoder (the registry's name, e.g. vit_tiny)")
    ap.add_argument(
        "--arch-options",
        default="{}",
        help="the encoder's own options (JSON), e.g. '{\"depth\": 6}' for a 6-block vit_tiny",
    )
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=1.0, help="Dirichlet alpha of the label split")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=5, help="local epochs per round")
    ap.add_argument("--every", type=int, default=4, help="kNN every this many rounds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    data = np.load(args.data)
    x_train, y_train, x_test, y_test = data["x_train"], data["y_train"], data["x_test"], data["y_test"]
    chosen = stratified_choice(y_train, args.images, np.random.default_rng(args.seed))
    parts = (
        dirichlet_partition(y_train[chosen], args.clients, args.alpha, args.seed)
        if args.clients > 1
        else [np.arange(len(chosen))]
    )
    bank = np.random.default_rng(args.seed + 5).permutation(len(x_train))[:5000]
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    train = json.loads(args.train)
    raw = {
        "rounds": args.rounds,
        "model": {"arch": args.arch, "width": args.width},
        "method": {"name": args.method, "options": json.loads(args.options)},
        "train": {"lr": train["lr"], "lr_schedule": args.lr_schedule},
    }  # cfg.round_lr: the app's schedule
    if json.loads(args.augment):
        raw["augment"] = json.loads(args.augment)
    cfg = ExperimentConfig.from_dict(raw)
    global_model = build_ssl_model(cfg, seed=args.seed, **json.loads(args.arch_options))
    augment = build_augment(cfg, int(x_train.shape[1]))
    shared = global_model.shared_prefixes()
    clients = [copy.deepcopy(global_model) for _ in parts]  # each one's target starts as the global online branch
    started = time.perf_counter()

    def score(server_round: int, linear: bool) -> None:
        r = evaluate_backbone(
            global_model.backbone, x_train[bank], y_train[bank], x_test, y_test, num_classes, linear=linear
        )
        print(
            json.dumps(
                {
                    "round": server_round,
                    "linear_probe_acc": r["linear_probe_acc"],
                    "knn_acc": r["knn_acc"],
                    "seconds": round(time.perf_counter() - started, 1),
                }
            ),
            flush=True,
        )

    score(0, linear=True)
    for server_round in range(1, args.rounds + 1):
        lr = cfg.round_lr(server_round)
        global_shared = state_to_numpy(split_state(global_model, shared)[0])
        states, sizes, losses, precision = [], [], [], ""
        for k, (client, part) in enumerate(zip(clients, parts)):
            load_partial_state(client, global_shared)  # the download; the client's target stays its own
            stats = train_ssl(
                client,
                x_train[chosen[part]],
                epochs=args.epochs,
                augment=augment,
                seed=args.seed * 1000 + server_round * 10 + k,
                **{**train, "lr": lr},
            )
            states.append(state_to_numpy(split_state(client, shared)[0]))
            sizes.append(len(part))
            losses.append(stats.loss)
            precision = stats.precision
        load_partial_state(global_model, weighted_average(states, sizes))
        print(
            json.dumps(
                {
                    "round": server_round,
                    "train_loss": round(float(np.mean(losses)), 4),
                    "lr": lr,
                    "precision": precision,
                    "seconds": round(time.perf_counter() - started, 1),
                }
            ),
            flush=True,
        )
        last = server_round == args.rounds
        if last or server_round % args.every == 0:
            score(server_round, linear=last)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
