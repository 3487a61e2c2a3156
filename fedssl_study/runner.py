"""Running a study: every (variant, seed) as a real ``flwr run``, one after another, into one folder.

```
<study-dir>/
  study.yaml                     the study as run (its file, the overrides given, every command run into it)
  runs/<variant>-seed<N>/        one run: config.yaml (the resolved experiment), run.json (its flwr run ids and
                                 outcome), and what the ServerApp writes: progress.log, metrics.jsonl,
                                 summary.json, model.pt, checkpoints/
  report.md, report.csv, curves.png, scores.png
```

One run at a time (one simulation per machine: two runs sharing the cores are many times slower than one after the
other). A run whose folder holds ``summary.json`` is finished and skipped; one that holds a checkpoint is resumed
from it (``resume=<run folder>``); one that stopped before its first checkpoint starts again. Ctrl-C (or SIGTERM)
stops the run under way for real (``flwr stop``, then the private SuperLink with its simulation), writes the report
of what has finished, and leaves the study resumable: the same command continues it.

Runs shared between studies (``reuse``: other study folders, e.g. a seed-0 sweep whose cells a 3-seed study repeats):
a run whose experiment (its resolved config without ``name`` and ``output_dir``, the data file by its name: same
seed, same everything else) finished in one of them is copied instead of run again (its records, model files and plots; not its checkpoints or
client state), and its ``run.json`` says where from (``reused_from``).
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from server_app.provenance import config_hash, git_state

from .launcher import Launcher, LaunchError
from .report import study_commands, study_record
from .spec import Study, run_folder_name, validate_experiment

RUNS = "runs"
IGNORED_FOR_REUSE = ("name", "output_dir")  # what may differ between two runs of one experiment
NOT_COPIED = ("checkpoints", "client_state", "tensorboard")  # for resuming a run, not for reading it


def experiment_key(resolved: dict) -> str:
    """The hash of an experiment's resolved config without what names or places the run; the data file counts by
    its file name (a published run's records keep only that, and another machine holds the copy elsewhere)."""
    config = {k: v for k, v in resolved.items() if k not in IGNORED_FOR_REUSE}
    data = dict(config.get("data") or {})
    if data.get("path"):
        data["path"] = str(data["path"]).rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
    return config_hash({**config, "data": data})


def study_time_left(
    durations: list[float], remaining_runs: int, elapsed: float, rounds_trained: int, rounds_left: int, rounds: int
) -> float | None:
    """Seconds until the study ends: the current run's ``rounds_left`` of its ``rounds`` and ``remaining_runs`` more,
    each at the mean of ``durations`` (whole runs finished by this invocation), or, before any finished, at the
    current run's pace (``elapsed`` seconds for the ``rounds_trained`` rounds this attempt trained: a resumed run
    starts after the rounds of its checkpoint). None before the current attempt's first round."""
    if durations:
        per_run = statistics.mean(durations)
    elif rounds_trained > 0:
        per_run = elapsed / rounds_trained * rounds
    else:
        return None
    return per_run * rounds_left / max(1, rounds) + per_run * remaining_runs


def reusable_run(resolved: dict, study_dirs: list[Path]) -> Path | None:
    """A finished run of the same experiment in one of ``study_dirs`` (read from its summary.json's config)."""
    key = experiment_key(resolved)
    for study_dir in study_dirs:
        for run in sorted((Path(study_dir) / RUNS).glob("*")):
            path = run / "summary.json"
            if not path.is_file():
                continue
            try:
                config = json.loads(path.read_text()).get("config") or {}
            except (OSError, ValueError):
                continue
            if config and experiment_key(config) == key:
                return run
    return None


@dataclass
class RunOutcome:
    variant: str
    seed: int
    folder: Path
    status: str  # "finished" (summary.json written), "skipped" (finished earlier), "failed", "interrupted"
    seconds: float = 0.0
    reason: str = ""


def run_folder(study_dir: Path, variant: str, seed: int) -> Path:
    return Path(study_dir) / RUNS / run_folder_name(variant, seed)


def has_checkpoint(folder: Path) -> bool:
    from server_app.checkpoint import complete_checkpoints

    return folder.is_dir() and bool(complete_checkpoints(folder))


def progress_lines(folder: Path) -> list[str]:
    path = folder / "progress.log"
    return path.read_text().splitlines() if path.is_file() else []


def last_progress_line(folder: Path) -> str:
    lines = progress_lines(folder)
    return lines[-1] if lines else ""


def rounds_done(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def attempt_app_digest(launcher) -> str | None:
    """The digest of the app code a submitted run gets (the launcher's app folder, read now: the runner outlives
    edits of the checkout, so the per-process cached value would go stale); None for a launcher without a folder."""
    from fedssl_wire import app_code_digest

    app_dir = getattr(launcher, "app_dir", None)
    return app_code_digest.__wrapped__(Path(app_dir)) if app_dir else None


def run_said_it_ended(folder: Path, lines_before: int = 0) -> bool:
    """The run's folder shows its end: ``summary.json`` written, or a "stopped: ..." progress line of the ServerApp
    (a failure, ``flwr stop`` or an interrupt) after the first ``lines_before`` lines (an earlier attempt's)."""
    if (folder / "summary.json").is_file():
        return True
    return any(line.startswith("stopped:") for line in progress_lines(folder)[lines_before:])


class StatusPolls:
    """When to ask the SuperLink for a run's status. ``flwr ls`` starts a Python process that imports Flower: 1.3 to
    1.8 CPU-seconds a call on a 2-core AMD EPYC, so asked after every 3 s poll it took about 0.3 of a core from the
    run it watched. It is asked at once when the run's folder shows the end (``run_said_it_ended``), otherwise at
    gaps that double from ``first_s`` to ``max_s``: a run that ends without a word in its folder (its ServerApp
    never started) is still noticed within ``max_s``."""

    def __init__(self, first_s: float, max_s: float, now: float) -> None:
        self.gap, self.max_s, self.next_at = first_s, max(first_s, max_s), now

    def due(self, now: float, ended_here: bool) -> bool:
        if not ended_here and now < self.next_at:
            return False
        self.next_at = now + self.gap
        self.gap = min(self.max_s, 2 * self.gap)
        return True


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class StudyRunner:
    """Runs a ``Study`` into ``study_dir`` through a ``Launcher``; ``say`` prints a progress line."""

    def __init__(
        self,
        study: Study,
        study_dir: Path,
        launcher: Launcher,
        *,
        say: Callable[[str], None] = print,
        poll_s: float = 3.0,
        status_max_s: float = 30.0,
        run_timeout_s: float | None = None,
        command: str = "",
        reuse: list[Path] | None = None,
    ) -> None:
        self.study, self.dir, self.launcher, self.say = study, Path(study_dir).resolve(), launcher, say
        self.reuse = [Path(d).resolve() for d in (reuse or [])]
        self.poll_s, self.run_timeout_s, self.command = poll_s, run_timeout_s, command
        self.status_max_s = status_max_s  # the longest gap between two status calls while a run says nothing
        self.durations: list[float] = []  # whole-run wall times of the runs this invocation finished (ETA)

    def write_study_record(self) -> None:
        """study.yaml: the study as this invocation runs it, and every command that has run into this folder (a
        study filled by several invocations, e.g. one per variant, has runs from each; its report lists them)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        commands = study_commands(study_record(self.dir))
        if self.command and (not commands or commands[-1] != self.command):
            commands.append(self.command)
        record = {
            "study": self.study.name,
            "file": str(self.study.path),
            "base": str(self.study.base),
            "seeds": self.study.seeds,
            "file_seeds": self.study.file_seeds or self.study.seeds,
            "overrides": self.study.overrides,
            "variants": self.study.variants,
            "variant_order": self.study.variant_order or list(self.study.variants),
            "command": self.command,
            "commands": commands,
            "description": self.study.description,
        }
        (self.dir / "study.yaml").write_text(yaml.safe_dump(record, sort_keys=False))

    def run(self) -> list[RunOutcome]:
        """Every run of the study; returns their outcomes (an interrupted study ends with an "interrupted" one)."""
        self.write_study_record()
        runs = self.study.runs()
        outcomes: list[RunOutcome] = []
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            for index, (variant, seed) in enumerate(runs, 1):
                try:
                    outcome = self.run_one(index, len(runs), variant, seed)
                except KeyboardInterrupt:
                    # Ctrl-C / SIGTERM outside a run's polling loop (while a run is submitted, between runs): the
                    # study stops as cleanly as inside it. Closing the launcher below stops the private SuperLink
                    # and any run it had started; the run resumes from its checkpoint, or starts again.
                    self.say(
                        f"[{index}/{len(runs)}] {variant}, seed {seed}: interrupted before its run was under "
                        "way (the study continues with it when started again)"
                    )
                    outcome = RunOutcome(
                        variant, seed, run_folder(self.dir, variant, seed), "interrupted", reason="interrupted"
                    )
                outcomes.append(outcome)
                if outcome.status == "interrupted":
                    break
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.launcher.close()
        return outcomes

    def eta(self, remaining_runs: int, elapsed: float, rounds_trained: int, rounds_left: int, rounds: int) -> str:
        left = study_time_left(self.durations, remaining_runs, elapsed, rounds_trained, rounds_left, rounds)
        return "ETA after the first round" if left is None else f"study ETA {_clock(left)}"

    def run_one(self, index: int, total: int, variant: str, seed: int) -> RunOutcome:
        folder = run_folder(self.dir, variant, seed)
        head = f"[{index}/{total}] {variant}, seed {seed}"
        if (folder / "summary.json").is_file():
            self.say(f"{head}: finished earlier, skipped ({folder})")
            return RunOutcome(variant, seed, folder, "skipped")
        tree = self.study.variant_tree(variant, seed)
        tree["output_dir"] = str(folder)
        cfg = validate_experiment(tree)
        resume = has_checkpoint(folder)
        if not resume and self.reuse:
            source = reusable_run(cfg.to_dict(), self.reuse)
            if source is not None:
                return self.copy_run(source, folder, variant, seed, cfg.to_dict(), head)
        if folder.exists() and not resume:  # stopped before its first checkpoint: nothing to continue from
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        resolved = cfg.to_dict()
        (folder / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        info_path = folder / "run.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {"attempts": []}
        commit, dirty = git_state()
        info.update(
            variant=variant,
            seed=seed,
            study=self.study.name,
            config_hash=config_hash(resolved),
            study_git_commit=commit,
            study_git_dirty=dirty,
        )
        run_config = f"resume='{folder}'" if resume else f"config='{folder / 'config.yaml'}' output-dir='{folder}'"
        self.say(
            f"{head}: {'resuming after round ' + str(rounds_done(folder)) if resume else 'starting'} "
            f"({cfg.rounds} rounds, {cfg.federation.num_clients} clients) in {folder}"
        )
        started = time.monotonic()
        progress_before = len(progress_lines(folder))  # a resumed run's log holds its earlier attempts' lines
        try:
            run_id = self.launcher.submit(run_config, cfg.federation.num_clients)
        except LaunchError as exc:
            return self._finish(info, info_path, RunOutcome(variant, seed, folder, "failed", 0.0, str(exc)), head)
        info["attempts"].append(
            {
                "run_id": run_id,
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "resumed": resume,
                # each attempt's code: a run resumed after the checkout changed trained on more than one version
                "app_digest": attempt_app_digest(self.launcher),
                "git_commit": commit,
                "git_dirty": dirty,
            }
        )
        info_path.write_text(json.dumps(info, indent=2))
        seen = -1
        rounds_before = rounds_done(folder) if resume else 0  # a resumed run trains only the rounds after these
        polls = StatusPolls(self.poll_s, self.status_max_s, time.monotonic())
        try:
            while True:
                status = None
                if polls.due(time.monotonic(), run_said_it_ended(folder, progress_before)):
                    status = self.launcher.status(run_id)
                done = rounds_done(folder)
                if done != seen:
                    seen = done
                    elapsed = time.monotonic() - started
                    remaining = total - index
                    self.say(
                        f"{head}: round {done}/{cfg.rounds}, {_clock(elapsed)} in this run; "
                        f"{self.eta(remaining, elapsed, done - rounds_before, cfg.rounds - done, cfg.rounds)}"
                    )
                if status is not None:
                    break
                if self.run_timeout_s and time.monotonic() - started > self.run_timeout_s:
                    self.launcher.stop(run_id)
                    return self._finish(
                        info,
                        info_path,
                        RunOutcome(
                            variant,
                            seed,
                            folder,
                            "failed",
                            time.monotonic() - started,
                            f"no result after {self.run_timeout_s:.0f} s (--run-timeout); stopped",
                        ),
                        head,
                    )
                time.sleep(self.poll_s)
        except KeyboardInterrupt:
            self.say(
                f"{head}: interrupted: stopping run {run_id} (the study continues from its last checkpoint "
                "when started again)"
            )
            self.launcher.stop(run_id)
            self.launcher.close()
            return self._finish(
                info,
                info_path,
                RunOutcome(variant, seed, folder, "interrupted", time.monotonic() - started, "interrupted"),
                head,
            )
        seconds = time.monotonic() - started
        if (folder / "summary.json").is_file():
            # the whole run at this attempt's pace (a resumed one trained its last rounds only)
            if cfg.rounds > rounds_before:
                self.durations.append(seconds * cfg.rounds / (cfg.rounds - rounds_before))
            return self._finish(info, info_path, RunOutcome(variant, seed, folder, "finished", seconds), head)
        last = last_progress_line(folder)
        reason = f"flwr status {status}, no summary.json" + (f"; the run's last line: {last}" if last else "")
        return self._finish(info, info_path, RunOutcome(variant, seed, folder, "failed", seconds, reason), head)

    def copy_run(self, source: Path, folder: Path, variant: str, seed: int, resolved: dict, head: str) -> RunOutcome:
        """A finished run of the same experiment in another study folder, copied in as this (variant, seed)."""
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns(*NOT_COPIED))
        origin = f"{source.parent.parent.name}/{RUNS}/{source.name}"  # <study folder>/runs/<run>
        info = {
            "variant": variant,
            "seed": seed,
            "study": self.study.name,
            "config_hash": config_hash(resolved),
            "reused_from": origin,
            "attempts": [],
        }
        old = folder / "run.json"
        if old.is_file():  # the source's own record: its commit and attempts (where and when it really ran)
            try:
                earlier = json.loads(old.read_text())
            except ValueError:
                earlier = {}
            for key in ("study_git_commit", "study_git_dirty", "attempts"):
                if key in earlier:
                    info[key] = earlier[key]
        old.write_text(json.dumps(info, indent=2))
        self.say(f"{head}: the same experiment finished in {origin}: copied, not run again")
        return RunOutcome(variant, seed, folder, "skipped", reason=f"reused from {origin}")

    def _finish(self, info: dict, info_path: Path, outcome: RunOutcome, head: str) -> RunOutcome:
        if info.get("attempts"):
            info["attempts"][-1].update(
                outcome=outcome.status, seconds=round(outcome.seconds, 1), reason=outcome.reason
            )
        info_path.parent.mkdir(parents=True, exist_ok=True)
        info_path.write_text(json.dumps(info, indent=2))
        if outcome.status == "finished":
            summary = json.loads((outcome.folder / "summary.json").read_text())
            lp, knn = summary.get("linear_probe_acc"), summary.get("knn_acc")
            scores = ", ".join(
                f"{name} {100 * v:.2f} %" for name, v in (("linear probe", lp), ("kNN", knn)) if v is not None
            )
            run_s = summary.get("run_s")  # the ServerApp's own time over every attempt: the report's "run s"
            resumed = summary.get("resumed_after_round")
            if not isinstance(run_s, (int, float)):
                inside = ""
            elif resumed:  # this attempt trained the rounds after the checkpoint; run_s counts the earlier ones too
                inside = (
                    f" (this attempt, resumed after round {resumed}; the run itself {_clock(float(run_s))} over "
                    f"{len(info.get('attempts', []))} attempts, the report's run s)"
                )
            else:
                inside = (
                    f" (the run itself {_clock(float(run_s))}, the report's run s; the rest is starting and "
                    "stopping the federation)"
                )
            self.say(f"{head}: done in {_clock(outcome.seconds)}{inside}: {scores}")
        elif outcome.status == "failed":
            self.say(f"{head}: FAILED: {outcome.reason}")
        return outcome


def _raise_keyboard_interrupt(signum, frame):  # SIGTERM: stop as Ctrl-C does
    raise KeyboardInterrupt
