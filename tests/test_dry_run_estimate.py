"""`fedssl-study run` says how long the study will take before it starts: each run's mean time in the published
report of the same study (measured), or its counted FLOPs over the rates the published studies ran at (counted), the
total, and the start-up each run adds."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fedssl_study.estimate import PUBLISHED, START_UP_S, StudyEstimator, clock, published_rates, published_study
from fedssl_study.spec import load_study

REPO = Path(__file__).resolve().parents[1]
HEADER = "row,kind,arch,seeds,client_tflops,run_s_mean\n"


def publish(root: Path, name: str, rows: str, machine: str = "Some CPU, 2 cores") -> None:
    (root / name).mkdir(parents=True)
    (root / name / "report.csv").write_text(HEADER + rows)
    (root / name / "report.md").write_text(f"# Study {name}\n\n- Python 3.11; device {machine}; app code x\n")


@pytest.fixture()
def study(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(
        f"study: tiny\nbase: {REPO / 'configs' / 'smoke.yaml'}\nseeds: [0, 1]\n"
        "variants:\n  A: {}\n  B: {train.local_epochs: 2}\n"
    )
    return load_study(path, {"data.dataset": "synthetic"})


def test_clock():
    assert [clock(s) for s in (42, 125, 3 * 3600 + 7 * 60 + 30)] == ["42s", "2m05s", "3h07m"]


def test_measured_times_come_from_the_published_report_of_the_same_study(study, tmp_path):
    root = tmp_path / "published"
    publish(root, "tiny", "random init,random init,,0 1,,\nA,variant,,0 1,2.0,100.0\nB,variant,,0 1,4.0,300.0\n")
    estimator = StudyEstimator(study, {"data.path": "x.npz"}, root=root)
    assert published_study("tiny", root).machine == "Some CPU, 2 cores"
    estimates = [estimator.run(v, s) for v, s in study.runs()]
    assert [e.seconds for e in estimates] == [100.0, 300.0, 100.0, 300.0]
    assert all(e.source == "measured" for e in estimates)
    assert "published report" in estimator.source_line() and "Some CPU, 2 cores" in estimator.source_line()
    assert "may change it" not in estimator.source_line()  # data.path says where the data is, not what runs
    total = estimator.total_line(estimates)
    low, high = START_UP_S[0] * 4 / 60, START_UP_S[1] * 4 / 60
    assert "about 13m20s" in total and f"plus {low:.0f}-{high:.0f} min of start-up" in total
    assert "may change it" in StudyEstimator(study, {"train.lr": 0.1}, root=root).source_line()


def test_a_study_without_a_published_report_gets_a_counted_estimate_with_its_range(study, tmp_path):
    root = tmp_path / "published"
    publish(root, "other", "X,variant,,0,2.0,100.0\nY,variant,,0,1.0,100.0\nY [resnet34],variant,,0,1.0,7.0\n")
    assert sorted(published_rates(root)) == [0.01, 0.02]  # a per-architecture copy of a row counts once
    estimator = StudyEstimator(study, {}, root=root)
    a, b = estimator.run("A", 0), estimator.run("B", 0)
    assert a.source == "counted" and a.low < a.seconds < a.high
    assert a.high == pytest.approx(2 * a.low)  # the rates' spread, 0.01 to 0.02 TFLOP/s
    assert b.seconds > 1.5 * a.seconds  # twice the local epochs: nearly twice the training FLOPs
    assert "counted, not measured" in estimator.source_line()


def test_dry_run_prints_each_run_the_total_and_the_start_up(capsys, tmp_path):
    from fedssl_study.cli import study_main

    with (PUBLISHED / "flesd-cpu" / "report.csv").open() as fh:
        measured = {row["row"]: float(row["run_s_mean"]) for row in csv.DictReader(fh) if row["run_s_mean"]}
    code = study_main(
        [
            "run",
            str(REPO / "configs" / "studies" / "cpu" / "flesd.yaml"),
            "--dry-run",
            "--set",
            "data.dataset=synthetic",
            "--set",
            "data.synthetic_train=3000",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"FLESD (T=2), seed 0: to run, about {clock(measured['FLESD (T=2)'])}" in out
    assert f"about {clock(sum(measured[v] for v in ('FLESD (T=2)', 'FedAvg (SimCLR)', 'centralized')) * 3)}" in out
    assert "of start-up" in out
