"""The CPU-comparison scripts derive every row's config from one file: each row must load and validate as the
ServerApp would load it, with the strategy its row names and nothing else changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from server_app.experiment import load_experiment

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import compare_lwfedssl_cpu  # noqa: E402


def strip(raw: dict) -> dict:
    return {k: v for k, v in raw.items() if k not in ("name", "strategy")}


def test_layerwise_comparison_rows_validate_and_differ_only_in_strategy(tmp_path):
    configs = compare_lwfedssl_cpu.load_configs()
    strategies = {variant: raw["strategy"]["name"] for variant, raw in configs.items()}
    assert strategies == {"FedMoCoV3 (end to end)": "fedssl", "LW-FedSSL": "lwfedssl", "FedMoCo-LW": "fedmoco_lw",
                          "Prog-FedSSL": "prog_fedssl", "FLL+DD": "fll_dd",
                          "centralized (strategy central)": "central"}
    reference = strip(configs["FedMoCoV3 (end to end)"])
    for variant, raw in configs.items():
        assert strip(raw) == reference, f"{variant}: more than the strategy differs from FedMoCoV3's config"
        path = tmp_path / f"{raw['strategy']['name']}.yaml"
        path.write_text(yaml.safe_dump(raw))
        cfg, _ = load_experiment({"config": str(path)})
        assert cfg.strategy.name == raw["strategy"]["name"]
        # every row ends with the same encoder: the layer-wise rows grow one block per stage up to the depth
        # FedMoCoV3 and the centralized row train from round 1
        assert cfg.model.options["depth"] == 6 and cfg.rounds == 12
        if raw["strategy"]["name"] not in ("fedssl", "central"):
            assert cfg.strategy.options["stages"] == 6


def fake_result(raw: dict) -> dict:
    """What run_experiment returns, without a run: scores that identify the run's config and seed."""
    arch = raw["model"]["arch"]
    score = 0.3 + 0.01 * raw["seed"] + 0.001 * len(raw["strategy"]["name"])
    summary = {"config": raw, "linear_probe_acc": score, "knn_acc": score - 0.05,
               "random_init": {arch: {"linear_probe_acc": 0.3, "knn_acc": 0.25}},
               "linear_probe_gain_over_random": score - 0.3, "bytes_up_total": 10, "bytes_down_total": 20,
               "resources": {"run": {"flops_run": 1e12, "mem_total_max": 2**20, "rss_peak_bytes_max": 2**21}}}
    return {"summary": summary, "rounds": [{"round": 1, "train_loss": 1.0, "knn_acc": 0.2, "clients": [{"mu": 0.5}]}],
            "run_s": 1.0}


@pytest.mark.parametrize("script", ["compare_fedema_cpu", "compare_flesd_cpu", "compare_lwfedssl_cpu"])
def test_a_comparison_runs_each_missing_seed_and_row_once_and_resumes(script, tmp_path, monkeypatch):
    import importlib

    import runs

    module = importlib.import_module(script)
    seen, kept = [], []
    monkeypatch.setattr(runs, "run_experiment",
                        lambda raw, keep_dir=None: seen.append(raw) or kept.append(keep_dir) or fake_result(raw))
    out = tmp_path / "cmp"
    assert module.main(["--data", "d.npz", "--seeds", "0", "--out", str(out)]) == 0
    first = len(seen)
    assert first >= 2 and {raw["seed"] for raw in seen} == {0}
    assert all(raw["name"].endswith("-seed0") and raw["data"]["path"] == str(Path("d.npz").resolve())
               for raw in seen)
    rows = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert len(rows) == first and len({r["variant"] for r in rows}) == first
    assert "random init" in out.with_suffix(".md").read_text()
    # A second invocation with one more seed runs only that seed's rows and keeps the first seed's.
    assert module.main(["--data", "d.npz", "--seeds", "0", "1", "--out", str(out)]) == 0
    assert len(seen) == 2 * first and {raw["seed"] for raw in seen[first:]} == {1}
    assert len(json.loads(out.with_suffix(".json").read_text())["runs"]) == 2 * first
    assert kept == [None] * len(seen)
    # --keep-runs: one folder per (row, seed), named after both, under the given folder.
    assert module.main(["--data", "d.npz", "--seeds", "2", "--out", str(out), "--keep-runs", str(tmp_path / "k")]) == 0
    folders = kept[2 * first:]
    assert len(folders) == first and len(set(folders)) == first
    assert all(f.parent == tmp_path / "k" and f.name.endswith("-seed2") for f in folders)


def test_comparison_table_shows_each_seeds_signed_gain_and_the_random_init_row():
    import runs

    made = [{"variant": "FedBYOL", "seed": s, "linear_probe_acc": lp, "knn_acc": 0.3, "random_init_linear_probe_acc": ri,
             "random_init_knn_acc": 0.28, "linear_probe_gain_over_random": lp - ri, "bytes_up": 2**20, "run_s": 10.0}
            for s, lp, ri in ((0, 0.393, 0.3304), (1, 0.36, 0.365))]
    lines = runs.comparison_lines(made, ["FedBYOL", "FedU"])
    header, rule, random_row, byol_row = lines
    assert header.count("|") == rule.count("|") == random_row.count("|") == byol_row.count("|")
    assert "| 33.04, 36.50 | 0 |" in random_row
    assert "| 39.30, 36.00 | +6.26, -0.50 |" in byol_row  # a loss against random init keeps its sign
    assert runs.scored_images_text(0) == "all" and runs.scored_images_text(1000) == "1000"
