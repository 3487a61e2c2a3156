"""Real `flwr run .` simulations of every layer-wise variant (LW-FedSSL, FedMoCo-LW, Prog-FedSSL, FLL+DD), on
configs/smoke-lwfedssl.yaml (3 stages of 2 rounds). FedMoCoV3 (strategy fedssl, whose `flwr run` test is the smoke
test's, with MoCo v3 and the whole 12-block ViT) runs in process: tests/test_run_inprocess.py."""

import json
import math

import pytest

from flwr_harness import SHORT_EVAL, data_overrides, flwr_run, read_jsonl
from ssl_models.evaluation.checkpoint import load_encoder_checkpoint

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch):
    """Tiny models on a 2-core machine: one torch thread per process runs faster than threads fighting over the
    cores (the runs inherit this environment)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


SMOKE = "configs/smoke-lwfedssl.yaml"


# What these tests check (stages, blocks exchanged, bytes and FLOPs books) needs few steps and a short probe.
SHORT = f"train.max_steps_per_epoch=2 {SHORT_EVAL}"


def run(tmp_path, extra: str = "", config: str = SMOKE):
    out = tmp_path / "out"
    proc = flwr_run(
        f"config='{config}' output-dir='{out}' {data_overrides()} {SHORT} {extra}", tmp_path / "flwr", timeout_s=300
    )
    log = proc.stdout + proc.stderr
    assert (out / "summary.json").is_file(), log[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    progress = (out / "progress.log").read_text()
    print("\n".join(line for line in progress.splitlines() if " round " in line or "done in" in line))
    return out, rounds, summary


def check_layerwise(out, rounds, summary, variant):
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5, 6]
    assert [r["stage"] for r in rounds] == [1, 1, 2, 2, 3, 3]
    assert [r["new_block"] for r in rounds] == [None, None, 2, None, 3, None]
    for r in rounds:
        assert r["variant"] == variant and r["num_clients"] == 2 and math.isfinite(r["train_loss"])
        assert r["bytes_down"] == r["bytes_down_encoder"] + r["bytes_down_heads"] > 0
        assert r["bytes_up"] == r["bytes_up_encoder"] + r["bytes_up_heads"] > 0
        for c in r["clients"]:
            assert c["flops_total"] > c["flops_forward"] > 0 and c["mem_total"] > 0 and c["rss_peak_bytes"] > 0
            assert c["flops_fvcore_equivalent"] == pytest.approx(c["flops_forward"] / 2)
            assert c["blocks_down"][-1] == r["stage"]
    resources = summary["resources"]
    assert resources["run"]["bytes_up"] == summary["bytes_up_total"]
    assert resources["run"]["bytes_down"] == summary["bytes_down_total"]
    assert set(resources["per_client"]) == {"0", "1"}
    e2e = resources["reference_e2e"]
    assert e2e["depth"] == 3 and e2e["flops_total"] > 0
    assert summary["layerwise"]["final_depth"] == 3 and summary["layerwise"]["rounds_per_stage"] == [2, 2, 2]
    assert 0 <= summary["linear_probe_acc"] <= 1
    backbone, info = load_encoder_checkpoint(out / "model.pt")  # fedssl-eval reads the grown encoder
    assert info["arch"] == "vit_tiny" and info["arch_options"] == {"depth": 3} and len(backbone.blocks) == 3
    return resources


def test_lwfedssl_smoke_calibrates_aligns_and_grows(tmp_path):
    out, rounds, summary = run(tmp_path)
    resources = check_layerwise(out, rounds, summary, "lwfedssl")
    for r in rounds:
        assert r["calibration"]["steps"] >= 1 and r["calibration"]["depth"] == r["stage"]
        for c in r["clients"]:
            assert c["full_submodel_down"] and c["align_loss"] > 0 and c["flops_align_forward"] > 0
    # the client's own upload is block s + norm + heads: smaller than the whole sub-model it downloads
    assert all(r["bytes_up_encoder"] < r["bytes_down_encoder"] for r in rounds if r["stage"] > 1)
    assert resources["calibration"]["rounds"] == 6
    print("resources:", json.dumps(resources["run"]), json.dumps(resources["reference_e2e"]))


def test_fedmoco_lw_smoke_exchanges_block_s(tmp_path):
    out, rounds, summary = run(tmp_path, "strategy.name='fedmoco_lw'")
    resources = check_layerwise(out, rounds, summary, "fedmoco_lw")
    for r in rounds:
        assert "calibration" not in r
        if r["round"] in (2, 4, 6):  # within a stage: block s + norm + heads both ways
            assert r["bytes_down"] == r["bytes_up"]
            assert all(c["blocks_down"] == [r["stage"]] for c in r["clients"])
    print("resources:", json.dumps(resources["run"]))


def test_prog_fedssl_smoke_exchanges_the_whole_sub_model(tmp_path):
    out, rounds, summary = run(tmp_path, "strategy.name='prog_fedssl'")
    resources = check_layerwise(out, rounds, summary, "prog_fedssl")
    for r in rounds:
        assert r["bytes_down"] == r["bytes_up"] and r["trainable"] == "all"
        assert all(c["full_submodel_down"] for c in r["clients"])
    print("resources:", json.dumps(resources["run"]))


def test_fll_dd_smoke_drops_frozen_blocks(tmp_path):
    out, rounds, summary = run(tmp_path, "strategy.name='fll_dd'")
    resources = check_layerwise(out, rounds, summary, "fll_dd")
    for r in rounds:
        for c in r["clients"]:
            assert c["depth_dropout"] == 0.5
            assert (c["flops_expected"] < c["flops_total"]) == (r["stage"] > 1)  # frozen blocks exist from stage 2
    print("resources:", json.dumps(resources["run"]))
