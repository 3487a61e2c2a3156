"""The report of a set of finished runs: ``report.md``, ``report.csv``, ``curves.png`` and ``scores.png``.

Runs are grouped into rows by variant: a study's runs by the variant named in their ``run.json``; runs given as
folders (``fedssl-report RUN_DIR...``) by their experiment config without the seed, name and output folder (so the
seeds of one experiment form one row, named after the run without its ``-seed<N>``). Per row, over its seeds: mean
and sample standard deviation of the linear probe and kNN accuracy and of the linear probe's gain over the run's own
random-init encoder, each seed's values, rounds, bytes up and down per client, the clients' training FLOPs and the
wall time. A random-init row (each seed's initial encoder, scored with the same protocol) comes first; a
``strategy: central`` row is marked as the centralized reference. Runs with several client encoders (Hetero-SSFL,
Min-Local) add a row per architecture (mean over that architecture's clients). Two rows whose means differ by less
than their seed spread (the sum of their standard deviations) are listed as not ranked.

Runs whose clients log their CKA to the server's average kernel before and after local training (Hetero-SSFL's
``cka_start`` / ``cka_end``, local SSL with ``mu: 0`` included) add an alignment table per variant: the clients'
mean CKA per round before -> after training (mean over seeds), the mean within-round change, in how many rounds
it fell, and the clients' raw centred-kernel norm per architecture in the first and last round.

Plots (matplotlib): the kNN accuracy per round of every row on one axis (mean over seeds, with the range of the
seeds as a band) and the final linear probe of every row (mean, with the standard deviation as an error bar).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server_app.provenance import config_hash

from .spec import run_folder_name

SCORES = ("linear_probe_acc", "knn_acc")
IGNORED_FOR_GROUPING = ("seed", "name", "output_dir")


@dataclass
class RunData:
    folder: Path
    variant: str
    seed: int
    summary: dict[str, Any]
    rounds: list[dict[str, Any]]

    @property
    def config(self) -> dict[str, Any]:
        return self.summary.get("config", {})

    @property
    def num_clients(self) -> int:
        return int(self.config.get("federation", {}).get("num_clients", 1) or 1)

    @property
    def central(self) -> bool:
        return self.config.get("strategy", {}).get("name") == "central"

    def archs(self) -> list[str]:
        return sorted((self.summary.get("scores_by_arch") or {}).keys())

    @property
    def client_flops(self) -> float | None:
        """The clients' FLOPs over the run (summary.json resources.run.flops_run); None where the record leaves out
        part of them: a Hetero-SSFL run recorded before the alignment term's RAD passes were counted (no
        ``flops_extra_run``) counted its SSL steps only."""
        run = (self.summary.get("resources") or {}).get("run") or {}
        if self.config.get("strategy", {}).get("name") == "heterossfl" and "flops_extra_run" not in run:
            return None
        return run.get("flops_run") or None


@dataclass
class Row:
    label: str
    runs: list[RunData] = field(default_factory=list)
    arch: str | None = None  # a per-architecture row of a multi-encoder run
    kind: str = "variant"  # "random init", "variant", "centralized"

    def values(self, key: str) -> list[float]:
        """Per seed (in run order), percent."""
        out = []
        for run in self.runs:
            value = self._value(run, key)
            if value is not None:
                out.append(100.0 * float(value))
        return out

    def _value(self, run: RunData, key: str) -> float | None:
        s = run.summary
        if self.kind == "random init":
            ref = s.get("random_init") or {}
            arch = self.arch or run.config.get("model", {}).get("arch")
            base = key.replace("_gain_over_random", "")
            if key.endswith("_gain_over_random"):
                return 0.0 if (ref.get(arch) or {}).get(base) is not None else None
            return (ref.get(arch) or {}).get(key)
        if self.arch is not None:
            by_arch = (s.get("scores_by_arch") or {}).get(self.arch) or {}
            if key.endswith("_gain_over_random"):
                base = key.replace("_gain_over_random", "")
                mean, ref = by_arch.get(f"{base}_mean"), ((s.get("random_init") or {}).get(self.arch) or {}).get(base)
                return None if mean is None or ref is None else mean - ref
            return by_arch.get(f"{key}_mean")
        if key.endswith("_gain_over_random"):
            return s.get(key)
        return s.get(key)


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt(mean: float | None, std: float | None, digits: int = 2) -> str:
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


# ---------------------------------------------------------------------------------------------- reading runs
def read_run(folder: Path, variant: str | None = None, seed: int | None = None) -> RunData | None:
    """The finished run in ``folder`` (None without ``summary.json``)."""
    folder = Path(folder)
    path = folder / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    rounds = []
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        rounds = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    info = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else {}
    cfg = summary.get("config", {})
    if variant is None:
        variant = info.get("variant")
    if variant is None:
        name = str(summary.get("name") or folder.name)
        suffix = f"-seed{cfg.get('seed')}"
        variant = name.removesuffix(suffix)
    return RunData(
        folder, str(variant), int(seed if seed is not None else info.get("seed", cfg.get("seed", 0))), summary, rounds
    )


def study_runs(study_dir: Path) -> tuple[list[RunData], list[str]]:
    """The finished runs of a study folder, in the study's order of variants, and its variant order."""
    study_dir = Path(study_dir)
    record = study_record(study_dir)
    runs = [r for r in (read_run(p) for p in sorted((study_dir / "runs").glob("*"))) if r is not None]
    # the study file's order (a record from before variant_order: the variants it ran, then the rest as found)
    order = list(record.get("variant_order") or (record.get("variants") or {}).keys())
    for run in runs:
        if run.variant not in order:
            order.append(run.variant)
    runs.sort(key=lambda r: (order.index(r.variant), r.seed))
    return runs, order


