"""docs/own-images.md works as written: its simulation command (with the test's folders for the page's) trains on a
generated folder of unlabelled images of mixed sizes and formats, scores on a labelled folder, and its plain-PyTorch
snippet reads the run's model.pt back and computes features."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flwr_harness import REPO, flwr_env, kill_flwr_home_processes

PAGE = REPO / "docs" / "own-images.md"


def recipe(name: str) -> str:
    """The code block after ``<!-- recipe:<name> -->`` on the page."""
    found = re.search(rf"<!-- recipe:{name} -->\n```\w*\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert found, f"docs/own-images.md has no recipe:{name} block"
    return found.group(1)


def write_images(folder: Path, count: int, tint: tuple[int, int, int] | None = None, seed: int = 0) -> None:
    """``count`` images of mixed sizes, modes and formats, some in nested folders."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        h, w = int(rng.integers(40, 120)), int(rng.integers(40, 120))
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        if tint is not None:
            pixels = (0.5 * pixels + 0.5 * np.array(tint)).astype(np.uint8)
        image = Image.fromarray(pixels)
        kind = i % 4
        target = folder / (f"day-{i % 3}" if i % 2 else "") / f"img-{i}"
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == 0:
            image.save(target.with_suffix(".jpg"), quality=90)
        elif kind == 1:
            image.convert("L").save(target.with_suffix(".png"))
        elif kind == 2:
            image.convert("RGBA").save(target.with_suffix(".png"))
        else:
            image.save(target.with_suffix(".bmp"))


@pytest.mark.e2e
def test_the_own_images_recipe_runs_as_written(tmp_path):
    images, labelled = tmp_path / "images", tmp_path / "labelled"
    write_images(images, 48)
    for part, count in (("train", 8), ("test", 4)):
        for cls, tint in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
            write_images(labelled / part / cls, count, tint, seed=len(part) + len(cls))
    command = recipe("simulation").strip()
    assert command.startswith("fedssl-run . --stream --run-config ")
    command = command.replace("/data/images", str(images)).replace("/data/labelled", str(labelled))
    out = tmp_path / "run"
    args = shlex.split(command)
    run_config = args[-1] + f" output-dir='{out}' rounds=1 train.max_steps_per_epoch=2 eval.probe_epochs=5"
    home = tmp_path / "flwr"
    env = flwr_env(home)
    env["FEDSSL_DATA_CACHE"] = str(tmp_path / "cache")
    try:
        proc = subprocess.run(
            # fedssl-run, as this Python runs it (its console script may live elsewhere than this interpreter)
            [
                sys.executable,
                "-c",
                "from fedssl_study.cli import run_main; raise SystemExit(run_main())",
                *args[1:-1],
                run_config,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        kill_flwr_home_processes(home)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and (out / "summary.json").is_file(), log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["train_images"] == 48 and summary["eval"]["scored"] is True
    assert summary["eval"]["num_test"] == 8 and 0 <= summary["linear_probe_acc"] <= 1
    progress = (out / "progress.log").read_text()
    assert "48 train images (64 px, unlabelled)" in progress and "CIFAR stem for 64 px images" in progress

    snippet = recipe("pytorch").replace("outputs/own-images-run/model.pt", str(out / "model.pt"))
    snippet = snippet.replace("photo.jpg", str(next(images.glob("*.jpg"))))
    ran = subprocess.run(
        [sys.executable, "-c", snippet], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == f"resnet18 torch.Size([1, {summary['eval']['feature_dim']}])"


@pytest.mark.e2e
def test_two_sites_each_train_on_their_own_folder_in_a_loopback_deployment(tmp_path):
    """The page's deployed command against a SuperLink and two SuperNodes on loopback, each node's data-path its own
    folder of a different size: each client trains on its own site's images, the server scores on its labelled
    folder."""
    from fedssl_gpu.deploy import LoopbackDeployment

    site_a, site_b, sample, labelled = (tmp_path / n for n in ("site-a", "site-b", "sample", "labelled"))
    write_images(site_a, 20, seed=1)
    write_images(site_b, 28, seed=2)
    write_images(sample, 8, seed=3)
    for part, count in (("train", 6), ("test", 3)):
        for cls, tint in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
            write_images(labelled / part / cls, count, tint, seed=len(part) + len(cls))
    command = recipe("deployed").strip()
    assert command.startswith("flwr run . fed --stream --run-config ")
    command = command.replace("/data/sample", str(sample)).replace("/data/labelled", str(labelled))
    args = shlex.split(command)
    out = tmp_path / "run"
    run_config = args[-1] + f" output-dir='{out}' rounds=1 train.max_steps_per_epoch=2 eval.probe_epochs=5"
    node_configs = [f"data-path='{site_a}'", f"data-path='{site_b}'"]
    deployment = LoopbackDeployment(
        tmp_path / "deployment",
        2,
        allowed_roots=[tmp_path],
        name="fed",
        threads_per_node=1,
        extra_env={"FEDSSL_DATA_CACHE": str(tmp_path / "cache")},
        node_configs=node_configs,
    )
    with deployment:
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "flwr"), *args[1:-1], run_config],
            cwd=REPO,
            env=deployment.cli_env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        logs = deployment.logs_tail()
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-3000:] + logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["client_sizes"] == [20, 28]  # what each site trained on: its own folder
    assert summary["eval"]["scored"] is True and summary["eval"]["num_test"] == 6
