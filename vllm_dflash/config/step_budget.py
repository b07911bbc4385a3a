# SPDX-License-Identifier: Apache-2.0
"""The whole step budget for DFlash engines: no drafting slots reserved from it.

``VllmConfig._set_max_num_scheduled_tokens`` lowers the scheduler's per-step
budget to ``max_num_batched_tokens - max_num_seqs * slots`` for every
speculative method, ``slots`` being the tokens the drafter may *add to the
target's batch* (``k`` per request for DFlash with #51256). That is right for
drafters whose forward runs the target's tokens and their own in one buffer.
vLLM 0.20.x's ``DFlashProposer`` does not: the target's tokens (the drafter's
context) go to their own buffers (``_context_positions_buffer``,
``_context_slot_mapping_buffer``: ``max_num_batched_tokens`` rows, and the
context K/V pass runs outside CUDA graphs), and its forward sees only the query
block, ``1 + k`` tokens per request, in ``input_ids`` (``max_num_batched_tokens``
rows) and ``positions`` (``max_num_seqs * (1 + k)`` rows). The two bounds that
matter are therefore ``scheduled <= max_num_batched_tokens`` and
``max_num_seqs * (1 + k) <= max_num_batched_tokens``, and neither depends on the
other.

The reservation shrinks DFlash's steps: at ``max_num_seqs = 256``, ``k = 15``
and ``max_num_batched_tokens = 16384`` a step schedules 12,544 tokens instead of
16,384 (with #51256, ``core/draft_slot_budget.py``; 12,800 with 0.20.1's own
``k - 1``), and vLLM warns that the budget "may lead to suboptimal performance".
With ``vllm serve``'s H200 defaults (8,192 tokens, 1,024 sequences) it refuses
DFlash ``k = 15`` outright, with a multi-line pydantic error about a budget of
-7,168 (-6,144 without #51256). On the H200 (2026-12-03, dense 8B pair, 64-256
requests) the whole budget was neutral in throughput: prefill steps are
compute-bound, so fewer, bigger ones take the same time.

This patch, for DFlash only:

* ``max_num_seqs * (1 + k) <= max_num_batched_tokens``: the step budget is
  ``max_num_batched_tokens``, as without speculation (a budget already set, by
  this patch in the front end or by the user, is kept if it is positive and at
  most ``max_num_batched_tokens``);
* ``max_num_batched_tokens <= max_num_seqs * k`` with no budget set (vLLM
  refuses with a budget <= 0): a one-line error naming the three values and the settings that work;
* in between: vLLM's own reservation (it keeps the query block inside
  ``input_ids`` by keeping fewer than ``max_num_seqs`` requests in a step).
"""

from __future__ import annotations

import types
from types import SimpleNamespace
from typing import Any

from vllm_dflash.config.layer_types import DrafterConfigError
from vllm_dflash.logger import init_logger, vllm_logs_silenced
from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020_ONLY,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

NAME = "dflash_full_step_budget"
_logged = False  # one log line per process


class StepBudgetError(DrafterConfigError):
    """``max_num_batched_tokens`` cannot hold a DFlash step's query block."""


def query_tokens(max_num_seqs: int, num_speculative_tokens: int) -> int:
    """The largest query block a DFlash drafter lays out in one step."""
    return max_num_seqs * (1 + num_speculative_tokens)


def full_budget(scheduler_config: Any, speculative_config: Any) -> int | None:
    """The step budget this patch sets, or None where vLLM's own rule stays.

    Raises :class:`StepBudgetError` where vLLM would refuse the config with a
    budget of 0 or less.
    """
    if speculative_config is None or speculative_config.method != "dflash":
        return None
    k = int(speculative_config.num_speculative_tokens)
    seqs = int(scheduler_config.max_num_seqs)
    batched = int(scheduler_config.max_num_batched_tokens)
    need = query_tokens(seqs, k)
    budget = scheduler_config.max_num_scheduled_tokens
    if need <= batched:
        # Unset: the whole budget. Set (by this patch in the front end: every
        # copy of the config validates again in the engine's processes, or by
        # the user): valid up to max_num_batched_tokens, where vLLM's own check
        # would demand the drafting slots again.
        if budget is None:
            return batched
        return budget if 0 < budget <= batched else None
    if budget is None and batched <= seqs * k:
        raise StepBudgetError(
            f"max_num_batched_tokens={batched} is too small for DFlash with "
            f"max_num_seqs={seqs} and num_speculative_tokens={k}: the drafter lays "
            f"out up to {seqs} x {1 + k} = {need} query tokens in one step. Set "
            f"--max-num-batched-tokens to {need} or more (the whole budget then "
            f"goes to scheduled tokens), or --max-num-seqs to {batched // (1 + k)} "
            f"or fewer."
        )
    return None


