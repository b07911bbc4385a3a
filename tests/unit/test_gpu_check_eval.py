# SPDX-License-Identifier: Apache-2.0
"""The GPU check's verdicts (benchmarks/gpu/gpu_check.py ``evaluate``), on
hand-made reports: each check passes on good data and fails on the defect it
exists to catch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from benchmarks.gpu.gpu_check import BY_NAME, Fixtures, Run, evaluate, kv_window_ok

FULL = {"kv_spec": "FullAttentionSpec", "window": [-1, -1]}
SLIDING = {"kv_spec": "FullAttentionSpec", "window": [5, 0]}


def _spec_run(rate: float, exact: float, kv: dict) -> dict:
    sliding = sum(v is SLIDING for v in kv.values())
    return {"sliding_layers": sliding,
        "rc": 0, "backends": ["FLASH_ATTN"], "lossless": {"1": "1/1"}, "divergences": [],
        "drafts_vs_reference": {"drafts": 1964, "tokens": 13748, "exact_match_rate": exact,
                                "match_rate_excusing_near_ties": rate},
        "kv": copy.deepcopy(kv), "window": 6,
    }  # fmt: skip


def good_report() -> dict:
    swa_kv = {"d.0": SLIDING, "d.1": SLIDING, "d.2": FULL}
    dense_kv = {"d.0": FULL, "d.1": FULL}
    return {
        "runs": {
            "base-eager": {"rc": 0, "backends": ["FLASH_ATTN"]},
            "dense-eager": _spec_run(0.99, 0.95, dense_kv),
            "swa-eager": _spec_run(0.996, 0.96, swa_kv),
            "dense-eager-stock40727": _spec_run(0.11, 0.10, dense_kv),
            "swa-eager-stock40898": _spec_run(0.03, 0.03, dense_kv),
            "dense-eager-fp32": {**_spec_run(1.0, 0.999, dense_kv), "backends": ["FLEX_ATTENTION"]},
            "dense-graph-tp2-noplugin": {"rc": 1, "backends": [], "expected_failure_seen": True},
            "hybrid-base-eager": {"rc": 0, "backends": ["FLASH_ATTN", "GDN_ATTN"]},
            "hybrid-swa-eager": _spec_run(0.995, 0.95, swa_kv),
            "hybrid-swa-eager-stock40727": _spec_run(0.45, 0.44, swa_kv),
            "hybrid-swa-eager-stock40898": _spec_run(0.02, 0.02, dense_kv),
        }
    }  # fmt: skip


def failed(report: dict) -> set[tuple[str, str]]:
    return {(c["check"], c["run"]) for c in evaluate(report) if not c["ok"]}


def test_good_report_passes_every_check():
    checks = evaluate(good_report())
    assert not failed(good_report())
    kinds = {c["check"] for c in checks}
    assert kinds == {
        "starts",
        "backend",
        "lossless",
        "drafts",
        "kv_window",
        "stock_defect",
    }


@pytest.mark.parametrize(
    "edit, expect",
    [
        # A divergence far from a near-tie is a speculative-decoding error.
        (lambda r: r["runs"]["swa-eager"]["divergences"].append({"gap_rel_range": 0.2}),
         ("lossless", "swa-eager")),
        # Drafts that drift from the reference.
        (lambda r: r["runs"]["dense-eager"]["drafts_vs_reference"].update(match_rate_excusing_near_ties=0.8),
         ("drafts", "dense-eager")),
        # fp32 is held to exact matches, not near-tie excuses.
        (lambda r: r["runs"]["dense-eager-fp32"]["drafts_vs_reference"].update(exact_match_rate=0.9),
         ("drafts", "dense-eager-fp32")),
        # Disabling the backport makes no difference: the check cannot see the defect.
        (lambda r: r["runs"]["swa-eager-stock40898"]["drafts_vs_reference"].update(match_rate_excusing_near_ties=0.95),
         ("stock_defect", "swa-eager-stock40898")),
        # Sliding layers planned as SlidingWindowSpec (precomputed context KV recycled).
        (lambda r: r["runs"]["swa-eager"]["kv"]["d.0"].update(kv_spec="SlidingWindowSpec"),
         ("kv_window", "swa-eager")),
        # The window silently not applied.
        (lambda r: r["runs"]["swa-eager"]["kv"]["d.1"].update(window=[-1, -1]),
         ("kv_window", "swa-eager")),
        (lambda r: r["runs"]["dense-eager"].update(backends=["TRITON_ATTN"]),
         ("backend", "dense-eager")),
        (lambda r: r["runs"]["dense-eager"].update(rc=1), ("starts", "dense-eager")),
        # The documented stock failure no longer happens: say so.
        (lambda r: r["runs"]["dense-graph-tp2-noplugin"].update(rc=0),
         ("starts", "dense-graph-tp2-noplugin")),
        (lambda r: r["runs"]["base-eager"].update(skipped="time budget", rc=None),
         ("starts", "base-eager")),
        # The stock run failed, but not with the documented crash (e.g. an import error).
        (lambda r: r["runs"]["dense-graph-tp2-noplugin"].update(expected_failure_seen=False),
         ("starts", "dense-graph-tp2-noplugin")),
        # A drafter with three sliding layers of which only two got the window.
        (lambda r: r["runs"]["swa-eager"].update(sliding_layers=3), ("kv_window", "swa-eager")),
        # Hybrid runs are judged against their own base and counterpart.
        (lambda r: r["runs"]["hybrid-swa-eager"]["divergences"].append({"gap_rel_range": 0.2}),
         ("lossless", "hybrid-swa-eager")),
        (lambda r: r["runs"]["hybrid-swa-eager-stock40727"]["drafts_vs_reference"].update(match_rate_excusing_near_ties=0.9),
         ("stock_defect", "hybrid-swa-eager-stock40727")),
        (lambda r: r["runs"]["hybrid-swa-eager"]["kv"]["d.2"].update(kv_spec="MambaSpec"),
         ("kv_window", "hybrid-swa-eager")),
    ],
)  # fmt: skip
def test_each_defect_fails_its_check(edit, expect):
    report = copy.deepcopy(good_report())
    edit(report)
    assert failed(report) == {expect}


def test_runs_pair_with_their_base_and_counterpart():
    assert BY_NAME["swa-graph-tp2"].base == "base-graph-tp2"
    assert BY_NAME["dense-eager-fp32"].base == "base-eager-fp32"
    assert BY_NAME["swa-eager-stock40898"].plugin_counterpart == "swa-eager"
    assert BY_NAME["dense-graph-tp2-noplugin"].plugin_counterpart is None
    assert kv_window_ok(Run("x", "dense"), {}, None)[0] is False  # no report: no pass


def test_hybrid_runs_use_the_hybrid_pair():
    hybrid = [r for r in BY_NAME.values() if r.fixtures == "hybrid"]
    assert {r.name for r in hybrid} >= {"hybrid-base-eager", "hybrid-swa-eager",
        "hybrid-swa-eager-stock40727", "hybrid-swa-eager-stock40898",
        "hybrid-base-graph", "hybrid-swa-graph"}  # fmt: skip
    for r in hybrid:
        assert r.base in BY_NAME and BY_NAME[r.base].fixtures == "hybrid"
        if r.plugin_counterpart:
            assert BY_NAME[r.plugin_counterpart].fixtures == "hybrid"
    assert BY_NAME["hybrid-swa-graph"].base == "hybrid-base-graph"
    assert (
        BY_NAME["hybrid-swa-eager-stock40898"].plugin_counterpart == "hybrid-swa-eager"
    )

    class Pair:  # stand-ins for TinyModels / TinyHybrid
        def __init__(self, **kw):
            self.__dict__.update(kw)

    fx = Fixtures(
        dense=Pair(target=Path("d/t"), dense=Path("d/dense"), swa=Path("d/swa")),
        hybrid=Pair(target=Path("h/t"), drafter=Path("h/drafter")),
    )
    assert fx.target(BY_NAME["hybrid-swa-eager"]) == Path("h/t")
    assert fx.drafter(BY_NAME["hybrid-swa-eager"]) == Path("h/drafter")
    assert fx.drafter(BY_NAME["swa-eager"]) == Path("d/swa")
    assert fx.target(BY_NAME["base-eager"]) == Path("d/t")


def test_gpu_hybrid_fixture_fits_the_cuda_kernels():
    """Head sizes the CUDA kernels take (FlashAttention: multiple of 8, <= 256; FLA
    GDN kernels: K <= 256), the M-RoPE sections cover the rotary half, the drafter's
    KV bytes per token equal the target attention's, prompts avoid vision tokens."""
    from benchmarks.gpu.run_llm import prompts
    from vllm_dflash.testing.tiny_hybrid import (
        GPU_HYBRID as H,
    )
    from vllm_dflash.testing.tiny_hybrid import (
        GPU_HYBRID_DRAFTER as D,
    )
    from vllm_dflash.testing.tiny_hybrid import (
        IMAGE_ID,
        hybrid_config,
    )

    for hd in (H.head_dim, D.head_dim, H.vision_hidden // H.vision_heads):
        assert hd % 8 == 0 and hd <= 256, hd
    assert H.linear_key_head_dim <= 256 and H.linear_value_head_dim <= 256
    text = hybrid_config(H)["text_config"]
    rotary = int(H.head_dim * text["rope_parameters"]["partial_rotary_factor"])
    assert sum(H.mrope_section) == rotary // 2
    assert D.num_kv_heads * D.head_dim == H.num_kv_heads * H.head_dim
    assert max(t for p in prompts(32) for t in p) < IMAGE_ID
    assert min(t for p in prompts(32) for t in p) >= 4


def test_a_pair_that_cannot_be_built_skips_only_its_runs(monkeypatch, tmp_path):
    """E.g. a transformers without Qwen3.5 on the GPU host: the hybrid runs are
    reported as skipped (a failed ``starts``), the dense runs still run."""
    import vllm_dflash.testing.tiny_hybrid as tiny_hybrid
    from benchmarks.gpu.gpu_check import build_fixtures

    def missing(root):
        raise ImportError("cannot import name 'Qwen3_5Config'")

    monkeypatch.setattr(tiny_hybrid, "ensure_gpu_tiny_hybrid", missing)
    fx, errors = build_fixtures(tmp_path, [BY_NAME["hybrid-swa-eager"]])
    assert fx.hybrid is None and set(errors) == {"hybrid"}
    assert "Qwen3_5Config" in errors["hybrid"]
    report = {"runs": {"hybrid-swa-eager": {"rc": None, "skipped": errors["hybrid"]}}}
    assert failed(report) == {("starts", "hybrid-swa-eager")}
