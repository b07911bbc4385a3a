# SPDX-License-Identifier: Apache-2.0
"""GPU checks (``pytest -m gpu`` on a CUDA host with vLLM 0.20.1 + this plugin).

Runs benchmarks/gpu/gpu_check.py once (every run the GPUs here allow, or only the
runs named in ``GPU_CHECK_RUNS=a,b``) and asserts each kind of check it made; the
judging itself is ``gpu_check.evaluate``. Skipped without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _wanted_runs() -> list[str]:
    """Run names from GPU_CHECK_RUNS=a,b (empty: every run the GPUs allow)."""
    return [n for n in os.environ.get("GPU_CHECK_RUNS", "").split(",") if n]


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> list[dict]:
    if _gpus() == 0:
        pytest.skip("needs an NVIDIA GPU")
    from benchmarks.gpu.gpu_check import RUNS

    # A fresh folder: never an earlier run's report. GPU_CHECK_OUT keeps the run
    # logs where a caller collects them (benchmarks/gpu/device_run.sh).
    out = Path(os.environ.get("GPU_CHECK_OUT") or tmp_path_factory.mktemp("gpu_check"))
    if out.exists() and any(out.iterdir()):
        raise AssertionError(f"GPU_CHECK_OUT={out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    wanted = _wanted_runs()
    unknown = sorted(set(wanted) - {r.name for r in RUNS})
    assert not unknown, f"GPU_CHECK_RUNS names unknown runs: {unknown}"
    runs = [
        r.name for r in RUNS if r.tp <= _gpus() and (not wanted or r.name in wanted)
    ]
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/gpu_check.py"), "--out", str(out),
           "--budget", "2100", "--models", str(out / "models"), "--runs", ",".join(runs)]  # fmt: skip
    rc = subprocess.run(cmd, timeout=2400).returncode
    # 0: every check passed; 1: some failed (asserted per kind below); else it crashed
    assert rc in (0, 1), f"gpu_check.py crashed (exit status {rc})"
    report = out / "gpu_check.json"
    assert report.exists(), "gpu_check.py wrote no report"
    return json.loads(report.read_text())["checks"]


@pytest.mark.parametrize(
    "kind", ["starts", "backend", "lossless", "drafts", "kv_window", "stock_defect"]
)
def test_gpu_check(checks, kind):
    mine = [c for c in checks if c["check"] == kind]
    if not mine and _wanted_runs():
        pytest.skip(f"no {kind} check among GPU_CHECK_RUNS")
    assert mine, f"no {kind} check ran"
    failed = [f"{c['run']}: {c['detail']}" for c in mine if not c["ok"]]
    assert not failed, failed
