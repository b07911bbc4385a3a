# SPDX-License-Identifier: Apache-2.0
"""Hybrid targets with DFlash: no host wait for the accepted-token counts.

With a Gated-DeltaNet (hybrid) target and speculative decoding, vLLM 0.20.x's
``GPUModelRunner._prepare_inputs`` waits on ``num_accepted_tokens_event`` (the
device-to-host copy of the previous step's accepted counts) and then reorders the
counts on the host into the new batch order. With asynchronous scheduling (vLLM's
default for DFlash on CUDA) that wait is the one point where the host blocks on the
previous step's target forward and rejection sampling; everything the host does
after it (the attention metadata of every KV-cache group: 15 of them on the
Qwen3.6-27B-shaped pair) runs while the GPU idles. Profiled on an H200 (2026-12-01,
H200, 2026-12-01, eaffc5e): a 6.4 ms wait, then ~14 ms of host
work before the next forward launches; 15.7 ms of GPU idle per 35 ms step.

The host values are not needed there. In asynchronous speculative decoding the
same function then calls ``update_num_computed_tokens_for_batch_change``, which
already rewrites the count of every row that verified drafts in the previous step
(the "participating" rows) from the device's own valid-token counts. Every other
row (new to the batch, or a prefill / undrafted row last step) has count 1 in the
host path too: a row without drafts samples exactly one token. So when that GPU
correction runs (a previous batch exists and the previous step left its valid
counts on the device), the patch lets ``_prepare_inputs`` take vLLM's own
"no event" branch for this call (counts set to 1, no wait) and the GPU correction
produces the same counts with no synchronisation
(``tests/unit/test_hybrid_accepted_sync.py`` checks that equivalence with vLLM's
function on random batches).

Only in DFlash engines on hybrid targets, with asynchronous scheduling, outside
the 'align' mamba cache mode (prefix caching: dflash_align_accepted_counts_order).
The host copy of the counts (``InputBatch.num_accepted_tokens_cpu``) is still
written by the device-to-host copy after each step; code that reads it
(``dflash_gdn_slot_after_unscheduled_step``) waits on the event itself.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.registry import V020_ONLY, Patch, PatchKind, code_reads, replace_attr
from vllm_dflash.spec_decode import uses_dflash

NAME = "dflash_hybrid_no_accepted_sync"
_APPLIES = "_vllm_dflash_no_accepted_sync"


def runner_applies(runner: Any) -> bool:
    """DFlash, hybrid target, async speculative decoding, not 'align' mode."""
    return (
        uses_dflash(runner)
        and bool(getattr(runner.model_config, "is_hybrid", False))
        and runner.cache_config.mamba_cache_mode != "align"
        and bool(getattr(runner, "use_async_spec_decode", False))
        and getattr(runner, "num_accepted_tokens_event", None) is not None
    )


def gpu_counts_complete(runner: Any) -> bool:
    """Whether vLLM's GPU correction will rewrite every drafted row this step."""
    return runner.valid_sampled_token_count_gpu is not None and bool(
        runner.input_batch.prev_req_id_to_index
    )


def probe() -> bool:
    """vLLM's _prepare_inputs still waits on the accepted-count event, and its
    GPU correction still rewrites the counts of drafted rows."""
    import torch
    from vllm.v1.spec_decode.utils import update_num_computed_tokens_for_batch_change
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not code_reads(GPUModelRunner._prepare_inputs, "num_accepted_tokens_event"):
        return False
    if not code_reads(
        GPUModelRunner._prepare_inputs, "update_num_computed_tokens_for_batch_change"
    ):
        raise RuntimeError(
            "GPUModelRunner._prepare_inputs no longer corrects the accepted counts on "
            "the device (update_num_computed_tokens_for_batch_change)"
        )
    # Row 0 drafted 3 tokens last step at row 1 and had 2 valid tokens; row 1 is new.
    # The function's Python source, run eagerly: calling the torch.compile wrapper
    # here compiled it (CPU Inductor) in every CUDA process that imports the model
    # runner, DFlash or not (a direct call: 17 s on the 2-core VM), and with grad
    # mode on, so the first real step (inference mode) compiled it again
    # (H200, 2026-12-03).
    update = getattr(
        update_num_computed_tokens_for_batch_change,
        "_torchdynamo_orig_callable",
        update_num_computed_tokens_for_batch_change,
    )
    accepted = torch.ones(2, dtype=torch.int32)
    update(
        torch.zeros(2, dtype=torch.int32),
        accepted,
        torch.tensor([1, -1]),
        torch.tensor([1, 2]),
        torch.tensor([0, 3], dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
    )
    if accepted.tolist() != [2, 1]:
        raise RuntimeError(
            "update_num_computed_tokens_for_batch_change no longer writes the "
            f"accepted counts of drafted rows (got {accepted.tolist()}, want [2, 1])"
        )
    return True


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = GPUModelRunner._prepare_inputs

    def _prepare_inputs(self, *args, **kwargs):
        applies = getattr(self, _APPLIES, None)
        if applies is None:  # decided once per runner
            applies = runner_applies(self)
            setattr(self, _APPLIES, applies)
        if not applies or not gpu_counts_complete(self):
            return stock(self, *args, **kwargs)
        event = self.num_accepted_tokens_event
        self.num_accepted_tokens_event = None  # vLLM's no-wait branch (counts = 1)
        try:
            return stock(self, *args, **kwargs)
        finally:
            self.num_accepted_tokens_event = event

    replace_attr(GPUModelRunner, "_prepare_inputs", _prepare_inputs, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",),
    summary=(
        "Hybrid targets with DFlash and async scheduling: the runner no longer waits "
        "for the previous step's accepted counts on the host; vLLM's own GPU "
        "correction provides them."
    ),
    why=(
        "The wait serialises the host's per-step metadata build (15 KV-cache groups "
        "on Qwen3.6-27B) with the GPU: ~8 ms of GPU idle per DFlash step on an H200."
    ),
    upstream="none (vLLM's own TODO: 'Remove .cpu() sync to enable fully async for "
    "hybrid model')",
    versions=V020_ONLY,  # the 0.20.x GDN layer, builder and runner
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future="Drop when vLLM's _prepare_inputs stops waiting on num_accepted_tokens_event.",
    probe_false_reason="_prepare_inputs no longer waits on num_accepted_tokens_event",
)
