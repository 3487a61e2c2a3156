"""``fedssl-study run STUDY.yaml`` / ``fedssl-study report STUDY_DIR`` / ``fedssl-report RUN_DIR...``.

Exit status: 0 when every run finished (or was finished earlier), 1 when a run failed, 2 for a bad study or bad
arguments (one line naming the key, before any run starts), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ssl_models.config import ConfigError


def parse_sets(items: list[str]) -> dict:
    """``--set key=value`` (repeatable): values read as YAML (``0.1`` a number, ``true`` a boolean, ``[1, 2]`` a
    list)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value (e.g. data.path=/data/cifar10.npz)")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


def study_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fedssl-study",
        description="Run a study (variants x seeds as real `flwr run` runs, one after another) and report it.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every (variant, seed) of a study file, then write its report")
    run.add_argument("study", help="the study file (YAML)")
    run.add_argument("--out", default=None, help="the study folder (default: ./outputs/studies/<study name>)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every run, e.g. --set data.path=/data/cifar10.npz (repeatable)",
    )
    run.add_argument("--variants", nargs="+", default=None, help="only these variants")
    run.add_argument("--seeds", nargs="+", type=int, default=None, help="only these seeds (instead of the file's)")
    run.add_argument(
        "--connection",
        default=None,
        metavar="SUPERLINK",
        help="a SuperLink connection of your $FLWR_HOME/config.toml (a deployed federation, or a "
        "simulation on a Ray cluster), as `flwr run . <connection>`; default: a private local "
        "simulation started and stopped by the study",
    )
    run.add_argument(
        "--federation-config",
        default=None,
        help="added to every run's --federation-config (e.g. 'client-resources-num-cpus=1'); the "
        "private simulation's size comes from each run's federation.num_clients",
    )
    run.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop a run that has no result after S seconds and go on with the next",
    )
    run.add_argument(
        "--reuse",
        action="append",
        default=[],
        metavar="STUDY_DIR",
        help="another study folder (repeatable): a run of the same experiment (same resolved config and "
        "seed) finished there is copied instead of run again",
    )
    run.add_argument("--dry-run", action="store_true", help="check the study and list its runs; run nothing")
    rep = sub.add_parser("report", help="(re)write the report of a study folder")
    rep.add_argument("study_dir")
    args = ap.parse_args(argv)
    command = "fedssl-study " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.command == "report":
        from .report import report_study

        folder = Path(args.study_dir)
        if not (folder / "runs").is_dir():
            print(f"fedssl-study report: {folder} is not a study folder (no runs/ inside)", file=sys.stderr)
            return 2
        print(report_study(folder))
        return 0

    from .spec import check_study_data, load_study

    try:
        study = load_study(args.study, parse_sets(args.set), seeds=args.seeds, variants=args.variants)
        check_study_data(study)
    except ConfigError as exc:
        print(f"fedssl-study: {exc}", file=sys.stderr)
        return 2
    study_dir = Path(args.out or Path("outputs") / "studies" / study.name).resolve()
    from .runner import StudyRunner, run_folder

    runs = study.runs()
    say(
        f"study {study.name!r}: {len(study.variants)} variants x {len(study.seeds)} seeds = {len(runs)} runs, "
        f"one after another, into {study_dir}"
    )
    for other in args.reuse:
        if not (Path(other) / "runs").is_dir():
            print(f"fedssl-study: --reuse {other}: not a study folder (no runs/ inside)", file=sys.stderr)
            return 2
    from .estimate import StudyEstimator, clock

    estimator = StudyEstimator(study, parse_sets(args.set))
    to_do = [(v, s) for v, s in runs if not (run_folder(study_dir, v, s) / "summary.json").is_file()]
    estimates = {(v, s): estimator.run(v, s) for v, s in to_do}
    if args.dry_run:
        from .runner import reusable_run
        from .spec import validate_experiment

        for variant, seed in runs:
            folder = run_folder(study_dir, variant, seed)
            state = "finished" if (folder / "summary.json").is_file() else "to run"
            if state == "to run" and args.reuse:
                tree = study.variant_tree(variant, seed)
                tree["output_dir"] = str(folder)
                source = reusable_run(validate_experiment(tree).to_dict(), [Path(d) for d in args.reuse])
                state = f"to copy from {source}" if source else state
            estimate = estimates.get((variant, seed))
            took = f", about {clock(estimate.seconds)}" if estimate is not None and state == "to run" else ""
            say(f"  {variant}, seed {seed}: {state}{took} ({folder})")
    if to_do:
        say(estimator.source_line())
        say(estimator.total_line(list(estimates.values())))
    if args.dry_run:
        return 0
    from .launcher import Launcher
    from .report import report_study

    launcher = Launcher(
        connection=args.connection, flwr_home=study_dir / ".flwr", federation_config=args.federation_config
    )
    outcomes = StudyRunner(
        study,
        study_dir,
        launcher,
        say=say,
        run_timeout_s=args.run_timeout,
        command=command,
        reuse=[Path(d) for d in args.reuse],
    ).run()
    report = report_study(study_dir)
    failed = [o for o in outcomes if o.status == "failed"]
    interrupted = any(o.status == "interrupted" for o in outcomes)
    say(
        f"report: {report}"
        + (
            f"; {len(failed)} run(s) failed: " + "; ".join(f"{o.variant} seed {o.seed}: {o.reason}" for o in failed)
            if failed
            else ""
        )
    )
    if interrupted:
        say("interrupted: run the same command again to continue the study")
        return 130
    return 1 if failed else 0


