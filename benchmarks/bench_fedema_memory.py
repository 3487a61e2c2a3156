"""FedEMA client-state memory: 80 clients with 8 per round against 8 clients in all (the paper's Table 6 setting).

Each configuration is a real `flwr run .` simulation at tiny scale (ResNet-18 width 0.25, BYOL heads 256,
2 local steps of batch 32, 3 rounds). While it runs, the resident memory (RSS) of every process of the run
(SuperLink, SuperExec, simulation, Ray and its workers: all processes carrying the run's FLWR_HOME) is
sampled every 0.25 s; the peak of the sum is reported, with the disk used by the client states.
The "memory" client-state mode (every client's state in the ClientApp's context.state) is run too, to show
what the default "disk" mode avoids.

Usage: python benchmarks/bench_fedema_memory.py --data /path/cifar10.npz
Writes benchmarks/results/fedema_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedssl_study.launcher import flwr_run, processes_with_env, read_jsonl

RESULTS = REPO / "benchmarks" / "results"


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler(threading.Thread):
    def __init__(self, flwr_home: Path, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.flwr_home, self.interval = str(flwr_home), interval
        self.peak, self.samples, self.stop_flag = 0, 0, threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            total = sum(rss_bytes(p) for p in processes_with_env("FLWR_HOME", self.flwr_home))
            self.peak = max(self.peak, total)
            self.samples += 1
            time.sleep(self.interval)


def run_case(npz: Path, num_clients: int, per_round: int, client_state: str, rounds: int) -> dict:
    raw = {
        "name": f"mem-{num_clients}-{client_state}",
        "seed": 0,
        "rounds": rounds,
        "data": {"dataset": "cifar10", "path": str(npz), "max_train": 40 * num_clients, "partition": "iid"},
        "model": {"arch": "resnet18", "width": 0.25},
        "method": {"name": "byol", "options": {"proj_hidden_dim": 256, "proj_out_dim": 128, "pred_hidden_dim": 256}},
        "strategy": {"name": "fedema", "options": {"client_state": client_state}},
        "federation": {"num_clients": num_clients, "clients_per_round": per_round},
        "train": {"local_epochs": 1, "batch_size": 32, "max_steps_per_epoch": 2, "lr": 0.05},
        "eval": {"knn_every": 0, "linear_probe": False, "max_train": 200, "max_test": 100},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
        home = tmp / "flwr"
        sampler = PeakSampler(home)
        sampler.start()
        t0 = time.perf_counter()
        proc = flwr_run(
            f"config='{tmp / 'cfg.yaml'}' output-dir='{tmp / 'out'}'",
            home,
            federation_config=f"num-supernodes={num_clients}",
            timeout_s=1800,
        )
        sampler.stop_flag.set()
        sampler.join()
        if not (tmp / "out" / "summary.json").is_file():
            raise RuntimeError((proc.stdout + proc.stderr)[-4000:])
        records = read_jsonl(tmp / "out" / "metrics.jsonl")
        state_files = list((tmp / "out" / "client_state").glob("run-*/client_*.npz"))
        return {
            "num_clients": num_clients,
            "clients_per_round": per_round,
            "client_state": client_state,
            "rounds": rounds,
            "peak_rss_mib": sampler.peak / 2**20,
            "samples": sampler.samples,
            "wall_s": time.perf_counter() - t0,
            "clients_trained": len({c["id"] for r in records for c in r["clients"]}),
            "state_files": len(state_files),
            "state_disk_mib": sum(f.stat().st_size for f in state_files) / 2**20,
            "state_file_mib": (state_files[0].stat().st_size / 2**20) if state_files else 0.0,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "fedema_memory"))
    args = ap.parse_args(argv)
    npz = Path(args.data).resolve()
    cases = [(8, 8, "disk"), (80, 8, "disk"), (80, 8, "memory")]
    results = []
    for n, k, mode in cases:
        print(f"{n} clients, {k} per round, client_state={mode} ...", flush=True)
        results.append(run_case(npz, n, k, mode, args.rounds))
        print(json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shown = (
        "python benchmarks/bench_fedema_memory.py --data "
        + npz.name
        + (f" --rounds {args.rounds}" if args.rounds != 3 else "")
    )
    out.with_suffix(".json").write_text(
        json.dumps({"command": shown, "date": time.strftime("%Y-%m-%d %H:%M"), "cases": results}, indent=2) + "\n"
    )
    lines = [
        f"# FedEMA client-state memory ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        (
            f"Command: `{shown}`. Tiny scale: ResNet-18 width 0.25 BYOL (heads 256), 40 images per client, "
            f"2 local steps of batch 32, {args.rounds} rounds, 2-core CPU, `flwr run` simulation "
            "(client-resources num-cpus=2). Peak = highest sum of the RSS of all the run's processes "
            "(SuperLink, SuperExec, simulation, Ray and its workers), sampled every 0.25 s."
        ),
        "",
        (
            "| clients | per round | client state | clients trained | peak RSS (MiB) | state on disk (MiB) | "
            "one client's state (MiB) | wall s |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['num_clients']} | {r['clients_per_round']} | {r['client_state']} | "
            f"{r['clients_trained']} | {r['peak_rss_mib']:.0f} | {r['state_disk_mib']:.1f} | "
            f"{r['state_file_mib']:.2f} | {r['wall_s']:.0f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
