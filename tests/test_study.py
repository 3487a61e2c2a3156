"""Studies: the study file's checks, the report's figures against hand computations, and `fedssl-study run` end to
end (real `flwr run` simulations: interrupted with Ctrl-C, resumed, skipped when finished)."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedssl_study.launcher import processes_with_env
from fedssl_study.report import report_runs, study_runs, write_report
from fedssl_study.runner import has_checkpoint
from fedssl_study.spec import load_study, slug
from fedssl_wire import app_code_digest
from ssl_models.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, tree) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tree if isinstance(tree, str) else yaml.safe_dump(tree, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------- the study file
def test_a_study_resolves_every_run_from_its_base_and_variants(tmp_path):
    study = load_study(
        write(
            tmp_path / "s.yaml",
            {
                "study": "demo",
                "base": str(REPO / "configs" / "smoke.yaml"),
                "seeds": [3, 4],
                "overrides": {"data.dataset": "synthetic"},
                "variants": {
                    "FedBYOL": {},
                    "FedU (0.2)": {"strategy": {"name": "fedu", "options": {"threshold": 0.2}}},
                    "central": {"strategy.name": "central"},
                },
            },
        ),
        {"eval.max_test": 50},
    )
    assert study.runs()[:3] == [("FedBYOL", 3), ("FedU (0.2)", 3), ("central", 3)]  # seed-major
    tree = study.variant_tree("FedU (0.2)", 4)
    assert (
        tree["seed"] == 4
        and tree["name"] == "demo-fedu-0.2-seed4"
        and tree["strategy"]["options"] == {"threshold": 0.2}
    )
    assert tree["data"]["dataset"] == "synthetic" and tree["eval"]["max_test"] == 50 and tree["rounds"] == 2
    assert slug("FedEMA (autoscaler, tau 0.7)") == "fedema-autoscaler-tau-0.7"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"variants": {"bad": {"train.learning_rate": 0.1}}}, r"^variants.bad \(seed 0\): train.learning_rate"),
        (
            {"variants": {"bad": {"strategy.options.tua": 0.5, "strategy.name": "fedema"}}},
            r"^variants.bad \(seed 0\): strategy.options.tua: unknown option",
        ),
        ({"base": "nowhere.yaml"}, r"^base: 'nowhere.yaml' not found"),
        ({"seeds": [0, "one"]}, r"^seeds: must be a non-empty list of integers"),
        ({"seeds": [0, 0]}, r"^seeds: lists a seed twice"),
        ({"variants": {}}, r"^variants: a study lists at least one variant"),
        ({"runs": 3}, r"^runs: unknown study key"),
    ],
)
def test_a_bad_study_stops_before_any_run_naming_the_key(tmp_path, change, message):
    spec = {"base": str(REPO / "configs" / "smoke.yaml"), "seeds": [0], "variants": {"ok": {}}, **change}
    with pytest.raises(ConfigError, match=message):
        load_study(write(tmp_path / "s.yaml", spec), {"data.dataset": "synthetic"})


def test_the_cli_refuses_a_bad_study_with_exit_2_and_one_line(tmp_path):
    path = write(
        tmp_path / "s.yaml",
        {"base": str(REPO / "configs" / "smoke.yaml"), "variants": {"typo": {"federation.num_client": 3}}},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "fedssl_study.cli", "run", str(path), "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and not (tmp_path / "o").exists()
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("fedssl-study: variants.typo (seed 0): federation.num_client: unknown key")


# ---------------------------------------------------------------------------------------------- the report
def fake_run(
    folder: Path, variant: str, seed: int, lp: float, knn: float, rand_lp: float, strategy="fedssl", rounds=3
) -> None:
    folder.mkdir(parents=True)
    summary = {
        "name": f"s-{slug(variant)}-seed{seed}",
        "linear_probe_acc": lp,
        "knn_acc": knn,
        "random_init": {"resnet18": {"linear_probe_acc": rand_lp, "knn_acc": 0.2}},
        "linear_probe_gain_over_random": lp - rand_lp,
        "rounds_completed": rounds,
        "bytes_up_total": 8 * 2**20,
        "bytes_down_total": 4 * 2**20,
        "run_s": 100.0 + seed,
        "resources": {"run": {"flops_run": 2e12}},
        "config": {
            "seed": seed,
            "rounds": rounds,
            "federation": {"num_clients": 2},
            "model": {"arch": "resnet18", "width": 0.25},
            "strategy": {"name": strategy},
            "data": {"dataset": "cifar10", "partition": "iid", "max_train": 1000},
            "train": {"local_epochs": 1, "batch_size": 32},
            "eval": {},
        },
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"round": r, "knn_acc": knn * r / rounds}) + "\n" for r in range(1, rounds + 1))
    )
    (folder / "run.json").write_text(json.dumps({"variant": variant, "seed": seed}))


def table_rows(report: Path) -> dict[str, list[str]]:
    rows = {}
    for line in report.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| row ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def test_report_rows_are_the_runs_mean_and_std_and_close_rows_are_not_ranked(tmp_path):
    values = {"A": [(0.40, 0.30), (0.44, 0.34)], "B": [(0.41, 0.31), (0.425, 0.32)], "C": [(0.60, 0.5), (0.62, 0.5)]}
    rand = [0.33, 0.35]
    for variant, pairs in values.items():
        for seed, (lp, knn) in enumerate(pairs):
            fake_run(
                tmp_path / "runs" / f"{slug(variant)}-seed{seed}",
                variant,
                seed,
                lp,
                knn,
                rand[seed],
                strategy="central" if variant == "C" else "fedssl",
            )
    runs, order = study_runs(tmp_path)
    report = write_report(tmp_path, runs, order, title="t")
    rows = table_rows(report)
    assert set(rows) == {"random init", "A", "B", "C (centralized reference)"}
    for variant, pairs in values.items():
        cells = rows["C (centralized reference)" if variant == "C" else variant]
        lp = [100 * p[0] for p in pairs]
        gain = [100 * p[0] - 100 * r for p, r in zip(pairs, rand)]
        assert cells[2] == f"{statistics.mean(lp):.2f} ± {statistics.stdev(lp):.2f}"
        assert (
            cells[3] == f"{statistics.mean(100 * p[1] for p in pairs):.2f} ± "
            f"{statistics.stdev([100 * p[1] for p in pairs]):.2f}"
        )
        assert cells[4] == f"{statistics.mean(gain):.2f} ± {statistics.stdev(gain):.2f}"
        assert cells[5] == " ".join(f"{v:.2f}" for v in lp)
        assert cells[8] == "4.0" and cells[9] == "2.0" and cells[10] == "2.0"  # MiB per client, TFLOP
    assert rows["random init"][2] == f"{statistics.mean([33.0, 35.0]):.2f} ± {statistics.stdev([33.0, 35.0]):.2f}"
    text = report.read_text()
    assert "A and B: linear probe" in text and "not ranked" in text  # 42.0 vs 41.75, spread 2.83 + 1.06
    assert "C (centralized reference) and" not in text.split("not ranked")[0].split("\n")[-1]
    csv_lines = (tmp_path / "report.csv").read_text().splitlines()
    assert csv_lines[0].startswith("row,kind,arch,seeds,linear_probe_mean") and len(csv_lines) == 5
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "scores.png").is_file()
    # fedssl-report on run folders: the seeds of one experiment form one row, named after the study's variant
    # when the run has one (run.json), else after the run without its -seed<N>
    other = report_runs(sorted((tmp_path / "runs").glob("a-seed*")), tmp_path / "cmp")
    assert list(table_rows(other)) == ["random init", "A"]
    for seed in (0, 1):
        (tmp_path / "runs" / f"b-seed{seed}" / "run.json").unlink()
    named = report_runs(sorted((tmp_path / "runs").glob("b-seed*")), tmp_path / "cmp2")
    assert list(table_rows(named)) == ["random init", "s-b"]


def test_a_hetero_ssfl_run_without_its_terms_flops_shows_no_client_tflop(tmp_path):
    for variant, extra in (("counted", {"flops_extra_run": 5e11}), ("before", None)):
        for seed in (0, 1):
            folder = tmp_path / "runs" / f"{variant}-seed{seed}"
            fake_run(folder, variant, seed, 0.4, 0.3, 0.33, strategy="heterossfl")
            summary = json.loads((folder / "summary.json").read_text())
            summary["resources"]["run"].update(extra or {})
            (folder / "summary.json").write_text(json.dumps(summary))
    mixed = tmp_path / "runs" / "mixed-seed0"
    fake_run(mixed, "mixed", 0, 0.4, 0.3, 0.33, strategy="heterossfl")
    summary = json.loads((mixed / "summary.json").read_text())
    summary["resources"]["run"]["flops_extra_run"] = 1e11
    (mixed / "summary.json").write_text(json.dumps(summary))
    fake_run(tmp_path / "runs" / "mixed-seed1", "mixed", 1, 0.4, 0.3, 0.33, strategy="heterossfl")
    runs, order = study_runs(tmp_path)
    report = write_report(tmp_path, runs, order, title="t")
    rows = table_rows(report)
    assert rows["counted"][10] == "2.0"  # flops_run as recorded (it already holds the term's FLOPs)
    assert rows["before"][10] == "-" and rows["mixed"][10] == "-"  # no mean over a part of the seeds
    assert "recorded before its alignment term's RAD passes were counted" in report.read_text()


def test_the_alignment_table_is_the_clients_mean_cka_per_round_over_seeds(tmp_path):
    """Runs whose clients log cka_start / cka_end (Hetero-SSFL, mu 0 included) get the alignment table: per round
    the clients' mean before -> after, averaged over seeds, the mean change, the rounds it fell and the kernel norm
    per architecture in the first and last round; runs without them get none."""
    ckas = {
        0: [[(0.8, 0.6), (0.6, 0.6)], [(0.7, 0.9), (0.9, 0.9)]],  # seed: round: client: (start, end)
        1: [[(0.6, 0.4), (0.4, 0.4)], [(0.5, 0.7), (0.7, 0.7)]],
    }
    for seed, per_round in ckas.items():
        folder = tmp_path / "runs" / f"h-seed{seed}"
        fake_run(folder, "H", seed, 0.4, 0.3, 0.33, rounds=2)
        (folder / "metrics.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "round": r + 1,
                        "knn_acc": 0.3,
                        "clients": [
                            {
                                "id": i,
                                "arch": ("resnet18", "resnet34")[i],
                                "cka_start": a,
                                "cka_end": b,
                                "kernel_norm": 10.0 * (i + 1) * (r + 1) + seed,
                            }
                            for i, (a, b) in enumerate(clients)
                        ],
                    }
                )
                + "\n"
                for r, clients in enumerate(per_round)
            )
        )
    fake_run(tmp_path / "runs" / "plain-seed0", "plain", 0, 0.4, 0.3, 0.33)
    runs, order = study_runs(tmp_path)
    text = write_report(tmp_path, runs, order, title="t").read_text()
    alignment = text.split("<!-- --8<-- [start:alignment] -->")[1].split("<!-- --8<-- [end:alignment] -->")[0]
    (line,) = [l for l in alignment.splitlines() if l.startswith("| H |")]
    # round 1: before (0.7 + 0.5) / 2 = 0.6, after (0.6 + 0.4) / 2 = 0.5; round 2: 0.7 -> 0.8
    assert line == (
        "| H | r1 0.600->0.500 r2 0.700->0.800 | +0.000 | 1 of 2 | resnet18 10.5 -> 20.5; resnet34 20.5 -> 40.5 |"
    ), line
    assert "| plain |" not in alignment


# ---------------------------------------------------------------------------------------------- end to end
STUDY = {
    "study": "e2e",
    "base": str(REPO / "configs" / "smoke.yaml"),
    # One seed: three launches (the cut run, its resume, FedEMA); the report's mean and std over seeds are
    # pinned by test_report_rows_are_the_runs_mean_and_std_and_close_rows_are_not_ranked on written summaries.
    "seeds": [0],
    "overrides": {
        "data": {"dataset": "synthetic", "synthetic_train": 240, "synthetic_test": 60, "max_train": 0},
        "rounds": 5,  # the cut run must still be training when the Ctrl-C lands, a few seconds after round 1
        "train.max_steps_per_epoch": 2,
        "eval": {"max_train": 120, "max_test": 60, "probe_epochs": 3, "knn_k": 10},
    },
    "variants": {"FedBYOL": {}, "FedEMA": {"strategy": {"name": "fedema", "options": {"tau": 0.7}}}},
}


def test_an_interrupt_while_a_run_is_submitted_stops_the_study_cleanly(tmp_path):
    """Ctrl-C (or SIGTERM, which the runner turns into the same) can land while `flwr run` submits a run, outside
    the loop that polls a run: the study still ends with an "interrupted" outcome and one line, no traceback, and
    the launcher is closed (its private SuperLink stopped)."""
    from fedssl_study.runner import StudyRunner

    study = load_study(
        write(
            tmp_path / "s.yaml",
            {
                "study": "demo",
                "base": str(REPO / "configs" / "smoke.yaml"),
                "seeds": [0, 1],
                "overrides": {"data.dataset": "synthetic"},
                "variants": {"FedBYOL": {}},
            },
        )
    )

    class InterruptedLauncher:
        closed = 0

        def submit(self, run_config, num_supernodes=None):
            raise KeyboardInterrupt

        def close(self):
            self.closed += 1

    launcher, said = InterruptedLauncher(), []
    outcomes = StudyRunner(study, tmp_path / "out", launcher, say=said.append).run()
    assert [(o.variant, o.seed, o.status) for o in outcomes] == [("FedBYOL", 0, "interrupted")]  # seed 1 not tried
    assert launcher.closed >= 1
    assert any("FedBYOL, seed 0: interrupted" in line for line in said), said


def test_a_study_filled_by_several_commands_records_and_reports_each(tmp_path):
    """A study folder filled one variant at a time (--variants, --seeds) holds runs from several commands:
    study.yaml keeps every command, oldest first (a command repeated at once: once), and the report lists each
    once, in the order it first ran, not the last one alone (a record from before the list shows its one command);
    its rows keep the study file's order."""
    from fedssl_study.report import study_commands
    from fedssl_study.runner import StudyRunner

    path = write(
        tmp_path / "s.yaml",
        {
            "study": "demo",
            "base": str(REPO / "configs" / "smoke.yaml"),
            "seeds": [0],
            "overrides": {"data.dataset": "synthetic"},
            "variants": {"A": {}, "B": {"train.lr": 0.01}},
        },
    )
    out = tmp_path / "out"
    for command, only in (
        ("fedssl-study run s.yaml --variants A", "A"),
        ("fedssl-study run s.yaml --variants B", "B"),
        ("fedssl-study run s.yaml --variants B", "B"),
        ("fedssl-study run s.yaml --variants A", "A"),
    ):
        StudyRunner(load_study(path, variants=[only]), out, launcher=None, command=command).write_study_record()
    record = yaml.safe_load((out / "study.yaml").read_text())
    assert record["commands"] == [
        "fedssl-study run s.yaml --variants A",
        "fedssl-study run s.yaml --variants B",
        "fedssl-study run s.yaml --variants A",
    ]
    assert record["command"] == "fedssl-study run s.yaml --variants A"
    assert list(record["variants"]) == ["A"] and record["variant_order"] == ["A", "B"]
    assert study_commands({"command": "fedssl-study run old.yaml"}) == ["fedssl-study run old.yaml"]
    fake_run(out / "runs" / "b-seed0", "B", 0, 0.41, 0.3, 0.33)
    fake_run(out / "runs" / "a-seed0", "A", 0, 0.40, 0.3, 0.33)
    # the rows keep the file's order, not the order of the last command's variants
    assert study_runs(out)[1] == ["A", "B"]
    from fedssl_study.report import report_study

    text = report_study(out).read_text()
    assert (
        "Commands, in the order they first ran into this folder:\n\n"
        "- `fedssl-study run s.yaml --variants A` (run 2 times)\n- `fedssl-study run s.yaml --variants B`\n" in text
    )
    assert "Command: `" not in text
    write_report(tmp_path / "one", [], [], title="t", command="fedssl-report r1 r2")
    assert "Command: `fedssl-report r1 r2`" in (tmp_path / "one" / "report.md").read_text()