def app_run_config_keys(app_dir: Path) -> set[str]:
    """Every run-config key the app at ``app_dir`` declares (``[tool.flwr.app.config]`` of its pyproject.toml,
    flattened as Flower flattens it)."""
    import tomllib

    from flwr.common.config import flatten_dict

    with (Path(app_dir) / "pyproject.toml").open("rb") as fh:
        return set(flatten_dict(tomllib.load(fh)["tool"]["flwr"]["app"]["config"]))


def check_data_here(cfg) -> None:
    """The experiment's data checks (it loads, it splits, it can be scored: ``ssl_models.data.preflight``) made on
    this machine before anything starts, when its data is here (a data set the server is to download is not)."""
    from ssl_models.data.preflight import check_experiment_data, data_is_local

    if data_is_local(cfg):
        check_experiment_data(cfg, log=lambda line: print(f"fedssl-run: {line}", file=sys.stderr, flush=True))


def closest(key: str, known: set[str]) -> str:
    import difflib

    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {near[0]}?)" if near else ""


def run_main(argv: list[str] | None = None) -> int:
    """``fedssl-run [APP] [SUPERLINK] --run-config ... [flwr run options]``: ``flwr run`` after checking, on this
    machine, every run-config key and the experiment it selects, so an unknown key or a bad value is named in one
    line (Flower answers only "[code: 15] Invalid run configuration", without the key)."""
    import os

    from flwr.common.config import parse_config_args

    args = list(sys.argv[1:] if argv is None else argv)
    positional = [a for a in args if not a.startswith("-")]
    run_configs = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--run-config", "-c")]
    app_dir = Path(positional[0] if positional else ".").expanduser()
    if not (app_dir / "pyproject.toml").is_file():
        print(
            f"fedssl-run: {app_dir} holds no pyproject.toml (give the app's folder first, as flwr run does)",
            file=sys.stderr,
        )
        return 2
    try:
        given = parse_config_args(run_configs) if run_configs else {}
    except Exception as exc:  # noqa: BLE001 - Flower's own parser: its message is the one to show
        print(f"fedssl-run: --run-config: {exc}", file=sys.stderr)
        return 2
    known = app_run_config_keys(app_dir)
    for key in given:
        if key not in known:
            print(
                f"fedssl-run: run-config key {key!r} is not a setting of this app{closest(key, known)}; the keys are "
                "the YAML settings (train.lr, strategy.options.mu, ...) and config, output-dir, resume",
                file=sys.stderr,
            )
            return 2
    num_clients = None  # a resumed run's: not known here
    if not given.get("resume"):  # a resumed run uses its own config: nothing more to check here
        from server_app.experiment import load_experiment

        cwd = Path.cwd()
        try:
            os.chdir(app_dir)  # relative config paths resolve as the ServerApp resolves them
            cfg, _ = load_experiment({k: v for k, v in given.items() if k != "output-dir"})
            num_clients = cfg.federation.num_clients
            check_data_here(cfg)
        except ConfigError as exc:
            print(f"fedssl-run: {exc}", file=sys.stderr)
            return 2
        finally:
            os.chdir(cwd)
    from .launcher import flwr_cli, flwr_run_args_with_gpu_share

    args, share = flwr_run_args_with_gpu_share(args, num_clients)
    if share:
        print(
            f"fedssl-run: this machine has NVIDIA GPUs: the local simulation's clients get {share} (set "
            '--federation-config "client-resources-num-gpus=F" to choose another share)',
            file=sys.stderr,
        )
    return run_and_report_outcome([flwr_cli(), "run", *args], streamed="--stream" in args)


