"""Every check that can be made from the config and the data files is made before the first round, with one line
naming the setting: by fedssl-run (exit 2, before Flower is called), by fedssl-study (exit 2, before the first run)
and by the ServerApp (before its output folder exists, so a refused run leaves no folder behind)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.preflight import check_experiment_data

REPO = Path(__file__).resolve().parents[1]


def write_npz(path: Path, *, classes: int = 3, per_class: int = 12, channels: int | None = 3) -> Path:
    """A labelled .npz of ``classes`` classes; ``channels=None`` writes (N, H, W) grayscale images."""
    n = classes * per_class
    shape = (n, 8, 8) if channels is None else (n, 8, 8, channels)
    x = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
    y = np.arange(n) % classes
    np.savez(path, x_train=x, y_train=y, x_test=x[: 2 * classes], y_test=y[: 2 * classes])
    return path


def config(path: Path, **changes) -> ExperimentConfig:
    tree = {
        "name": "precheck",
        "rounds": 1,
        "data": {"dataset": "npz", "path": str(path), "partition": "iid"},
        "model": {"arch": "resnet18", "width": 0.125},
        "federation": {"num_clients": 2},
        "eval": {"knn_every": 0, "max_train": 0, "max_test": 0},
    }
    for key, value in changes.items():
        section, name = key.split(".")
        tree[section][name] = value
    return ExperimentConfig.from_dict(tree)


@pytest.fixture()
def files(tmp_path):
    return SimpleNamespace(
        good=write_npz(tmp_path / "good.npz"),
        gray=write_npz(tmp_path / "gray.npz", channels=None),
        rgba=write_npz(tmp_path / "rgba.npz", channels=4),
        one_class=write_npz(tmp_path / "one.npz", classes=1, per_class=30),
        missing=tmp_path / "missing.npz",
    )


def test_good_data_passes_and_is_returned_for_the_run(files):
    checked = check_experiment_data(config(files.good))
    assert checked.data.num_classes == 3 and checked.client_sizes == [18, 18]
    assert len(checked.eval_train_idx) == 36 and len(checked.eval_test_idx) == 6


@pytest.mark.parametrize(
    "name, changes, message",
    [
        (
            "gray",
            {},
            (
                r"^data.path: .*gray.npz: x_train must have shape \(N, H, W, 3\).*got shape \(36, 8, 8\) "
                r"\(grayscale images: give them three channels"
            ),
        ),
        ("rgba", {}, r"^data.path: .*rgba.npz: x_train .*\(RGBA images: drop the alpha channel"),
        (
            "good",
            {"data.partition": "pathological", "data.classes_per_client": 5},
            r"^data.classes_per_client: 5 is more than the 3 classes the training labels hold",
        ),
        ("good", {"data.partition": "dirichlet", "data.min_size": 30}, r"^data.partition \(dirichlet, 2 clients\): "),
        ("good", {"data.public_size": 36}, r"^data.public_size: size \(36 -> 36 items\) must leave items"),
        ("missing", {}, r"^data.path: npz data file not found: .*missing.npz"),
        (
            "one_class",
            {},
            (
                r"^data.path: the labelled data \(.*one.npz\) holds 1 class; the evaluation .* needs at least "
                "two classes"
            ),
        ),
        (
            "good",
            {"eval.max_train": 1},
            (
                r"^eval.max_train: the 1 labelled training images the evaluation fits on hold 1 "
                "class"
            ),
        ),
    ],
)
def test_each_check_is_one_line_naming_the_setting(files, name, changes, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_experiment_data(config(getattr(files, name), **changes))
    assert "\n" not in str(err.value)


def test_fedssl_run_refuses_before_flower_is_called(files, capsys, monkeypatch):
    from fedssl_study import cli

    monkeypatch.setattr(cli, "run_and_report_outcome", lambda *a, **k: pytest.fail("flwr run was called"))
    run_config = f"config='configs/smoke.yaml' data.dataset='npz' data.path='{files.gray}'"
    assert cli.run_main([str(REPO), "--run-config", run_config, "--stream"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedssl-run: data.path: ") and "grayscale" in err[0]
    run_config = f"config='configs/smoke.yaml' data.dataset='npz' data.path='{files.good}' data.classes_per_client=5"
    assert cli.run_main([str(REPO), "--run-config", run_config]) == 2
    assert "fedssl-run: data.classes_per_client: 5 is more than the 3 classes" in capsys.readouterr().err


def test_fedssl_study_refuses_before_the_first_run(files, tmp_path, capsys):
    from fedssl_study.cli import study_main

    study = tmp_path / "study.yaml"
    study.write_text(
        f"study: precheck\nbase: {REPO / 'configs' / 'smoke.yaml'}\nseeds: [0, 1]\n"
        "variants:\n  iid: {data.partition: iid}\n  skewed: {data.classes_per_client: 4}\n"
    )
    out = tmp_path / "out"
    code = study_main(
        ["run", str(study), "--out", str(out), "--set", "data.dataset=npz", "--set", f"data.path={files.good}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("fedssl-study: variants.skewed (seed 0): data.classes_per_client: 4 is more than the 3")
    assert not out.exists()  # nothing started, nothing written
    # the same study on data that passes: its dry run lists the runs
    assert (
        study_main(
            [
                "run",
                str(study),
                "--out",
                str(out),
                "--dry-run",
                "--set",
                "data.dataset=npz",
                "--set",
                f"data.path={files.good}",
                "--variants",
                "iid",
            ]
        )
        == 0
    )


def test_the_serverapp_refuses_before_its_output_folder_exists(files, tmp_path):
    from server_app.app import main

    class InMemoryGrid:  # the ServerApp reads a local simulation from the grid's type name
        def get_node_ids(self):
            pytest.fail("the ServerApp asked for clients")

    out = tmp_path / "run"
    context = SimpleNamespace(
        run_id=1,
        run_config={
            "config": str(REPO / "configs" / "smoke.yaml"),
            "output-dir": str(out),
            "data.dataset": "npz",
            "data.path": str(files.one_class),
            "data.partition": "iid",
        },
    )
    with pytest.raises(ConfigError, match=r"holds 1 class; the evaluation"):
        main(InMemoryGrid(), context)
    assert not out.exists()
