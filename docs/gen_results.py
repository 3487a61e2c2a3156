"""Generate the results pages from the study reports, so that no figure is typed twice.

The CPU-scale studies (``configs/studies/cpu/*.yaml``) write their reports into a study folder; a published report
is a copy of ``report.md``, ``report.csv`` and the plots under ``benchmarks/results/studies/<study>/``, with the
study's record (``study.yaml``) and every run's records (``runs/<run>/summary.json``, ``metrics.jsonl``,
``run.json``: scores, per-round metrics, config and provenance, no weights) beside them, so that the published
folder is itself a study folder: ``fedssl-study report`` rewrites its report from them, and a study file's missing
runs can be added to a copy of it (``fedssl-study run STUDY.yaml --out <the copy>`` skips the runs it holds).
From the reports this script writes

- ``benchmarks/results/cpu_studies.md``: one section per study (the scale, the table, where the report is), between
  snippet markers, so the docs pages include a study's section with
  ``--8<-- "benchmarks/results/cpu_studies.md:<study>"``; a study not measured at the current version says so and
  gives the command that measures it;
- the README's results block (between ``<!-- results:start -->`` and ``<!-- results:end -->``): one compact table
  of every published study;
- a study's section written into the pages that must also read as plain Markdown (``PLAIN_PAGES``: the getting
  started page), between ``<!-- study:<name>:start -->`` and ``<!-- study:<name>:end -->``.

Usage:
    python docs/gen_results.py                       # rewrite both from the published reports
    python docs/gen_results.py --check               # exit 1 when either is stale (tests/test_docs.py does this)
    python docs/gen_results.py --publish STUDY_DIR   # copy a finished study's report into benchmarks/results/studies/
                                                     # (--partial: also one some of whose runs have no result)
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "benchmarks" / "results" / "studies"
STUDIES_PAGE = REPO / "benchmarks" / "results" / "cpu_studies.md"
README = REPO / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


@dataclass(frozen=True)
class Study:
    name: str  # the study file's `study:` name, also the published folder's name
    file: str  # the study file, relative to the repository
    title: str  # what it compares, in words
    in_readme: bool = True  # its rows in the README's table (a one-seed sweep's cells stay on its method page)


STUDIES = (
    Study(
        "default",
        "configs/studies/cpu/default.yaml",
        "The default experiment (FedSimCLR) and its centralized reference",
    ),
    Study(
        "fedema-family-cpu",
        "configs/studies/cpu/fedema-family.yaml",
        "FedBYOL, FedU and FedEMA, with L-DAWA, FedX, Orchestra and FedU2",
    ),
    Study("flesd-cpu", "configs/studies/cpu/flesd.yaml", "FLESD against FedAvg (SimCLR)"),
    Study(
        "lwfedssl-cpu",
        "configs/studies/cpu/lwfedssl.yaml",
        "LW-FedSSL, FedMoCo-LW, Prog-FedSSL and FLL+DD against end-to-end FedMoCoV3",
    ),
    Study("heterossfl-cpu", "configs/studies/cpu/heterossfl.yaml", "Hetero-SSFL against local SSL per architecture"),
    Study(
        "heterossfl-sweep",
        "configs/studies/cpu/heterossfl-sweep.yaml",
        "Hetero-SSFL's alignment settings (mu x refresh x kernel normalisation, one seed) against local SSL",
        in_readme=False,
    ),
)


def command(study: Study) -> str:
    return f"fedssl-study run {study.file} --set data.path=/abs/path/cifar10.npz"


def report_rows(study: Study) -> list[dict[str, str]] | None:
    path = PUBLISHED / study.name / "report.csv"
    if not path.is_file():
        return None
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def runs_without_result(study: Study) -> tuple[int, int] | None:
    """(runs without a result, runs of the study file) for a study published part-way (``--partial``): the
    numbers its report's table names; None for a finished one."""
    report = PUBLISHED / study.name / "report.md"
    if not report.is_file():
        return None
    match = re.search(r"Runs without a result: (\d+) of the study's (\d+)\.", report.read_text())
    return (int(match.group(1)), int(match.group(2))) if match else None


