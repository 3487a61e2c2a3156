"""A real `flwr run .` of configs/smoke-heterossfl.yaml: ResNet-18 and ResNet-34 clients, no global model."""

import json
import math
import subprocess
import sys

import pytest

from conftest import skip_unless_required
from flwr_harness import REPO, SHORT_EVAL, data_overrides, flwr_run, read_jsonl

pytestmark = pytest.mark.e2e


def test_heterossfl_smoke_mixed_architectures_kernels_and_per_client_evaluation(tmp_path, monkeypatch):
    from conftest import cifar10_npz

    # Tiny encoders on a shared 2-core machine: one torch thread per process runs several times faster than two
    # threads fighting over the cores (measured: 88 s against 365 s for this test under load).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    npz = cifar10_npz()
    out = tmp_path / "out"
    proc = flwr_run(
        # a short probe and no random-init reference: the test checks the kernels and that each model is scored
        f"config='configs/smoke-heterossfl.yaml' output-dir='{out}' {data_overrides()} {SHORT_EVAL}",
        tmp_path / "flwr",
    )
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]
    n = 100  # the RAD: data.public_size
    kernel_bytes = 4 * n * n  # one dense fp32 N_RAD^2 kernel
    for r in rounds:
        assert sorted((c["id"], c["arch"]) for c in r["clients"]) == [(0, "resnet18"), (1, "resnet34")]
        assert all(math.isfinite(c["loss"]) for c in r["clients"])
        assert r["rad_size"] == n and r["kernels_stored"] == 2
        # Up: one N^2 kernel per client, whatever the model (plus the arrays' small headers).
        assert 2 * kernel_bytes <= r["kernel_bytes_up"] < 2 * kernel_bytes + 4096
        # Down: K_bar to both clients, from round 1 on (K_bar(0) of the initial models, Algorithm 1).
        assert r["kbar_clients"] == 2 and 2 * kernel_bytes <= r["bytes_down"] < 2 * kernel_bytes + 4096
        # Every client aligned, with the term recomputed at every step (one local epoch: more than one refresh), and
        # logs its kernel's norm.
        assert all(
            c["aligned"] == 1.0 and c["refreshes"] > 1 and 0 <= c["cka_start"] <= 1 and c["kernel_norm"] > 0
            for c in r["clients"]
        )
    # Round 1's bytes up include the initial kernels the server asked for before it (one per client).
    assert rounds[0]["initial_kernel_clients"] == 2 and set(rounds[0]["initial_kernel_norms"]) == {"0", "1"}
    assert rounds[0]["bytes_up"] == rounds[0]["kernel_bytes_up"] + rounds[0]["initial_kernel_bytes_up"]
    assert rounds[1]["bytes_up"] == rounds[1]["kernel_bytes_up"]
    # With the default (the term recomputed at every step), local training does not pull the clients away from
    # K_bar: the aligned clients' mean CKA to K_bar after the last round's training is not below its value before.
    last = rounds[-1]["clients"]
    assert sum(c["cka_end"] for c in last) >= sum(c["cka_start"] for c in last), [
        (c["cka_start"], c["cka_end"]) for c in last
    ]
    # The encoders travel only for evaluation (round 2 = last round), counted apart from the round's bytes.
    assert "eval_bytes_up" not in rounds[0] and rounds[1]["eval_bytes_up"] > 0 and rounds[1]["eval_clients"] == 2
    assert set(rounds[1]["knn_acc_by_model"]) == {"client_0", "client_1"}
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["scores_by_model"]) == {"client_0", "client_1"}
    assert set(summary["scores_by_arch"]) == {"resnet18", "resnet34"}
    assert 0 <= summary["scores_by_arch"]["resnet34"]["linear_probe_acc_mean"] <= 1
    assert summary["client_archs"] == ["resnet18", "resnet34"] and summary["eval_bytes_up_total"] > 0
    assert summary["bytes_up_total"] == sum(r["bytes_up"] for r in rounds)
    # The clients' FLOPs include the alignment term's RAD passes and the kernel forwards, kept apart as well.
    run_res = summary["resources"]["run"]
    assert 0 < run_res["flops_extra_run"] < run_res["flops_run"]
    assert sum(c["flops_extra"] for r in rounds for c in r["clients"]) == pytest.approx(run_res["flops_extra_run"])
    # Training moved the clients: the loss of round 2 is below round 1's for both.
    assert all(
        second["loss"] < first["loss"]
        for first, second in zip(
            sorted(rounds[0]["clients"], key=lambda c: c["id"]), sorted(rounds[1]["clients"], key=lambda c: c["id"])
        )
    )

    # The payload is what it claims to be: the kernel the server stored from client 1 in the last round equals
    # K = A A^T / ||H A A^T H||_F (kernel_normalization: frobenius, the default) computed here, independently, from
    # that client's saved model on the RAD (its predictor output with BatchNorm on the RAD's own batch statistics,
    # bn_mode: train, the default; float32, images in [0, 1]).
    import torch

    from fedssl_wire import DiskStateStore, RoundStateStore
    from ssl_models.config import ExperimentConfig
    from ssl_models.data.splits import public_images
    from ssl_models.factory import build_ssl_model, load_partial_state
    from ssl_models.federated.kernel_alignment import decode_kernel

    cfg = ExperimentConfig.from_dict(summary["config"])
    (state_dir,) = list((out / "client_state").glob("run-*"))
    state = RoundStateStore(state_dir).load(1)
    model = build_ssl_model(cfg, seed=0, arch="resnet34")
    load_partial_state(model, {k: v for k, v in state.items() if not k.startswith("meta.")})
    model.train()  # a copy: its running statistics may move
    rad = torch.as_tensor(public_images(cfg)).permute(0, 3, 1, 2).float().contiguous() / 255.0
    with torch.no_grad():
        a = model.predictor(model.projector(model.backbone(rad))).double()
    stored = DiskStateStore(out / "client_state" / "server-kernels").load(1)
    got = decode_kernel({k: v for k, v in stored.items() if not k.startswith("meta.")}, n).double()
    want = a @ a.T
    centre = torch.eye(n, dtype=torch.float64) - 1.0 / n
    want = want / torch.linalg.matrix_norm(centre @ want @ centre)
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())

    # Each personalised encoder is saved with its own architecture and can be scored by fedssl-eval.
    assert (out / "model_client_0.pt").is_file() and (out / "model_client_1.pt").is_file()
    if npz is None:
        skip_unless_required("the fedssl-eval part needs the CIFAR-10 dev npz")
    ev = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssl_models.evaluation.cli",
            str(out / "model_client_1.pt"),
            str(npz),
            "--max-train",
            "200",
            "--max-test",
            "100",
            "--probe-epochs",
            "2",
            "--semi-supervised",
            "0.1",
            "--semi-epochs",
            "1",
            "--semi-mode",
            "head",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    line = json.loads(ev.stdout.strip().splitlines()[-1])
    assert 0 <= line["knn_acc"] <= 1 and line["num_train"] == 200
