"""The GPU campaign's throughput stage (fedssl_gpu/throughput.py) at tiny scale on the CPU: it measures every method in
plain fp32 and on the fast path, and its files hold figures that agree with each other. The figures themselves mean
nothing here (a shared 2-core machine); the GPU lease measures the real ones."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedssl_gpu.throughput import (
    PAPER_CONFIGS,
    PROFILED_STEPS,
    dense_bf16_peak,
    estimate_flops,
    run_throughput,
    timed_steps,
)

STEPS = 2


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    lines: list[str] = []
    # One torch thread (tests/conftest.py): the figures are not what is tested here.
    record = run_throughput(out, device="cpu", scale="tiny", compile=False, steps=STEPS, log=lines.append)
    return out, record, lines


def test_the_stage_writes_its_files_and_says_what_it_ran(stage):
    out, record, lines = stage
    assert record["ok"] is True
    assert json.loads((out / "throughput.json").read_text()) == json.loads(json.dumps(record, default=str))
    settings = record["settings"]
    assert settings["scale"] == "tiny" and settings["steps"] == STEPS and settings["warmup_steps"] == STEPS
    assert settings["configurations"] == ["fp32", "fast"] and settings["compile"] is False
    assert settings["command"].startswith("python3 -m fedssl_gpu.throughput --device cpu --scale tiny")
    assert record["device"]["type"] == "cpu" and record["device"]["torch"] == torch.__version__
    assert record["device"]["bf16_peak"] is None  # no tabulated peak for a CPU: no MFU
    markdown = (out / "throughput.md").read_text()
    assert markdown.startswith("# Throughput of local SSL training: ") and "tiny scale" in markdown.splitlines()[0]
    for entry in record["methods"].values():
        assert f"## {entry['label']}: {entry['model']}" in markdown
    assert any("wrote" in line for line in lines)


def test_every_method_is_measured_in_fp32_and_on_the_fast_path(stage):
    _, record, _ = stage
    assert list(record["methods"]) == list(PAPER_CONFIGS)
    matmul = record["matmul"]["flops_per_s"]
    assert matmul > 0 and record["matmul"]["dtype"] in ("float32", "bfloat16")
    for name, entry in record["methods"].items():
        assert entry["batch"] == 16 and entry["config"] == PAPER_CONFIGS[name]
        assert entry["flops_per_step"] == pytest.approx(entry["flops_per_image"] * entry["batch"])
        assert set(entry["runs"]) == {"fp32", "fast"}
        fp32, fast = entry["runs"]["fp32"], entry["runs"]["fast"]
        assert fp32["precision"] == "fp32" and not fp32["channels_last"] and fast["channels_last"]
        for run in (fp32, fast):
            assert "error" not in run, run.get("error")
            assert run["steps_run"] == 2 * STEPS + PROFILED_STEPS and math.isfinite(run["loss"])
            assert run["images_per_s"] > 0
            assert run["images_per_s"] == pytest.approx(STEPS * entry["batch"] / run["timed_s"])
            assert run["flops_per_s"] == pytest.approx(entry["flops_per_step"] * STEPS / run["timed_s"])
            assert run["mfu_pct"] is None or 0 < run["mfu_pct"] <= 100
            assert run["matmul_util_pct"] == pytest.approx(100 * run["flops_per_s"] / matmul)
            assert run["peak_rss_bytes"] > 0
        assert entry["fast_over_fp32"] == pytest.approx(fast["images_per_s"] / fp32["images_per_s"])
        assert entry["fastest"] == max(("fp32", "fast"), key=lambda c: entry["runs"][c]["images_per_s"])


def test_the_fastest_configuration_has_its_top_operators(stage):
    _, record, _ = stage
    for entry in record["methods"].values():
        profile = entry["profile"]
        assert profile["configuration"] == entry["fastest"] and profile["time"] == "self CPU time"
        operators = profile["operators"]
        assert 0 < len(operators) <= 15 and all(op["ms_per_step"] > 0 for op in operators)
        assert [op["ms_per_step"] for op in operators] == sorted((op["ms_per_step"] for op in operators), reverse=True)
        assert sum(op["share_pct"] for op in operators) <= 100 + 1e-6
        # a training step's heavy work: the encoder's convolutions or the ViT's attention and matrix products
        assert any(k in op["operator"] for op in operators[:5] for k in ("convolution", "attention", "mm"))


def test_the_time_plan_counts_the_same_work_the_stage_measures(stage):
    _, record, _ = stage
    flops = estimate_flops("tiny")
    assert flops == {name: entry["flops_per_step"] for name, entry in record["methods"].items()}
    assert timed_steps("tiny") >= 1 and timed_steps("paper") >= timed_steps("tiny")


def test_known_gpus_get_their_dense_bf16_peak():
    assert dense_bf16_peak("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989.4e12)
    assert dense_bf16_peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756e12)
    assert dense_bf16_peak("NVIDIA H200") == ("H200", 989.4e12)
    assert dense_bf16_peak("NVIDIA A100-SXM4-80GB") == ("A100", 312e12)
    assert dense_bf16_peak("NVIDIA GeForce RTX 4090") is None
