"""The CPU-comparison scripts derive every row's config from one file: each row must load and validate as the
ServerApp would load it, with the strategy its row names and nothing else changed."""

from __future__ import annotations

import sys
from pathlib import Path

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
        if raw["strategy"]["name"] not in ("fedssl", "central"):  # the layer-wise rows share the stage schedule
            assert cfg.strategy.options["stages"] == 12 and cfg.rounds == 24
