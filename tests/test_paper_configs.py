"""The paper configs hold the papers' settings (FLESD Table 1, FedEMA Tables 3 and 6, EasyFL/FLESD augmentation
recipes and heads), and every config states its scale in its header comment."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import experiment_config_files, study_experiments, study_files
from ssl_models.config import ExperimentConfig
from strategies import FedEMA

REPO = Path(__file__).resolve().parents[1]
CONFIGS = experiment_config_files() + study_files()  # every file states its scale
EASYFL_JITTER = (0.8, 0.8, 0.8, 0.2)


def load(path: Path) -> ExperimentConfig:
    return ExperimentConfig.from_yaml(path)


def jitter(cfg: ExperimentConfig) -> tuple:
    a = cfg.augment
    return a.brightness, a.contrast, a.saturation, a.hue


def header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO)) for p in CONFIGS])
def test_every_config_states_its_scale(path):
    assert "scale" in header(path).lower(), f"{path.relative_to(REPO)}: the header comment does not state its scale"


def table1(dataset: str, alpha: str) -> dict[str, ExperimentConfig]:
    prefix = f"{dataset}-alpha{alpha}-"
    return {
        name[len(prefix) :]: cfg
        for name, cfg in study_experiments("paper/flesd-table1").items()
        if name.startswith(prefix)
    }


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
@pytest.mark.parametrize("alpha", ["0.01", "1", "100"])
def test_flesd_table1_fixes_200_local_epochs_and_sweeps_fedprox_mu(dataset, alpha):
    configs = table1(dataset, alpha)
    schedule = {name: (c.rounds, c.train.local_epochs) for name, c in configs.items() if name != "flesd-client0"}
    assert schedule.pop("fedavg") == (10, 20) and schedule.pop("flesd") == (2, 100)
    assert schedule.pop("flesd-cc") == (1, 200) and schedule.pop("local") == (1, 200)
    mus = {}
    for name, (rounds, epochs) in schedule.items():
        assert name.startswith("fedprox-mu") and (rounds, epochs) == (10, 20), name
        mus[configs[name].strategy.options["proximal_mu"]] = name
    assert sorted(mus) == [0.001, 0.01, 0.1, 1.0]
    for name, cfg in configs.items():  # the FLESD recipe for every method of the table
        assert cfg.method.options["proj_batch_norm"] is False and cfg.method.options["proj_hidden_dim"] == 512
        assert cfg.augment.crop_scale == [0.2, 1.0] and jitter(cfg) == EASYFL_JITTER and cfg.augment.jitter_p == 0.8
        assert cfg.augment.normalize and cfg.augment.mean == [0.5, 0.5, 0.5] and cfg.augment.std == [0.5, 0.5, 0.5]
        if cfg.strategy.name == "flesd":
            assert cfg.strategy.options["sparsify"] == "zero_similarity"


def test_flesd_ablations_use_the_paper_recipe_and_the_masked_variant_is_an_option():
    sparsify = {}
    for name, cfg in study_experiments("paper/flesd-ablations").items():
        assert cfg.method.options["proj_batch_norm"] is False and cfg.augment.crop_scale == [0.2, 1.0], name
        sparsify[name] = cfg.strategy.options["sparsify"]
    assert len(sparsify) == 34
    assert sparsify.pop("quantization-topk-0.1-zero-probability") == "zero_probability"
    assert set(sparsify.values()) == {"zero_similarity"}


def test_fedema_paper_configs():
    folder = REPO / "configs/fedema"
    table3, table6 = study_experiments("paper/fedema-table3"), study_experiments("paper/fedema-table6")
    ablations = study_experiments("paper/fedema-ablations")
    paper = [load(p) for p in folder.rglob("*.yaml") if p.name != "cpu-compare.yaml"]
    paper += list(table3.values()) + list(table6.values()) + list(ablations.values())
    assert len(paper) > 30
    for cfg in paper:  # EasyFL's transform for SimCLR/BYOL/SimSiam/MoCo v2
        assert jitter(cfg) == EASYFL_JITTER and cfg.augment.jitter_p == 0.8, cfg.name
        assert cfg.augment.crop_scale == [0.08, 1.0] and cfg.augment.blur_p == 0 and not cfg.augment.normalize
    fedema_defaults = {k: v for k, v in FedEMA.default_options().items()}
    for name, cfg in table3.items():
        if name.endswith("-fedema-lambda"):
            assert cfg.strategy.options == {
                **fedema_defaults,
                "mu_mode": "lambda",
                "lambda": 0.8,
                "ema_scope": "both",
                "divergence": "paper",
            }
        if name.endswith("-fedema-autoscaler"):
            assert cfg.strategy.options["mu_mode"] == "autoscaler" and cfg.strategy.options["tau"] == 0.7
    assert len(table3) == 16
    for name, cfg in {**table3, **table6, **ablations}.items():
        if cfg.strategy.name == "fedu":
            assert cfg.strategy.options["divergence"] == "easyfl", name
    expected6 = {"20clients-5perround": (20, 5, 5, 400), "80clients-8perround": (80, 8, 2, 800)}
    for name, cfg in table6.items():
        key = next(k for k in expected6 if k in name)
        f = cfg.federation
        assert (f.num_clients, f.clients_per_round, cfg.train.local_epochs, cfg.rounds) == expected6[key]
        if cfg.strategy.name == "fedssl":
            assert cfg.strategy.options["update_both"] is True  # the paper's FedBYOL baseline there
    moco = load(folder / "fedmoco.yaml").method.options
    assert (moco["version"], moco["proj_hidden_dim"], moco["proj_out_dim"]) == (2, 512, 128)
    both = ablations["fedbyol-update-both"].strategy.options
    aggregated = ablations["fedbyol-aggregate-target"].strategy.options
    assert both.get("update_both") is True and not both.get("aggregate_target")
    assert aggregated.get("aggregate_target") is True and not aggregated.get("update_both")
