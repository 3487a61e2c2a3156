"""The documentation: the site builds with warnings as errors (broken links, missing pages, an included results file
that is gone), the configuration reference is what the code generates (a field or option added without a comment
fails), the README stays short and its figures come from the results files, no file cites the developers' paper
digest."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_docs_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists() and shutil.which("mkdocs") is None:
        pytest.fail("mkdocs is not installed: `pip install -e '.[test]'` installs it")
    proc = subprocess.run(
        [str(mkdocs) if mkdocs.exists() else "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "methods" / "heterossfl" / "index.html").is_file()


def test_the_configuration_reference_is_generated_from_the_code():
    gen = load_script(REPO / "docs" / "gen_reference.py")
    assert (REPO / "docs" / "reference" / "configuration.md").read_text() == gen.generate(), (
        "docs/reference/configuration.md is stale: run python docs/gen_reference.py"
    )


def test_a_field_without_a_comment_fails_the_reference(monkeypatch):
    import dataclasses

    from ssl_models import config

    gen = load_script(REPO / "docs" / "gen_reference.py")

    @dataclasses.dataclass
    class Probe:
        documented: int = 1  # a documented field
        undocumented: int = 2

    with pytest.raises(gen.Undocumented, match=r"probe\.undocumented"):
        missing: list[str] = []
        gen.config_rows(Probe, "probe.", missing)
        if missing:
            raise gen.Undocumented("no comment documents: " + ", ".join(missing))
    assert config  # the real config is documented: test_the_configuration_reference_is_generated_from_the_code


def test_the_readme_is_short_and_its_results_block_is_generated():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    gen = load_script(REPO / "docs" / "gen_results.py")
    assert gen.readme_with_results(readme) == readme, (
        "README.md's results block is stale: run python docs/gen_results.py"
    )
    assert gen.STUDIES_PAGE.read_text() == gen.studies_page(), (
        "benchmarks/results/cpu_studies.md is stale: run python docs/gen_results.py"
    )


def test_figures_in_flowing_text_come_from_their_results_files():
    gen = load_script(REPO / "docs" / "gen_results.py")
    for page in gen.FIGURE_PAGES:
        text = page.read_text()
        assert "<!-- fig:" in text, page.name
        assert gen.page_with_figures(text) == text, f"{page.name}: a figure is stale: run python docs/gen_results.py"
    startup = json.loads(gen.STARTUP_RESULTS.read_text())["single_run"]
    sample = "a run takes <!-- fig:startup.single -->1 s<!-- /fig --> to start"
    assert gen.page_with_figures(sample) == (
        f"a run takes <!-- fig:startup.single -->{startup['min_s']:.0f}-{startup['max_s']:.0f} s<!-- /fig --> to start"
    )
    with pytest.raises(ValueError, match="figure 'startup.nothing'"):
        gen.page_with_figures("<!-- fig:startup.nothing -->1<!-- /fig -->")


def test_a_published_report_reaches_the_readme_and_the_studies_page(tmp_path, monkeypatch):
    gen = load_script(REPO / "docs" / "gen_results.py")
    study = tmp_path / "study"
    study.mkdir()
    (study / "study.yaml").write_text("study: flesd-cpu\n")
    (study / "report.csv").write_text(
        "row,kind,arch,seeds,linear_probe_mean,linear_probe_std,knn_mean,knn_std,linear_probe_gain_mean,"
        "linear_probe_gain_std\nrandom init,random init,,0 1,30.0,1.0,25.0,1.0,,\n"
        "FLESD,variant,,0 1,41.25,0.5,35.0,0.2,11.25,0.5\n"
    )
    (study / "report.md").write_text(
        "Command: `fedssl-study run x.yaml --set data.path=/some/where/c.npz --out /tmp/o --reuse /some/where/sweep/`\n"
        "<!-- --8<-- [start:scale] -->\nScale: tiny.\n<!-- --8<-- [end:scale] -->\n"
        "<!-- --8<-- [start:table] -->\n| row |\n|---|\n| FLESD |\n<!-- --8<-- [end:table] -->\n"
    )
    monkeypatch.setattr(gen, "PUBLISHED", tmp_path / "published")
    out = gen.publish(study)
    assert "data.path=c.npz --reuse sweep`" in (out / "report.md").read_text()
    assert "/some/where" not in (out / "report.md").read_text() and "/tmp" not in (out / "report.md").read_text()
    block = gen.results_block()
    assert "| FLESD | 0 1 | 41.25 ± 0.50 | +11.25 ± 0.50 |" in block
    assert "| random init | 0 1 | 30.00 ± 1.00 | 0 |" in block
    page = gen.studies_page()
    assert "Scale: tiny." in page and "| FLESD |" in page
    assert "against end-to-end FedMoCoV3**: not measured at the current version" in page


def test_a_published_study_keeps_its_runs_records_and_rewrites_the_same_report(tmp_path, monkeypatch):
    """--publish refuses a study some of whose runs have no result, naming them, unless --partial; it copies
    study.yaml and every finished run's summary.json, metrics.jsonl and run.json with no local path left in them;
    the published folder is a study folder whose report is the original one."""
    import json

    import yaml

    from fedssl_study.report import report_study
    from test_study import fake_run

    gen = load_script(REPO / "docs" / "gen_results.py")
    study = tmp_path / "study"
    for seed, lp in enumerate((0.41, 0.43)):
        fake_run(study / "runs" / f"a-seed{seed}", "A", seed, lp, 0.3, 0.33)
        summary = json.loads((study / "runs" / f"a-seed{seed}" / "summary.json").read_text())
        summary["config"]["data"]["path"] = "/some/where/cifar10.npz"
        summary["config"]["output_dir"] = str(study / "runs" / f"a-seed{seed}")
        summary["provenance"] = {"note": "code loaded from /some/where/checkout/client_app"}
        (study / "runs" / f"a-seed{seed}" / "summary.json").write_text(json.dumps(summary))
    (study / "runs" / "b-seed0").mkdir(parents=True)  # unfinished: not published
    (study / "study.yaml").write_text(
        yaml.safe_dump(
            {
                "study": "flesd-cpu",
                "file": "/some/where/checkout/configs/studies/cpu/flesd.yaml",
                "command": "fedssl-study run x.yaml --set data.path=/some/where/c.npz --out /some/where/o",
                "variants": {"A": {}, "B": {}},
                "seeds": [0, 1],
            }
        )
    )
    report_study(study)
    monkeypatch.setattr(gen, "PUBLISHED", tmp_path / "published")
    with pytest.raises(gen.UnfinishedStudy, match=r"2 of the study's 4\. Started, not finished: B seed 0\. Not "):
        gen.publish(study)
    assert gen.main(["--publish", str(study)]) == 2 and not (tmp_path / "published").exists()
    out = gen.publish(study, partial=True)
    assert "Runs without a result: 2 of the study's 4." in (out / "report.md").read_text()
    assert "flesd-cpu is published part-way: 2 of its 4 runs have no result yet" in gen.results_block()
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["a-seed0", "a-seed1"]
    for path in [out / "study.yaml", *(out / "runs").rglob("*")]:
        if path.is_file():
            assert "/some/where" not in path.read_text(), path
    record = yaml.safe_load((out / "study.yaml").read_text())
    assert record["file"] == "configs/studies/cpu/flesd.yaml"
    assert record["command"] == "fedssl-study run x.yaml --set data.path=c.npz"
    published = json.loads((out / "runs" / "a-seed1" / "summary.json").read_text())
    assert published["config"]["data"]["path"] == "cifar10.npz" and published["linear_probe_acc"] == 0.43
    original = (out / "report.csv").read_text()
    report_study(out)  # the published folder is a study folder: the same table from its records
    assert (out / "report.csv").read_text() == original


def test_nothing_cites_the_developers_paper_digest():
    digest = "papers" + ".md"  # spelled apart, so this file does not cite it either
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    citing = [f for f in files if (REPO / f).is_file() and digest in (REPO / f).read_text(errors="ignore")]
    assert citing == [], citing
