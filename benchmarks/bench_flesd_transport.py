"""FLESD transport check: a 10,000-image public set's similarity matrices (10^8 entries each) through a real
`flwr run .` simulation, with the peak memory of all the run's processes.

Two clients (tiny ResNet-18/ResNet-34, 5 local steps) upload dense matrices of the server-held public split;
the server ensembles them and distils. Writes benchmarks/results/flesd_transport_10k.{json,md}.

Usage: python benchmarks/bench_flesd_transport.py --data /path/cifar10.npz [--similarity dense-fp16|dense-fp32|topk]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_fedema_memory import PeakSampler
from fedssl_study.launcher import flwr_run, read_jsonl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--public-size", type=int, default=10_000)
    ap.add_argument("--similarity", default="dense-fp16", choices=("dense-fp32", "dense-fp16", "topk"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "flesd_transport_10k"))
    args = ap.parse_args(argv)
    raw = yaml.safe_load((REPO / "configs" / "smoke-flesd.yaml").read_text())
    raw.update(name="flesd-transport", rounds=1)
    raw["data"].update(
        path=str(Path(args.data).resolve()), max_train=args.public_size + 2000, public_size=args.public_size
    )
    raw["strategy"]["options"]["similarity"] = args.similarity
    raw["train"]["max_steps_per_epoch"] = 5
    raw["eval"].update(knn_every=0, linear_probe=False)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
        sampler = PeakSampler(tmp / "flwr")
        sampler.start()
        t0 = time.perf_counter()
        proc = flwr_run(f"config='{tmp / 'cfg.yaml'}' output-dir='{tmp / 'out'}'", tmp / "flwr", timeout_s=1800)
        sampler.stop_flag.set()
        sampler.join()
        if not (tmp / "out" / "summary.json").is_file():
            raise RuntimeError((proc.stdout + proc.stderr)[-3000:])
        rec = read_jsonl(tmp / "out" / "metrics.jsonl")[0]
    result = {
        "command": f"python benchmarks/bench_flesd_transport.py --data {Path(args.data).name} --similarity "
        f"{args.similarity}" + (f" --public-size {args.public_size}" if args.public_size != 10_000 else ""),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "public_size": args.public_size,
        "similarity": args.similarity,
        "clients": 2,
        "bytes_up": rec["bytes_up"],
        "bytes_down": rec["bytes_down"],
        "round_wall_s": rec["wall_s"],
        "ensemble_s": rec["ensemble_s"],
        "distill_s": rec["distill_s"],
        "peak_rss_mib": sampler.peak / 2**20,
        "run_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"# FLESD: a {args.public_size:,}-image public set through Flower ({result['date']})\n\n"
        f"Command: `{result['command']}` (configs/smoke-flesd.yaml with a {args.public_size:,}-image public split, "
        f"{args.similarity} uploads, 1 round, 2 clients: ResNet-18 and ResNet-34 at width 0.125, 5 local steps; "
        "`flwr run` simulation on a 2-core CPU).\n\n"
        "| public images | entries per matrix | upload form | bytes up (2 clients) | round wall s | server ensemble s "
        "| distillation s | peak RSS of all run processes (MiB) |\n|---|---|---|---|---|---|---|---|\n"
        f"| {args.public_size:,} | {args.public_size**2:,} | {args.similarity} | {result['bytes_up']:,} "
        f"({result['bytes_up'] / 2**20:.1f} MiB) | {result['round_wall_s']:.1f} | {result['ensemble_s']:.1f} | "
        f"{result['distill_s']:.1f} | {result['peak_rss_mib']:.0f} |\n"
    )
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
