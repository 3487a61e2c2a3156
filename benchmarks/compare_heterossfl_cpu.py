"""CPU-scale comparison of Hetero-SSFL with local-only SSL, per architecture (the paper's Table 4 shape).

Rows per architecture (ResNet-18 and ResNet-34 clients of `configs/heterossfl/cpu-compare.yaml`):
- random init: the clients' initial encoder of that architecture (seeded: the weights every client of it starts
  from), scored with the same protocol (`ServerEvaluator`, i.e. `evaluate_backbone` on the config's eval subsets);
- local SSL: `strategy: local`, the same clients, architectures, data, initial weights and local training, no
  collaboration;
- Hetero-SSFL: the config as it is, and a variant with the exact per-step alignment on RAD minibatches;
- centralized: one `strategy: central` run per architecture on the clients' pooled data (the same method, recipe
  and number of passes over every image, one trainer).
Each federated run is a real `flwr run .` simulation (seeds from --seeds); the client rows are the mean (and
minimum) over that architecture's clients. Writes benchmarks/results/heterossfl_cpu_compare.{json,md}, updated
after every run. With --semi-supervised 0.01,0.1 every saved client encoder is also fine-tuned on those label
fractions by `fedssl-eval` (slow on a CPU).

Two Hetero-SSFL variants run by default (``--hetero``): the config as it is (A_k recomputed once per local epoch)
and ``refresh=minibatch,rad_batch_size=128`` (the exact alignment gradient at every step on a RAD minibatch).

Usage: python benchmarks/compare_heterossfl_cpu.py --data /path/cifar10.npz [--seeds 0 1 2] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from runs import REPO, run_experiment

sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
CONFIG = REPO / "configs" / "heterossfl" / "cpu-compare.yaml"
SCORES = ("linear_probe_acc", "knn_acc")
# Hetero-SSFL runs of every seed: the config as it is (A_k once per local epoch, the paper's Algorithm 1) and the
# exact per-step alignment on RAD minibatches (the better of the two in the one-seed pilot).
HETERO_VARIANTS = ("", "refresh=minibatch,rad_batch_size=128")


def variant_configs(base: dict, seed: int, data: str, rounds: int | None) -> dict[str, dict]:
    """The federated runs of one seed: Hetero-SSFL, local SSL, and centralized per architecture if available."""
    from strategies import STRATEGIES

    def derive(name: str, **changes) -> dict:
        raw = json.loads(json.dumps(base))
        raw.update(seed=seed, name=f"{base['name']}-{name}-seed{seed}")
        raw["data"]["path"] = data
        if rounds:
            raw["rounds"] = rounds
        for key, value in changes.items():
            section, field = key.split(".")
            raw[section][field] = value
        return raw

    out = {"heterossfl": derive("heterossfl"),
           "local": derive("local", **{"strategy.name": "local", "strategy.options": {}})}
    if "central" in STRATEGIES:
        for arch in sorted(set(base["model"]["client_archs"])):
            out[f"central-{arch}"] = derive(f"central-{arch}", **{"strategy.name": "central", "strategy.options": {},
                                                                  "model.arch": arch, "model.client_archs": []})
    return out


def random_init_scores(raw: dict) -> dict[str, dict[str, float]]:
    """Each architecture's initial encoder (what its clients start from), scored with the server's protocol."""
    from client_app.tasks import initial_client_model
    from fedssl_wire import to_array_record
    from server_app.app import ServerEvaluator
    from ssl_models.config import ExperimentConfig
    from ssl_models.factory import split_state, state_to_numpy
    from strategies.fedssl import ModelToEvaluate

    cfg = ExperimentConfig.from_dict(raw)
    evaluator = ServerEvaluator(cfg)
    scores = {}
    for arch in sorted(set(cfg.client_arch(i) for i in range(cfg.federation.num_clients))):
        pid = next(i for i in range(cfg.federation.num_clients) if cfg.client_arch(i) == arch)
        model = initial_client_model(cfg, pid)
        state = state_to_numpy(split_state(model, ("backbone.",))[0])
        s = evaluator.evaluate(ModelToEvaluate(arch, to_array_record(state)), knn=True, linear=cfg.eval.linear_probe)
        scores[arch] = {k: s[k] for k in SCORES}
    return scores


def semi_supervised(out_dir: Path, data: str, fractions: str, max_train: int, max_test: int) -> dict[str, Any]:
    """fedssl-eval's semi-supervised fine-tuning on every saved client encoder (model_client_<i>.pt)."""
    scores = {}
    for path in sorted(out_dir.glob("model_client_*.pt")):
        proc = subprocess.run([sys.executable, "-m", "ssl_models.evaluation.cli", str(path), data,
                               "--semi-supervised", fractions, "--max-train", str(max_train), "--max-test",
                               str(max_test), "--no-linear"], cwd=REPO, capture_output=True, text=True, check=True)
        line = json.loads(proc.stdout.strip().splitlines()[-1])
        scores[path.stem[len("model_"):]] = {str(r["fraction"]): r["accuracy"] for r in line.get("semi_supervised", [])}
    return scores


