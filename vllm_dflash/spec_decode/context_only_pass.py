# SPDX-License-Identifier: Apache-2.0
"""Context-only DFlash drafting steps (worker side of ``"draft_length": "adaptive"``).

The scheduler says on each scheduler output how many drafts the next step
verifies at most (``vllm_dflash_drafts_next``, see
``core/adaptive_draft_length.py``); the runner hands that number to the drafter
(``NEXT_DRAFTS_ATTR``; ``spec_decode/partial_draft_head.py`` reads it too). At 0
the drafter skips its query pass (the
forward of the bonus token and the k mask tokens, the LM head and the argmax:
at a large batch as costly as a target step over ``batch * (k + 1)`` tokens) and
only stores the step's context: the target hidden states projected to the
drafter's K/V (``precompute_and_store_context_kv``), as every drafting step does
first. Its KV cache thus stays complete, so when drafting resumes the drafts are
those of a drafter that never paused (the reference's).

The pass returns a ``[batch, k]`` block of zeros: no step verifies it (the
scheduler caps the next step at 0 drafts), and the runner's buffers keep their
shape. Engines without the adaptive mode never see the attribute and run vLLM's
code unchanged (one ``getattr`` per step).
"""

from __future__ import annotations

import torch

from vllm_dflash.core.adaptive_draft_length import DRAFTS_NEXT_ATTR
from vllm_dflash.registry import V020, Patch, PatchKind, replace_attr

NAME = "dflash_context_only_pass"
_ZEROS = "_vllm_dflash_zero_drafts"
# On the drafter: the number of drafts the next step verifies at most (0: this
# pass stores context only); absent or None: k (no adaptive draft length).
NEXT_DRAFTS_ATTR = "_vllm_dflash_next_drafts"


def next_drafts(drafter) -> int | None:
    """Drafts the step after this drafting pass verifies at most (None: k)."""
    return getattr(drafter, NEXT_DRAFTS_ATTR, None)


def context_only(self, **kw) -> torch.Tensor:
    """Store the step's context K/V in the drafter's cache; draft nothing."""
    cad = kw["common_attn_metadata"]
    batch = cad.batch_size()
    hidden = self.model.combine_hidden_states(kw["target_hidden_states"])
    num_tokens, _, _ = self.set_inputs_first_pass(
        target_token_ids=kw["target_token_ids"],
        next_token_ids=kw["next_token_ids"],
        target_positions=kw["target_positions"],
        target_hidden_states=hidden,
        token_indices_to_sample=kw.get("token_indices_to_sample"),
        cad=cad,
        num_rejected_tokens_gpu=kw.get("num_rejected_tokens_gpu"),
    )
    # vLLM's first-pass input builder stores the context K/V (and nothing else
    # that a later step reads); its model inputs are dropped.
    self.build_model_inputs_first_pass(num_tokens, num_tokens, None)
    zeros = getattr(self, _ZEROS, None)
    if zeros is None or zeros.shape[0] < batch:
        zeros = torch.zeros(
            (max(batch, self.max_batch_size), self.num_speculative_tokens),
            dtype=torch.int64,
            device=self.device,
        )
        setattr(self, _ZEROS, zeros)
    return zeros[:batch]


def probe() -> bool:
    return True  # no vLLM release skips the DFlash query pass


def apply() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_draft = GPUModelRunner.propose_draft_token_ids
    stock_propose = DFlashProposer.propose

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if drafter is not None:
            setattr(
                drafter,
                NEXT_DRAFTS_ATTR,
                getattr(scheduler_output, DRAFTS_NEXT_ATTR, None),
            )
        return stock_draft(self, scheduler_output, *args, **kwargs)

    def propose(self, *args, **kwargs):
        if args or next_drafts(self) != 0:
            return stock_propose(self, *args, **kwargs)
        return context_only(self, **kwargs)

    replace_attr(
        GPUModelRunner, "propose_draft_token_ids", propose_draft_token_ids, NAME
    )
    replace_attr(DFlashProposer, "propose", propose, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
        "vllm.v1.spec_decode.dflash:DFlashProposer.propose",
    ),
    summary=(
        "When the next step verifies no drafts (adaptive draft length), the DFlash "
        "drafter only stores its context K/V and skips the query pass."
    ),
    why=(
        "At large batches the query pass over batch*(k+1) tokens costs as much as "
        "a target step; a step that verifies nothing should not pay it."
    ),
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Keep with dflash_adaptive_draft_length.",
)