def test_the_report_names_the_study_runs_without_a_result(tmp_path):
    """Runs of the study file with no summary.json are named under the table: those started (a run folder) and
    those not started, also the seeds a --seeds command left out, so a study stopped part-way does not read as a
    finished one with fewer seeds."""
    from fedssl_study.report import report_study, unfinished_runs
    from fedssl_study.runner import StudyRunner

    path = write(
        tmp_path / "s.yaml",
        {
            "study": "demo",
            "base": str(REPO / "configs" / "smoke.yaml"),
            "seeds": [0, 1],
            "overrides": {"data.dataset": "synthetic"},
            "variants": {"A": {}, "Bee (two)": {"train.lr": 0.01}, "C": {}},
        },
    )
    out = tmp_path / "out"
    StudyRunner(load_study(path, seeds=[0]), out, launcher=None, command="c").write_study_record()
    record = yaml.safe_load((out / "study.yaml").read_text())
    assert record["seeds"] == [0] and record["file_seeds"] == [0, 1]
    fake_run(out / "runs" / "a-seed0", "A", 0, 0.40, 0.3, 0.33)
    fake_run(out / "runs" / "c-seed1", "C", 1, 0.42, 0.3, 0.33)
    (out / "runs" / "bee-two-seed0").mkdir()  # started, stopped before its result
    line = (
        "Runs without a result: 4 of the study's 6. Started, not finished: Bee (two) seed 0. "
        "Not started: A: seed 1; Bee (two): seed 1; C: seed 0."
    )
    assert unfinished_runs(out).line() == line
    text = report_study(out).read_text()
    assert line in text.split("<!-- --8<-- [end:table] -->")[0]  # with the table: a docs page quoting it shows it
    (out / "runs" / "bee-two-seed0").rmdir()
    for variant, seed in (("A", 1), ("Bee (two)", 0), ("Bee (two)", 1), ("C", 0)):
        fake_run(out / "runs" / f"{slug(variant)}-seed{seed}", variant, seed, 0.4, 0.3, 0.33)
    assert not unfinished_runs(out) and "without a result" not in report_study(out).read_text()