def client_rows(summary: dict, archs: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per architecture, each score of every client of it."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, scores in (summary.get("scores_by_model") or {}).items():
        arch = archs[int(name.split("_")[1])]
        for key in SCORES:
            if scores.get(key) is not None:
                out.setdefault(arch, {}).setdefault(key, []).append(100 * scores[key])
    return out


def alignment_curve(rounds: list[dict]) -> list[dict[str, Any]]:
    """Per round: mean CKA(K_k, K_bar) over the clients that had a K_bar, before and after local training (also
    without alignment, mu 0: the no-alignment reference), and the clients' mean raw kernel norm ||H K H||_F."""
    curve = []
    for r in rounds:
        measured = [c for c in r.get("clients", []) if c.get("cka_start") is not None and c.get("cka_end") is not None]
        if measured:
            curve.append({"round": r["round"],
                          "cka_start": statistics.mean(c["cka_start"] for c in measured),
                          "cka_end": statistics.mean(c["cka_end"] for c in measured),
                          "kernel_norm": {str(c["id"]): c.get("kernel_norm") for c in r["clients"]}})
    return curve


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def write_tables(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    base = results["config"]
    archs = base["model"]["client_archs"]
    seeds = sorted({r["seed"] for r in results["runs"]})
    d, t = base["data"], base["train"]
    lines = [f"# Hetero-SSFL vs local SSL at CPU scale ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"{'**Pilot**: ' if results.get('pilot') else ''}Command: `{results['command']}`. Config: "
             f"`configs/heterossfl/cpu-compare.yaml` ({results['rounds']} rounds x {t['local_epochs']} local epochs, "
             f"batch {t['batch_size']}; {base['federation']['num_clients']} clients {archs} at width "
             f"{base['model']['width']}, {d['classes_per_client']} CIFAR-10 classes each, "
             f"{int(d['max_train'] - d['public_size'])} client images, RAD of {int(d['public_size'])} images; "
             f"{base['method']['name']}; mu {base['strategy']['options']['mu']}). Scores: linear probe / kNN of each client's own encoder on "
             f"{base['eval']['max_train']} labelled train and {base['eval']['max_test'] or 'all'} dev-test images (CIFAR-10 "
             "dev copy, JPEG-derived: relative comparison only). Client rows: mean over that architecture's "
             f"clients, then mean ± std over seeds {', '.join(map(str, seeds))}.", "",
             "| architecture | row | linear probe | kNN | min over clients (linear probe) |", "|---|---|---|---|---|"]
    for arch in sorted(set(archs)):
        rand = [100 * r["random_init"][arch]["linear_probe_acc"] for r in results["runs"] if "random_init" in r]
        rand_knn = [100 * r["random_init"][arch]["knn_acc"] for r in results["runs"] if "random_init" in r]
        lines.append(f"| {arch} | random init | {mean_std(rand)} | {mean_std(rand_knn)} | - |")
        hetero = sorted({r["variant"] for r in results["runs"] if r["variant"].startswith("heterossfl")})
        plain = f"Hetero-SSFL (the config: refresh={base['strategy']['options'].get('refresh', 'epoch')})"
        for variant, label in [("local", "local SSL (strategy local)")] + [
                (v, "Hetero-SSFL" + v[len("heterossfl"):] if v != "heterossfl" else plain) for v in hetero]:
            rs = [r for r in results["runs"] if r["variant"] == variant]
            per_seed = [r["by_arch"].get(arch, {}) for r in rs]
            lp = [statistics.mean(s["linear_probe_acc"]) for s in per_seed if s.get("linear_probe_acc")]
            kn = [statistics.mean(s["knn_acc"]) for s in per_seed if s.get("knn_acc")]
            mins = [min(s["linear_probe_acc"]) for s in per_seed if s.get("linear_probe_acc")]
            lines.append(f"| {arch} | {label} | {mean_std(lp)} | {mean_std(kn)} | {mean_std(mins)} |")
        central = [r for r in results["runs"] if r["variant"] == f"central-{arch}"]
        if central:
            lines.append(f"| {arch} | centralized (strategy central) | "
                         f"{mean_std([100 * r['summary_scores']['linear_probe_acc'] for r in central])} | "
                         f"{mean_std([100 * r['summary_scores']['knn_acc'] for r in central])} | - |")
        else:
            lines.append(f"| {arch} | centralized (strategy central) | not run (`--variants central-{arch}`) | - | - |")
    lines += ["", "Per run:", "", "| variant | seed | per-client linear probe | per-client kNN | up MiB | down MiB | "
              "eval MiB up | run s |", "|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        if "per_client" not in r:
            continue
        lp = ", ".join(f"{k}: {100 * v['linear_probe_acc']:.1f}" for k, v in r["per_client"].items()
                       if v.get("linear_probe_acc") is not None)
        kn = ", ".join(f"{k}: {100 * v['knn_acc']:.1f}" for k, v in r["per_client"].items()
                       if v.get("knn_acc") is not None)
        lines.append(f"| {r['variant']} | {r['seed']} | {lp} | {kn} | {r['bytes_up'] / 2**20:.1f} | "
                     f"{r['bytes_down'] / 2**20:.1f} | {r.get('eval_bytes_up', 0) / 2**20:.1f} | {r['run_s']:.0f} |")
    curves = [r for r in results["runs"] if r.get("alignment")]
    if curves:
        lines += ["", "Alignment (Hetero-SSFL): mean CKA(K_k, K_bar) of the round's clients at their first refresh "
                  "(before local training) and after it:", ""]
        for r in curves:
            lines.append(f"- {r['variant']}, seed {r['seed']}: " + "; ".join(
                f"r{c['round']} {c['cka_start']:.3f} -> {c['cka_end']:.3f}" for c in r["alignment"]))
    lines += ["", "Bytes: Hetero-SSFL moves one N_RAD^2 kernel each way per client and round (`up`/`down`; round 1 "
              "has nothing to send down) and the encoders only for evaluation (`eval MiB up`); the local-SSL run "
              "uploads each client's model every round for the server's evaluation (Min-Local's design) and "
              "receives the initial model once.", ""]
    if results.get("notes"):
        lines += [f"- {n}" for n in results["notes"]] + [""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--rounds", type=int, default=None, help="override the config's rounds (pilot runs)")
    ap.add_argument("--variants", nargs="+", default=None, help="only these variants (heterossfl, local, central-*)")
    ap.add_argument("--only-hetero", action="store_true", help="only the --hetero variants (no local or central run)")
    ap.add_argument("--semi-supervised", default="", help="label fractions for fedssl-eval, e.g. 0.01,0.1")
    ap.add_argument("--pilot", action="store_true", help="label the results as a pilot")
    ap.add_argument("--note", action="append", default=[], help="a sentence added under the tables")
    ap.add_argument("--hetero", action="append", default=None, metavar="OPTIONS",
                    help="a Hetero-SSFL variant: strategy options over the config's, 'name=value,...' ('' = the "
                         f"config as it is); repeatable (default: {' and '.join(repr(v) for v in HETERO_VARIANTS)})")
    ap.add_argument("--results", default=None,
                    help="add the runs to this earlier results JSON (same config); its (variant, seed) pairs are kept, "
                         "not run again")
    ap.add_argument("--out", default=str(RESULTS / "heterossfl_cpu_compare"))
    args = ap.parse_args(argv)
    base = yaml.safe_load(CONFIG.read_text())
    hetero = {}
    for spec in (args.hetero if args.hetero is not None else list(HETERO_VARIANTS)):
        overrides = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = item.partition("=")
            if not key or not value:
                ap.error(f"--hetero {spec!r}: expected name=value,... (strategy options)")
            overrides[key] = yaml.safe_load(value)
        name = "heterossfl" + (" (" + ", ".join(f"{k}={v}" for k, v in overrides.items()) + ")" if overrides else "")
        hetero[name] = overrides
    data = str(Path(args.data).resolve())
    command = (f"python benchmarks/compare_heterossfl_cpu.py --data {Path(args.data).name} --seeds "
               + " ".join(map(str, args.seeds)) + (f" --rounds {args.rounds}" if args.rounds else "")
               + (" --pilot" if args.pilot else ""))
    if args.hetero is not None:
        command += "".join(f" --hetero '{spec}'" for spec in args.hetero)
    if args.variants:
        command += " --variants " + " ".join(f"'{v}'" for v in args.variants)
    if args.only_hetero:
        command += " --only-hetero"
    results: dict[str, Any] = {"command": command, "config": base, "rounds": args.rounds or base["rounds"],
                               "pilot": args.pilot, "notes": args.note, "runs": []}
    if args.results:  # continue an earlier results file: keep its runs, commands and notes
        earlier = json.loads(Path(args.results).read_text())
        if earlier["config"] != base or earlier["rounds"] != results["rounds"]:
            ap.error(f"--results {args.results}: measured with another config or number of rounds than "
                     f"{CONFIG.relative_to(REPO)} now holds; start a new results file (--out)")
        results["runs"] = earlier["runs"]
        results["command"] = earlier["command"] + "; then " + command + " --results <the first results JSON>"
        results["notes"] = earlier.get("notes", []) + args.note
    archs = base["model"]["client_archs"]
    out = Path(args.out)
    for seed in args.seeds:
        configs = variant_configs(base, seed, data, args.rounds)
        plain = configs.pop("heterossfl")
        for name, overrides in hetero.items():
            configs[name] = json.loads(json.dumps(plain))
            configs[name]["strategy"]["options"].update(overrides)
            if overrides:  # a distinct run name per variant
                configs[name]["name"] += "-" + "-".join(f"{k}-{v}" for k, v in overrides.items())
        if not any(r["variant"] == "random-init" and r["seed"] == seed for r in results["runs"]):
            t0 = time.perf_counter()
            rand = random_init_scores(plain)
            results["runs"].append({"variant": "random-init", "seed": seed, "random_init": rand,
                                    "run_s": time.perf_counter() - t0})
            print(json.dumps(results["runs"][-1]), flush=True)
            write_tables(results, out)
        for variant, raw in configs.items():
            if args.variants and variant not in args.variants:
                continue
            if args.only_hetero and variant not in hetero:
                continue
            if any(r["variant"] == variant and r["seed"] == seed for r in results["runs"]):
                continue  # measured by the earlier invocation (--results): keep it
            with tempfile.TemporaryDirectory() as keep:
                res = run_experiment(raw, keep_dir=Path(keep))
                s = res["summary"]
                run = {"variant": variant, "seed": seed, "run_s": res["run_s"],
                       "bytes_up": s["bytes_up_total"], "bytes_down": s["bytes_down_total"],
                       "eval_bytes_up": s.get("eval_bytes_up_total", 0),
                       "summary_scores": {k: s.get(k) for k in SCORES},
                       "knn_curve": [[r["round"], r.get("knn_acc_by_model") or r.get("knn_acc")]
                                     for r in res["rounds"] if r.get("knn_acc") is not None]}
                if s.get("scores_by_model"):
                    run["per_client"] = s["scores_by_model"]
                    run["by_arch"] = client_rows(s, archs)
                if variant.startswith("heterossfl"):
                    run["alignment"] = alignment_curve(res["rounds"])
                    run["options"] = raw["strategy"]["options"]
                if args.semi_supervised and s.get("scores_by_model"):
                    run["semi_supervised"] = semi_supervised(Path(keep) / "out", data, args.semi_supervised,
                                                             base["eval"]["max_train"], base["eval"]["max_test"])
            results["runs"].append(run)
            print(json.dumps({k: run[k] for k in ("variant", "seed", "run_s", "summary_scores")}), flush=True)
            write_tables(results, out)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
