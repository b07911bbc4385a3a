# SPDX-License-Identifier: Apache-2.0
"""Backport of vLLM #51256: reserve DFlash's bonus query slot in the step budget.

``VllmConfig`` lowers ``max_num_scheduled_tokens`` by
``max_num_new_slots_for_drafting * max_num_seqs`` so the drafter's inputs fit the
proposer's buffers (``input_ids``, ``hidden_states``: ``max_num_batched_tokens``
rows). Every parallel drafter gets ``k - 1`` slots per request there, but DFlash
runs ``k + 1`` query tokens per request, ``k`` more than the one token the
scheduler already counts: a step of ``n`` requests with few scheduled tokens
each can lay out ``n * (k + 1)`` query tokens, up to ``max_num_seqs`` more than
the buffers hold (out-of-bounds writes in the Triton input-expansion kernel).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

NAME = "dflash_draft_slot_budget"


def _stock_property() -> property:
    from vllm.config.speculative import SpeculativeConfig

    prop = SpeculativeConfig.__dict__["max_num_new_slots_for_drafting"]
    return property(original(prop.fget))


def stock_slots(num_speculative_tokens: int) -> int:
    """vLLM's own answer for a DFlash config (stand-in with SpeculativeConfig's methods)."""
    from vllm.config.speculative import SpeculativeConfig

    spec = SimpleNamespace(
        method="dflash",
        num_speculative_tokens=num_speculative_tokens,
        parallel_drafting=True,
    )
    for name in ("use_eagle", "use_dflash", "uses_draft_model"):
        fn = getattr(SpeculativeConfig, name, None)
        if fn is not None:
            setattr(spec, name, fn.__get__(spec))
    return _stock_property().fget(spec)


def probe() -> bool:
    k = 4
    return stock_slots(k) < k


def apply() -> None:
    from vllm.config.speculative import SpeculativeConfig

    stock = original(SpeculativeConfig.__dict__["max_num_new_slots_for_drafting"].fget)

    def max_num_new_slots_for_drafting(self: Any) -> int:
        if self.method == "dflash":
            # One bonus query plus k mask queries per request.
            return max(stock(self), self.num_speculative_tokens)
        return stock(self)

    max_num_new_slots_for_drafting.__wrapped_original__ = stock
    max_num_new_slots_for_drafting.__vllm_dflash_patch__ = NAME
    current = SpeculativeConfig.__dict__["max_num_new_slots_for_drafting"]
    if getattr(current.fget, "__vllm_dflash_patch__", None) == NAME:
        return
    replace_attr(
        SpeculativeConfig,
        "max_num_new_slots_for_drafting",
        property(max_num_new_slots_for_drafting),
        NAME,
    )


PATCH = Patch(
    name=NAME,
    kind=PatchKind.BACKPORT,
    targets=(
        "vllm.config.speculative:SpeculativeConfig.max_num_new_slots_for_drafting",
    ),
    summary="DFlash reserves k (not k-1) drafting slots per request in the step budget "
    "(max_num_scheduled_tokens).",
    why="DFlash lays out k+1 query tokens per request: with k-1 reserved, a step can "
    "overrun the proposer's max_num_batched_tokens-row buffers by max_num_seqs rows.",
    upstream="vllm-project/vllm#51256 (merged 2026-08-06; after 0.23.0)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when the oldest supported vLLM has #51256; the probe skips it there.",
)
