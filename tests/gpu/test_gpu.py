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


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if not _has_cuda():
        pytest.skip("needs an NVIDIA GPU")
    out = tmp_path_factory.mktemp("gpu")
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/gpu_check.py"), "--out", str(out),
           "--budget", "2100", "--models", str(out / "models")]  # fmt: skip
    if _gpus() < 2:  # the tensor-parallel runs need two GPUs
        from benchmarks.gpu.gpu_check import RUNS

        cmd += ["--runs", ",".join(r[0] for r in RUNS if r[4] == 1)]
    subprocess.run(cmd, check=True, timeout=2400)
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


def _near_tie_lossless(report, run: str, max_divergent: int) -> None:
    for bs, res in report[run]["lossless"].items():
        same, n = (int(x) for x in res["identical_sequences"].split("/"))
        assert n - same <= max_divergent, (run, bs, res)


def test_tp2_starts_and_matches_reference(report):
    """TP=2 (needs 2 GPUs): stock vLLM 0.20.1 cannot start DFlash here
    (custom all-reduce replay during graph capture); the plugin can."""
    if _gpus() < 2:
        pytest.skip("needs two GPUs")
    assert report["dense-graph-tp2-noplugin"]["rc"] != 0  # documents the stock defect
    for run in ("dense-graph-tp2", "swa-graph-tp2"):
        r = report[run]
        assert r["rc"] == 0, run
        assert r["drafts_vs_reference"]["match_rate_excusing_near_ties"] >= 0.95
        # bf16 near-tie flips only (measured: <= 5 of 41; see benchmarks/results).
        _near_tie_lossless(report, run, max_divergent=6)
