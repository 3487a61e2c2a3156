"""A simulation on a Ray cluster started beforehand, its two nodes on two hosts (network namespaces linked by a veth
pair), as the docs' "simulation on a Ray cluster" section runs it: `ray start --head` on one host, `ray start
--address=...` on the other, then `flwr run` with `RAY_ADDRESS` in the environment of the local SuperLink (Flower's
simulation joins the cluster instead of starting a Ray of its own) and `client-resources-num-cpus=1`.

Checked: each node gets one client actor (every client records the Ray node it ran on, `node_ip` in metrics.jsonl)
and the run's metrics equal those of the same run on one machine; the worker node stopped mid-run costs that
round's client on it, not the run. Needs root (namespaces); skipped with the reason where they cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import skip_unless_required
from flwr_harness import REPO, SHORT_EVAL, flwr_env, flwr_run, kill_processes_with_env, read_jsonl
from netns import Network, namespaces_unavailable

pytestmark = pytest.mark.e2e

MARKER = "FEDSSL_RAY_CLUSTER_TEST"  # every Ray process of the test carries it, so teardown finds them all
# a short final probe and no random-init reference: the test compares the runs' scores, whatever they are
RUN = f"config='configs/smoke.yaml' data.dataset='synthetic' eval.knn_every=1 {SHORT_EVAL}"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster():
    reason = namespaces_unavailable()
    if reason:
        skip_unless_required(f"Ray cluster test skipped: {reason}")
    # A short folder of its own: Ray's sockets live under RAY_TMPDIR, and a Unix socket's path may not exceed 107
    # bytes, which pytest's numbered base folder (pytest-of-<user>/pytest-<n>/...) overran once n had three digits.
    tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    net = Network(tag=f"r{os.getpid() % 10000}", spokes=["worker"], hub="head", net=215)
    head_ip, worker_ip = net.hub_ip("worker"), net.spoke_ip("worker")
    base = {
        **os.environ,
        MARKER: str(tmp),
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env = {"head": {**base, "RAY_TMPDIR": str(tmp / "head")}, "worker": {**base, "RAY_TMPDIR": str(tmp / "worker")}}
    with net:
        try:
            start = [str(BIN / "ray"), "start", "--num-cpus=1", "--disable-usage-stats"]
            proc = net.run(
                "head",
                start + ["--head", f"--node-ip-address={head_ip}", "--port=6379", "--include-dashboard=false"],
                env=env["head"],
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            proc = net.run(
                "worker",
                start + [f"--address={head_ip}:6379", f"--node-ip-address={worker_ip}"],
                env=env["worker"],
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            deadline = time.monotonic() + 120
            while True:  # both nodes registered
                status = net.run(
                    "head",
                    [str(BIN / "ray"), "status", f"--address={head_ip}:6379"],
                    env=env["head"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout
                active = status.split("Active:")[-1].split("Pending:")[0]
                if active.count("node_") >= 2:
                    break
                assert time.monotonic() < deadline, status
                time.sleep(2)
            yield {"net": net, "env": env, "head_ip": head_ip, "worker_ip": worker_ip, "tmp": tmp}
        finally:
            kill_processes_with_env(MARKER, str(tmp))  # the Ray processes of both nodes, and the runs' SuperLinks
            shutil.rmtree(tmp, ignore_errors=True)


def cluster_run(c: dict, name: str, extra: str = "", wait: bool = True) -> tuple[Path, subprocess.Popen | None]:
    """`flwr run` from the head host, its local SuperLink joining the cluster through RAY_ADDRESS."""
    out, home = c["tmp"] / name, c["tmp"] / f"flwr-{name}"
    env = {
        **flwr_env(home),
        **{k: v for k, v in c["env"]["head"].items() if k != "RAY_TMPDIR"},
        "RAY_ADDRESS": f"{c['head_ip']}:6379",
    }
    cmd = [
        "ip",
        "netns",
        "exec",
        c["net"].ns("head"),
        str(BIN / "flwr"),
        "run",
        str(REPO),
        "--stream",
        "--run-config",
        f"{RUN} output-dir='{out}' {extra}",
        "--federation-config",
        "client-resources-num-cpus=1",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
    )
    if not wait:
        return out, proc
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        kill_processes_with_env("FLWR_HOME", str(home))
    assert (out / "summary.json").is_file(), output[-3000:]
    return out, None


def comparable(rounds: list[dict]) -> list[dict]:
    return [
        {
            "round": r["round"],
            "train_loss": r["train_loss"],
            "knn_acc": r.get("knn_acc"),
            "clients": sorted((c["id"], c["loss"]) for c in r["clients"]),
        }
        for r in rounds
    ]


def test_a_run_on_a_two_node_ray_cluster_uses_both_nodes_and_matches_one_machine(cluster, tmp_path, monkeypatch):
    out, _ = cluster_run(cluster, "two-nodes")
    rounds = read_jsonl(out / "metrics.jsonl")
    ips = {c.get("node_ip") for r in rounds for c in r["clients"]}
    assert ips == {cluster["head_ip"], cluster["worker_ip"]}, ips  # one client actor on each node
    # The same run on one machine (Flower's own Ray, started for it)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    alone = tmp_path / "alone"
    proc = flwr_run(
        f"{RUN} output-dir='{alone}'",
        tmp_path / "flwr-alone",
        federation_config="num-supernodes=2 client-resources-num-cpus=1",
    )
    assert (alone / "summary.json").is_file(), (proc.stdout + proc.stderr)[-3000:]
    assert comparable(rounds) == comparable(read_jsonl(alone / "metrics.jsonl"))
    a, b = (json.loads((d / "summary.json").read_text()) for d in (out, alone))
    for key in ("linear_probe_acc", "knn_acc", "final_train_loss", "bytes_up_total"):
        assert a[key] == b[key], key


def test_a_node_stopped_mid_run_costs_its_clients_not_the_run(cluster):
    out, proc = cluster_run(cluster, "node-lost", "rounds=4 train.local_epochs=2", wait=False)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        # the worker host goes away: every process of its Ray node (raylet, workers, the client actor on it)
        kill_processes_with_env("RAY_TMPDIR", str(cluster["tmp"] / "worker"))
        output, _ = proc.communicate(timeout=600)
    finally:
        kill_processes_with_env("FLWR_HOME", str(cluster["tmp"] / "flwr-node-lost"))
    assert (out / "summary.json").is_file(), output[-3000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]  # the run went on
    assert rounds[0]["num_clients"] == 2 and sum(r["num_failed"] for r in rounds[1:]) >= 1
    assert all(r["num_clients"] >= 1 for r in rounds)
    lost = [f for r in rounds for f in r["failed_clients"]]
    assert lost and all(len(f["reason"]) < 400 for f in lost)  # one readable line each, no Ray traceback