def test_a_run_resumed_on_other_code_is_named_under_the_provenance(tmp_path):
    """The provenance line of a run names its last attempt's code; a run whose attempts ran on different code (the
    checkout changed between a stop and the resume) gets its own line naming each version and its attempts. Runs
    that record no per-attempt code (from before the record) and runs on one version get none."""
    from fedssl_study.report import report_study

    out = tmp_path / "study"

    def attempts(folder, *versions):
        info = json.loads((folder / "run.json").read_text())
        info["attempts"] = [
            {"run_id": i, "outcome": "finished", **({"app_digest": d, "git_commit": c} if d else {})}
            for i, (d, c) in enumerate(versions)
        ]
        (folder / "run.json").write_text(json.dumps(info))

    for seed in (0, 1, 2):
        fake_run(out / "runs" / f"a-seed{seed}", "A", seed, 0.40, 0.3, 0.33)
    attempts(out / "runs" / "a-seed0", ("a" * 64, "1" * 40), ("a" * 64, "1" * 40), ("b" * 64, "2" * 40))
    attempts(out / "runs" / "a-seed1", ("a" * 64, "1" * 40), ("a" * 64, "1" * 40))
    attempts(out / "runs" / "a-seed2", (None, None), ("b" * 64, None))
    text = report_study(out).read_text()
    assert (
        "- A seed 0 ran on more than one version of the code, resumed between them: app code aaaaaaaaaaaa, commit "
        "111111111111 (attempts 1, 2); app code bbbbbbbbbbbb, commit 222222222222 (attempt 3)"
    ) in text
    assert (
        "- A seed 2 resumed, with the code of some attempts not recorded: code not recorded (attempt 1); app code bbb"
        in text
    )
    assert "A seed 1 ran" not in text


