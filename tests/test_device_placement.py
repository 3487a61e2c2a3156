"""Where clients train: the device decision (client_app/placement.py), Ray's GPU mask removed before CUDA starts, the
loud failure of ``train.device: cuda`` without a usable GPU, the GPU share our launchers give a local simulation
on a GPU machine, and the device recorded for every client round (metrics.jsonl, progress.log, summary.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from flwr.app import Context, RecordDict

import server_app.app as server_module
import server_app.results as results_module
from client_app import placement
from client_app.placement import DevicePlacementError, decide_client_device
from conftest import REPO
from fedssl_study import launcher
from ssl_models.config import ExperimentConfig
from test_server_app import MIN_LOCAL, ClientAppGrid


def decide(requested, *, mask=None, ray=False, gpus=0, cuda=False, keep=False):
    return decide_client_device(
        requested,
        cuda_visible_devices=mask,
        in_ray_worker=ray,
        gpus_on_machine=gpus,
        cuda_available=cuda,
        keep_ray_mask=keep,
        host="box-7",
    )


# ---------------------------------------------------------------------------------------------- the decision
@pytest.mark.parametrize(
    "requested, facts, device, unhide, reason",
    [
        # train.device: cpu is the CPU, whatever the machine has (the process is unmasked all the same: see unhide)
        ("cpu", {"gpus": 1, "cuda": True}, "cpu", False, "train.device: cpu"),
        ("cpu", {"mask": "", "ray": True, "gpus": 1}, "cpu", True, "train.device: cpu"),
        # Ray gave the client 0 GPUs on a GPU machine: unhidden, shared, and the way to schedule it named
        ("auto", {"mask": "", "ray": True, "gpus": 1, "cuda": True}, "cuda", True, "client-resources-num-gpus=F"),
        (
            "cuda",
            {"mask": "", "ray": True, "gpus": 2, "cuda": True},
            "cuda",
            True,
            "shared by every client running at once",
        ),
        # ... kept hidden on request: auto trains on the CPU and says why
        (
            "auto",
            {"mask": "", "ray": True, "gpus": 1, "keep": True},
            "cpu",
            False,
            "FEDSSL_KEEP_RAY_GPU_MASK=1 keeps them hidden",
        ),
        # ... the unhiding came too late (CUDA started before the ClientApp's import)
        ("auto", {"mask": "", "ray": True, "gpus": 1}, "cpu", True, "unhiding failed"),
        # Ray scheduled a GPU for the client (client-resources-num-gpus > 0)
        ("auto", {"mask": "0", "ray": True, "gpus": 1, "cuda": True}, "cuda", False, "Ray assigned GPU 0"),
        # Ray's empty mask on a machine without GPUs is no hiding: the CPU, because there is no GPU
        ("auto", {"mask": "", "ray": True, "gpus": 0}, "cpu", False, "no NVIDIA GPU on this machine"),
        # outside Ray (a deployed SuperNode, the tests): CUDA when torch can use it
        ("auto", {"gpus": 1, "cuda": True}, "cuda", False, "CUDA available"),
        ("cuda:1", {"gpus": 2, "cuda": True}, "cuda:1", False, "CUDA available"),
        ("auto", {}, "cpu", False, "no NVIDIA GPU on this machine"),
        ("auto", {"mask": "", "gpus": 1}, "cpu", False, "CUDA_VISIBLE_DEVICES='' leaves torch no usable GPU"),
        ("auto", {"gpus": 1}, "cpu", False, "torch cannot use CUDA"),
    ],
)
def test_the_decision_table(requested, facts, device, unhide, reason):
    decided = decide(requested, **facts)
    assert (decided.device, decided.unhide) == (device, unhide)
    assert reason in decided.reason


@pytest.mark.parametrize(
    "facts, cause",
    [
        ({}, "no NVIDIA GPU on this machine"),
        ({"mask": "", "ray": True, "gpus": 1, "keep": True}, "CUDA_VISIBLE_DEVICES='') and FEDSSL_KEEP_RAY_GPU_MASK=1"),
        ({"mask": "", "ray": True, "gpus": 1}, "Ray hid the machine's 1 GPU (0 GPUs per client) and unhiding failed"),
        ({"mask": "7", "gpus": 1}, "CUDA_VISIBLE_DEVICES='7' leaves torch no usable GPU of the machine's 1 GPU"),
        ({"gpus": 2}, "the machine has 2 GPUs but torch cannot use CUDA"),
    ],
)
@pytest.mark.parametrize("requested", ["cuda", "cuda:0"])
def test_cuda_without_a_usable_gpu_fails_naming_the_setting_the_machine_and_the_cause(requested, facts, cause):
    with pytest.raises(DevicePlacementError) as caught:
        decide(requested, **facts)
    text = str(caught.value)
    assert text.startswith(f"train.device: {requested} but this client cannot use a GPU on box-7: ")
    assert cause in text and "train.device: auto or cpu trains on the CPU" in text


def test_an_unknown_device_is_refused():
    with pytest.raises(DevicePlacementError, match="'tpu' is not a device"):
        decide("tpu", gpus=1, cuda=True)


# ---------------------------------------------------------------------------------------------- Ray's mask removed
@pytest.mark.parametrize(
    "env, gpus, removed",
    [
        ({"RAY_RAYLET_PID": "1", "CUDA_VISIBLE_DEVICES": ""}, 1, True),
        ({"RAY_RAYLET_PID": "1", "CUDA_VISIBLE_DEVICES": "", "FEDSSL_KEEP_RAY_GPU_MASK": "1"}, 1, False),
        ({"RAY_RAYLET_PID": "1", "CUDA_VISIBLE_DEVICES": "", "FEDSSL_KEEP_RAY_GPU_MASK": "0"}, 1, True),
        ({"RAY_RAYLET_PID": "1", "CUDA_VISIBLE_DEVICES": "0"}, 1, False),  # Ray assigned a GPU: its mask stays
        ({"RAY_RAYLET_PID": "1", "CUDA_VISIBLE_DEVICES": ""}, 0, False),  # no GPU to unhide
        ({"CUDA_VISIBLE_DEVICES": ""}, 1, False),  # not a Ray worker: the user's own mask stays
    ],
)
def test_rays_empty_mask_is_removed_from_the_environment(monkeypatch, env, gpus, removed):
    for key in ("RAY_RAYLET_PID", "CUDA_VISIBLE_DEVICES", "FEDSSL_KEEP_RAY_GPU_MASK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert placement.unhide_gpus_hidden_by_ray(gpus_on_machine=gpus) is removed
    assert ("CUDA_VISIBLE_DEVICES" not in os.environ) is removed
    if not removed:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"]


def test_gpus_are_counted_from_the_drivers_files(tmp_path):
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (dev / name).touch()
    assert placement.physical_gpu_count(proc, dev) == 2  # no /proc/driver/nvidia/gpus: the /dev/nvidia<N> files
    proc.mkdir()
    for address in ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"):
        (proc / address).mkdir()
    assert placement.physical_gpu_count(proc, dev) == 3  # the driver's own list first
    assert placement.physical_gpu_count(tmp_path / "none", tmp_path / "none") == 0


def test_the_clientapp_unhides_before_anything_touches_cuda():
    """Importing the ClientApp in a Ray worker that Ray gave 0 GPUs on a (faked) GPU machine removes the mask, and
    nothing on the way asks CUDA anything before (CUDA reads the mask once, at its first use)."""
    script = """
