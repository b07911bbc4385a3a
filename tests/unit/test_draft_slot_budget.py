# SPDX-License-Identifier: Apache-2.0
"""dflash_draft_slot_budget (vLLM #51256): the step budget vLLM derives leaves
room for every DFlash query token in the proposer's buffers.

vLLM's own ``VllmConfig._set_max_num_scheduled_tokens`` runs on a stand-in
config; the proposer's ``input_ids``/``hidden_states`` hold
``max_num_batched_tokens`` rows (``SpecDecodeBaseProposer.max_num_tokens``) and
DFlash lays out ``k + 1`` query tokens for each scheduled request.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dflash.core import draft_slot_budget as draft_budget
from vllm_dflash.registry import evaluate


@pytest.mark.parametrize("max_num_batched_tokens", [36, 64, 2048])
def test_worst_case_query_tokens_fit_the_proposer_buffers(max_num_batched_tokens):
    from vllm.config import SchedulerConfig, VllmConfig
    from vllm.config.speculative import SpeculativeConfig

    state = evaluate(draft_budget.PATCH, apply=True).state
    k, seqs = 4, 8
    if max_num_batched_tokens == 2048:
        seqs = 256
    spec = SimpleNamespace(
        method="dflash", num_speculative_tokens=k, parallel_drafting=True
    )
    for name in ("use_eagle", "use_dflash", "uses_draft_model"):
        setattr(spec, name, getattr(SpeculativeConfig, name).__get__(spec))
    slots = SpeculativeConfig.max_num_new_slots_for_drafting.fget(spec)
    spec.max_num_new_slots_for_drafting = slots
    sched = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=seqs,
        max_model_len=max_num_batched_tokens,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    cfg = SimpleNamespace(speculative_config=spec, scheduler_config=sched)
    try:
        VllmConfig._set_max_num_scheduled_tokens(cfg)
    except ValueError:
        return  # vLLM refuses the config outright: nothing can overflow
    budget = sched.max_num_scheduled_tokens
    # Worst step: as many requests as fit, each with >= 1 scheduled token.
    reqs = min(seqs, budget)
    query_tokens = reqs * (k + 1)
    assert query_tokens <= max_num_batched_tokens, (
        f"{reqs} requests x {k + 1} DFlash query tokens = {query_tokens} rows > "
        f"{max_num_batched_tokens}-row proposer buffers (budget {budget}, "
        f"{slots} slots/request reserved; {state.value})"
    )