def test_the_provenance_names_each_runs_number_format(tmp_path):
    """Runs of one study that trained in different number formats (bf16 autocast on a machine with native bf16
    units, fp32 elsewhere) get one provenance line each, naming the format from the clients' round records."""
    from fedssl_study.report import report_study

    out = tmp_path / "study"
    for seed, precision in ((0, "bf16"), (1, "fp32")):
        folder = out / "runs" / f"a-seed{seed}"
        fake_run(folder, "A", seed, 0.40, 0.3, 0.33)
        summary = json.loads((folder / "summary.json").read_text())
        summary["provenance"] = {"device": "AMD EPYC, 2 cores", "app_digest": "c" * 64, "git_commit": "3" * 40}
        (folder / "summary.json").write_text(json.dumps(summary))
        rows = [
            json.loads(line) | {"clients": [{"id": 0, "precision": precision}]}
            for line in (folder / "metrics.jsonl").read_text().splitlines()
        ]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report_study(out).read_text()
    assert "commit 333333333333; precision bf16: 1 run(s)" in text
    assert "commit 333333333333; precision fp32: 1 run(s)" in text


def test_a_run_of_the_same_experiment_in_another_study_is_copied_not_run_again(tmp_path):
    """--reuse: a (variant, seed) whose resolved config, seed included and name and output folder left out, equals
    a finished run's of another study folder is copied from there (records, not checkpoints) with run.json naming
    the source; a run of another seed or another setting is run."""
    from fedssl_study.cli import study_main
    from fedssl_study.runner import StudyRunner
    from fedssl_study.spec import validate_experiment

    base = {"base": str(REPO / "configs" / "smoke.yaml"), "overrides": {"data.dataset": "synthetic"}}
    sweep = load_study(
        write(
            tmp_path / "sweep.yaml",
            {
                **base,
                "study": "sweep",
                "seeds": [0],
                "variants": {"tau 0.7": {"strategy": {"name": "fedema", "options": {"tau": 0.7}}}},
            },
        )
    )
    three = write(
        tmp_path / "three.yaml",
        {
            **base,
            "study": "three",
            "seeds": [0, 1],
            "variants": {
                "FedEMA": {"strategy": {"name": "fedema", "options": {"tau": 0.7}}},
                "FedEMA (tau 0.5)": {"strategy": {"name": "fedema", "options": {"tau": 0.5}}},
            },
        },
    )
    # the sweep's finished run, as the ServerApp leaves it (its config as summary.json records it)
    tree = sweep.variant_tree("tau 0.7", 0)
    tree["output_dir"] = str(tmp_path / "sweep-out" / "runs" / "tau-0.7-seed0")
    done = Path(tree["output_dir"])
    fake_run(done, "tau 0.7", 0, 0.41, 0.3, 0.33)
    summary = json.loads((done / "summary.json").read_text())
    summary["config"] = validate_experiment(tree).to_dict()
    (done / "summary.json").write_text(json.dumps(summary))
    (done / "run.json").write_text(
        json.dumps(
            {
                "variant": "tau 0.7",
                "seed": 0,
                "study_git_commit": "abc123",
                "attempts": [{"run_id": 7, "outcome": "finished"}],
            }
        )
    )
    (done / "checkpoints").mkdir()
    (done / "checkpoints" / "round-1.pt").write_bytes(b"state")

    class Launcher:
        def __init__(self):
            self.submitted = []

        def submit(self, run_config, num_supernodes=None):
            self.submitted.append(run_config)
            from fedssl_study.launcher import LaunchError

            raise LaunchError("not in this test")

        def close(self):
            pass

    launcher, said = Launcher(), []
    outcomes = StudyRunner(
        load_study(three), tmp_path / "out", launcher, say=said.append, reuse=[tmp_path / "sweep-out"]
    ).run()
    status = {(o.variant, o.seed): o.status for o in outcomes}
    assert status == {
        ("FedEMA", 0): "skipped",
        ("FedEMA (tau 0.5)", 0): "failed",
        ("FedEMA", 1): "failed",
        ("FedEMA (tau 0.5)", 1): "failed",
    }
    assert len(launcher.submitted) == 3
    copied = tmp_path / "out" / "runs" / "fedema-seed0"
    assert json.loads((copied / "summary.json").read_text())["linear_probe_acc"] == 0.41
    assert not (copied / "checkpoints").exists()
    info = json.loads((copied / "run.json").read_text())
    assert info["variant"] == "FedEMA" and info["reused_from"] == "sweep-out/runs/tau-0.7-seed0"
    assert info["study_git_commit"] == "abc123" and info["attempts"] == [{"run_id": 7, "outcome": "finished"}]
    assert any("copied, not run again" in line for line in said), said
    runs, _ = study_runs(tmp_path / "out")
    assert [(r.variant, r.seed) for r in runs] == [("FedEMA", 0)]
    # the data file counts by its name (a published run keeps only that): the same experiment on another machine
    from fedssl_study.runner import experiment_key

    resolved = validate_experiment(tree).to_dict()
    here, published, other = (json.loads(json.dumps(resolved)) for _ in range(3))
    here["data"]["path"], published["data"]["path"], other["data"]["path"] = "/a/b/cifar.npz", "cifar.npz", "/a/c.npz"
    published["name"] = "another-name"
    assert experiment_key(here) == experiment_key(published) != experiment_key(other)
    # --reuse names a folder that is not a study's: refused before anything runs
    assert study_main(["run", str(three), "--out", str(tmp_path / "o2"), "--reuse", str(tmp_path)]) == 2