def snippet(report_md: str, section: str) -> str:
    """The text between a report's ``--8<-- [start:section]`` and ``[end:section]`` markers."""
    match = re.search(
        rf"<!-- --8<-- \[start:{section}\] -->\n(.*?)<!-- --8<-- \[end:{section}\] -->", report_md, re.DOTALL
    )
    if match is None:
        raise ValueError(f"the report has no '{section}' section (markers missing): re-publish it")
    return match.group(1).strip()


def pm(row: dict[str, str], key: str, signed: bool = False) -> str:
    mean, std = row.get(f"{key}_mean", ""), row.get(f"{key}_std", "")
    if mean == "":
        return "-"
    text = f"{float(mean):+.2f}" if signed else f"{float(mean):.2f}"
    return text + (f" ± {float(std):.2f}" if std != "" else "")


def study_section(study: Study) -> str:
    lines = [f"<!-- --8<-- [start:{study.name}] -->", ""]
    report = PUBLISHED / study.name / "report.md"
    if report.is_file():
        text = report.read_text()
        lines += [f"**{study.title}.** {snippet(text, 'scale')}", "", snippet(text, "table"), ""]
        if "[start:alignment]" in text:
            lines += [snippet(text, "alignment"), ""]
        lines += [
            (
                f"Full report with curves and provenance: `benchmarks/results/studies/{study.name}/report.md`. "
                f"Reproduce: `{command(study)}`."
            )
        ]
    else:
        lines += [
            (
                f"**{study.title}**: not measured at the current version. Measure it with "
                f"`{command(study)}` (CPU scale: see the comment at the top of `{study.file}` for its size)."
            )
        ]
    lines += ["", f"<!-- --8<-- [end:{study.name}] -->", ""]
    return "\n".join(lines)


def studies_page() -> str:
    parts = [
        "# CPU-scale studies",
        "",
        (
            "Generated by `python docs/gen_results.py` from the published study reports under "
            "`benchmarks/results/studies/`; do not edit by hand. CPU scale means quarter-width encoders, a few "
            "thousand CIFAR-10 images (the JPEG-derived dev copy) and minutes per run on 2 CPU cores: a relative "
            "comparison of the methods and their baselines, not the papers' numbers."
        ),
        "",
    ]
    parts += [study_section(s) for s in STUDIES]
    return "\n".join(parts).rstrip() + "\n"


def results_block() -> str:
    """The README's table: every published study's rows (per-architecture rows left to the report)."""
    lines = [
        START,
        "",
        "| study | row | seeds | linear probe % | gain over random init (points) |",
        "|---|---|---|---|---|",
    ]
    missing, partial = [], []
    for study in (s for s in STUDIES if s.in_readme):
        rows = report_rows(study)
        if rows is None:
            missing.append(study)
            continue
        to_do = runs_without_result(study)
        if to_do:
            partial.append((study, *to_do))
        link = f"[{study.name}](benchmarks/results/studies/{study.name}/report.md)"
        for row in rows:
            if row.get("arch") and row.get("kind") != "random init":
                continue  # the per-architecture rows of a multi-architecture run are in its report
            gain = "0" if row["kind"] == "random init" else pm(row, "linear_probe_gain", signed=True)
            lines.append(f"| {link} | {row['row']} | {row['seeds']} | {pm(row, 'linear_probe')} | {gain} |")
            link = ""
    if len(lines) == 4:
        lines = [START]  # nothing published yet: no empty table
    for study, without, planned in partial:
        lines += [
            "",
            (
                f"{study.name} is published part-way: {without} of its {planned} runs have no result yet (its report "
                f"names them; `{command(study)} --out <a copy of its folder>` adds them). "
                "Each row's seeds column says which seeds it holds."
            ),
        ]
    if missing:
        lines += [
            "",
            "Not measured at the current version yet: " + ", ".join(f"{s.name} (`{s.file}`)" for s in missing) + ".",
        ]
    lines += ["", END]
    return "\n".join(lines)


