"""Run one experiment config as a real `flwr run .` simulation from a benchmark script."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from flwr_harness import flwr_run, read_jsonl  # noqa: E402


def run_experiment(raw: dict, timeout_s: float = 3600, keep_dir: Path | None = None) -> dict:
    """Write ``raw`` as a YAML config, run it on a federation of ``federation.num_clients`` SuperNodes, and
    return {"summary", "rounds", "run_s"}; a failed run raises with the tail of its output. With ``keep_dir``
    the run's folder (config, ``out/`` with its saved models) is kept there instead of a temporary one."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(keep_dir) if keep_dir is not None else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
        t0 = time.perf_counter()
        proc = flwr_run(f"config='{tmp / 'cfg.yaml'}' output-dir='{tmp / 'out'}'", tmp / "flwr",
                        federation_config=f"num-supernodes={raw['federation']['num_clients']}", timeout_s=timeout_s)
        summary_path = tmp / "out" / "summary.json"
        if not summary_path.is_file():
            raise RuntimeError(f"{raw.get('name')} failed:\n" + (proc.stdout + proc.stderr)[-3000:])
        return {"summary": json.loads(summary_path.read_text()), "rounds": read_jsonl(tmp / "out" / "metrics.jsonl"),
                "run_s": time.perf_counter() - t0}