import os, torch
seen = []
def watch(name, real):
    def wrapper(*args, **kwargs):
        seen.append((name, os.environ.get("CUDA_VISIBLE_DEVICES")))
        return real(*args, **kwargs)
    return wrapper
for name in ("is_available", "device_count", "_lazy_init", "init", "current_device", "get_device_name",
             "is_bf16_supported", "get_device_capability"):
    setattr(torch.cuda, name, watch(name, getattr(torch.cuda, name)))
import client_app.placement as placement
placement.physical_gpu_count = lambda *args: 1
os.environ.update(RAY_RAYLET_PID="1", CUDA_VISIBLE_DEVICES="")
import client_app.app as app
assert app.RAY_GPU_MASK_REMOVED and "CUDA_VISIBLE_DEVICES" not in os.environ, os.environ.get("CUDA_VISIBLE_DEVICES")
assert all(mask is None for _, mask in seen), seen
print("calls before the first message:", seen)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "FEDSSL_KEEP_RAY_GPU_MASK")}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- the loud failure


def test_a_client_asked_for_cuda_without_a_gpu_fails_the_round_naming_why(task_identity, monkeypatch):
    from client_app.app import app as client_app
    from test_client import TINY, train_message

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(placement, "physical_gpu_count", lambda *args: 0)
    cfg = ExperimentConfig.from_dict({**TINY, "train": {**TINY["train"], "device": "cuda"}})
    ctx = Context(
        run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(), run_config={}
    )
    with pytest.raises(
        DevicePlacementError,
        match="train.device: cuda but this client cannot use a GPU on .*: no NVIDIA GPU on this machine",
    ):
        client_app(train_message(cfg, 1), ctx)