# Pages that must read well as plain Markdown too (on the repository host, where a ``--8<--`` include shows as a raw
# line): a study's section is written into them between ``<!-- study:<name>:start -->`` and ``<!-- study:<name>:end
# -->``, and ``--check`` fails when a copy differs from the published report.
PLAIN_PAGES = (REPO / "docs" / "getting-started.md",)
STUDY_BLOCK = re.compile(
    r"(<!-- study:(?P<name>[\w.-]+):start -->\n)(?P<body>.*?)(<!-- study:(?P=name):end -->)", re.DOTALL
)


def page_with_study_blocks(page: str) -> str:
    """``page`` with every study block rewritten from the published report (the section the studies page has,
    without its include markers)."""
    by_name = {s.name: s for s in STUDIES}

    def block(match: re.Match) -> str:
        name = match.group("name")
        if name not in by_name:
            raise ValueError(f"study block {name!r}: no such study in docs/gen_results.py's STUDIES")
        body = "\n".join(line for line in study_section(by_name[name]).splitlines() if "--8<--" not in line).strip()
        return f"{match.group(1)}\n{body}\n\n{match.group(4)}"

    return STUDY_BLOCK.sub(block, page)


# Single figures typed in flowing text, each taken from its benchmark's results file: ``<!-- fig:<name> -->`` and
# ``<!-- /fig -->`` around the figure (invisible in plain Markdown and on the docs site alike).
FIGURE_PAGES = (REPO / "docs" / "getting-started.md", REPO / "docs" / "studies.md")
FIGURE = re.compile(r"(<!-- fig:(?P<name>[\w.-]+) -->)(?P<body>.*?)(<!-- /fig -->)", re.DOTALL)
STARTUP_RESULTS = REPO / "benchmarks" / "results" / "startup.json"


def figures() -> dict[str, str]:
    """Every figure a page may name, from the benchmarks' results files."""
    startup = json.loads(STARTUP_RESULTS.read_text())
    single, study_run = startup["single_run"], startup["study_run"]
    return {
        "startup.single": f"{single['min_s']:.0f}-{single['max_s']:.0f} s",
        "startup.study_run": f"{study_run['min_s']:.0f}-{study_run['max_s']:.0f} s",
    }


def page_with_figures(page: str) -> str:
    known = figures()

    def figure(match: re.Match) -> str:
        name = match.group("name")
        if name not in known:
            raise ValueError(f"figure {name!r}: not one docs/gen_results.py knows ({', '.join(sorted(known))})")
        return f"{match.group(1)}{known[name]}{match.group(4)}"

    return FIGURE.sub(figure, page)


def readme_with_results(readme: str) -> str:
    if START not in readme or END not in readme:
        raise ValueError(f"README.md has no results block: add the lines {START} and {END}")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + results_block() + tail


RUN_RECORDS = ("summary.json", "metrics.jsonl", "run.json")


def _cut(path: str) -> str:
    """An absolute path as a results file may show it: from ``configs/`` on for a file of a checkout (whichever
    checkout ran it), else its last name (``/x/y/cifar.npz`` -> ``cifar.npz``)."""
    if "/configs/" in path:
        return "configs/" + path.split("/configs/", 1)[1]
    return path.rstrip("/").rsplit("/", 1)[-1]


