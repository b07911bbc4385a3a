# SPDX-License-Identifier: Apache-2.0
"""Gated-DeltaNet state of decodes that verify no drafts (adaptive draft length).

A hybrid target's GDN layers keep ``1 + k`` state slots per request while
speculating: a verify writes the state after each of its tokens to its own slot,
and the next step starts from the slot of the last accepted token
(``num_accepted_tokens - 1``). A plain decode reads and writes slot 0 instead.

With ``"draft_length": "adaptive"`` the scheduler may verify 0 drafts for the
whole batch; it keeps those decodes speculative (empty draft lists, so the
runner's ``num_decode_draft_tokens`` is 0, not -1). But
``GDNAttentionMetadataBuilder.build`` takes the speculative path only when the
batch's draft count is positive, so a step in which every decode verifies 0
drafts runs as plain decodes: each request whose last verify accepted drafts
reads slot 0, a stale state, and the target's tokens go wrong (CPU, trained
hybrid pair, lengths 4,0,4,0,...: 8 of 8 sequences diverge, up to 9.6% of the
logit range).

The patch hands the builder a draft count with one decode's 0 raised to 1 when
every decode has 0: the builder reads the values only through ``>= 0`` (which
requests are speculative) and that sum, so the batch takes the speculative path
with the same requests and query lengths. Only adaptive engines produce 0-draft
speculative decodes; every other engine (decided once per builder) passes its
counts through untouched.

A batch made speculative this way also gets its accepted-token counts raised to
at least 1. A real step's counts already are (``_prepare_inputs`` sets them), but
vLLM's start-up warm-up before each FULL CUDA graph capture builds the GDN
metadata from the runner's zero-initialised buffers: draft counts 0, which this
patch turns speculative, and accepted counts 0, from which vLLM's speculative
GDN kernel (``fused_sigmoid_gating_delta_rule_update``) reads the initial state
slot at column ``0 - 1``, the word before its index buffer: a wild state slot
and "an illegal memory access" (the 27B-shaped pair in bfloat16 with prefix
caching, H100, 2026-12-06). Outside the 'align' mamba cache mode the plugin's
GDN state replay serves that call and clamps the counts, so only prefix caching
reached it.
"""

from __future__ import annotations

import torch

from vllm_dflash.config import draft_length
from vllm_dflash.registry import V020, Patch, PatchKind, code_reads, replace_attr

NAME = "dflash_gdn_zero_draft_decodes"
_ADAPTIVE = "_vllm_dflash_adaptive"


def keep_speculative(num_decode_draft_tokens_cpu: torch.Tensor | None):
    """The draft counts to give the builder (a copy when changed, else the same
    tensor)."""
    t = num_decode_draft_tokens_cpu
    if t is None:
        return t
    spec = t >= 0
    if not bool(spec.any()) or int(t[spec].sum()) != 0:
        return t
    t = t.clone()
    t[int(spec.nonzero()[0, 0])] = 1
    return t


def at_least_one(num_accepted_tokens: torch.Tensor | None) -> torch.Tensor | None:
    """The accepted-token counts of a batch made speculative, each at least 1 (a
    copy; on the device, no host sync)."""
    if num_accepted_tokens is None:
        return None
    return num_accepted_tokens.clamp(min=1)


def probe() -> bool:
    """vLLM's builder decides the speculative path by the sum of draft counts."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    return code_reads(GDNAttentionMetadataBuilder.build, "sum")


def apply() -> None:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    stock = GDNAttentionMetadataBuilder.build

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        adaptive = getattr(self, _ADAPTIVE, None)
        if adaptive is None:  # decided once per builder
            adaptive = draft_length.mode_of(self.vllm_config) == draft_length.ADAPTIVE
            setattr(self, _ADAPTIVE, adaptive)
        if adaptive and num_decode_draft_tokens_cpu is not None:
            counts = keep_speculative(num_decode_draft_tokens_cpu)
            if counts is not num_decode_draft_tokens_cpu:
                num_decode_draft_tokens_cpu = counts
                num_accepted_tokens = at_least_one(num_accepted_tokens)
        return stock(
            self,
            common_prefix_len,
            common_attn_metadata,
            num_accepted_tokens=num_accepted_tokens,
            num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu,
            fast_build=fast_build,
        )

    replace_attr(GDNAttentionMetadataBuilder, "build", build, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=("vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.build",),
    summary=(
        "Hybrid targets: a step whose decodes all verify 0 drafts keeps the "
        "speculative GDN state slots (adaptive draft length)."
    ),
    why=(
        "vLLM runs such a step as plain decodes, which read GDN state slot 0 instead "
        "of the last accepted token's: wrong tokens after accepted drafts. Such a "
        "batch's accepted counts are raised to 1: vLLM's start-up warm-up of FULL "
        "CUDA graphs has them at 0, which its GDN kernel reads as state column -1."
    ),
    upstream="none (0-draft speculative decodes come from vllm-dflash's adaptive mode)",
    versions=V020,
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Keep with dflash_adaptive_draft_length; propose with it upstream.",
    probe_false_reason="the GDN builder no longer decides by the draft-count sum",
)
