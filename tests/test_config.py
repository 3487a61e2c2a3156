"""Config loading and validation: every error names the bad key; pyproject lists every override key."""

import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest

from conftest import experiment_config_files, study_files
from server_app.experiment import load_experiment, option_run_keys, overrides_from_run_config
from ssl_models.config import ConfigError, ExperimentConfig, leaf_keys, validate_component_options

REPO = Path(__file__).resolve().parents[1]
CONFIGS = experiment_config_files()


def test_defaults_validate():
    cfg = ExperimentConfig.from_dict({})
    assert cfg.clients_per_round == cfg.federation.num_clients
    assert cfg.min_available_clients == cfg.federation.num_clients


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"train": {"lrr": 0.1}}, "train.lrr"),
        ({"bogus": 1}, "bogus"),
        ({"train": {"lr": "fast"}}, "train.lr"),
        ({"train": {"local_epochs": 1.5}}, "train.local_epochs"),
        ({"train": {"fast_path": 1}}, "train.fast_path"),
        ({"data": {"alpha": 0}}, "data.alpha"),
        ({"data": {"alpha": -1.0}}, "data.alpha"),
        ({"data": {"partition": "shards"}}, "data.partition"),
        ({"federation": {"num_clients": 3, "clients_per_round": 4}}, "federation.clients_per_round"),
        ({"rounds": 0}, "rounds"),
        ({"train": "sgd"}, "train"),
        ({"data": {"dataset": "npz"}}, "data.path"),
        ({"train": {"lr": float("nan")}}, "train.lr"),
    ],
)
def test_invalid_values_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}:"):
        ExperimentConfig.from_dict(raw)


def test_missing_data_path_is_reported_with_its_resolved_location(tmp_path):
    cfg = ExperimentConfig.from_dict({"data": {"dataset": "npz", "path": str(tmp_path / "nope.npz")}})
    with pytest.raises(ConfigError, match=r"^data.path: does not exist"):
        cfg.check_files()


def test_int_is_accepted_for_float_and_converted():
    cfg = ExperimentConfig.from_dict({"train": {"lr": 1}})
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1.0


def test_json_round_trip():
    cfg = ExperimentConfig.from_dict({"method": {"name": "simclr", "options": {"temperature": 0.2}}, "seed": 3})
    assert ExperimentConfig.from_json(cfg.to_json()) == cfg


def test_cosine_lr_per_round():
    cfg = ExperimentConfig.from_dict({"rounds": 4, "train": {"lr": 1.0}})
    # lr_r = lr * (1 + cos(pi * (r-1)/R)) / 2
    assert [round(cfg.round_lr(r), 6) for r in (1, 2, 3, 4)] == [1.0, 0.853553, 0.5, 0.146447]
    const = ExperimentConfig.from_dict({"train": {"lr_schedule": "constant", "lr": 0.3}})
    assert const.round_lr(50) == 0.3


def test_component_options_checked_against_defaults():
    defaults = {"temperature": 0.5, "num_layers": 2, "flag": True, "dim": None}
    merged = validate_component_options({"temperature": 1, "dim": 7}, defaults, "method.options")
    assert merged == {"temperature": 1.0, "num_layers": 2, "flag": True, "dim": 7}
    with pytest.raises(ConfigError, match=r"^method.options.tempreature: unknown option"):
        validate_component_options({"tempreature": 1.0}, defaults, "method.options")
    with pytest.raises(ConfigError, match=r"^method.options.flag: expected bool"):
        validate_component_options({"flag": "yes"}, defaults, "method.options")


def test_run_config_overrides_only_non_empty_values():
    rc = {"config": "configs/smoke.yaml", "output-dir": "/tmp/x", "train.lr": "", "rounds": 7}
    assert overrides_from_run_config(rc) == {"rounds": 7, "output_dir": "/tmp/x"}


def test_load_experiment_applies_overrides_and_checks_components():
    cfg, path = load_experiment({"config": "configs/smoke.yaml", "rounds": 5, "data.dataset": "synthetic"})
    assert path.name == "smoke.yaml" and cfg.rounds == 5 and cfg.data.dataset == "synthetic"
    with pytest.raises(ConfigError, match=r"^method.name:"):
        load_experiment({"config": "configs/smoke.yaml", "method.name": "dino", "data.dataset": "synthetic"})
    with pytest.raises(ConfigError, match=r"^method.options.tau:"):
        cfg2 = ExperimentConfig.from_yaml(REPO / "configs/smoke.yaml", {"method.options.tau": 0.1})
        from ssl_models.factory import method_options

        method_options(cfg2)
    with pytest.raises(
        ConfigError, match=r"^config: 'configs/does-not-exist.yaml' not found \(looked for it in the app"
    ):
        load_experiment({"config": "configs/does-not-exist.yaml"})


