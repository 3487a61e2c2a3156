"""Per-round overhead of a deployed federation against a simulated one, same config, same machine.

Simulated: `flwr run .` on Flower's local simulation (Ray), as in the README's default command.
Deployed: the README's by-hand deployment on loopback: a SuperLink and one SuperNode per client, TLS and
SuperNode authentication on, made with docker/make-certs.sh and docker/make-supernode-key.sh. Two isolation
modes: `subprocess` (the SuperLink and SuperNodes start the ServerApp/ClientApps themselves, the README's
commands) and `process` (a separate SuperExec per SuperLink/SuperNode, the layout of the docker compose
files).

The round time is the ServerApp's own `wall_s` (from sending the round's messages to aggregating the
replies, evaluation excluded); the overhead of a round is deployed minus simulated. Writes
benchmarks/results/deployment.{json,md}.

Containers (`--isolation containers`, or a list such as `subprocess,containers`): the README's one-host compose
block, docker/compose.yml + docker/compose.tls.yml (process isolation, TLS + SuperNode authentication, each
component in its own container), on a Docker engine that runs or that the benchmark starts (as root) and stops,
with the images of docker/docker_engine.py (built or reused); the run config carries the same settings.

Usage: python benchmarks/bench_deployment.py --data /path/cifar10.npz [--rounds 4] [--isolation both]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "docker"))  # compose_native, docker_engine

from compose_native import kill_group, wait_for
from fedssl_study.launcher import free_port, kill_processes_with_env, read_jsonl, run_experiment

MARKER = "FEDSSL_BENCH_DEPLOYMENT"
BIN = Path(sys.executable).parent


def experiment(data: Path, rounds: int) -> dict:
    raw = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    raw.update(name="bench-deployment", rounds=rounds)
    raw["data"].update(path=str(data.resolve()))
    raw["eval"].update(knn_every=0)  # evaluation is outside wall_s anyway; this keeps the run short
    return raw


def _exe(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else name


class LoopbackDeployment:
    """A SuperLink and SuperNodes on 127.0.0.1, TLS + SuperNode auth, each process in its own group."""

    def __init__(self, tmp: Path, num_nodes: int, isolation: str, threads_per_node: int) -> None:
        self.tmp, self.n, self.isolation = tmp, num_nodes, isolation
        self.threads_per_node = threads_per_node
        self.port = free_port()
        self.secrets = tmp / "secrets"
        self.env = {
            **os.environ,
            MARKER: str(os.getpid()),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            # The SuperExec looks for new tasks every second by default; every message pays up to that.
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1"),
        }
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, argv: list[str], home: str, **env: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - the child process's output: open as long as it runs
        proc = subprocess.Popen(
            argv,
            cwd=self.tmp,
            env={**self.env, "FLWR_HOME": str(self.tmp / home), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def _cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_exe("flwr"), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env={**self.env, "FLWR_HOME": str(self.tmp / "cli")},
            check=False,
        )

    def start(self) -> None:
        sh = lambda *a: subprocess.run(["bash", *map(str, a)], check=True, capture_output=True)
        sh(REPO / "docker" / "make-certs.sh", self.secrets, "localhost", "127.0.0.1")
        tls = [
            "--ssl-ca-certfile",
            self.secrets / "ca.crt",
            "--ssl-certfile",
            self.secrets / "server.pem",
            "--ssl-keyfile",
            self.secrets / "server.key",
        ]
        secret = ["--superexec-auth-secret-file", str(self.secrets / "superexec.secret")]
        process = self.isolation == "process"
        self._start(
            "superlink",
            [
                _exe("flower-superlink"),
                *map(str, tls),
                "--enable-supernode-auth",
                "--isolation",
                self.isolation,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
                *(secret if process else []),
            ],
            "link",
        )
        if process:
            self._start(
                "superexec-serverapp",
                [
                    _exe("flower-superexec"),
                    "--runtime-api-address",
                    f"127.0.0.1:{self.port}",
                    "--root-certificates",
                    str(self.secrets / "ca.crt"),
                    *secret,
                ],
                "exec-server",
            )
        try:
            wait_for(self._listening, 60, "the SuperLink to listen")
        except TimeoutError:
            raise RuntimeError((self.tmp / "superlink.log").read_text()[-2000:]) from None
        (self.tmp / "cli").mkdir(exist_ok=True)
        (self.tmp / "cli" / "config.toml").write_text(
            f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{self.secrets / "ca.crt"}"\n'
        )
        for i in range(self.n):
            keys = self.tmp / f"node-{i}"
            sh(REPO / "docker" / "make-supernode-key.sh", keys)
            reg = self._cli("supernode", "register", str(keys / "supernode.key.pub"), "bench")
            if reg.returncode != 0:
                raise RuntimeError(reg.stdout + reg.stderr)
            node_port = free_port()
            node_secret = ["--superexec-auth-secret-file", str(keys / "superexec.secret")]
            self._start(
                f"supernode-{i}",
                [
                    _exe("flower-supernode"),
                    "--superlink",
                    f"127.0.0.1:{self.port}",
                    "--root-certificates",
                    str(self.secrets / "ca.crt"),
                    "--auth-supernode-private-key",
                    str(keys / "supernode.key"),
                    "--isolation",
                    self.isolation,
                    "--port",
                    str(node_port),
                    "--node-config",
                    f"partition-id={i} num-partitions={self.n}",
                    *(node_secret if process else []),
                ],
                f"node-{i}",
                **self.node_env(),
            )
            if process:
                self._start(
                    f"superexec-clientapp-{i}",
                    [
                        _exe("flower-superexec"),
                        "--insecure",
                        "--runtime-api-address",
                        f"127.0.0.1:{node_port}",
                        *node_secret,
                    ],
                    f"exec-node-{i}",
                    **self.node_env(),
                )

    def node_env(self) -> dict[str, str]:
        """The SuperNodes share this machine's cores: torch threads per ClientApp, so that they do not
        oversubscribe them (the simulation runs one client at a time with every core)."""
        return {"OMP_NUM_THREADS": str(self.threads_per_node)}

    def run(self, config: Path, out: Path) -> subprocess.CompletedProcess:
        return self._cli("run", str(REPO), "bench", "--stream", "--run-config", f"config='{config}' output-dir='{out}'")

    def stop(self) -> None:
        for proc in self.procs:
            kill_group(proc, signal.SIGKILL)
        kill_processes_with_env(MARKER, str(os.getpid()))


def deployed_run(raw: dict, isolation: str, threads_per_node: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
        dep = LoopbackDeployment(tmp, raw["federation"]["num_clients"], isolation, threads_per_node)
        # The operator's roots for the run's paths (server_app/paths.py): this run's folder and the data file's.
        data_dir = str(Path(raw["data"].get("path") or tmp).parent)
        dep.env["FEDSSL_ALLOWED_ROOTS"] = os.pathsep.join([str(tmp), data_dir])
        try:
            t0 = time.perf_counter()
            dep.start()
            started_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            proc = dep.run(tmp / "cfg.yaml", tmp / "out")
            run_s = time.perf_counter() - t1
        finally:
            dep.stop()
        if not (tmp / "out" / "summary.json").is_file():
            raise RuntimeError(f"deployed run ({isolation}) failed:\n" + (proc.stdout + proc.stderr)[-3000:])
        return {
            "summary": json.loads((tmp / "out" / "summary.json").read_text()),
            "rounds": read_jsonl(tmp / "out" / "metrics.jsonl"),
            "run_s": run_s,
            "startup_s": started_s,
        }


def container_run(raw: dict, data: Path, threads_per_node: int) -> dict:
    """The same experiment in containers: docker/compose.yml + docker/compose.tls.yml on this machine."""
    from docker_engine import CACHE, Engine, OneHost, docker_disk_mb, engine_unavailable, ensure_images

    reason = engine_unavailable()
    if reason:
        raise RuntimeError(f"no Docker engine for the container run: {reason}")
    engine = Engine(CACHE / "dockerd.log").start()
    try:
        images = ensure_images()
        with tempfile.TemporaryDirectory() as tmp:
            one = OneHost(Path(tmp), data, f"fedssl-bench-{os.getpid()}", free_port(), threads_per_node)
            try:
                t0 = time.perf_counter()
                one.up()
                started_s = time.perf_counter() - t0
                log = Path(tmp) / "run.log"
                t1 = time.perf_counter()
                # The experiment of the other modes, as run-config overrides of the same YAML (inside the FAB).
                proc = one.cli.run(
                    f"config='configs/smoke.yaml' name='{raw['name']}' rounds={raw['rounds']} "
                    f"eval.knn_every={raw['eval']['knn_every']} data.path='/data/cifar10.npz'",
                    log,
                )
                proc.wait(timeout=3600)
                run_s = time.perf_counter() - t1
                summaries = list(one.outputs.glob(f"{raw['name']}-*/summary.json"))
                if len(summaries) != 1:
                    raise RuntimeError("container run failed:\n" + log.read_text()[-3000:])
                out = summaries[0].parent
                result = {
                    "summary": json.loads(summaries[0].read_text()),
                    "rounds": read_jsonl(out / "metrics.jsonl"),
                    "run_s": run_s,
                    "startup_s": started_s,
                }
            finally:
                one.down()
        result["images"] = {
            "flwr": images.flwr,
            "torch": images.torch,
            "sizes_mb": images.sizes_mb,
            "build_s": images.timings_s,
            "docker_disk_mb": docker_disk_mb(),
        }
        return result
    finally:
        engine.stop()


COLD_START = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from client_app.rounds.weights import local_images, train_local_ssl
from ssl_models.config import ExperimentConfig
t2 = time.perf_counter()
cfg = ExperimentConfig.from_yaml(sys.argv[1])
images = local_images(cfg, 0)
t3 = time.perf_counter()
train = lambda: train_local_ssl(cfg, images, {}, None, server_round=2, partition_id=0, lr=cfg.train.lr,
                                update_both=False, rule="fedssl", rule_options={}, proximal_mu=0.0,
                                proximal_form="paper", log=lambda line: None)
train()
t4 = time.perf_counter()
train()
t5 = time.perf_counter()
print(json.dumps({"import_torch_s": t1 - t0, "import_app_s": t2 - t1, "load_partition_s": t3 - t2,
                  "first_training_s": t4 - t3, "warm_training_s": t5 - t4}))
"""