def group_runs(runs: Iterable[RunData]) -> tuple[list[RunData], list[str]]:
    """Runs given one by one: rows by their config without seed, name and output folder."""
    runs = list(runs)
    by_hash: dict[str, str] = {}
    order: list[str] = []
    for run in runs:
        cfg = {k: v for k, v in run.config.items() if k not in IGNORED_FOR_GROUPING}
        key = config_hash(cfg)
        if key not in by_hash:
            by_hash[key] = run.variant
            order.append(run.variant)
        run.variant = by_hash[key]
    runs.sort(key=lambda r: (order.index(r.variant), r.seed))
    return runs, order


def build_rows(runs: list[RunData], order: list[str]) -> list[Row]:
    """The random-init row(s), then every variant (and its per-architecture rows), the centralized one marked."""
    rows: list[Row] = []
    by_seed: dict[int, RunData] = {}
    multi = sorted({a for r in runs for a in r.archs()})
    for run in runs:  # one reference per seed (every run of a seed starts from the same seeded encoder)
        if run.summary.get("random_init") and not run.central:
            by_seed.setdefault(run.seed, run)
    ref_runs = [by_seed[s] for s in sorted(by_seed)]
    if ref_runs:
        archs = multi or [None]
        for arch in archs:
            rows.append(Row("random init" + (f" [{arch}]" if arch else ""), ref_runs, arch, "random init"))
    for variant in order:
        vr = [r for r in runs if r.variant == variant]
        if not vr:
            continue
        kind = "centralized" if all(r.central for r in vr) else "variant"
        marked = kind == "centralized" and "central" not in variant.lower()
        rows.append(Row(variant + (" (centralized reference)" if marked else ""), vr, None, kind))
        archs = sorted({a for r in vr for a in r.archs()})
        if len(archs) >= 1 and any(r.summary.get("scores_by_model") for r in vr):
            for arch in archs:
                rows.append(Row(f"{variant} [{arch}]", vr, arch, kind))
    return rows


# ---------------------------------------------------------------------------------------------- alignment
def _round_means(run: RunData, key: str) -> dict[int, float]:
    """Per round, the mean of the clients' ``key`` (those that report it)."""
    out = {}
    for record in run.rounds:
        values = [float(c[key]) for c in record.get("clients") or [] if c.get(key) is not None]
        if values:
            out[int(record["round"])] = statistics.mean(values)
    return out