def test_the_server_never_falls_back_to_the_cpu_for_cuda(monkeypatch):
    """eval.device (the server's evaluation) and train.device on the server (FLESD's distillation, LW-FedSSL's
    calibration) go through resolve_device, which refuses cuda without CUDA."""
    from server_app.app import ServerEvaluator
    from ssl_models.training import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="device 'cuda' requested but CUDA is not available"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
    cfg = ExperimentConfig.from_dict({"eval": {"device": "cuda"}, "data": {"dataset": "synthetic"}})
    with pytest.raises(RuntimeError, match="device 'cuda' requested but CUDA is not available"):
        ServerEvaluator(cfg)


# ---------------------------------------------------------------------------------------------- the launchers' share
@pytest.mark.parametrize(
    "num_clients, gpus, share",
    [
        (2, 1, 0.5),
        (10, 1, 0.25),
        (4, 1, 0.25),
        (1, 1, 1.0),
        (3, 1, 0.3333),
        (3, 2, 0.5),  # 2 per GPU: all three at once (2/3 each would fit only one client per GPU)
        (2, 8, 1.0),  # a whole GPU each
        (None, 1, 0.25),  # a count not known: the most clients per GPU
    ],
)
def test_gpu_share(num_clients, gpus, share):
    assert launcher.gpu_share(num_clients, gpus) == share
    assert launcher.gpu_share(num_clients, gpus) * launcher.MAX_CLIENTS_PER_GPU >= 1 - 1e-3  # never more than 4


def test_the_federation_config_is_unchanged_without_gpus_and_gets_a_share_with_them():
    assert launcher.with_gpu_share("num-supernodes=3", 0) == "num-supernodes=3"
    assert launcher.with_gpu_share(None, 0) is None
    assert launcher.with_gpu_share("num-supernodes=3", 1) == "num-supernodes=3 client-resources-num-gpus=0.3333"
    assert launcher.with_gpu_share(None, 2, num_clients=8) == "client-resources-num-gpus=0.25"
    given = "num-supernodes=3 client-resources-num-gpus=1"  # the caller's own share wins
    assert launcher.with_gpu_share(given, 1) == given


class FakeCompleted:
    returncode, stdout, stderr = 0, '{"success": true, "run-id": 7}', ""


@pytest.mark.parametrize(
    "gpus, expected",
    [
        (0, "num-supernodes=2 client-resources-num-cpus=1"),
        (1, "num-supernodes=2 client-resources-num-cpus=1 client-resources-num-gpus=0.5"),
    ],
)
def test_the_study_launcher_gives_its_simulation_a_gpu_share_on_a_gpu_machine(tmp_path, monkeypatch, gpus, expected):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launcher, "physical_gpu_count", lambda *args: gpus)
    calls = []
    monkeypatch.setattr(launcher.Launcher, "_call", lambda self, args, timeout=0: calls.append(args) or FakeCompleted)
    private = launcher.Launcher(flwr_home=tmp_path / "flwr", federation_config="client-resources-num-cpus=1")
    assert private.submit("seed=0", num_supernodes=2) == 7
    args = calls[-1]
    assert args[args.index("--federation-config") + 1] == expected
    remote = launcher.Launcher(connection="cluster", federation_config="client-resources-num-cpus=1")
    remote.submit("seed=0", num_supernodes=2)  # a named connection: its own federation decides
    args = calls[-1]
    assert args[args.index("--federation-config") + 1] == "client-resources-num-cpus=1"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # joining a Ray cluster: its nodes' GPUs are not counted here
    joining = launcher.Launcher(flwr_home=tmp_path / "flwr-2", federation_config="client-resources-num-cpus=1")
    joining.submit("seed=0", num_supernodes=2)
    args = calls[-1]
    assert args[args.index("--federation-config") + 1] == "num-supernodes=2 client-resources-num-cpus=1"


@pytest.mark.parametrize(
    "gpus, expected", [(0, "num-supernodes=3"), (1, "num-supernodes=3 client-resources-num-gpus=0.3333")]
)
def test_run_experiment_and_the_tests_runs_get_the_share_through_flwr_run(tmp_path, monkeypatch, gpus, expected):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launcher, "physical_gpu_count", lambda *args: gpus)
    monkeypatch.setattr(launcher, "kill_processes_with_env", lambda *args, **kwargs: None)
    commands = []
    monkeypatch.setattr(launcher.subprocess, "run", lambda cmd, **kwargs: commands.append(cmd))
    launcher.flwr_run("seed=0", tmp_path / "flwr", federation_config="num-supernodes=3")
    assert commands[-1][commands[-1].index("--federation-config") + 1] == expected