def test_pyproject_run_config_lists_every_setting():
    toml = tomllib.loads((REPO / "pyproject.toml").read_text())
    section = toml["tool"]["flwr"]["app"]["config"]

    def flatten(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flatten(v, f"{prefix}{k}.")
            else:
                yield prefix + k, v

    flat = dict(flatten(section))
    expected = {k for k in leaf_keys() if k != "output_dir"} | {"config", "output-dir", "resume"}
    expected |= set(option_run_keys())  # every method's, strategy's and architecture's options
    assert set(flat) == expected, sorted(set(flat) ^ expected)
    assert all(v == "" for k, v in flat.items() if k != "config")


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO)) for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = ExperimentConfig.from_yaml(path)
    from ssl_models.factory import method_options
    from strategies import get_strategy_class

    method_options(cfg)
    validate_component_options(
        cfg.strategy.options, get_strategy_class(cfg.strategy.name).default_options(), "strategy.options"
    )


@pytest.mark.parametrize(
    "model, key",
    [
        ({"arch": "resnet18", "options": {"depth": 6}}, "model.options"),  # ResNets take no options
        ({"arch": "vit_tiny", "options": {"heads": 6}}, "model.options"),
        ({"arch": "vit_tiny", "options": {"depth": 0}}, "model.options.depth"),
        ({"arch": "vit_tiny", "options": {"depth": 2.5}}, "model.options.depth"),
    ],
)
def test_model_options_are_checked_against_the_architecture(model, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}:"):
        ExperimentConfig.from_dict({"model": model})


def test_model_options_shape_every_model_of_the_config_arch():
    from ssl_models.factory import build_ssl_model

    cfg = ExperimentConfig.from_dict(
        {"model": {"arch": "vit_tiny", "width": 0.125, "options": {"depth": 3}}, "method": {"name": "mocov3"}}
    )
    assert len(build_ssl_model(cfg, seed=0).backbone.blocks) == 3
    assert len(build_ssl_model(cfg, seed=0, depth=2).backbone.blocks) == 2  # an explicit option wins
    # the options belong to model.arch: another architecture of the same config is built without them
    assert not hasattr(build_ssl_model(cfg, seed=0, arch="resnet18").backbone, "blocks")


def test_layerwise_run_refuses_a_model_depth_other_than_its_stages(tmp_path):
    path = tmp_path / "lw.yaml"
    path.write_text(
        "rounds: 4\nmodel: {arch: vit_tiny, width: 0.125, options: {depth: 3}}\n"
        "method: {name: mocov3}\nstrategy: {name: fedmoco_lw, options: {stages: 4}}\n"
        "data: {dataset: synthetic}\n"
    )
    with pytest.raises(ConfigError, match=r"model.options.depth=3 disagrees with strategy.options.stages=4"):
        load_experiment({"config": str(path)})
    path.write_text(path.read_text().replace("depth: 3", "depth: 4"))
    cfg, _ = load_experiment({"config": str(path)})
    assert cfg.model.options == {"depth": 4}


# ---------------------------------------------------------------------------------------------- composition
def write_yaml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_config_names_a_base_and_overrides_only_what_differs(tmp_path):
    write_yaml(
        tmp_path / "family" / "base.yaml",
        "name: b\nrounds: 7\ntrain: {lr: 0.5, batch_size: 16}\n"
        "strategy: {name: fedema, options: {tau: 0.7, mu_mode: autoscaler}}\n",
    )
    write_yaml(tmp_path / "family" / "mid.yaml", "base: base.yaml\nname: m\ntrain: {lr: 0.25}\n")
    leaf = write_yaml(
        tmp_path / "runs" / "leaf.yaml",  # a chain, resolved relative to each file
        "base: ../family/mid.yaml\nstrategy.options.tau: 0.5\nname: leaf\n",
    )
    cfg = ExperimentConfig.from_yaml(leaf)
    assert (cfg.name, cfg.rounds, cfg.train.lr, cfg.train.batch_size) == ("leaf", 7, 0.25, 16)
    assert cfg.strategy.options == {"tau": 0.5, "mu_mode": "autoscaler"}
    # null: back to the default (a variant switching to a strategy that takes other options)
    switch = write_yaml(tmp_path / "switch.yaml", "base: family/base.yaml\nstrategy: {name: fedssl, options: null}\n")
    assert ExperimentConfig.from_yaml(switch).strategy.options == {}
    # run-config overrides (dotted) apply last, options included
    over = ExperimentConfig.from_yaml(leaf, {"strategy.options.tau": 0.9, "train.lr": 0.1})
    assert over.strategy.options["tau"] == 0.9 and over.train.lr == 0.1


