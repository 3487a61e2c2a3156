"""The GPU campaign's pieces that need no run: the plan's checks, the time plan's arithmetic, the bundle's choice of
wheels, publishing (tests/test_campaign_cpu.py runs the whole campaign)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from conftest import REPO
from fedssl_gpu import bundle, campaign
from fedssl_gpu.timeplan import Assumptions, run_estimate

ASSUMED = {
    "train_tflops": 1.0,
    "fp32_tflops": 0.5,
    "run_start_s": 10,
    "round_overhead_s": 3,
    "pytest_s": 5,
    "throughput_overhead_s": 1,
    "compile_s": 20,
    "train_images": 1000,
    "test_images": 100,
}


def write_plan(tmp_path: Path, **changes) -> Path:
    raw = {
        "campaign": "t",
        "device": "cpu",
        "assumed": dict(ASSUMED),
        "stages": {"correctness": {"smoke": ["configs/smoke.yaml"], "set": {"rounds": 1}}},
    }
    raw.update(changes)
    import yaml

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_shipped_plans_load_and_the_time_plan_lists_every_item():
    for name in ("gpu", "cpu-tiny"):
        plan = campaign.Plan.load(REPO / "fedssl_gpu" / "plans" / f"{name}.yaml")
        assert plan.stages == campaign.STAGES
    gpu = campaign.Plan.load(REPO / "fedssl_gpu" / "plans" / "gpu.yaml")
    written = campaign.timeplan_file(gpu.path).read_text()
    for f in gpu.smoke:
        assert f"| correctness | {f.name} |" in written
    for study in gpu.study_objects():
        assert f"| paper-shape | {study.name} |" in written, "rewrite it: fedssl-campaign plan ... --write"
    for key, value in gpu.assumed.__dict__.items():
        assert f"| `{key}` | {value:g} |" in written


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"device": "tpu"}, "device 'tpu'"),
        ({"stages": {"warmup": {}}}, "unknown stage(s) warmup"),
        ({"stages": {"correctness": {"smoke": ["configs/nope.yaml"]}}}, "configs/nope.yaml: no such file"),
        ({"stages": {"correctness": {"smok": []}}}, "stages.correctness: unknown key(s) smok"),
        ({"stages": {"throughput": {"compile": "yes"}}}, "stages.throughput.compile"),
        (
            {"stages": {"correctness": {"smoke": ["configs/smoke.yaml"], "set": {"train.optimiser": "sgd"}}}},
            "smoke config smoke.yaml",
        ),
        ({"assumed": {**ASSUMED, "train_tflops": 0}}, "assumed.train_tflops: expected a positive number"),
        ({"assumed": {k: v for k, v in ASSUMED.items() if k != "pytest_s"}}, "missing key(s) pytest_s"),
        ({"colour": 1}, "unknown key(s) colour"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_key(tmp_path, changes, named):
    with pytest.raises(campaign.CampaignError) as err:
        campaign.Plan.load(write_plan(tmp_path, **changes))
    assert named in str(err.value)


def test_a_run_estimate_counts_the_images_of_the_config_and_the_fixed_costs():
    from fedssl_study.spec import validate_experiment
    from ssl_models.config import load_config_tree, merge_config

    tree = merge_config(
        load_config_tree(REPO / "configs" / "smoke.yaml"),
        {"rounds": 3, "eval.knn_every": 1, "eval.max_train": 300, "eval.max_test": 50},
    )
    cfg = validate_experiment(tree)
    a = Assumptions.from_mapping(ASSUMED)
    est = run_estimate(cfg, a)
    # smoke.yaml: 400 training images over 2 clients, 1 local epoch; 3 rounds, every client every round
    assert est["images_trained"] == 3 * 1 * 2 * 200
    assert est["evaluated_images"] == (3 + 2) * (300 + 50)  # 3 kNN monitors, the final scores, the random init
    assert 0 < est["forward_flops_per_image"] < est["train_flops_per_image"]
    assert est["flops"] == pytest.approx(
        est["images_trained"] * est["train_flops_per_image"] + est["evaluated_images"] * est["forward_flops_per_image"]
    )
    assert est["seconds"] == pytest.approx(est["flops"] / 1e12 + 10 + 3 * 3)
    central = validate_experiment(merge_config(tree, {"strategy": {"_replace": True, "name": "central"}}))
    assert run_estimate(central, a)["images_trained"] == 3 * 400  # the union of the clients' images
    orchestra = merge_config(load_config_tree(REPO / "configs" / "smoke-orchestra.yaml"), {"rounds": 3})
    # Orchestra's round 1 only seeds the centroids: 2 of the 3 rounds train (400 images over 2 clients).
    assert run_estimate(validate_experiment(orchestra), a)["images_trained"] == 2 * 1 * 2 * 200
    no_seeding = merge_config(orchestra, {"strategy.options.seed_round": False})
    assert run_estimate(validate_experiment(no_seeding), a)["images_trained"] == 3 * 1 * 2 * 200


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_the_bundle_carries_what_the_target_lacks_and_nothing_more(tmp_path):
    wheels = [
        bundle.read_wheel(fake_wheel(tmp_path, *w))
        for w in [
            (
                "flwr",
                "1.41.0",
                [
                    "numpy>=1.26",
                    "grpcio>=1.70",
                    "typer>=0.12",
                    "uv>=0.12",
                    "tomli>=2; python_version < '3.11'",
                    "ray==2.55.1; extra == 'simulation'",
                ],
            ),
            ("typer", "0.20.1", ["click>=8"]),
            ("click", "8.5.1", []),
            ("numpy", "2.5.5", []),
            ("grpcio", "1.85.3", []),
            ("uv", "0.12.24", []),
            ("tomli", "2.5.0", []),
            ("ray", "2.55.1", []),
        ]
    ]
    have = bundle.read_have(_have(tmp_path, "numpy\ngrpcio==1.60.0  # too old for flwr\n# a comment\nClick==8.1.0\n"))
    assert have == {"numpy": None, "grpcio": "1.60.0", "click": "8.1.0"}
    chosen, notes = bundle.select_wheels(wheels, ["flwr==1.41.0"], have, "3.12")
    assert [w.name for w in chosen] == ["flwr", "grpcio", "typer"]  # numpy and click are there; no uv, ray, tomli
    assert any(n.startswith("grpcio: the target has 1.60.0") for n in notes)
    assert any(n.startswith("uv: left out") for n in notes)
    chosen, _ = bundle.select_wheels(wheels, ["flwr==1.41.0"], have, "3.10")
    assert "tomli" in [w.name for w in chosen]  # a marker is evaluated for the target's Python, not this one's
    with pytest.raises(bundle.BundleError, match="no wheel for missing"):
        bundle.select_wheels(
            wheels + [bundle.read_wheel(fake_wheel(tmp_path, "x", "1", ["missing"]))], ["x"], {}, "3.12"
        )
    with pytest.raises(bundle.BundleError, match="cannot read"):
        bundle.read_have(_have(tmp_path, "numpy>=2\n"))


def _have(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "have.txt"
    path.write_text(text)
    return path


def test_a_part_over_the_limit_is_named(tmp_path):
    out = tmp_path / "b"
    for i, size in ((1, 3000), (2, 5000)):
        (out / f"part-{i}").mkdir(parents=True)
        (out / f"part-{i}" / "data.bin").write_bytes(b"x" * size)
    (out / "part-1" / bundle.APP_ARCHIVE).write_bytes(b"c" * 1000)
    rows, table = bundle.part_table(out, code_bytes=1000, limit_bytes=5500)
    assert [(r["part"], r["bytes_with_code"], r["over_limit"]) for r in rows] == [
        ("part-1", 4000, False),
        ("part-2", 6000, True),
    ]  # a later part travels with the code beside it
    assert "part-2" in table.splitlines()[2] and "OVER THE LIMIT" in table.splitlines()[2]


def test_publish_writes_a_gpu_campaign_and_refuses_a_cpu_one(tmp_path):
    out = tmp_path / "c"
    (out / "throughput").mkdir(parents=True)
    state = {
        "plan": "fedssl_gpu/plans/gpu.yaml",
        "calls": [{"command": "fedssl-campaign run x", "started": "then"}],
        "device": {"requested": "cuda", "name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"},
        "install": {"flwr": "1.41.0"},
        "stages": {
            "correctness": {
                "status": "done",
                "results": {
                    "pytest": {"passed": 8, "failed": 0, "errors": 0, "skipped": 0},
                    "smoke.yaml": {"ok": True, "devices": ["cuda:0 (NVIDIA H100 80GB HBM3)"], "seconds": 20.5},
                },
            }
        },
    }
    (out / campaign.STATE_FILE).write_text(json.dumps(state))
    (out / "throughput" / "throughput.md").write_text("# Throughput\n| method | img/s |\n")
    dest = campaign.publish(out, tmp_path / "gpu.md")
    text = dest.read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "`fedssl-campaign run x`" in text
    assert "| CUDA tests | 8 passed, 0 failed, 0 errors, 0 skipped |" in text
    assert "| smoke.yaml deployed on loopback | ok, clients on cuda:0 (NVIDIA H100 80GB HBM3) | 20.5 |" in text
    assert "# Throughput" in text
    state["device"]["requested"] = "cpu"
    (out / campaign.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(campaign.CampaignError, match="not cuda"):
        campaign.publish(out, tmp_path / "gpu.md")


def test_run_config_quotes_strings_only():
    assert (
        campaign._run_config({"config": "configs/smoke.yaml", "rounds": 2, "eval.linear_probe": False, "train.lr": 0.5})
        == "config='configs/smoke.yaml' rounds=2 eval.linear_probe=false train.lr=0.5"
    )
