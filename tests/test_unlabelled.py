"""Unlabelled training images are first-class: an .npz of ``x_train`` alone trains; labels are needed only by a
label-skewed split (refused before the first round) and by the evaluation, which reads a labelled set of its own
(``eval.path``). Without one the run trains, saves its encoder and says plainly that it scored nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from flwr.app import Context, RecordDict

import server_app.app as server_module
import server_app.results as results_module
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.datasets import load_npz
from ssl_models.data.preflight import NOTHING_SCORED, check_experiment_data
from test_server_app import ClientAppGrid, simulated_clientapps  # noqa: F401 - an autouse fixture

pytestmark = pytest.mark.usefixtures("task_identity")  # messages are built outside a run


def images(n: int, side: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, side, side, 3), dtype=np.uint8)


@pytest.fixture()
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSSL_DATA_CACHE", str(tmp_path / "cache"))
    unlabelled = tmp_path / "unlabelled.npz"
    np.savez(unlabelled, x_train=images(48))
    labelled = tmp_path / "labelled.npz"
    y = np.arange(40) % 4
    np.savez(labelled, x_train=images(40, seed=1), y_train=y, x_test=images(12, seed=2), y_test=y[:12])
    other_side = tmp_path / "labelled-24px.npz"
    np.savez(other_side, x_train=images(40, 24), y_train=y, x_test=images(12, 24), y_test=y[:12])
    return unlabelled, labelled, other_side


def config(path, **changes) -> ExperimentConfig:
    tree: dict = {
        "data": {"dataset": "npz", "path": str(path), "partition": "iid"},
        "federation": {"num_clients": 2},
        "eval": {},
    }
    for key, value in changes.items():
        section, name = key.split(".")
        tree[section][name] = value
    return ExperimentConfig.from_dict(tree)


def test_an_npz_of_training_images_alone_is_unlabelled(files):
    data = load_npz(files[0])
    assert not data.labelled and data.num_classes == 1 and len(data.x_train) == 48 and len(data.x_test) == 0
    checked = check_experiment_data(config(files[0]))
    assert checked.eval_data is None and checked.client_sizes == [24, 24]


@pytest.mark.parametrize("partition", ["dirichlet", "pathological"])
def test_a_label_skewed_split_of_unlabelled_images_is_refused(files, partition):
    with pytest.raises(
        ConfigError,
        match=rf"^data.partition: {partition} splits the images by label, but the training "
        r"images \(.*unlabelled.npz\) are unlabelled; use data.partition: iid",
    ):
        check_experiment_data(config(files[0], **{"data.partition": partition}))


def test_eval_path_names_the_labelled_set_the_encoder_is_scored_on(files):
    unlabelled, labelled, other_side = files
    checked = check_experiment_data(config(unlabelled, **{"eval.path": str(labelled)}))
    assert checked.eval_data is not None and checked.eval_data.num_classes == 4
    assert len(checked.eval_train_idx) == 40 and len(checked.eval_test_idx) == 12
    with pytest.raises(ConfigError, match=r"^eval.path: its images are 24 px but the encoders see 16 px images"):
        check_experiment_data(config(unlabelled, **{"eval.path": str(other_side)}))
    with pytest.raises(ConfigError, match=r"^eval.path: .*unlabelled.npz holds no labels"):
        check_experiment_data(config(labelled, **{"eval.path": str(unlabelled)}))
    with pytest.raises(ConfigError, match=r"^eval.path: .*nowhere does not exist"):
        check_experiment_data(config(unlabelled, **{"eval.path": str(labelled.parent / "nowhere")}))


def run(tmp_path, monkeypatch, data_path, **eval_changes):
    raw = {
        "name": "unlabelled",
        "rounds": 1,
        "data": {"dataset": "npz", "path": str(data_path), "partition": "iid"},
        "model": {"arch": "resnet18", "width": 0.125},
        "method": {"name": "simclr", "options": {"proj_hidden_dim": 16, "proj_out_dim": 8}},
        "federation": {"num_clients": 2, "node_wait_s": 0.0},
        "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False, "device": "cpu"},
        "eval": {"knn_every": 1, "knn_k": 5, "linear_probe": False, "device": "cpu", **eval_changes},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    monkeypatch.setattr(results_module.ResultsWriter, "plot", lambda self, title: None)
    context = Context(
        run_id=1,
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config={"config": str(tmp_path / "cfg.yaml"), "output-dir": str(out)},
    )
    server_module.main(ClientAppGrid(2), context)
    return out, json.loads((out / "summary.json").read_text())


def test_a_run_without_a_labelled_set_trains_saves_its_encoder_and_says_it_scored_nothing(files, tmp_path, monkeypatch):
    out, summary = run(tmp_path, monkeypatch, files[0])
    assert summary["eval"]["scored"] is False and summary["eval"]["reason"] == NOTHING_SCORED
    assert summary["knn_acc"] is None and summary["linear_probe_acc"] is None and "random_init" not in summary
    assert (out / "model.pt").is_file() and summary["final_train_loss"] is not None
    log = (out / "progress.log").read_text().splitlines()
    assert "(16 px, unlabelled)" in log[1] and "nothing to score on" in log[1]
    assert "nothing scored: the training images are unlabelled" in log[-1] and log[-1].split(" ", 1)[1].startswith(
        "done in"
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0].get("knn_acc") is None  # no kNN monitor either


def test_a_run_on_unlabelled_images_scores_on_eval_path(files, tmp_path, monkeypatch):
    _, summary = run(tmp_path, monkeypatch, files[0], path=str(files[1]), random_init_reference=True)
    assert summary["eval"]["scored"] is True and summary["eval"]["num_test"] == 12
    assert 0 <= summary["knn_acc"] <= 1 and summary["random_init"]
    assert summary["eval"]["protocol"]["data"] == str(files[1])