def test_composition_errors_name_the_file_and_the_key(tmp_path):
    a = write_yaml(tmp_path / "a.yaml", "base: b.yaml\n")
    write_yaml(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"^base: cycle a.yaml -> b.yaml -> a.yaml"):
        ExperimentConfig.from_yaml(a)
    missing = write_yaml(tmp_path / "m.yaml", "base: ../nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"^base: '../nowhere.yaml' not found .*m.yaml"):
        ExperimentConfig.from_yaml(missing)
    wrong = write_yaml(tmp_path / "w.yaml", "base: [a.yaml]\n")
    with pytest.raises(ConfigError, match=r"^base: must be the path"):
        ExperimentConfig.from_yaml(wrong)
    typo = write_yaml(tmp_path / "t.yaml", "base: a2.yaml\n")
    write_yaml(tmp_path / "a2.yaml", "train: {learning_rate: 0.1}\n")
    with pytest.raises(ConfigError, match=r"^train.learning_rate"):
        ExperimentConfig.from_yaml(typo)


def test_run_config_sets_component_options_by_dotted_key(tmp_path):
    cfg, _ = load_experiment(
        {
            "config": "configs/smoke-fedema.yaml",
            "data.dataset": "synthetic",
            "strategy.options.tau": 0.5,
            "method.options.momentum": 0.9,
        }
    )
    assert cfg.strategy.options["tau"] == 0.5 and cfg.method.options["momentum"] == 0.9
    # an option the chosen strategy does not take is refused by name, not ignored
    with pytest.raises(ConfigError, match=r"^strategy.options.stages: unknown option"):
        load_experiment(
            {"config": "configs/smoke-fedema.yaml", "data.dataset": "synthetic", "strategy.options.stages": 3}
        )
    with pytest.raises(ConfigError, match=r"^strategy.options.tua: unknown run-config key"):
        overrides_from_run_config({"strategy.options.tua": 0.5})


# ---------------------------------------------------------------------------------------------- shipped configs
SNAPSHOT = json.loads((REPO / "tests" / "config_snapshot.json").read_text())


# Sections added to the config after the snapshot was taken, with their defaults: a config that leaves one at its
# default resolves to the experiment it was (the section did not exist then); one that sets it differs.
ADDED_SINCE_SNAPSHOT = {"logging": {"tensorboard": False}}
# Keys added to existing sections after the snapshot, with their defaults (the same rule, one key at a time).
KEYS_ADDED_SINCE_SNAPSHOT = {
    "data": {"image_size": 0, "folder_labels": "auto", "unreadable": "stop", "stl10_split": "train"},
    "model": {"stem": "auto", "init_weights": ""},
    "eval": {"path": ""},
}


def resolved_hash(config: dict) -> str:
    kept = {k: v for k, v in config.items() if k != "name" and ADDED_SINCE_SNAPSHOT.get(k, object()) != v}
    for section, added in KEYS_ADDED_SINCE_SNAPSHOT.items():
        if isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items() if added.get(k, object()) != v}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("old", sorted(SNAPSHOT))
def test_every_former_config_resolves_to_what_it_was(old):
    """tests/config_snapshot.json: the 218 experiment configs as they resolved before their families were collapsed
    onto bases and study files (their name aside: a study names each run itself), and where each lives now: the
    same file (shorter, over a base) or a study's variant (``study#variant``)."""
    from fedssl_study.spec import load_study

    entry = SNAPSHOT[old]
    if "#" in entry["now"]:
        study_path, variant = entry["now"].split("#")
        tree = load_study(REPO / study_path, validate=False).variant_tree(variant, 0)
        config = ExperimentConfig.from_dict(tree).to_dict()
    else:
        config = ExperimentConfig.from_yaml(REPO / entry["now"]).to_dict()
    assert resolved_hash(config) == entry["sha256"], f"{old} -> {entry['now']} resolves to another experiment"


@pytest.mark.parametrize("path", study_files(), ids=[str(p.relative_to(REPO)) for p in study_files()])
def test_shipped_studies_resolve_every_run(path):
    from fedssl_study.spec import load_study

    study = load_study(path)  # validates every (variant, seed)
    assert study.variants and study.seeds


def test_the_config_family_shrank():
    assert len(experiment_config_files()) <= 52 and len(SNAPSHOT) == 218
