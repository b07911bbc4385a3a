# SPDX-License-Identifier: Apache-2.0
"""Refuse hybrid-model prefix-caching setups that stall or corrupt requests.

DFlash + prefix caching on a hybrid target (mamba cache mode 'align'): vLLM
0.20.x's prefix-cache hit can claim a block the full-attention layers do not
hold, and the target's output changes after the hit
(``vllm_dflash.core.hybrid_cache_hit``, whose two backports fix it). At start-up
the check runs that module's KV-cache manager simulation through the code in
force; where hits are not exact (a backport disabled or not applicable) it
refuses with one line naming what works. With asynchronous scheduling (vLLM's
default on CUDA) the same engine also needs the worker fix
``dflash_align_accepted_counts_order``: where it cannot be in force (disabled,
or another vLLM version) the check refuses too, naming ``--no-async-scheduling``.

With prefix caching on a hybrid (mamba / Gated-DeltaNet) target, vLLM 0.20.x
uses mamba cache mode 'align': prefill chunks are cut to multiples of the
block size (``Scheduler._mamba_block_aligned_split``: ``n // block * block``).
Speculative decoding lowers the per-step budget (``max_num_scheduled_tokens =
max_num_batched_tokens - max_num_seqs * new draft slots``; for DFlash ``k`` per
request, and none where ``dflash_full_step_budget`` gives DFlash the whole budget).
When that budget is below the block size, every long
prompt gets a 0-token chunk at every step: it is never scheduled, the engine
idles and the request never finishes (reproduced on CPU: a tiny Qwen3.5 target,
DFlash k=4, max_num_batched_tokens 32, 8 sequences -> budget 8 < block 16;
the 35- and 40-token prompts never start). The start-up check only compares
the block size with ``max_num_batched_tokens``. This patch fails the engine
start instead, with one line that says what works.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm_dflash.core.hybrid_cache_hit import exact_hits
from vllm_dflash.registry import Patch, PatchKind, gate, original, replace_attr
from vllm_dflash.spec_decode import hybrid_align_accepted_order as align_order

PATCH_NAME = "hybrid_align_budget_check"


class AlignBudgetError(ValueError):
    """Prefix caching (mamba 'align') with a budget below the block size."""


def check(scheduler) -> None:
    if not getattr(scheduler, "need_mamba_block_aligned_split", False):
        return
    spec = getattr(getattr(scheduler, "vllm_config", None), "speculative_config", None)
    dflash = spec is not None and spec.method == "dflash"
    if dflash and not exact_hits():
        raise AlignBudgetError(
            "DFlash with prefix caching on a hybrid (mamba/Gated-DeltaNet) target "
            "is refused: this vLLM's prefix-cache hits claim blocks the attention "
            "layers do not hold (patches dflash_hybrid_mamba_no_eagle_margin and "
            "dflash_hybrid_full_attention_truncation are disabled or not "
            "applicable; see `vllm-dflash doctor`). Run with "
            "--no-enable-prefix-caching, or enable those patches."
        )
    if dflash and getattr(scheduler.scheduler_config, "async_scheduling", False):
        blocked = gate(align_order.PATCH)
        if blocked is not None:
            raise AlignBudgetError(
                "DFlash with prefix caching on a hybrid (mamba/Gated-DeltaNet) target "
                "and asynchronous scheduling is refused: patch "
                f"{align_order.NAME} is {blocked.state.value} ({blocked.reason}), "
                "so GDN states would start from another request's accepted count. "
                "Run with --no-async-scheduling or --no-enable-prefix-caching."
            )
    block = scheduler.cache_config.block_size
    budget = scheduler.max_num_scheduled_tokens
    if budget >= block:
        return
    sc = scheduler.scheduler_config
    need = sc.max_num_batched_tokens + (block - budget)
    raise AlignBudgetError(
        f"prefix caching on a hybrid model (mamba cache mode 'align') needs "
        f"max_num_scheduled_tokens >= block_size, got {budget} < {block} "
        f"(max_num_batched_tokens {sc.max_num_batched_tokens} minus draft slots): "
        f"long prompts would never be scheduled. Set max_num_batched_tokens >= "
        f"{need}, or lower max_num_seqs / num_speculative_tokens, or disable "
        f"prefix caching."
    )


def probe() -> bool:
    """Does the stock block-aligned split cut a below-block budget to 0 tokens?"""
    from vllm.v1.core.sched.scheduler import Scheduler

    fake = SimpleNamespace(cache_config=SimpleNamespace(block_size=16), use_eagle=True)
    request = SimpleNamespace(
        num_computed_tokens=0, num_prompt_tokens=40, num_tokens=40
    )
    return original(Scheduler._mamba_block_aligned_split)(fake, request, 8) == 0


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    stock = Scheduler.__init__

    def __init__(self, *args, **kwargs) -> None:
        stock(self, *args, **kwargs)
        check(self)

    replace_attr(Scheduler, "__init__", __init__, PATCH_NAME)


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.FIX,
    targets=("vllm.v1.core.sched.scheduler:Scheduler.__init__",),
    summary="Refuse hybrid prefix caching ('align') with DFlash where prefix-cache "
    "hits are not exact, or with a speculative step budget below the block size.",
    why="DFlash: without the dflash_hybrid_* hit backports, the target's output "
    "changes after a prefix-cache hit. Any method: "
    "'align' cuts prefill chunks to block multiples; with draft slots reserved the "
    "budget rounds to 0 and long prompts are never scheduled (hang).",
    upstream="none (vLLM 0.20.x scheduler)",
    # 0.20.0-0.20.2 share this scheduler; later versions not checked.
    versions=">=0.20.0,<0.21.0",
    platforms=("cuda", "cpu", "rocm"),
    probe=probe,
    apply=apply,
    future="Upstream: check max_num_scheduled_tokens (not max_num_batched_tokens) "
    "against block_size in align mode.",
    probe_false_reason="the scheduler no longer rounds a below-block budget to 0",
)
