"""The paper configs hold the papers' settings (FLESD Table 1, FedEMA Tables 3 and 6, EasyFL/FLESD augmentation
recipes and heads), and every config states its scale in its header comment."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssl_models.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))
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
    folder = REPO / "configs/flesd/table1"
    return {p.stem.split(f"{dataset}-alpha{alpha}-", 1)[1]: load(p)
            for p in folder.glob(f"{dataset}-alpha{alpha}-*.yaml")}


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
    for path in sorted((REPO / "configs/flesd/ablations").glob("*.yaml")):
        cfg = load(path)
        assert cfg.method.options["proj_batch_norm"] is False and cfg.augment.crop_scale == [0.2, 1.0], path.name
        sparsify[path.name] = cfg.strategy.options["sparsify"]
    assert sparsify.pop("quantization-topk-0.1-zero-probability.yaml") == "zero_probability"
    assert set(sparsify.values()) == {"zero_similarity"}


def test_fedema_paper_configs():
    folder = REPO / "configs/fedema"
    paper = [p for p in folder.rglob("*.yaml") if p.name != "cpu-compare.yaml"]
    assert len(paper) > 30
    for path in paper:  # EasyFL's transform for SimCLR/BYOL/SimSiam/MoCo v2
        cfg = load(path)
        assert jitter(cfg) == EASYFL_JITTER and cfg.augment.jitter_p == 0.8, path.name
        assert cfg.augment.crop_scale == [0.08, 1.0] and cfg.augment.blur_p == 0 and not cfg.augment.normalize
    for path in sorted((folder / "table3").glob("*-fedema-lambda.yaml")):
        assert load(path).strategy.options == {"mu_mode": "lambda", "lambda": 0.8, "ema_scope": "both",
                                               "divergence": "paper"}
    for path in sorted((folder / "table3").glob("*-fedema-autoscaler.yaml")):
        options = load(path).strategy.options
        assert options["mu_mode"] == "autoscaler" and options["tau"] == 0.7
    for path in sorted(folder.rglob("*fedu*.yaml")):
        assert load(path).strategy.options["divergence"] == "easyfl"
    expected6 = {"20clients-5perround": (20, 5, 5, 400), "80clients-8perround": (80, 8, 2, 800)}
    for path in sorted((folder / "table6").glob("*.yaml")):
        cfg = load(path)
        key = next(k for k in expected6 if k in path.name)
        f = cfg.federation
        assert (f.num_clients, f.clients_per_round, cfg.train.local_epochs, cfg.rounds) == expected6[key]
        if cfg.strategy.name == "fedssl":
            assert cfg.strategy.options["update_both"] is True  # the paper's FedBYOL baseline there
    moco = load(folder / "fedmoco.yaml").method.options
    assert (moco["version"], moco["proj_hidden_dim"], moco["proj_out_dim"]) == (2, 512, 128)
    both = load(folder / "ablations/fedbyol-update-both.yaml").strategy.options
    aggregated = load(folder / "ablations/fedbyol-aggregate-target.yaml").strategy.options
    assert both.get("update_both") is True and not both.get("aggregate_target")
    assert aggregated.get("aggregate_target") is True and not aggregated.get("update_both")
