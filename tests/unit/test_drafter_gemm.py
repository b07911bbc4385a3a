# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu/drafter_gemm.py: the GEMMs of one draft step, from a drafter config."""

import importlib.util
import json
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "gpu" / "drafter_gemm.py"
_spec = importlib.util.spec_from_file_location("drafter_gemm", _PATH)
drafter_gemm = importlib.util.module_from_spec(_spec)
sys.modules["drafter_gemm"] = drafter_gemm  # its dataclass looks its module up
_spec.loader.exec_module(drafter_gemm)


def test_27b_drafter_step_reads_its_weights_once():
    config = json.loads(drafter_gemm.DEFAULT_CONFIG.read_text())
    gemms = drafter_gemm.step_gemms(config, requests=1, tau=6.35)
    by_name = {g.name: g for g in gemms}
    assert len(gemms) == 1 + 5 * 5 + 1
    # fc: 5 target layers' hidden states of the 6 new context tokens
    assert (by_name["fc"].m, by_name["fc"].k, by_name["fc"].n) == (6, 5 * 5120, 5120)
    # the block's 16 query positions through every layer; 15 draft positions' logits
    assert by_name["layer4.gate_up"].m == 16
    assert (by_name["layer0.qkv"].k, by_name["layer0.qkv"].n) == (5120, (32 + 16) * 128)
    assert (by_name["lm_head"].m, by_name["lm_head"].n) == (15, 248320)
    # docs/performance.md: 6.0 GB a step (5 layers 3.2, fc 0.26, LM head 2.54), plus
    # the context K/V read of the K/V slices of qkv again (0.1 GB)
    total = sum(g.weight_bytes_bf16 for g in gemms) / 1e9
    assert total == pytest.approx(6.0 + 0.1, abs=0.06)
    assert by_name["lm_head"].weight_bytes_bf16 / 1e9 == pytest.approx(2.54, abs=0.01)


def test_batch_scales_tokens_not_weights():
    config = json.loads(drafter_gemm.DEFAULT_CONFIG.read_text())
    one = drafter_gemm.step_gemms(config, requests=1, tau=3.5)
    four = drafter_gemm.step_gemms(config, requests=4, tau=3.5)
    assert [g.m for g in four] == [14] + [14, 64, 64, 64, 64] * 5 + [60]
    assert [g.m for g in one][0] == 4  # round(3.5) context tokens
    assert [(g.k, g.n) for g in one] == [(g.k, g.n) for g in four]