def _arch_norms(run: RunData, round_index: int) -> dict[str, float]:
    """The round's mean ``kernel_norm`` per client architecture."""
    records = [r for r in run.rounds if r.get("clients")]
    if not records:
        return {}
    by_arch: dict[str, list[float]] = {}
    for c in records[round_index]["clients"]:
        if c.get("kernel_norm") is not None:
            by_arch.setdefault(str(c.get("arch", "?")), []).append(float(c["kernel_norm"]))
    return {a: statistics.mean(v) for a, v in by_arch.items()}


def alignment_lines(runs: list[RunData], order: list[str]) -> list[str]:
    """The alignment table of the runs that log ``cka_start`` / ``cka_end`` (none otherwise)."""
    lines = []
    for variant in order:
        vr = [r for r in runs if r.variant == variant]
        starts = [_round_means(r, "cka_start") for r in vr]
        ends = [_round_means(r, "cka_end") for r in vr]
        rounds = sorted(set().union(*starts) & set().union(*ends)) if starts else []
        if not rounds:
            continue
        pairs = []
        for rnd in rounds:
            a = [s[rnd] for s in starts if rnd in s]
            b = [e[rnd] for e in ends if rnd in e]
            pairs.append((rnd, statistics.mean(a), statistics.mean(b)))
        changes = [b - a for _, a, b in pairs]
        first, last = [_arch_norms(r, 0) for r in vr], [_arch_norms(r, -1) for r in vr]
        archs = sorted(set().union(*first, *last))
        norms = "; ".join(
            f"{a} {statistics.mean([f[a] for f in first if a in f]):.3g} -> "
            f"{statistics.mean([x[a] for x in last if a in x]):.3g}"
            for a in archs
            if any(a in f for f in first) and any(a in x for x in last)
        )
        lines.append(
            f"| {variant} | {' '.join(f'r{r} {a:.3f}->{b:.3f}' for r, a, b in pairs)} | "
            f"{statistics.mean(changes):+.3f} | {sum(c < 0 for c in changes)} of {len(changes)} | "
            f"{norms or '-'} |"
        )
    if not lines:
        return []
    return [
        "<!-- --8<-- [start:alignment] -->",
        "",
        (
            "Alignment: the clients' mean CKA(K_k, K_bar) on the whole RAD per round, before -> after local training "
            "(mean over the row's seeds); the mean within-round change; the rounds in which it fell; the clients' "
            "raw ||H K H||_F per architecture, first -> last round."
        ),
        "",
        (
            "| row | CKA to K_bar per round, before -> after training | mean change | rounds it fell "
            "| kernel norm (first -> last round) |"
        ),
        "|---|---|---|---|---|",
        *lines,
        "",
        "<!-- --8<-- [end:alignment] -->",
    ]


# ---------------------------------------------------------------------------------------------- tables
CSV_COLUMNS = (
    "row",
    "kind",
    "arch",
    "seeds",
    "linear_probe_mean",
    "linear_probe_std",
    "knn_mean",
    "knn_std",
    "linear_probe_gain_mean",
    "linear_probe_gain_std",
    "linear_probe_per_seed",
    "gain_per_seed",
    "rounds",
    "bytes_up_per_client_mib",
    "bytes_down_per_client_mib",
    "client_tflops",
    "run_s_mean",
)


def row_figures(row: Row) -> dict[str, Any]:
    lp, knn, gain = row.values("linear_probe_acc"), row.values("knn_acc"), row.values("linear_probe_gain_over_random")
    out: dict[str, Any] = {
        "row": row.label,
        "kind": row.kind,
        "arch": row.arch or "",
        "seeds": " ".join(str(r.seed) for r in row.runs),
    }
    for name, values in (("linear_probe", lp), ("knn", knn), ("linear_probe_gain", gain)):
        m, s = mean_std(values)
        out[f"{name}_mean"], out[f"{name}_std"] = m, s
    out["linear_probe_per_seed"] = " ".join(f"{v:.2f}" for v in lp)
    out["gain_per_seed"] = " ".join(f"{v:+.2f}" for v in gain) if row.kind != "random init" else ""
    if row.kind == "random init":
        return out
    runs = row.runs
    out["rounds"] = " ".join(sorted({str(r.summary.get("rounds_completed", "")) for r in runs}))
    out["bytes_up_per_client_mib"] = (
        statistics.mean(r.summary.get("bytes_up_total", 0) / r.num_clients for r in runs) / 2**20
    )
    out["bytes_down_per_client_mib"] = (
        statistics.mean(r.summary.get("bytes_down_total", 0) / r.num_clients for r in runs) / 2**20
    )
    flops = [r.client_flops for r in runs]
    # a mean over some of the seeds would read as the row's: a row with an uncounted run shows none
    out["client_tflops"] = statistics.mean(flops) / 1e12 if flops and all(flops) else None
    out["run_s_mean"] = statistics.mean(float(r.summary.get("run_s", 0.0)) for r in runs)
    return out


