"""Bad inputs get one line naming them: a truncated or non-zip .npz (in a run's data loading and in fedssl-eval,
exit 2), labels outside 0..K-1, an output folder that cannot be written, an unknown run-config key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from server_app.app import check_writable
from ssl_models.config import ConfigError
from ssl_models.data.datasets import load_npz

REPO = Path(__file__).resolve().parents[1]


def save(path: Path, y_train=(0, 1, 2, 3), x=None) -> Path:
    x = np.zeros((len(y_train), 32, 32, 3), np.uint8) if x is None else x
    np.savez(path, x_train=x, y_train=np.array(y_train), x_test=x[:2], y_test=np.array(y_train[:2]))
    return path


def test_a_truncated_or_foreign_npz_is_named_with_what_to_check(tmp_path):
    good = save(tmp_path / "good.npz")
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp_path / "text.npz").write_text("these are not arrays")
    with pytest.raises(ValueError, match=r"cut.npz is not a complete .npz archive \(BadZipFile"):
        load_npz(tmp_path / "cut.npz")
    with pytest.raises(ValueError, match=r"text.npz is not an .npz archive of arrays"):
        load_npz(tmp_path / "text.npz")
    assert load_npz(good).num_classes == 4


def test_labels_must_be_the_classes_0_to_k_minus_1(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"stray.npz: labels must be the classes 0..K-1.*imply 1001 classes but 996 .*"
        r"labels above it: \[1000\]",
    ):
        load_npz(save(tmp_path / "stray.npz", y_train=(0, 1, 2, 3, 1000)))


def test_fedssl_eval_reports_a_bad_data_file_in_one_line_with_exit_2(tmp_path):
    good = save(tmp_path / "good.npz")
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[:100])
    proc = subprocess.run(
        [sys.executable, "-m", "ssl_models.evaluation.cli", str(tmp_path / "model.pt"), str(tmp_path / "cut.npz")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_an_output_dir_that_cannot_be_written_is_named(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"^output-dir: cannot write to .*a-file/run \("):
        check_writable(tmp_path / "a-file" / "run")
    check_writable(tmp_path / "fine" / "run")
    assert (tmp_path / "fine" / "run").is_dir() and not list((tmp_path / "fine" / "run").iterdir())


@pytest.mark.parametrize(
    "run_config, message",
    [
        (
            "config='configs/smoke.yaml' strategy.options.tua=0.1",
            "run-config key 'strategy.options.tua' is not a setting of this app (did you mean strategy.options.tau?)",
        ),
        ("config='configs/smoke.yaml' train.lr=-1", "train.lr: must be > 0"),
        ("config='configs/smoke.yaml' strategy.options.stages=3", "strategy.options.stages: unknown option"),
    ],
)
def test_fedssl_run_names_a_bad_run_config_key_before_flower_is_called(run_config, message, capsys):
    from fedssl_study.cli import run_main

    assert run_main([str(REPO), "--run-config", run_config, "--stream"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize(
    ("status", "streamed", "expected"),
    [
        ("finished:completed", True, 0),
        ("finished:failed", True, 1),
        ("finished:stopped", True, 1),
        ("finished:failed", False, 0),  # without --stream the run goes on after flwr run returns: Flower's status
    ],
)
def test_fedssl_run_exits_as_the_run_ended(tmp_path, capsys, status, streamed, expected):
    """`flwr run --stream` exits 0 whatever happened to the run; fedssl-run asks the SuperLink how it ended."""
    from fedssl_study.cli import run_and_report_outcome

    flwr = tmp_path / "flwr"
    asked = tmp_path / "ls-args"
    flwr.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = run ]; then echo "Successfully started run 4242"; echo "round 1/1 ..."; exit 0; fi\n'
        f'echo "$@" > {asked}\n'
        f'echo \'{{"success": true, "runs": [{{"run-id": 4242, "status": "{status}"}}]}}\'\n'
    )
    flwr.chmod(0o755)
    args = [str(flwr), "run", ".", "--run-config", "config='configs/smoke.yaml'", *(["--stream"] if streamed else [])]
    assert run_and_report_outcome(args, streamed=streamed) == expected
    out, err = capsys.readouterr()
    assert "Successfully started run 4242" in out  # Flower's output passes through
    if expected:
        assert err.strip() == (
            f"fedssl-run: run 4242 ended {status} (flwr ls --run-id 4242); why: the ServerApp's error above (a run "
            "refused before its first round has no output folder), or the last line of the run's progress.log"
        )
    if streamed:  # the default connection: a run-config value is no connection name
        assert asked.read_text().split() == ["ls", "--run-id", "4242", "--format", "json"]
        asked.unlink()
        run_and_report_outcome([*args[:3], "lab", *args[3:]], streamed=True)
        assert asked.read_text().split() == ["ls", "lab", "--run-id", "4242", "--format", "json"]