def message_objects(raw: dict) -> dict:
    """Flower objects in one training message of this config's model (each is one request on every hop): the app's
    packed record against one Array per tensor (Flower's plain ArrayRecord, this app's encoding until 2026-11-23)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from fedssl_wire import record_bytes, to_array_record
    from ssl_models.config import ExperimentConfig
    from ssl_models.factory import build_ssl_model, split_state, state_to_numpy

    cfg = ExperimentConfig.from_dict(raw)
    model = build_ssl_model(cfg, seed=cfg.seed)
    state = state_to_numpy(split_state(model, model.shared_prefixes(with_target=False))[0])
    # As after a round of training, every tensor distinct: the initial model's BatchNorm ones and zeros repeat, and
    # Flower stores a repeated object once, which would understate a warm round's count.
    rng = np.random.default_rng(0)
    state = {
        k: (v + rng.standard_normal(v.shape).astype(v.dtype)) if v.dtype.kind == "f" else v for k, v in state.items()
    }
    out = {"arrays": len(state)}
    for name, record in (
        ("per_array", ArrayRecord({k: Array(v) for k, v in state.items()})),
        ("packed", to_array_record(state)),
    ):
        content = RecordDict({"arrays": record, "config": ConfigRecord({"server-round": 1})})
        # + 1: the Message around the content (building one needs a run's identity)
        out[name] = {"objects": len(get_all_nested_objects(content)) + 1, "record_bytes": record_bytes(record)}
    return out


def client_cold_start(raw: dict, threads: int) -> dict:
    """What a ClientApp pays in a new process before and during its first training (a deployed SuperNode
    starts a new process for every message): imports, loading its partition, the first training."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cfg.yaml").write_text(yaml.safe_dump(raw))
        proc = subprocess.run(
            [sys.executable, "-c", COLD_START, str(Path(tmp) / "cfg.yaml")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def round_table(runs: dict[str, dict]) -> list[dict]:
    sim = runs["simulation"]["rounds"]
    rows = []
    for i, r in enumerate(sim):
        row = {"round": r["round"], "simulation_s": r["wall_s"], "simulation_train_s": r["client_train_s_max"]}
        for mode, res in runs.items():
            if mode == "simulation":
                continue
            d = res["rounds"][i]
            row[f"{mode}_s"] = d["wall_s"]
            row[f"{mode}_train_s"] = d["client_train_s_max"]
            row[f"{mode}_overhead_s"] = d["wall_s"] - r["wall_s"]
        rows.append(row)
    return rows


# A deployed round's time per client, from the timeline each reply carries (metrics.jsonl `timeline_s`: seconds after
# the server created the client's message; strategies/nodes.py client_timeline), as consecutive stretches.
HOPS = (
    ("dispatch", None, "process_start", "SuperLink -> SuperNode (its poll) -> executor -> a new process"),
    (
        "interpreter and Flower",
        "process_start",
        "import_start",
        "Python and Flower start; the message's objects are received and pulled; the FAB is installed",
    ),
    ("app imports", "import_start", "app_imported", "torch and the app's modules"),
    ("to the handler", "app_imported", "handler_start", "the message and context reach the handler"),
    ("handler", "handler_start", "reply_ready", "data, model, local training (train_s), the reply's metrics"),
    ("way back", "reply_ready", "received", "serialise, -> SuperNode -> SuperLink -> the ServerApp's poll"),
)


def hop_breakdown(rounds: list[dict]) -> dict[str, float]:
    """Mean over the given rounds' clients of each stretch of HOPS (s), with the mean training time inside the
    handler. A ClientApp in a long-lived process (the simulation's: its process started before the message) has
    no start-up stretches: its dispatch runs up to the handler."""
    values: dict[str, list[float]] = {}
    for c in (c for r in rounds for c in r.get("clients", [])):
        t = c.get("timeline_s") or {}
        if not t:
            continue
        reused = t.get("process_start", -1.0) < 0
        for name, start, end, _ in HOPS:
            if reused and name != "handler" and name != "way back":
                if name == "dispatch" and "handler_start" in t:
                    values.setdefault(name, []).append(t["handler_start"])
                continue
            a, b = (0.0 if start is None else t.get(start)), t.get(end)
            if a is not None and b is not None:
                values.setdefault(name, []).append(b - a)
        values.setdefault("train_s (inside the handler)", []).append(float(c["train_s"]))
        if "received" in t:
            values.setdefault("message created -> reply received", []).append(t["received"])
    return {name: statistics.mean(v) for name, v in values.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--isolation",
        default="both",
        help="subprocess, process, both (= subprocess,process), containers, or a comma-separated list",
    )
    ap.add_argument(
        "--threads-per-node",
        type=int,
        default=0,
        help="OMP_NUM_THREADS of each SuperNode's ClientApps (default: CPU cores / clients)",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "deployment"))
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="an earlier result's .json: its warm-round figures are put beside the new ones",
    )
    args = ap.parse_args(argv)
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    raw = experiment(args.data, args.rounds)
    modes = ["subprocess", "process"] if args.isolation == "both" else args.isolation.split(",")
    if not set(modes) <= {"subprocess", "process", "containers"}:
        ap.error(f"--isolation {args.isolation}: unknown mode")
    threads = args.threads_per_node or max(1, (os.cpu_count() or 1) // raw["federation"]["num_clients"])

    runs: dict[str, dict] = {}
    print("simulation ...", flush=True)
    runs["simulation"] = run_experiment(raw)
    for mode in modes:
        print(f"deployed, {mode} isolation ...", flush=True)
        runs[f"deployed_{mode}"] = (
            container_run(raw, args.data, threads) if mode == "containers" else deployed_run(raw, mode, threads)
        )

    cold = client_cold_start(raw, threads)
    objects = message_objects(raw)
    rows = round_table(runs)
    warm = rows[1:] if len(rows) > 1 else rows
    summary = {}
    for mode in runs:
        if mode == "simulation":
            continue
        summary[mode] = {
            "first_round_overhead_s": rows[0][f"{mode}_overhead_s"],
            "warm_round_overhead_s_mean": statistics.mean(r[f"{mode}_overhead_s"] for r in warm),
            "warm_round_s_mean": statistics.mean(r[f"{mode}_s"] for r in warm),
            "warm_round_ratio": statistics.mean(r[f"{mode}_s"] for r in warm)
            / statistics.mean(r["simulation_s"] for r in warm),
            "warm_train_s_mean": statistics.mean(r[f"{mode}_train_s"] for r in warm),
            "run_s": runs[mode]["run_s"],
            "startup_s": runs[mode]["startup_s"],
            # Same seeds and data; other torch thread counts change float rounding only.
            "max_loss_difference": max(
                abs(a["train_loss"] - b["train_loss"])
                for a, b in zip(runs[mode]["rounds"], runs["simulation"]["rounds"])
            ),
            "linear_probe_acc": runs[mode]["summary"]["linear_probe_acc"],
            "hops_warm_mean_s": hop_breakdown(runs[mode]["rounds"][1:]),
        }
    result = {
        "command": f"python benchmarks/bench_deployment.py --data {args.data.name} --rounds {args.rounds} "
        f"--isolation {args.isolation}"
        + (f" --threads-per-node {args.threads_per_node}" if args.threads_per_node else "")
        + (f" --baseline {args.baseline.name}" if args.baseline else ""),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} CPU cores, no GPU" if not _has_cuda() else f"{os.cpu_count()} CPU cores + GPU",
        "config": "configs/smoke.yaml (2 clients, 200 images each, ResNet-18 width 0.125, BYOL) with "
        f"rounds={args.rounds}, eval.knn_every=0",
        "deployment": "loopback, TLS + SuperNode authentication, one SuperNode per client, "
        f"OMP_NUM_THREADS={threads} per SuperNode (the simulation: one client at a time, all cores)",
        "simulation": {
            "warm_round_s_mean": statistics.mean(r["simulation_s"] for r in warm),
            "warm_train_s_mean": statistics.mean(r["simulation_train_s"] for r in warm),
            "run_s": runs["simulation"]["run_s"],
            "linear_probe_acc": runs["simulation"]["summary"]["linear_probe_acc"],
            "hops_warm_mean_s": hop_breakdown(runs["simulation"]["rounds"][1:]),
        },
        "deployed": summary,
        "client_cold_start": {
            **cold,
            "OMP_NUM_THREADS": threads,
            "note": "one ClientApp's work in a new process, measured alone (a deployed SuperNode "
            "starts one for every message; the simulation's ClientApps stay warm)",
        },
        "message_objects": objects,
        "rounds": rows,
    }
    if baseline is not None:
        result["baseline"] = {
            "file": args.baseline.name,
            "command": baseline.get("command"),
            "date": baseline.get("date"),
            "simulation": baseline.get("simulation"),
            "deployed": baseline.get("deployed"),
        }
    if "deployed_containers" in runs:
        result["containers"] = {
            "layout": "docker/compose.yml + docker/compose.tls.yml (process isolation, TLS + "
            "SuperNode authentication), OMP_NUM_THREADS per ClientApp executor as above",
            **runs["deployed_containers"]["images"],
        }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def render(r: dict) -> str:
    modes = list(r["deployed"])
    lines = [
        "# Deployed vs simulated: per-round overhead",
        "",
        f"Command: `{r['command']}` ({r['date']}, {r['machine']}).",
        "",
        f"Config: {r['config']}. Deployment: {r['deployment']}.",
        "",
        (
            "Round time = the ServerApp's `wall_s` (send the round's messages -> aggregate the replies; evaluation "
            "excluded). Overhead = deployed minus simulated round time. `train` = the slowest client's local "
            "training time inside the round."
        ),
        "",
        "| round | simulation s (train) | " + " | ".join(f"{m} s (train) | {m} overhead s" for m in modes) + " |",
        "|---|---|" + "---|---|" * len(modes),
    ]
    for row in r["rounds"]:
        cells = [f"{row['round']}", f"{row['simulation_s']:.1f} ({row['simulation_train_s']:.1f})"]
        for m in modes:
            cells += [f"{row[f'{m}_s']:.1f} ({row[f'{m}_train_s']:.1f})", f"{row[f'{m}_overhead_s']:+.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        (
            "| | warm round s (mean, rounds 2+) | warm overhead s | ratio | first-round overhead s | "
            "run s | max train-loss difference to simulation | linear probe |"
        ),
        "|---|---|---|---|---|---|---|---|",
        (
            f"| simulation | {r['simulation']['warm_round_s_mean']:.1f} | - | 1.00 | - | "
            f"{r['simulation']['run_s']:.0f} | - | {100 * r['simulation']['linear_probe_acc']:.1f}% |"
        ),
    ]
    for m, s in r["deployed"].items():
        lines.append(
            f"| {m} | {s['warm_round_s_mean']:.1f} | {s['warm_round_overhead_s_mean']:+.1f} | "
            f"{s['warm_round_ratio']:.2f} | {s['first_round_overhead_s']:+.1f} | {s['run_s']:.0f} | "
            f"{s['max_loss_difference']:.4f} | {100 * s['linear_probe_acc']:.1f}% |"
        )
    hops = {
        "simulation": r["simulation"].get("hops_warm_mean_s", {}),
        **{m: s.get("hops_warm_mean_s", {}) for m, s in r["deployed"].items()},
    }
    if any(hops.values()):
        names = [h[0] for h in HOPS] + ["train_s (inside the handler)", "message created -> reply received"]
        what = {h[0]: h[3] for h in HOPS}
        lines += [
            "",
            (
                "Where a warm round's time goes, per client (mean over rounds 2+ and clients, seconds after the "
                "server created the client's message, from the timeline each reply carries; one host, one clock; "
                "the simulation's ClientApps live in long-lived processes, so it has no dispatch or start-up "
                "stretches):"
            ),
            "",
            "| stretch | what | " + " | ".join(hops) + " |",
            "|---|---|" + "---|" * len(hops),
        ]
        for name in names:
            lines.append(
                f"| {name} | {what.get(name, '')} | "
                + " | ".join(f"{h[name]:.2f}" if name in h else "-" for h in hops.values())
                + " |"
            )
    base = r.get("baseline")
    if base:
        lines += [
            "",
            (
                f"Against the earlier result `{base['file']}` ({base['date']}, `{base['command']}`), warm rounds, "
                "mean seconds:"
            ),
            "",
            "| | earlier | now | change |",
            "|---|---|---|---|",
        ]
        for m, s in r["deployed"].items():
            old = (base.get("deployed") or {}).get(m)
            if not old:
                continue
            pairs = [
                (f"{m}: warm round", old["warm_round_s_mean"], s["warm_round_s_mean"]),
                (
                    f"{m}: warm overhead over the simulation",
                    old["warm_round_overhead_s_mean"],
                    s["warm_round_overhead_s_mean"],
                ),
            ]
            old_hops, new_hops = old.get("hops_warm_mean_s", {}), s.get("hops_warm_mean_s", {})
            pairs += [(f"{m}: {name}", old_hops[name], new_hops[name]) for name in new_hops if name in old_hops]
            lines += [f"| {name} | {a:.2f} | {b:.2f} | {b - a:+.2f} |" for name, a, b in pairs]
    o = r.get("message_objects")
    if o:
        lines += [
            "",
            (
                f"One training message of this model ({o['arrays']} arrays) is {o['packed']['objects']} Flower "
                f"objects with the app's packed record ({o['packed']['record_bytes']:,} bytes), against "
                f"{o['per_array']['objects']} with one Array per tensor ({o['per_array']['record_bytes']:,} bytes); "
                "Flower 1.41 pushes and pulls every object with its own request on every hop."
            ),
        ]
    c = r["client_cold_start"]
    lines += [
        "",
        (
            f"A ClientApp in a new process, measured alone (OMP_NUM_THREADS={c['OMP_NUM_THREADS']}): import torch "
            f"{c['import_torch_s']:.1f} s, import the app {c['import_app_s']:.1f} s, load its partition "
            f"{c['load_partition_s']:.1f} s, first training {c['first_training_s']:.1f} s (the same training warm: "
            f"{c['warm_training_s']:.1f} s). A deployed SuperNode starts such a process for every message; the rest "
            "of the overhead is Flower's transport: the SuperNode polls for messages every 3 s, its SuperExec for "
            "tasks every 1 s, the ServerApp's Grid for replies every 3 s, each exchange over HTTPS."
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
