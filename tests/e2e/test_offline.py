# SPDX-License-Identifier: Apache-2.0
"""End to end on vLLM's CPU backend through ``vllm.LLM``: real engine processes.

Every run is greedy; drafts are traced with VLLM_DFLASH_TRACE and replayed on
the float64 reference (tests/helpers/reference.py).
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import needed_here
from tests.helpers.equivalence import compare
from tests.helpers.patch_log import applied_by_process
from tests.helpers.reference import Reference

pytestmark = pytest.mark.cpu_e2e

# Chunked prefill: prompts are up to 40 tokens (8 of them, 180 tokens). 8 seqs x
# (1 + k=4) query tokens fit 40, so the DFlash step budget is all 40 tokens
# (dflash_full_step_budget; vLLM alone reserves 8 x 4 drafting slots: 8 tokens).
CHUNKED = 40
VLLM_BUDGET = CHUNKED - 8 * 4
MIN_DRAFTS = 200
CPU_PATCHES = (
    "cpu_aux_hidden_state_layers",
    "cpu_keep_dflash_weights",
    "cpu_rejection_sampler_args",
    "cpu_recovered_tokens_args",
    "cpu_dflash_input_expansion",
    "cpu_attn_kv_cache_update",
    "cpu_attn_exact_noncausal",
)


@pytest.fixture(scope="module")
def refs(tiny_models):
    return {
        "dense": Reference.load(tiny_models.target, tiny_models.dense),
        "swa": Reference.load(tiny_models.target, tiny_models.swa),
    }


@pytest.fixture(scope="module")
def baseline(offline):
    run = offline.run(None)
    assert run.ok, run.log[-4000:]
    return run


def _check(run, baseline, ref):
    assert run.ok, run.log[-4000:]
    assert run.data["outputs"] == baseline.data["outputs"], (
        "DFlash changed greedy output"
    )
    stats = compare(ref, run.data, run.trace)
    return stats


def test_patches_active_in_worker_process(offline, baseline):
    run = offline.run("dense", max_num_batched_tokens=CHUNKED)  # shared with others
    assert run.ok, run.log[-4000:]
    # register() ran in the spawned worker, not only in the parent; worker-side
    # patches were applied there when the worker imported their modules.
    applied = applied_by_process(run.log)
    workers = {k: v for k, v in applied.items() if k.startswith("VllmWorker")}
    assert workers, f"no vllm-dflash INFO line from a worker process: {applied}"
    names = next(iter(workers.values()))
    assert {"cpu_attn_exact_noncausal", "dflash_aux_layer_shift"} <= names, names
    # ...and the parent, which runs no model, never imported the model runner.
    assert "dflash_aux_layer_shift" not in applied.get("MainProcess", set())
    assert run.trace, "the trace hook (worker-side patch) wrote nothing"


def test_dflash_schedules_the_whole_step_budget(offline, baseline):
    """dflash_full_step_budget: the shared dense engine (lossless and equal to
    the reference in the tests below) got the whole 40-token budget, and its
    steps used more than vLLM's reservation would leave."""
    run = offline.run("dense", max_num_batched_tokens=CHUNKED)
    assert run.ok, run.log[-4000:]
    steps = run.data["scheduler"]
    assert steps["budget"] == CHUNKED, steps
    assert steps["max_step_tokens"] > VLLM_BUDGET, steps
    assert "DFlash step budget: 40 tokens" in run.log


@pytest.mark.parametrize(
    "drafter, prefix_caching",
    [("dense", False), ("swa", False), ("swa", True)],
    ids=["dense", "swa", "swa-prefixcache"],
)
def test_lossless_and_drafts_match_reference(
    offline, baseline, refs, drafter, prefix_caching
):
    run = offline.run(
        drafter, prefix_caching=prefix_caching, max_num_batched_tokens=CHUNKED
    )
    stats = _check(run, baseline, refs[drafter])
    assert run.data["spec_decode"]["vllm:spec_decode_num_drafts"] > 0
    assert stats.drafts >= MIN_DRAFTS, stats
    assert stats.token_rate >= 0.99, stats


# How each CPU defect shows when its patch is off: an error the engine dies
# with (regex over the run's log), or drafts that no longer match the reference.
DIVERGES = "drafts diverge"
CPU_DEFECTS = {
    "cpu_aux_hidden_state_layers": r"too many values to unpack",
    "cpu_keep_dflash_weights": r"RuntimeError: .*(shape|size|mat1 and mat2)",
    "cpu_rejection_sampler_args": r"TypeError: .*unexpected keyword argument",
    "cpu_recovered_tokens_args": r"TypeError: .*USE_FP64_GUMBEL",
    "cpu_dflash_input_expansion": r"(triton|Triton|next_power_of_2|active driver)",
    "cpu_attn_kv_cache_update": r"AttributeError: .*do_kv_cache_update",
    "cpu_attn_exact_noncausal": DIVERGES,
}