def test_fedssl_run_adds_a_share_for_a_local_simulation_on_a_gpu_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))  # no config.toml: flwr run's default is local
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = [".", "--run-config", "seed=1", "--stream"]
    monkeypatch.setattr(launcher, "physical_gpu_count", lambda *a: 0)
    assert launcher.flwr_run_args_with_gpu_share(args, 2) == (args, None)
    monkeypatch.setattr(launcher, "physical_gpu_count", lambda *a: 1)
    added, share = launcher.flwr_run_args_with_gpu_share(args, 2)
    assert share == "client-resources-num-gpus=0.5" and added == [*args, "--federation-config", share]
    sized = [*args, "--federation-config", "num-supernodes=8"]  # the federation's size given: it counts
    assert launcher.flwr_run_args_with_gpu_share(sized, 2)[1] == "client-resources-num-gpus=0.25"
    own = [*args, "--federation-config=client-resources-num-gpus=1"]
    assert launcher.flwr_run_args_with_gpu_share(own, 2) == (own, None)
    (tmp_path / "flwr-home").mkdir()
    (tmp_path / "flwr-home" / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n[superlink.local]\naddress = ":local:"\n'
        '[superlink.site]\naddress = "10.0.0.5:9093"\n'
    )
    assert launcher.flwr_run_args_with_gpu_share(args, 2)[1] == "client-resources-num-gpus=0.5"
    remote = [".", "site", "--run-config", "seed=1"]  # a deployed federation: its SuperNodes place their clients
    assert launcher.flwr_run_args_with_gpu_share(remote, 2) == (remote, None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a local SuperLink joining a Ray cluster
    assert launcher.flwr_run_args_with_gpu_share(args, 2) == (args, None)


# ---------------------------------------------------------------------------------------------- the recording
def test_a_cpu_round_on_a_gpu_machine_shows_in_metrics_progress_and_summary(tmp_path, monkeypatch, task_identity):
    """An in-process run (the real ClientApp, strategy and ServerApp) on a machine faked to have 2 GPUs that torch
    cannot use: every client record says where it trained and why, the round's progress line says so, and
    summary.json counts the devices and raises the flag."""
    monkeypatch.setenv("FEDSSL_ALLOWED_ROOTS", str(tmp_path))  # the test grid is not Flower's: paths confined
    monkeypatch.setattr(placement, "physical_gpu_count", lambda *args: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(results_module.ResultsWriter, "plot", lambda self, title: None)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **MIN_LOCAL,
                "name": "devices",
                "rounds": 1,
                "strategy": {"name": "fedssl"},
                "train": {**MIN_LOCAL["train"], "device": "auto"},
                "eval": {**MIN_LOCAL["eval"], "linear_probe": False, "random_init_reference": False},
            }
        )
    )
    out = tmp_path / "out"
    server_module.main(
        ClientAppGrid(2),
        Context(
            run_id=1,
            node_id=0,
            node_config={},
            state=RecordDict(),
            run_config={"config": str(config), "output-dir": str(out)},
        ),
    )
    [line] = [json.loads(text) for text in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(c["id"] for c in line["clients"]) == [0, 1]
    for client in line["clients"]:
        assert client["device"] == "cpu" and client["gpus_on_machine"] == 2
        assert client["device_reason"].startswith("the machine has 2 GPUs but torch cannot use CUDA")
    round_line = next(t for t in (out / "progress.log").read_text().splitlines() if "round 1/1" in t)
    assert round_line.endswith(
        "2 clients ok | on cpu (the CPU of a machine with a GPU: device_reason in metrics.jsonl says why)"
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["client_devices"] == {"cpu": 2} and summary["cpu_despite_gpu"] is True


def test_the_device_summary_over_a_runs_rounds():
    gpu = {"device": "cuda:0 (NVIDIA H100 80GB HBM3)", "gpus_on_machine": 1}
    cpu_box = {"device": "cpu", "gpus_on_machine": 0}
    rounds = [{"clients": [gpu, gpu]}, {"clients": [gpu, cpu_box]}, {"clients": []}, {}]
    assert results_module.client_device_summary(rounds) == {
        "client_devices": {"cpu": 1, "cuda:0 (NVIDIA H100 80GB HBM3)": 3},
        "cpu_despite_gpu": False,
    }
    cpu_on_gpu_box = {"device": "cpu", "gpus_on_machine": 1}
    assert results_module.client_device_summary([{"clients": [gpu, cpu_on_gpu_box]}])["cpu_despite_gpu"] is True
    assert results_module.devices_note([gpu, gpu]) == " | on cuda:0 (NVIDIA H100 80GB HBM3)"
    assert results_module.devices_note([gpu, cpu_box, gpu]) == " | on cpu x1, cuda:0 (NVIDIA H100 80GB HBM3) x2"
    assert results_module.devices_note([{"id": 0}]) == ""  # a record from before devices were recorded
