"""The lint, format and type checks are wired up as CONTRIBUTING.md says: CI (`.ci/run`) and the pre-commit hooks run
ruff check, ruff format --check and mypy; the hooks are local (offline, no hook repositories to download); the test
extra pins the versions and pyproject.toml holds the settings."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
import tomllib

import yaml

from conftest import REPO

CHECKS = {  # tool -> the command CI runs
    "ruff check": ["python3", "-m", "ruff", "check", "."],
    "ruff format --check": ["python3", "-m", "ruff", "format", "--check", "."],
    "mypy": ["python3", "-m", "mypy"],
}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def ci_commands() -> list[list[str]]:
    """The top-level command lines of .ci/run, split into words (not comments, not indented lines)."""
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    return [
        shlex.split(line)
        for line in lines
        if line.strip() and not line.lstrip().startswith("#") and not line.startswith((" ", "\t"))
    ]


def hooks() -> list[dict]:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    return [hook for repo in config["repos"] for hook in repo["hooks"]]


def test_ci_runs_the_lint_format_and_type_checks_before_the_tests() -> None:
    commands = ci_commands()
    assert ["set", "-euo", "pipefail"] in commands  # a failing check stops the run
    pytest_at = commands.index(["python3", "-m", "pytest", "-q"])
    for name, command in CHECKS.items():
        assert command in commands, f".ci/run does not run {name!r} ({shlex.join(command)})"
        assert commands.index(command) < pytest_at, f".ci/run runs {name!r} after the tests"


def test_pre_commit_hooks_are_local_and_run_the_same_checks() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    for repo in config["repos"]:
        # a remote hook repository would be cloned on first use: no hooks without network
        assert repo["repo"] == "local", f"pre-commit repo {repo['repo']!r} is not local"
        assert "rev" not in repo
    entries = {}
    for hook in hooks():
        assert hook["language"] == "system", f"hook {hook['id']}: language {hook['language']!r} installs its own env"
        assert "additional_dependencies" not in hook
        entries[hook["id"]] = shlex.split(hook["entry"])
    runs = [" ".join(entry) for entry in entries.values()]
    assert any(re.search(r"-m ruff check\b", r) for r in runs), runs
    assert any(re.search(r"-m ruff format --check\b", r) for r in runs), runs
    mypy = [h for h in hooks() if shlex.split(h["entry"])[-2:] == ["-m", "mypy"]]
    assert len(mypy) == 1, runs
    # mypy checks the files pyproject.toml names, not the changed files one by one
    assert mypy[0]["pass_filenames"] is False


def test_the_test_extra_pins_ruff_and_mypy_and_they_are_installed() -> None:
    test_extra = pyproject()["project"]["optional-dependencies"]["test"]
    pins = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)", r).groups() for r in test_extra if "==" in r)
    assert {"ruff", "mypy"} <= set(pins), f"the test extra must pin ruff and mypy exactly, got {test_extra}"
    for tool in ("ruff", "mypy"):
        installed = importlib.metadata.version(tool)
        # another version may report other findings than CI: `pip install -e ".[test]"` installs the pinned one
        assert installed == pins[tool], f"{tool} {installed} is installed, the test extra pins {pins[tool]}"


def test_settings_line_length_and_type_checked_packages() -> None:
    tools = pyproject()["tool"]
    assert tools["ruff"]["line-length"] == 120
    assert tools["ruff"]["target-version"] == "py311"
    assert "format" in tools["ruff"]
    assert sorted(tools["mypy"]["files"]) == ["ssl_models", "strategies"]


def test_ruff_check_passes_on_the_repository() -> None:
    """What CI's first check runs (a fraction of a second): a finding names its file and line."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
