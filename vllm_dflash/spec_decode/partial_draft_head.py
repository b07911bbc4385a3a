# SPDX-License-Identifier: Apache-2.0
"""The DFlash draft head over the positions the next step verifies (adaptive mode).

DFlash drafts a block of ``k`` positions in one drafter forward, then runs the
LM head and an argmax over every position: ``batch * k`` rows of a
``[hidden, vocab]`` GEMM (Qwen3-8B-DFlash: 4096 x 151,936; 27B: 5120 x 248,320)
and a ``[batch * k, vocab]`` logits tensor. With ``"draft_length": "adaptive"``
the scheduler has already said how many drafts the next step verifies at most
(``d``, see ``spec_decode/context_only_pass.py``); at large batches it says 2-4
of 15 (H200, 2026-12-01, e0d2e48: 8B pair, 64-256 requests).
This patch then runs the head over the first ``d`` positions of each request
only, and returns the usual ``[batch * k]`` ids with zeros after them: the
scheduler caps the next step at ``d``, so no step verifies those.

Exact: the drafter's forward is unchanged (the whole block, non-causal), and
each position's argmax depends only on its own hidden state, so the ``d`` ids
are those the full head gives (the reference's first ``d``). Engines without the
adaptive mode, and steps that verify all ``k``, run vLLM's head unchanged. No
host sync: ``d`` is a host integer the scheduler sent, the selection a view.
"""

from __future__ import annotations

import torch

from vllm_dflash.registry import V020, Patch, PatchKind, is_patched, replace_attr
from vllm_dflash.spec_decode.context_only_pass import next_drafts

NAME = "dflash_partial_draft_head"
# On the drafter, after each query pass: the positions per request its head
# computed (k: all; dflash_trace records only those).
HEAD_POSITIONS_ATTR = "_vllm_dflash_head_positions"


def head_positions(drafter) -> int:
    return getattr(drafter, HEAD_POSITIONS_ATTR, drafter.num_speculative_tokens)


def partial_greedy_sample(
    stock, drafter, hidden_states: torch.Tensor, d: int, k: int
) -> torch.Tensor:
    """Ids of positions ``0..d-1`` of each request's ``k``-row block; zeros after."""
    batch = hidden_states.shape[0] // k
    rows = hidden_states.view(batch, k, -1)[:, :d].reshape(batch * d, -1)
    ids = stock(drafter, rows)
    out = ids.new_zeros((batch, k))
    out[:, :d] = ids.view(batch, d)
    return out.view(-1)


def probe() -> bool:
    return True  # no vLLM release limits the DFlash head to the verified drafts


def apply() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer

    stock = DFlashProposer._greedy_sample
    if is_patched(stock, NAME):
        return

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        d = next_drafts(self)
        if d is None:  # no adaptive draft length: vLLM's head, nothing else
            return stock(self, hidden_states)
        k = self.num_speculative_tokens
        if not 0 < d < k or hidden_states.shape[0] % k:
            setattr(self, HEAD_POSITIONS_ATTR, k)
            return stock(self, hidden_states)
        setattr(self, HEAD_POSITIONS_ATTR, d)
        return partial_greedy_sample(stock, self, hidden_states, d, k)

    replace_attr(DFlashProposer, "_greedy_sample", _greedy_sample, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=("vllm.v1.spec_decode.dflash:DFlashProposer._greedy_sample",),
    summary=(
        "With the adaptive draft length, the DFlash draft head (LM head + argmax) "
        "runs only over the positions the next step verifies."
    ),
    why=(
        "At large batches the adaptive policy verifies 2-4 of 15 drafts; the head "
        "over all 15 positions is a batch*15 x vocab GEMM whose rows no step reads."
    ),
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Keep with dflash_adaptive_draft_length.",
)