def study_cli(study: Path, out: Path, *extra: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models on a shared 2-core machine
    # Ctrl-C as from a terminal: a test process started in the background by a shell (`cmd &` in a script) inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so the signal this test sends would be
    # dropped. The study itself keeps whatever disposition it is given, as any program should.
    return subprocess.Popen(
        [sys.executable, "-m", "fedssl_study.cli", "run", str(study), "--out", str(out), *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 - see above
        **kw,
    )


@pytest.mark.e2e
def test_study_runs_resumes_after_ctrl_c_skips_finished_runs_and_reports_them(tmp_path):
    study = write(tmp_path / "study.yaml", STUDY)
    out = tmp_path / "out"
    first_run = out / "runs" / "fedbyol-seed0"
    # 1. Interrupted: Ctrl-C once the first run has its round-1 checkpoint (and no result yet)
    proc = study_cli(study, out)
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and not has_checkpoint(first_run):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    assert has_checkpoint(first_run)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "interrupted: stopping run" in output and not (first_run / "summary.json").is_file()
    assert processes_with_env("FLWR_HOME", str(out / ".flwr")) == []  # the simulation is gone, not only the stream
    rounds_then = (first_run / "metrics.jsonl").read_text()
    time.sleep(3)
    assert (first_run / "metrics.jsonl").read_text() == rounds_then  # nothing trains on for the stopped run
    # 2. The same command: the interrupted run resumes from its checkpoint, the others run
    proc = study_cli(study, out)
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output
    # after round 1, or later where stopping took longer than a round (1-2 s) on busy cores
    assert re.search(r"\[1/2\] FedBYOL, seed 0: resuming after round [1-5]", output), output
    # the progress line's wall time beside the run's own (the report's "run s"), so the two do not disagree unsaid
    clock = r"(\d+h\d\dm|\d+m\d\ds|\d+s)"
    assert re.search(
        rf"\[2/2\] FedEMA, seed 0: done in {clock} \(the run itself {clock}, the report's run s;", output
    ), output
    # a resumed run's wall time is its last attempt's, its run s every attempt's: the line says which is which
    assert re.search(
        rf"\[1/2\] FedBYOL, seed 0: done in {clock} \(this attempt, resumed after round [1-5]; the run itself "
        rf"{clock} over 2 attempts, the report's run s\)",
        output,
    ), output
    info = json.loads((first_run / "run.json").read_text())
    assert [a["resumed"] for a in info["attempts"]] == [False, True] and info["attempts"][-1]["outcome"] == "finished"
    # the code of each attempt, as the ServerApp records it for the run
    summary = json.loads((first_run / "summary.json").read_text())
    assert [a["app_digest"] for a in info["attempts"]] == [summary["provenance"]["app_digest"]] * 2
    assert len((first_run / "metrics.jsonl").read_text().splitlines()) == 5
    # 3. Once more: every run finished earlier, nothing runs
    proc = study_cli(study, out)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and output.count("finished earlier, skipped") == 2, output
    # The report's rows are the runs' summary.json values (one seed: no ±)
    rows = table_rows(out / "report.md")
    for variant in ("FedBYOL", "FedEMA"):
        summary = json.loads((out / "runs" / f"{slug(variant)}-seed0" / "summary.json").read_text())
        for column, key in ((2, "linear_probe_acc"), (3, "knn_acc"), (4, "linear_probe_gain_over_random")):
            assert rows[variant][column] == f"{100 * summary[key]:.2f}"
        assert rows[variant][1] == "0"
        assert summary["provenance"]["versions"]["flwr"] and summary["provenance"]["config_hash"]
    assert (out / "report.csv").is_file() and (out / "curves.png").is_file() and (out / "scores.png").is_file()
    resolved = yaml.safe_load((out / "runs" / "fedema-seed0" / "config.yaml").read_text())
    assert resolved["strategy"]["name"] == "fedema" and resolved["seed"] == 0 and resolved["rounds"] == 5
    assert resolved["strategy"]["options"]["tau"] == 0.7 and "mu_mode" in resolved["strategy"]["options"]


def test_status_polls_double_their_gap_up_to_the_cap_and_come_at_once_when_the_folder_says_the_end(tmp_path):
    from fedssl_study.runner import StatusPolls, run_said_it_ended

    polls = StatusPolls(3.0, 30.0, now=0.0)
    asked = [t for t in range(200) if polls.due(float(t), ended_here=False)]
    assert asked == [0, 3, 9, 21, 45, 75, 105, 135, 165, 195]  # gaps 3, 6, 12, 24, then 30
    assert polls.due(196.0, ended_here=True) and polls.due(197.0, ended_here=True)  # the end: every poll
    # the folder's word: a "stopped:" line of this attempt (a resumed run's log holds the earlier attempts' lines)
    (tmp_path / "progress.log").write_text("round 1/3\nstopped: the ServerApp ended after round 1\nresuming\n")
    assert not run_said_it_ended(tmp_path, lines_before=2) and run_said_it_ended(tmp_path, lines_before=1)
    (tmp_path / "summary.json").write_text("{}")
    assert run_said_it_ended(tmp_path, lines_before=3)


@pytest.mark.parametrize("ending", ["summary", "stopped line", "silent failure"])
def test_a_run_is_watched_with_few_status_calls_and_its_end_is_seen_at_once(tmp_path, monkeypatch, ending):
    """The runner reads the run's folder every poll and asks ``flwr ls`` (a process importing Flower) rarely: a
    finished or stopped run is noticed at the next poll; a run that ends without a word in its folder (its
    ServerApp never started) within the cap of the status gap."""
    from types import SimpleNamespace

    from fedssl_study import runner

    study = load_study(
        write(
            tmp_path / "s.yaml",
            {
                "study": "demo",
                "base": str(REPO / "configs" / "smoke.yaml"),
                "overrides": {"data.dataset": "synthetic", "rounds": 2},
                "variants": {"A": {}},
            },
        )
    )
    folder = tmp_path / "out" / "runs" / "a-seed0"
    clock = SimpleNamespace(t=0.0)
    end_at = 200.0

    def sleep(seconds):
        before, clock.t = clock.t, clock.t + seconds
        if before < 100.0 <= clock.t and ending != "silent failure":
            (folder / "metrics.jsonl").write_text('{"round": 1}\n')
        if before < end_at <= clock.t:
            if ending == "summary":
                (folder / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
                (folder / "summary.json").write_text("{}")
            elif ending == "stopped line":
                with open(folder / "progress.log", "a") as log:
                    log.write("stopped: ValueError: something\n")

    class Launcher:
        app_dir = REPO

        def __init__(self):
            self.asked: list[float] = []

        def submit(self, run_config, num_supernodes=None):
            return 7

        def status(self, run_id):
            self.asked.append(clock.t)
            return "finished:completed" if clock.t >= end_at else None

        def close(self):
            pass

    monkeypatch.setattr(
        runner, "time", SimpleNamespace(monotonic=lambda: clock.t, sleep=sleep, strftime=lambda *a: "now")
    )
    launcher = Launcher()
    said: list[str] = []
    runner.StudyRunner(study, tmp_path / "out", launcher, say=said.append, poll_s=3.0, status_max_s=30.0).run()
    while_running = [t for t in launcher.asked if t < end_at]
    assert len(while_running) <= 10, launcher.asked  # every 3 s would be 67 calls
    seen = launcher.asked[-1]
    assert seen - end_at <= (3.0 if ending != "silent failure" else 30.0), launcher.asked
    if ending == "summary":
        assert any("done in" in line for line in said), said
    else:
        assert any("FAILED" in line for line in said), said
    (attempt,) = json.loads((folder / "run.json").read_text())["attempts"]
    assert attempt["app_digest"] == app_code_digest(REPO)  # each attempt records the code it ran on


def test_the_study_eta_counts_the_rounds_a_resumed_run_still_has_to_train():
    from fedssl_study.runner import study_time_left

    # A run resumed after round 6 of 12 that trained round 7 in 300 s: 5 more rounds, then 2 whole runs of 12
    assert study_time_left([], 2, 300.0, 1, 5, 12) == 300.0 * 5 + 300.0 * 12 * 2
    # The same run's first progress line (round 6 done before this attempt, nothing trained yet): no figure
    assert study_time_left([], 2, 5.0, 0, 6, 12) is None
    # Runs finished in this invocation set the pace: 3 of 12 rounds left of a 2400 s run, then one more
    assert study_time_left([2000.0, 2800.0], 1, 50.0, 9, 3, 12) == 2400.0 * 3 / 12 + 2400.0


def test_legend_stays_inside_for_few_curves_and_goes_beside_the_axes_for_a_sweep():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedssl_study.report import MAX_LEGEND_INSIDE, place_legend

    for curves, outside in ((3, False), (MAX_LEGEND_INSIDE + 1, True), (46, True)):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i in range(curves):
            ax.plot([1, 2], [i, i + 1], label=f"cell {i}")
        place_legend(fig, ax)
        legend = ax.get_legend()
        assert len(legend.get_texts()) == curves
        widened = bool(fig.get_size_inches()[0] > 8)
        assert widened is outside
        if outside:  # anchored right of the axes (x > 1 in axes coordinates), 30 entries per column at most
            assert legend.get_bbox_to_anchor().transformed(ax.transAxes.inverted()).x0 > 1.0
            assert legend._ncols == -(-curves // 30)
        plt.close(fig)


@pytest.mark.parametrize("rows_count", [3, 25])  # bars, and a sweep's horizontal bars
def test_the_score_chart_starts_at_zero_and_draws_every_seed(tmp_path, rows_count):
    import matplotlib.pyplot as plt

    from fedssl_study.report import Row, RunData, draw_scores

    def run(seed: int, acc: float) -> RunData:
        return RunData(tmp_path, "v", seed, {"linear_probe_acc": acc}, [])

    rows = [
        Row(f"row {i}", [run(0, 0.40 + 0.001 * i), run(1, 0.42 + 0.001 * i), run(2, 0.44)]) for i in range(rows_count)
    ]
    fig = draw_scores(rows)
    ax = fig.axes[0]
    low, high = ax.get_ylim() if rows_count <= 20 else ax.get_xlim()
    assert low == 0.0 and high >= 44.0  # 40-44 % drawn from 0: a two-point gap looks like one
    dots = next(c for c in ax.collections if c.get_label() == "one seed").get_offsets()
    values = dots[:, 1] if rows_count <= 20 else dots[:, 0]
    assert len(dots) == 3 * rows_count
    np.testing.assert_allclose(values[:3], [40.0, 42.0, 44.0])
    plt.close(fig)
    assert draw_scores([Row("no score", [RunData(tmp_path, "v", 0, {}, [])])]) is None