def not_ranked(rows: list[Row], figures: list[dict[str, Any]]) -> list[str]:
    """Pairs of rows (of one architecture) whose linear-probe means differ by less than their seed spread."""
    notes = []
    scored = [(r, f) for r, f in zip(rows, figures) if f["linear_probe_mean"] is not None]
    for i, (ra, fa) in enumerate(scored):
        for rb, fb in scored[i + 1 :]:
            if ra.arch != rb.arch or (fa["linear_probe_std"] is None and fb["linear_probe_std"] is None):
                continue
            spread = (fa["linear_probe_std"] or 0.0) + (fb["linear_probe_std"] or 0.0)
            gap = abs(fa["linear_probe_mean"] - fb["linear_probe_mean"])
            if gap < spread:
                notes.append(
                    f"{ra.label} and {rb.label}: linear probe {fa['linear_probe_mean']:.2f} vs "
                    f"{fb['linear_probe_mean']:.2f}, {gap:.2f} points apart, less than their seed spread "
                    f"({spread:.2f}): not ranked"
                )
    return notes


def provenance_lines(runs: list[RunData]) -> list[str]:
    """What produced the runs (summary.json ``provenance``): one line per distinct environment."""
    seen: dict[str, list[str]] = {}
    for run in runs:
        p = run.summary.get("provenance") or {}
        if not p:
            continue
        info_path = run.folder / "run.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        commit = p.get("git_commit") or info.get("study_git_commit")
        dirty = p.get("git_dirty") if p.get("git_commit") else info.get("study_git_dirty")
        v = p.get("versions", {})
        # the training's number format differs between machines (bf16 autocast only where the CPU or GPU has native
        # bf16 units): a study whose runs ran on several machines says which ran in which. A round without training
        # (Orchestra's centroid seeding) records fp32 beside the training rounds' bf16.
        precisions = sorted(
            {str(c["precision"]) for r in run.rounds for c in [r, *r.get("clients", [])] if c.get("precision")}
        )
        text = (
            f"Python {v.get('python', '?')}, torch {v.get('torch', '?')}, torchvision {v.get('torchvision', '?')}, "
            f"flwr {v.get('flwr', '?')}, numpy {v.get('numpy', '?')}; device {p.get('device', '?')}; "
            f"app code {str(p.get('app_digest', '?'))[:12]}, commit {commit[:12] if commit else 'unknown'}"
            f"{' with uncommitted changes' if dirty else ''}"
            f"{'; precision ' + ' and '.join(precisions) if precisions else ''}"
        )
        seen.setdefault(text, []).append(f"{run.variant} seed {run.seed}")
    lines = [f"- {text}: {len(names)} run(s)" for text, names in seen.items()] or ["(these runs record no provenance)"]
    return lines + mixed_code_lines(runs)


