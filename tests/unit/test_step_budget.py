# SPDX-License-Identifier: Apache-2.0
"""dflash_full_step_budget: DFlash engines get the whole step budget where the
drafter's query block fits its buffers, and a one-line error where vLLM would
refuse the budget.

vLLM's own ``VllmConfig._set_max_num_scheduled_tokens`` (patched and unpatched)
runs on stand-in configs; the buffer bounds are those of 0.20.x's
``DFlashProposer``: context rows <= ``max_num_batched_tokens`` (scheduled
tokens), query rows ``requests x (1 + k)`` <= ``max_num_batched_tokens``
(``input_ids``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dflash.config import step_budget
from vllm_dflash.config.step_budget import StepBudgetError, full_budget
from vllm_dflash.core import draft_slot_budget
from vllm_dflash.registry import PatchState, evaluate, original


def _config(method: str, k: int, seqs: int, batched: int, budget=None):
    from vllm.config.speculative import SpeculativeConfig

    spec = SimpleNamespace(
        method=method, num_speculative_tokens=k, parallel_drafting=method == "dflash"
    )
    for name in ("use_eagle", "use_dflash", "uses_draft_model"):
        setattr(spec, name, getattr(SpeculativeConfig, name).__get__(spec))
    evaluate(draft_slot_budget.PATCH, apply=True)
    spec.max_num_new_slots_for_drafting = (
        SpeculativeConfig.max_num_new_slots_for_drafting.fget(spec)
    )
    sched = SimpleNamespace(
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
        max_num_scheduled_tokens=budget,
    )
    return SimpleNamespace(speculative_config=spec, scheduler_config=sched)


def _budget(cfg, patched: bool) -> int:
    from vllm.config.vllm import VllmConfig

    fn = VllmConfig._set_max_num_scheduled_tokens
    (fn if patched else original(fn))(cfg)
    return cfg.scheduler_config.max_num_scheduled_tokens


@pytest.fixture(scope="module", autouse=True)
def applied():
    state = evaluate(step_budget.PATCH, apply=True).state
    assert state == PatchState.APPLIED, state


@pytest.mark.parametrize(
    "k, seqs, batched, stock, ours",
    [
        (15, 256, 16384, 12544, 16384),  # the H200 runs of #19 (2026-12-03)
        (15, 1024, 32768, 17408, 32768),  # z-lab's recipe on vllm serve's seqs
        (4, 8, 40, 8, 40),  # the CPU e2e tests' chunked budget
        (4, 8, 39, 7, 7),  # 8 x 5 query tokens do not fit 39: vLLM's rule
    ],
)
def test_dflash_gets_the_whole_budget_where_the_query_block_fits(
    k, seqs, batched, stock, ours
):
    assert _budget(_config("dflash", k, seqs, batched), patched=False) == stock
    assert _budget(_config("dflash", k, seqs, batched), patched=True) == ours


@pytest.mark.parametrize("batched", range(1, 90))
def test_every_step_fits_the_proposer_buffers(batched):
    """For every budget: scheduled tokens (the drafter's context) and the query
    block of the most requests a step can hold both fit ``max_num_batched_tokens``
    rows (the rows of 0.20.x's context buffers and of ``input_ids``); where vLLM
    computes a budget of 0 or less, the patch refuses, in one line."""
    k, seqs = 4, 8
    cfg = _config("dflash", k, seqs, batched)
    try:
        budget = _budget(cfg, patched=True)
    except StepBudgetError as e:
        assert batched <= seqs * k
        assert "\n" not in str(e)
        return
    assert batched > seqs * k, "vLLM refuses this budget: the patch must too"
    assert 0 < budget <= batched
    requests = min(seqs, budget)  # each scheduled request has >= 1 token
    assert requests * (1 + k) <= batched, (budget, batched)


def test_the_buffers_are_what_the_rule_assumes():
    """0.20.x's DFlashProposer: context rows in buffers of max_num_batched_tokens
    (max_num_tokens), query rows in buffers of their own."""
    import inspect

    from vllm.v1.spec_decode.dflash import DFlashProposer

    src = inspect.getsource(original(DFlashProposer.__init__))
    for buf in ("_context_slot_mapping_buffer", "_context_positions_buffer"):
        assert f"self.{buf} = torch.zeros(\n            self.max_num_tokens," in src
    assert "self.max_query_tokens = self.max_batch_size * (1 + self." in src


def test_other_methods_keep_vllms_rule():
    cfg, want = _config("eagle3", 4, 8, 64), _config("eagle3", 4, 8, 64)
    assert _budget(cfg, patched=True) == _budget(want, patched=False)
    assert full_budget(SimpleNamespace(max_num_scheduled_tokens=None), None) is None


@pytest.mark.parametrize("budget", [-1, 0, 20, 33, 64, 65])
def test_a_budget_already_set(budget):
    """A set budget (the front end's, validated again in the engine core, or the
    user's) is kept where it is positive and at most max_num_batched_tokens: vLLM
    alone would demand the drafting slots again (raise above 64 - 8 x 4 = 32)."""
    for patched, highest in ((True, 64), (False, 32)):
        cfg = _config("dflash", 4, 8, 64, budget=budget)
        if 0 < budget <= highest:
            assert _budget(cfg, patched=patched) == budget
        else:
            with pytest.raises(ValueError):
                _budget(cfg, patched=patched)


def test_refusal_names_the_values_and_the_fix():
    """vllm serve's H200 defaults (8192 tokens, 1024 sequences) with k = 15: vLLM
    with #51256 (dflash_draft_slot_budget) computes a budget of -7168 and fails
    with a pydantic error (0.20.1 alone: -6144)."""
    cfg = _config("dflash", 15, 1024, 8192)
    with pytest.raises(ValueError, match="-7168"):
        _budget(cfg, patched=False)
    with pytest.raises(StepBudgetError) as e:
        _budget(_config("dflash", 15, 1024, 8192), patched=True)
    msg = str(e.value)
    assert "max_num_batched_tokens=8192" in msg and "max_num_seqs=1024" in msg
    assert "num_speculative_tokens=15" in msg
    assert "--max-num-batched-tokens to 16384" in msg
    assert "--max-num-seqs to 512" in msg
    assert "\n" not in msg


def test_probe_reads_the_unpatched_rule():
    assert step_budget.probe()  # 0.20.x reserves the slots