class _StandIn(SimpleNamespace):
    """A VllmConfig stand-in: helpers of VllmConfig that the rule calls (a later
    vLLM's, or patches/'s 0019 diff) run on it."""

    def __getattr__(self, name: str) -> Any:
        from vllm.config.vllm import VllmConfig

        return types.MethodType(getattr(VllmConfig, name), self)


def _stand_in(method: str, k: int, seqs: int, batched: int) -> SimpleNamespace:
    spec = SimpleNamespace(
        method=method,
        num_speculative_tokens=k,
        max_num_new_slots_for_drafting=k,
    )
    sched = SimpleNamespace(
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
        max_num_scheduled_tokens=None,
    )
    return _StandIn(speculative_config=spec, scheduler_config=sched)


def probe() -> bool:
    """Does the running vLLM reserve drafting slots from a DFlash step budget?"""
    from vllm.config.vllm import VllmConfig

    # A budget that stays >= 8192 after the reservation: vLLM warns below that,
    # and a probe must not log (it runs in every vLLM process, DFlash or not).
    batched = 8192 + 64
    cfg = _stand_in("dflash", k=4, seqs=8, batched=batched)
    with vllm_logs_silenced():
        original(VllmConfig._set_max_num_scheduled_tokens)(cfg)
    return cfg.scheduler_config.max_num_scheduled_tokens < batched


def apply() -> None:
    from vllm.config.vllm import VllmConfig

    stock = VllmConfig._set_max_num_scheduled_tokens

    def _set_max_num_scheduled_tokens(self: Any) -> None:
        global _logged
        budget = full_budget(self.scheduler_config, self.speculative_config)
        if budget is None:
            stock(self)
            return
        self.scheduler_config.max_num_scheduled_tokens = budget
        if not _logged:
            _logged = True
            init_logger(__name__).info(
                "DFlash step budget: %d tokens (max_num_batched_tokens; the drafter's "
                "query block of up to %d tokens has its own buffers, so no drafting "
                "slots are reserved: %s)",
                budget,
                query_tokens(
                    self.scheduler_config.max_num_seqs,
                    self.speculative_config.num_speculative_tokens,
                ),
                NAME,
            )

    replace_attr(
        VllmConfig, "_set_max_num_scheduled_tokens", _set_max_num_scheduled_tokens, NAME
    )


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=("vllm.config.vllm:VllmConfig._set_max_num_scheduled_tokens",),
    summary="DFlash engines schedule up to max_num_batched_tokens a step (no drafting "
    "slots reserved) when max_num_seqs x (1 + k) query tokens fit; one-line error "
    "where vLLM would refuse the budget.",
    why="0.20.x's DFlash proposer keeps the target's tokens and its query block in "
    "separate buffers, but vLLM reserves k slots per sequence from the step budget "
    "anyway: 12,544 instead of 16,384 tokens a step at 256 sequences, k=15 (with "
    "#51256), and vllm serve's H200 defaults with k=15 are refused with a pydantic "
    "error about a negative budget.",
    upstream="vllm-project/vllm#53080 (open: separate target and draft scheduling "
    "budgets)",
    versions=V020_ONLY,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when upstream budgets the drafter's query block apart from the "
    "target's tokens; the probe skips it there. Later vLLM lines: check that the "
    "DFlash proposer still keeps context and query buffers apart before widening "
    "versions.",
    probe_false_reason="vLLM no longer reserves drafting slots from a DFlash step budget",
)