def mixed_code_lines(runs: list[RunData]) -> list[str]:
    """A line per run whose attempts ran on more than one version of the app code (a run resumed after the checkout
    changed): the line above names only the code of its last attempt. From run.json's attempts (a study records
    each attempt's code; runs from before that record none and get no line)."""
    lines = []
    for run in runs:
        info_path = run.folder / "run.json"
        attempts = json.loads(info_path.read_text()).get("attempts", []) if info_path.is_file() else []
        if not any(a.get("app_digest") for a in attempts):
            continue
        versions: dict[str, list[int]] = {}
        for number, attempt in enumerate(attempts, 1):
            digest, commit = attempt.get("app_digest"), attempt.get("git_commit")
            version = (
                f"app code {digest[:12]}, commit {commit[:12] if commit else 'unknown'}"
                f"{' with uncommitted changes' if attempt.get('git_dirty') else ''}"
                if digest
                else "code not recorded"
            )
            versions.setdefault(version, []).append(number)
        if len(versions) > 1:
            parts = [
                f"{version} (attempt{'s' if len(n) > 1 else ''} {', '.join(map(str, n))})"
                for version, n in versions.items()
            ]
            what = (
                "resumed, with the code of some attempts not recorded"
                if "code not recorded" in versions
                else "ran on more than one version of the code, resumed between them"
            )
            lines.append(f"- {run.variant} seed {run.seed} {what}: {'; '.join(parts)}")
    return lines


def scale_line(runs: list[RunData]) -> str:
    """The runs' scale in words, from the first run's config (what the rows share)."""
    cfg = runs[0].config
    d, m, t, f, e = (
        cfg.get("data", {}),
        cfg.get("model", {}),
        cfg.get("train", {}),
        cfg.get("federation", {}),
        cfg.get("eval", {}),
    )
    archs = sorted({a for r in runs for a in (r.config.get("model", {}).get("client_archs") or [])}) or [m.get("arch")]
    scored = [r for r in runs if r.summary.get("eval", {}).get("scored", True)]
    where = f" ({e['path']})" if e.get("path") else ""
    scoring = (
        f"scored on {e.get('max_train') or 'all'} labelled train and {e.get('max_test') or 'all'} test images{where}"
        if scored
        else "nothing scored (unlabelled training images, no eval.path)"
    )
    return (
        f"{cfg.get('rounds')} rounds x {t.get('local_epochs')} local epochs, batch {t.get('batch_size')}, "
        f"{f.get('num_clients')} clients ({d.get('partition')}), {d.get('dataset')} "
        f"{('max ' + str(d.get('max_train')) + ' train images') if d.get('max_train') else 'all train images'}, "
        f"{', '.join(map(str, archs))} width {m.get('width')}; {scoring}"
    )