def test_cpu_defect_table_covers_every_cpu_patch():
    from vllm_dflash.catalog import PATCHES
    from vllm_dflash.registry import PatchKind

    engine_patches = {
        p.name for p in PATCHES if p.kind is PatchKind.CPU and p.name in CPU_PATCHES
    }
    assert engine_patches == set(CPU_DEFECTS)


def _defect_absent(patch: str) -> str | None:
    """Why the patch's defect cannot show here (None: it can)."""
    needed, why = needed_here(patch)
    if not needed:
        return f"{patch}: {why}"
    if patch == "cpu_keep_dflash_weights":
        from vllm_dflash.cpu.weights import repacking_active

        if not repacking_active():
            return (
                "this CPU keeps linear weights (no oneDNN/SGL repacking): defect absent"
            )
    return None


@pytest.fixture(scope="module")
def defect_runs(offline):
    """One engine per CPU patch (that patch off), two engines at a time."""
    wanted = [p for p in CPU_PATCHES if _defect_absent(p) is None]
    runs = offline.run_many(
        [
            dict(drafter="dense", disable=(p,), max_num_batched_tokens=CHUNKED)
            for p in wanted
        ]
    )
    return dict(zip(wanted, runs, strict=True))


@pytest.mark.parametrize("patch", CPU_PATCHES)
def test_each_cpu_patch_is_needed(defect_runs, baseline, refs, patch):
    """With the patch off, the run fails with *that* defect's error, or (for a
    numerical defect) its drafts stop matching the reference; any other
    failure (import error, timeout, OOM) fails this test."""
    absent = _defect_absent(patch)
    if absent:
        pytest.skip(absent)
    run = defect_runs[patch]
    expected = CPU_DEFECTS[patch]
    if expected == DIVERGES:
        assert run.ok, run.log[-4000:]
        assert run.data["outputs"] == baseline.data["outputs"]  # verification holds
        stats = compare(refs["dense"], run.data, run.trace)
        assert stats.token_rate < 0.9, (
            f"{patch} disabled but drafts still exact: {stats}"
        )
    else:
        assert not run.ok, f"{patch} disabled but the engine ran"
        assert re.search(expected, run.log), (
            f"{patch} disabled: expected /{expected}/, got:\n{run.log[-3000:]}"
        )


def _drafts_by_step(trace: list[dict]) -> dict[tuple[str, int], list[int]]:
    # Engine request ids carry a random suffix: key by the user's id.
    return {
        (r["request_id"].split("-")[0], r["num_tokens"]): r["draft_token_ids"]
        for r in trace
    }


def test_upstream_diffs_reproduce_the_plugin(offline, baseline, refs, tmp_path_factory):
    """patches/ applied to a copy of vLLM: probes see the fixes, drafts are the same."""
    import json
    import os
    import subprocess
    import sys

    import vllm

    from tests.helpers.upstream import patched_copy

    dest = patched_copy(vllm.__version__, tmp_path_factory.mktemp("vllm-patched"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(dest), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "vllm_dflash.entrypoints.cli.main", "doctor", "--json"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    doctor = json.loads(out.stdout)
    states = {p["name"]: p["state"] for p in doctor["patches"]}
    assert states["dflash_aux_layer_shift"] == "not needed"  # never shifted twice
    assert states["dflash_sliding_window"] == "not needed"
    assert states["cpu_expand_kernel_float"] == "not needed"
    assert states["dflash_lookahead_slots"] == "not needed"
    assert states["dflash_draft_slot_budget"] == "not needed"
    assert states["dflash_drafter_kv_cache_dtype"] == "not needed"
    assert states["dflash_no_drafter_mm_gather"] == "not needed"
    # the fixes of patches/ with no upstream PR yet: their probes see the diffs too
    assert states["dflash_gdn_shared_metadata"] == "not needed"
    assert states["dflash_gdn_state_replay"] == "not needed"
    assert states["dflash_drafter_kv_shared_group"] == "not needed"
    assert states["dflash_full_step_budget"] == "not needed"
    assert states["dflash_min_tokens_positions"] == "not needed"
    assert states["dflash_async_stale_draft_placeholders"] == "not needed"

    upstream = offline.run("swa", max_num_batched_tokens=CHUNKED, pythonpath=str(dest))
    stats = _check(upstream, baseline, refs["swa"])
    assert stats.drafts >= MIN_DRAFTS and stats.token_rate >= 0.99, stats
    assert upstream.data["scheduler"]["budget"] == CHUNKED  # 0019's whole budget
    plugin = offline.run("swa", max_num_batched_tokens=CHUNKED)
    assert plugin.ok
    a, b = _drafts_by_step(upstream.trace), _drafts_by_step(plugin.trace)
    common = a.keys() & b.keys()
    assert len(common) >= MIN_DRAFTS
    assert sum(a[s] == b[s] for s in common) / len(common) >= 0.99