# Flower prints this when the SuperLink has accepted a run (``flwr run``'s output, with or without --stream).
STARTED_RUN = re.compile(r"Successfully started run (\d+)")


def run_and_report_outcome(cmd: list[str], streamed: bool) -> int:
    """Run ``flwr run`` with its output passed through, then exit as the run ended: ``flwr run --stream`` exits 0
    whatever happened to the run, so its final status is asked of the SuperLink (``flwr ls --run-id``): 0 for
    ``finished:completed``, 1 for any other end (failed, stopped), with one line saying so; without ``--stream`` the
    run goes on after ``flwr run`` returns, and its exit status is Flower's."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    run_id = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        found = STARTED_RUN.search(line)
        if found and run_id is None:
            run_id = int(found.group(1))
    code = proc.wait()
    if code != 0 or not streamed or run_id is None:
        return code
    from .launcher import flwr_run_connection

    status = run_status(cmd[0], run_id, flwr_run_connection(cmd[2:]))
    if status == "finished:completed":
        return 0
    print(
        f"fedssl-run: run {run_id} ended {status or 'with an unknown status'} (flwr ls --run-id {run_id}); "
        "why: the ServerApp's error above (a run refused before its first round has no output folder), or the last "
        "line of the run's progress.log",
        file=sys.stderr,
    )
    return 1


def run_status(flwr: str, run_id: int, connection: str | None) -> str | None:
    """Flower's final status of a run (``finished:completed``, ``finished:failed``, ...), None if it cannot say."""
    import json

    cmd = [flwr, "ls", *([connection] if connection else []), "--run-id", str(run_id), "--format", "json"]
    for _ in range(10):  # the SuperLink records the end a moment after the stream closes
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout
            runs = json.loads(out[out.index("{") :]).get("runs", [])
        except (subprocess.TimeoutExpired, ValueError, OSError):
            runs = []
        status = next((str(r.get("status", "")) for r in runs if int(r.get("run-id", -1)) == run_id), "")
        if status.startswith("finished"):
            return status
        time.sleep(1.0)
    return None


def report_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fedssl-report",
        description="Compare finished runs (their output folders): "
        "report.md, report.csv and plots; the seeds of one experiment form one row.",
    )
    ap.add_argument("runs", nargs="+", help="run output folders (each with summary.json)")
    ap.add_argument("--out", default=".", help="where report.md / report.csv / the plots go (default: here)")
    args = ap.parse_args(argv)
    from .report import report_runs

    try:
        print(
            report_runs(
                [Path(p) for p in args.runs],
                Path(args.out),
                command="fedssl-report " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            )
        )
    except FileNotFoundError as exc:
        print(f"fedssl-report: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(study_main())