def local_paths_cut(value):
    """A JSON/YAML value with every absolute path cut (``_cut``), also inside a sentence or a command, whose
    ``--out FOLDER`` (the study folder of the machine that ran it) is dropped."""
    if isinstance(value, dict):
        return {k: local_paths_cut(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local_paths_cut(v) for v in value]
    if isinstance(value, str):
        value = re.sub(r" --out [^\s`]+", "", value)
        return re.sub(r"(?<![\w.])/(?:[\w.+-]+/)*[\w.+-]+", lambda m: _cut(m.group(0)), value)
    return value


def publish_runs(study_dir: Path, out: Path) -> int:
    """Copy every finished run's records (RUN_RECORDS, paths cut) into ``out/runs/``; returns how many runs."""
    import json

    count = 0
    for run in sorted((study_dir / "runs").glob("*")):
        if not (run / "summary.json").is_file():
            continue  # unfinished: the report names it; nothing to publish yet
        target = out / "runs" / run.name
        target.mkdir(parents=True, exist_ok=True)
        for item in RUN_RECORDS:
            src = run / item
            if not src.is_file():
                continue
            if item.endswith(".jsonl"):
                lines = [
                    json.dumps(local_paths_cut(json.loads(line)))
                    for line in src.read_text().splitlines()
                    if line.strip()
                ]
                (target / item).write_text("".join(line + "\n" for line in lines))
            else:
                (target / item).write_text(json.dumps(local_paths_cut(json.loads(src.read_text())), indent=1) + "\n")
        count += 1
    return count


class UnfinishedStudy(Exception):
    """A study folder some of whose runs have no result, published without ``--partial``."""


def publish(study_dir: Path, partial: bool = False) -> Path:
    """Copy a finished study's report, its record and its runs' records into benchmarks/results/studies/<name>/
    with this machine's paths cut to file names (a results file names no local folder). A study some of whose runs
    have no result is refused (UnfinishedStudy, naming them) unless ``partial``: its report then names them."""
    import yaml

    from fedssl_study.report import unfinished_runs

    unfinished = unfinished_runs(study_dir)
    if unfinished.planned_without_result and not partial:
        raise UnfinishedStudy(
            f"{study_dir}: not published. {unfinished.line()} Finish it (run the study's command again: it resumes "
            "and skips the finished runs), or publish it as it is with --partial."
        )
    record = yaml.safe_load((study_dir / "study.yaml").read_text()) or {}
    name = record.get("study") or study_dir.name
    out = PUBLISHED / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.yaml").write_text(yaml.safe_dump(local_paths_cut(record), sort_keys=False))
    if (study_dir / "runs").is_dir():
        publish_runs(study_dir, out)
    for item in ("report.md", "report.csv", "curves.png", "scores.png"):
        src = study_dir / item
        if not src.is_file():
            continue
        if item.endswith(".png"):
            shutil.copyfile(src, out / item)
            continue
        text = src.read_text()
        text = re.sub(r"(data\.path=)\S*/([^/\s`]+)", r"\1\2", text)  # --set data.path=/x/y/cifar.npz -> cifar.npz
        text = re.sub(r" --out [^\s`]+", "", text)  # the closing backtick of the command stays
        # --reuse /x/heterossfl-sweep -> --reuse heterossfl-sweep
        text = re.sub(r"(--reuse )(?:[^\s`]*/)?([^/\s`]+)/?(?=[\s`]|$)", r"\1\2", text)
        (out / item).write_text(text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale")
    parser.add_argument("--publish", metavar="STUDY_DIR", type=Path, help="copy a study's report in first")
    parser.add_argument(
        "--partial", action="store_true", help="with --publish: publish a study some of whose runs have no result"
    )
    args = parser.parse_args(argv)
    if args.publish:
        try:
            print(f"published {publish(args.publish, partial=args.partial)}")
        except UnfinishedStudy as exc:
            print(exc, file=sys.stderr)
            return 2
    outputs = [(STUDIES_PAGE, studies_page()), (README, readme_with_results(README.read_text()))]
    pages = {p: p.read_text() for p in (*PLAIN_PAGES, *FIGURE_PAGES)}
    for p in PLAIN_PAGES:
        pages[p] = page_with_study_blocks(pages[p])
    for p in FIGURE_PAGES:
        pages[p] = page_with_figures(pages[p])
    outputs += list(pages.items())
    if args.check:
        stale = [p.name for p, text in outputs if not p.is_file() or p.read_text() != text]
        if stale:
            print("stale: " + ", ".join(stale) + ": run python docs/gen_results.py", file=sys.stderr)
            return 1
        return 0
    for path, text in outputs:
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