def write_report(
    out_dir: Path,
    runs: list[RunData],
    order: list[str],
    *,
    title: str,
    command: str | list[str] = "",
    unfinished: Unfinished | None = None,
) -> Path:
    """Write report.md, report.csv and the plots into ``out_dir``; returns report.md's path. ``command``: the
    command that produced the runs, or the several, oldest first, that filled a study folder."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = build_rows(runs, order)
    figures = [row_figures(r) for r in rows]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for f in figures:
        writer.writerow(
            {
                k: ("" if f.get(k) is None else (round(f[k], 4) if isinstance(f.get(k), float) else f[k]))
                for k in CSV_COLUMNS
            }
        )
    (out_dir / "report.csv").write_text(buffer.getvalue())
    lines = [f"# {title}", ""]
    commands = [command] if isinstance(command, str) else list(command)
    commands = [c for c in commands if c]
    if len(commands) == 1:
        lines += [f"Command: `{commands[0]}`", ""]
    elif commands:
        # a study stopped and started again runs the same command several times: each is listed once
        times = {c: commands.count(c) for c in commands}
        lines += ["Commands, in the order they first ran into this folder:", ""]
        lines += [f"- `{c}`" + (f" (run {n} times)" if n > 1 else "") for c, n in times.items()]
        lines += [""]
    if runs:
        lines += [
            "<!-- --8<-- [start:scale] -->",
            (
                f"Scale: {scale_line(runs)}. Seeds: {', '.join(str(s) for s in sorted({r.seed for r in runs}))}. "
                "Accuracies in %; mean ± sample standard deviation over the row's seeds (no ± with one seed); "
                "gain = linear probe minus the same seed's random-init encoder, in points."
            ),
            "<!-- --8<-- [end:scale] -->",
            "",
        ]
    # the table and its notes between snippet markers: a docs page includes them with "report.md:table"
    lines += [
        "<!-- --8<-- [start:table] -->",
        "",
        (
            "| row | seeds | linear probe | kNN | gain over random init | per-seed linear probe | per-seed gain "
            "| rounds | up / client (MiB) | down / client (MiB) | client TFLOP | run s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:

        def num(key: str, digits: int = 1, f: dict = f) -> str:
            return "-" if f.get(key) is None else f"{f[key]:,.{digits}f}"

        lines.append(
            f"| {f['row']} | {f['seeds']} | {fmt(f['linear_probe_mean'], f['linear_probe_std'])} | "
            f"{fmt(f['knn_mean'], f['knn_std'])} | "
            f"{fmt(f['linear_probe_gain_mean'], f['linear_probe_gain_std']) if f['kind'] != 'random init' else '0'} | "
            f"{f['linear_probe_per_seed'] or '-'} | {f['gain_per_seed'] or '-'} | {f.get('rounds') or '-'} | "
            f"{num('bytes_up_per_client_mib')} | {num('bytes_down_per_client_mib')} | {num('client_tflops')} | "
            f"{num('run_s_mean', 0)} |"
        )
    notes = not_ranked(rows, figures)
    if notes:
        lines += ["", "Within their seed spread (not ranked):", ""] + [f"- {n}" for n in notes]
    if any(r.client_flops is None and r.config.get("strategy", {}).get("name") == "heterossfl" for r in runs):
        lines += [
            "",
            (
                'Client TFLOP "-": a Hetero-SSFL run recorded before its alignment term\'s RAD passes were '
                "counted (its record holds the SSL steps' FLOPs only)."
            ),
        ]
    if unfinished:
        lines += ["", unfinished.line()]
    lines += ["", "<!-- --8<-- [end:table] -->"]
    aligned = alignment_lines(runs, order)
    if aligned:
        lines += ["", *aligned]
    plots = draw_plots(out_dir, rows)
    if plots:
        lines += ["", *[f"![{p.stem}]({p.name})" for p in plots]]
    lines += ["", "Produced by:", "", *provenance_lines(runs), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


# ---------------------------------------------------------------------------------------------- plots
MAX_LEGEND_INSIDE = 10  # more curves than this and the legend would cover them: it goes beside the axes
MAX_VERTICAL_BARS = 20  # more rows than this and the bar chart turns horizontal, one readable label per line
LEGEND_ENTRIES_PER_COLUMN = 30  # a legend beside the axes wraps into another column past this many entries


def place_legend(fig: Any, ax: Any) -> None:
    """The legend inside the axes for a few curves; beside them, in as many columns of at most
    LEGEND_ENTRIES_PER_COLUMN entries as it takes, for many (a sweep), with the figure widened so the axes keep
    their size."""
    handles, _ = ax.get_legend_handles_labels()
    if len(handles) <= MAX_LEGEND_INSIDE:
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        return
    columns = -(-len(handles) // LEGEND_ENTRIES_PER_COLUMN)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width + 3.2 * columns, max(height, 0.16 * min(len(handles), LEGEND_ENTRIES_PER_COLUMN) + 1.0))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=columns, borderaxespad=0.0)
    fig.tight_layout()


def draw_scores(rows: list[Row]):
    """The final linear probe per row: a bar at the mean over seeds with the std as its error bar, and a dot for
    every seed's own value (the spread a mean hides). The accuracy axis starts at 0, so a gap between rows looks as
    large as it is; None when no row has a score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [(r, r.values("linear_probe_acc")) for r in rows]
    scored = [(r, seeds, *mean_std(seeds)) for r, seeds in scored if seeds]
    if not scored:
        return None
    colors = [
        "0.6" if r.kind == "random init" else ("tab:green" if r.kind == "centralized" else "tab:blue")
        for r, *_ in scored
    ]
    means, errors = [m for _, _, m, _ in scored], [s or 0.0 for _, _, _, s in scored]
    labels = [r.label for r, *_ in scored]
    top = max(max(seeds) for _, seeds, _, _ in scored)
    vertical = len(scored) <= MAX_VERTICAL_BARS
    if vertical:
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(scored) + 2), 4.5))
        ax.bar(range(len(scored)), means, yerr=errors, capsize=3, color=colors)
        ax.set_xticks(range(len(scored)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("linear probe accuracy (%)")
        ax.set_ylim(0.0, max(top, max(m + e for m, e in zip(means, errors))) * 1.08)
        ax.grid(axis="y", alpha=0.3)
    else:  # a sweep: one bar per line, top to bottom in the table's order, so every label stays readable
        fig, ax = plt.subplots(figsize=(9, 0.22 * len(scored) + 1.5))
        ax.barh(range(len(scored)), means, xerr=errors, capsize=2, color=colors)
        ax.set_yticks(range(len(scored)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("linear probe accuracy (%)")
        ax.set_xlim(0.0, max(top, max(m + e for m, e in zip(means, errors))) * 1.08)
        ax.grid(axis="x", alpha=0.3)
    positions = [i for i, (_, seeds, _, _) in enumerate(scored) for _ in seeds]
    values = [v for _, seeds, _, _ in scored for v in seeds]
    xy = (positions, values) if vertical else (values, positions)
    ax.scatter(*xy, s=10, color="black", zorder=3, label="one seed")  # the title says what the dots are
    ax.set_title("final linear probe (bar: mean over seeds, error bar: std, dots: each seed)")
    fig.tight_layout()
    return fig


def draw_plots(out_dir: Path, rows: list[Row]) -> list[Path]:
    """curves.png (kNN per round, mean and range over seeds, every non-reference row) and scores.png (final linear
    probe per row, mean ± std); nothing when no run has a score to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours_in_cycle = len(plt.rcParams["axes.prop_cycle"])
    drawn = 0
    for row in rows:
        if row.kind == "random init":
            continue
        curves: dict[int, list[float]] = {}
        for run in row.runs:
            for record in run.rounds:
                value = record.get("knn_acc")
                if row.arch is not None:
                    by_model = record.get("knn_acc_by_model") or {}
                    archs = run.config.get("model", {}).get("client_archs") or []
                    vals = [
                        v
                        for name, v in by_model.items()
                        if v is not None
                        and name.startswith("client_")
                        and int(name.split("_")[1]) < len(archs)
                        and archs[int(name.split("_")[1])] == row.arch
                    ]
                    value = statistics.mean(vals) if vals else None
                elif record.get("knn_acc_by_model") and row.runs[0].summary.get("scores_by_model"):
                    continue  # the per-architecture rows draw these runs
                if value is not None:
                    curves.setdefault(int(record["round"]), []).append(100 * float(value))
        if not curves:
            continue
        xs = sorted(curves)
        mean = [statistics.mean(curves[x]) for x in xs]
        # past the colour cycle's last colour, a new line style tells the curves apart
        style = ("-", "--", "-.", ":")[drawn // colours_in_cycle % 4]
        (line,) = ax.plot(xs, mean, marker="o", markersize=3, linestyle=style, label=row.label)
        if any(len(curves[x]) > 1 for x in xs):
            ax.fill_between(
                xs, [min(curves[x]) for x in xs], [max(curves[x]) for x in xs], alpha=0.15, color=line.get_color()
            )
        drawn += 1
    if drawn:
        references = [r for r in rows if r.kind == "random init"]
        for row in references:  # each seed's initial encoder: a dashed level per architecture
            values = row.values("knn_acc")
            if values:
                ax.axhline(
                    statistics.mean(values), color="0.5", linestyle="--", linewidth=1, label=f"{row.label} (kNN)"
                )
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel("kNN accuracy (%)")
        ax.set_title("kNN accuracy per round (mean over seeds; band: their range)")
        ax.grid(alpha=0.3)
        place_legend(fig, ax)
        fig.savefig(out_dir / "curves.png", dpi=120, bbox_inches="tight")
        written.append(out_dir / "curves.png")
    plt.close(fig)
    fig = draw_scores(rows)
    if fig is not None:
        fig.savefig(out_dir / "scores.png", dpi=120)
        written.append(out_dir / "scores.png")
        plt.close(fig)
    return written


def study_record(study_dir: Path) -> dict[str, Any]:
    """The ``study.yaml`` a study run wrote (its name, command, variants), or {}."""
    path = Path(study_dir) / "study.yaml"
    if not path.is_file():
        return {}
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def study_commands(record: dict[str, Any]) -> list[str]:
    """The commands that ran into a study folder, oldest first (a record from before the list: its one command)."""
    commands = record.get("commands")
    if isinstance(commands, list):
        return [str(c) for c in commands if c]
    return [str(record["command"])] if record.get("command") else []


def planned_runs(record: dict[str, Any]) -> list[tuple[str, int]]:
    """Every (variant, seed) of the study file, seed-major, also when a command narrowed its variants or seeds (a
    record from before ``file_seeds``: the seeds of the last command)."""
    variants = [str(v) for v in (record.get("variant_order") or record.get("variants") or {})]
    seeds = record.get("file_seeds") or record.get("seeds") or []
    return [(variant, int(seed)) for seed in seeds for variant in variants]


@dataclass
class Unfinished:
    """The runs of a study folder without a result."""

    planned: int  # the runs of the study file
    planned_without_result: int
    started: list[str]  # run folders without summary.json: "variant seed N", or the folder's name
    not_started: list[tuple[str, int]]  # runs of the study file without a folder

    def __bool__(self) -> bool:
        return bool(self.started or self.not_started)

    def line(self) -> str:
        """One sentence for the report: how many of the study's runs have no result, and which."""
        parts = []
        if self.planned:
            parts.append(f"Runs without a result: {self.planned_without_result} of the study's {self.planned}.")
        else:
            parts.append("Runs without a result:")
        if self.started:
            parts.append(f"Started, not finished: {', '.join(self.started)}.")
        if self.not_started:
            seeds: dict[str, list[int]] = {}
            for variant, seed in self.not_started:
                seeds.setdefault(variant, []).append(seed)
            listed = [
                f"{variant}: {'seed' if len(s) == 1 else 'seeds'} {', '.join(str(x) for x in sorted(s))}"
                for variant, s in seeds.items()
            ]
            parts.append(f"Not started: {'; '.join(listed)}.")
        return " ".join(parts)


def unfinished_runs(study_dir: Path) -> Unfinished:
    """The study folder's run folders without ``summary.json`` and the study file's runs without a folder."""
    study_dir = Path(study_dir)
    planned = planned_runs(study_record(study_dir))
    label = {run_folder_name(v, s): f"{v} seed {s}" for v, s in planned}
    runs_dir = study_dir / "runs"
    folders = sorted(p.name for p in runs_dir.glob("*") if p.is_dir()) if runs_dir.is_dir() else []
    finished = {name for name in folders if (runs_dir / name / "summary.json").is_file()}
    started = [label.get(name, name) for name in folders if name not in finished]
    not_started = [(v, s) for v, s in planned if run_folder_name(v, s) not in folders]
    without_result = sum(run_folder_name(v, s) not in finished for v, s in planned)
    variants = list(dict.fromkeys(v for v, _ in planned))
    not_started.sort(key=lambda run: (variants.index(run[0]), run[1]))  # by variant, as the report's rows
    return Unfinished(len(planned), without_result, started, not_started)


def report_study(study_dir: Path, command: str = "") -> Path:
    """``fedssl-study report``: the report of a study folder (every finished run; the runs without a result named)."""
    study_dir = Path(study_dir)
    runs, order = study_runs(study_dir)
    record = study_record(study_dir)
    return write_report(
        study_dir,
        runs,
        order,
        title=f"Study {record.get('study', study_dir.name)}",
        command=[command] if command else study_commands(record),
        unfinished=unfinished_runs(study_dir),
    )


def report_runs(folders: list[Path], out_dir: Path, command: str = "") -> Path:
    """``fedssl-report RUN_DIR...``: the report of any set of finished runs."""
    runs = []
    for folder in folders:
        run = read_run(folder)
        if run is None:
            raise FileNotFoundError(f"{folder}: no summary.json (not a finished run folder)")
        runs.append(run)
    runs, order = group_runs(runs)
    return write_report(out_dir, runs, order, title="Runs compared", command=command)
