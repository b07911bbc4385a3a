# SPDX-License-Identifier: Apache-2.0
"""A DFlash query block of ``1 + d`` positions when the next step verifies ``d < k``.

DFlash drafts in one drafter forward over a query block of ``1 + k`` positions
per request (the newest token and ``k`` mask tokens; non-causal inside the
block). With ``"draft_length": "adaptive"`` the scheduler has already said how
many drafts the next step verifies at most (``d``,
``spec_decode/context_only_pass.py``); at large batches it says 1-4 of 15. The
drafter's forward over the full block then costs ``batch * (1 + k)`` tokens
through every drafter layer, of which the step reads ``d`` per request: on the
H200 (Qwen3-8B-shaped pair, k = 15) that pass over 64 x 16 positions is a large
part of a 3-draft step (H200, 2026-12-02, 494805a).

This patch runs the query pass of such a step as vLLM's DFlash does for
``num_speculative_tokens = d``: a block of ``1 + d`` positions (bonus token and
``d`` masks), the head over those ``d``. The drafts are therefore the ones a
DFlash engine configured with ``k = d`` proposes (vLLM lets a user run a
16-position drafter with any smaller ``k``), not the first ``d`` of the full
block: the mask positions after ``d`` are not in the attention. Output stays
exact (verification does not depend on what was drafted), and the drafts equal
the float64 reference's drafts for a block of ``d`` (tests: the reference's
``draft(seq, d)``). The result is padded back to ``[batch, k]`` with zeros that
no step verifies (the scheduler caps the next step at ``d``).

Steps that verify ``k`` (every step at concurrency 1), the context-only pass
(``d = 0``) and engines without the adaptive mode run vLLM's block unchanged, and
so do drafters whose attention backend is not in :data:`SHORT_BLOCK_BACKENDS`:
on the H200, FLEX_ATTENTION (vLLM's choice for a float32 drafter) hit
torch.compile's recompile limit (16) with short blocks of several lengths and the
engine failed (2026-12-02, ``hybrid-swa-graph-fp32-adaptive``); it keeps the full
block (logged once).
Disable this patch (``VLLM_DFLASH_DISABLE=dflash_short_draft_block``) to keep the
full block and compute only its first ``d`` positions' head
(``dflash_partial_draft_head``), whose drafts are the full block's first ``d``.
No host sync: ``d`` is a host integer from the scheduler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import V020, Patch, PatchKind, is_patched, replace_attr
from vllm_dflash.spec_decode.context_only_pass import next_drafts
from vllm_dflash.spec_decode.partial_draft_head import HEAD_POSITIONS_ATTR

logger = init_logger(__name__)

NAME = "dflash_short_draft_block"
# On the drafter, after each query pass: its query block (mask positions, k for
# vLLM's block); dflash_trace records it so drafts are replayed with that block.
QUERY_BLOCK_ATTR = "_vllm_dflash_query_block"
# On the drafter: whether its attention backends take short blocks (decided once).
_CAPABLE_ATTR = "_vllm_dflash_short_block_capable"
# Drafter attention backends that run blocks of any length without recompiling
# (FLASH_ATTN: H200, 2026-12-02; CPU_ATTN: tests/e2e/test_draft_length.py).
SHORT_BLOCK_BACKENDS = ("FLASH_ATTN", "CPU_ATTN")


def query_block(drafter) -> int:
    """Mask positions of the drafter's last query block (k unless shortened)."""
    return getattr(drafter, QUERY_BLOCK_ATTR, drafter.num_speculative_tokens)


def short_block_capable(drafter) -> bool:
    """Whether every attention backend of the drafter is in
    :data:`SHORT_BLOCK_BACKENDS` (decided on the first short step, logged once
    if not)."""
    capable = getattr(drafter, _CAPABLE_ATTR, None)
    if capable is None:
        groups = getattr(drafter, "draft_attn_groups", None) or []
        names = sorted({g.backend.get_name() for g in groups})
        capable = bool(names) and all(n in SHORT_BLOCK_BACKENDS for n in names)
        if not capable:
            logger.info(
                "DFlash short draft blocks are off for drafter attention backend(s) "
                "%s (supported: %s): steps that verify fewer drafts draft the "
                "full block",
                names or "unknown",
                ", ".join(SHORT_BLOCK_BACKENDS),
            )
        setattr(drafter, _CAPABLE_ATTR, capable)
    return capable


def short_block_propose(stock, drafter, d: int, kwargs: dict) -> torch.Tensor:
    """Run ``stock`` (vLLM's propose) as for ``num_speculative_tokens = d``;
    return its ``[batch, d]`` drafts padded with zeros to ``[batch, k]``."""
    k = drafter.num_speculative_tokens
    drafter.num_speculative_tokens = d
    try:
        drafts = stock(drafter, **kwargs)
    finally:
        drafter.num_speculative_tokens = k
    setattr(drafter, QUERY_BLOCK_ATTR, d)
    setattr(drafter, HEAD_POSITIONS_ATTR, d)
    return F.pad(drafts, (0, k - d))


def probe() -> bool:
    return True  # no vLLM release shortens the DFlash block per step


def apply() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer

    stock = DFlashProposer.propose
    if is_patched(stock, NAME):
        return

    def propose(self, *args, **kwargs):
        d = next_drafts(self)
        if d is None:  # no adaptive draft length: vLLM's propose, nothing else
            return stock(self, *args, **kwargs)
        k = self.num_speculative_tokens
        if args or not 0 < d < k or not short_block_capable(self):
            # full block, a context-only pass, or a backend without short blocks
            setattr(self, QUERY_BLOCK_ATTR, k)
            return stock(self, *args, **kwargs)
        return short_block_propose(stock, self, d, kwargs)

    replace_attr(DFlashProposer, "propose", propose, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=("vllm.v1.spec_decode.dflash:DFlashProposer.propose",),
    summary=(
        "With the adaptive draft length, a step followed by d < k verified drafts "
        "runs the DFlash query pass over a block of 1 + d positions (vLLM's "
        "DFlash with num_speculative_tokens = d)."
    ),
    why=(
        "At large batches the adaptive policy verifies 1-4 of 15 drafts, and the "
        "drafter's forward over batch*(1+k) block positions is a large part of "
        "the step; positions no step verifies need not be in it."
    ),
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Keep with dflash_adaptive_draft_length.",
    # wraps dflash_context_only_pass's propose, applied on this import
    trigger="vllm.v1.worker.gpu_model_runner",
)
