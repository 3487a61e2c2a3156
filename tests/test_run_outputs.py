"""What a user sees of a run's outputs: an earlier run is never overwritten, a config that is not found is named as
given, and the first progress line says what actually travels each way for every strategy."""

from __future__ import annotations

import pytest

from server_app.experiment import load_experiment
from server_app.results import ResultsWriter, unused_output_dir
from ssl_models.config import ConfigError
from strategies import get_strategy_class


def test_an_earlier_run_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    assert unused_output_dir(out) == out  # nothing there yet
    out.mkdir()
    assert unused_output_dir(out) == out  # an empty folder holds no run
    writer = ResultsWriter(out)
    writer.progress("round 1/2 | loss 1.0")  # a partial run: its progress.log is not empty
    assert unused_output_dir(out) == tmp_path / "run-2"
    (tmp_path / "run-2").mkdir()
    (tmp_path / "run-2" / "summary.json").write_text("{}")
    assert unused_output_dir(out) == tmp_path / "run-3"
    assert (out / "progress.log").read_text().endswith("round 1/2 | loss 1.0\n")  # untouched


def test_a_config_that_is_not_found_is_named_as_given():
    with pytest.raises(ConfigError, match=r"config: 'configs/nope\.yaml' not found .*give an absolute path"):
        load_experiment({"config": "configs/nope.yaml"})


@pytest.mark.parametrize(
    "name, words",
    [
        ("fedssl", "down and up per client and round: the model, 1.00 MiB"),
        ("central", "one trainer"),
        ("local", "down: the initial model (1.00 MiB) once per client"),
    ],
)
def test_first_progress_line_says_what_travels(name, words, tmp_path):
    strategy = get_strategy_class(name)(clients={0: 10, 1: 11}, clients_per_round=2, state_dir=str(tmp_path))
    assert words in strategy.traffic(2**20)


def test_flesd_and_heterossfl_say_that_no_weights_go_up():
    flesd = get_strategy_class("flesd").__new__(get_strategy_class("flesd"))
    flesd.options = {"topk_fraction": 0.1, "similarity": "topk"}
    flesd.public = [0] * 200

    class Cfg:
        class model:
            arch = "resnet18"

    flesd.cfg = Cfg
    line = flesd.traffic(2**20)
    assert "up: no weights, a 200 x 200 similarity matrix" in line and "top 0.1 of each row" in line
    hetero = get_strategy_class("heterossfl").__new__(get_strategy_class("heterossfl"))
    hetero.rad_size, hetero.options = 100, {"kernel_encoding": "dense-fp16", "initial_kernels": "query"}
    line = hetero.traffic(2**20)
    assert "no weights: up, the client's 100 x 100 RAD kernel (dense-fp16)" in line
    assert "before round 1 each client's kernel of its initial model (K_bar(0))" in line  # Algorithm 1's K_bar(0)


def test_curves_png_is_drawn_with_matplotlib(tmp_path):
    writer = ResultsWriter(tmp_path)
    for r in (1, 2, 3):
        writer.write_round({"round": r, "train_loss": 3.0 - r, "knn_acc": 0.2 + 0.01 * r if r != 2 else None})
    path = writer.plot("demo")
    assert path == tmp_path / "curves.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def tensorboard_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_per_round_and_client_and_a_resume_drops_the_cut_off_round(tmp_path):
    def record(r):
        return {
            "round": r,
            "train_loss": 3.0 - r,
            "bytes_up": 100 * r,
            "knn_acc": 0.5 if r == 2 else None,
            "clients": [{"id": 0, "loss": 1.0 * r, "train_s": 2.0}, {"id": 1, "loss": 2.0 * r, "mu": 0.7}],
        }

    writer = ResultsWriter(tmp_path, tensorboard=True)
    for r in (1, 2, 3):
        writer.write_round(record(r))
    writer.tensorboard.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["round/train_loss"] == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert scalars["round/knn_acc"] == [(2, 0.5)] and scalars["round/bytes_up"][-1] == (3, 300.0)
    assert scalars["client_1/loss"] == [(1, 2.0), (2, 4.0), (3, 6.0)] and scalars["client_1/mu"][0] == (1, 0.7)
    # resumed after round 2's checkpoint: round 3 runs again, its first version is gone
    writer = ResultsWriter(tmp_path, resume_round=2, tensorboard=True)
    writer.write_round({**record(3), "train_loss": -1.0})
    writer.tensorboard.close()
    assert tensorboard_scalars(tmp_path / "tensorboard")["round/train_loss"] == [(1, 2.0), (2, 1.0), (3, -1.0)]


def test_tensorboard_without_the_package_is_refused_naming_the_key(monkeypatch):
    import sys

    from server_app.experiment import load_experiment
    from ssl_models.config import ConfigError

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(ConfigError, match=r"^logging.tensorboard: the tensorboard package is not installed"):
        load_experiment({"config": "configs/smoke.yaml", "data.dataset": "synthetic", "logging.tensorboard": True})


def test_the_books_say_what_clients_trained_on_when_a_node_has_its_own_data():
    from server_app.results import client_size_notes, trained_client_sizes

    split = [200, 200]
    rounds = [
        {"clients": [{"id": 0, "num_examples": 270}, {"id": 1, "num_examples": 200}]},
        {"clients": [{"id": 0, "num_examples": 270}]},
    ]
    assert trained_client_sizes(rounds, split) == [270, 200]
    assert trained_client_sizes([], split) == split  # no reply yet: the server's figure
    noted: set[int] = set()
    lines = client_size_notes(rounds[0]["clients"], split, noted)
    assert lines == [
        ("client 0 trains on 270 images of its own data file, not the 200 of the server's split (its node's data-path)")
    ]
    assert client_size_notes(rounds[1]["clients"], split, noted) == []  # named once
