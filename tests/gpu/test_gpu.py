# SPDX-License-Identifier: Apache-2.0
"""GPU checks (``pytest -m gpu`` on a CUDA host with vLLM 0.20.1 + this plugin).

Runs benchmarks/gpu/gpu_check.py and asserts on its JSON. Skipped without a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if not _has_cuda():
        pytest.skip("needs an NVIDIA GPU")
    out = tmp_path_factory.mktemp("gpu")
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/gpu_check.py"), "--out", str(out), "--budget", "1500",
         "--models", str(out / "models")],
        check=True, timeout=1800,
    )  # fmt: skip
    return json.loads((out / "gpu_check.json").read_text())["runs"]


@pytest.mark.parametrize(
    "run", ["dense-eager", "swa-eager", "dense-graph", "swa-graph"]
)
def test_plugin_runs_use_flash_attention_and_match_reference(report, run):
    r = report[run]
    assert r["rc"] == 0 and "FLASH_ATTN" in r["backends"]
    assert r["drafts_vs_reference"]["drafts"] >= 200
    assert r["drafts_vs_reference"]["match_rate_excusing_near_ties"] >= 0.95


@pytest.mark.parametrize("run", ["dense-eager", "swa-eager"])
def test_eager_lossless(report, run):
    for bs, res in report[run]["lossless"].items():
        n = {"1": 1, "8": 8, "32": 32}[bs]
        assert res["identical_sequences"] == f"{n}/{n}", (bs, res)


@pytest.mark.parametrize(
    "stock, plugin",
    [("dense-eager-stock40727", "dense-eager"), ("swa-eager-stock40898", "swa-eager")],
)
def test_stock_vllm_shows_the_defect(report, stock, plugin):
    bad = report[stock]["drafts_vs_reference"]["match_rate_excusing_near_ties"]
    good = report[plugin]["drafts_vs_reference"]["match_rate_excusing_near_ties"]
    assert bad <= good - 0.3
