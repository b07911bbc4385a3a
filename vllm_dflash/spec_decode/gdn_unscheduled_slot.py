# SPDX-License-Identifier: Apache-2.0
"""Hybrid targets: a decode that sat out a step resumes from its accepted GDN slot.

A speculative verify on a Gated-DeltaNet layer leaves the state after each of
its tokens in its own slot, and the next verify starts from the slot of the last
accepted token: ``num_accepted_tokens - 1``, which the runner keeps per row of
its persistent batch. A running request the scheduler leaves out of a step (its
token budget went to other requests first) is removed from that batch; when it
is scheduled again, ``InputBatch.add_request`` sets its count to 1 (and with
asynchronous scheduling ``_prepare_inputs`` forces 1 for every row that was not
in the previous step). So its next verify reads slot 0, which holds the state
after the *first* token of its last verify, not after its last accepted one:
wrong tokens from there on. Seen on the CPU backend with the trained hybrid pair
(chunked prefill with a 40-token budget, draft lengths 4,1,4,1,...: request 2
sat out 5 steps, its output diverged at token 11, 0.28% of the logit range).

The patch remembers the count of each removed request and writes it back into
the step's ``num_accepted_tokens`` when the request returns (not after a
preemption: that request prefills again and its rows start at slot 0 anyway).
It runs only in DFlash engines on hybrid targets, and does work only on steps
that leave out or bring back a request; the count is read after the previous
step's device-to-host copy has finished (the event ``_prepare_inputs`` waits on
right after, so no extra wait in effect).
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.registry import V020, Patch, PatchKind, code_reads, replace_attr
from vllm_dflash.spec_decode import uses_dflash

NAME = "dflash_gdn_slot_after_unscheduled_step"
_SAVED = "_vllm_dflash_saved_accepted"
_APPLIES = "_vllm_dflash_gdn_slot_fix"


def _applies(runner: Any) -> bool:
    """Outside 'align' mode; in it only with the GDN state replay, whose next
    step commits the returning request's records by this count (vLLM's 'align'
    path moves its 1 + k state copies by the count it already holds)."""
    from vllm_dflash.layers.gdn_state_replay import config_replays

    return (
        uses_dflash(runner)
        and getattr(runner.model_config, "is_hybrid", False)
        and (
            runner.cache_config.mamba_cache_mode != "align"
            or config_replays(runner.vllm_config)
        )
    )


def save_unscheduled(runner: Any, scheduler_output: Any) -> None:
    """Before vLLM drops the step's unscheduled rows: their accepted counts."""
    batch = runner.input_batch
    scheduled = scheduler_output.num_scheduled_tokens
    leaving = batch.req_id_to_index.keys() - scheduled.keys()
    saved: dict[str, int] = getattr(runner, _SAVED, None) or {}
    if saved:
        for req_id in scheduler_output.finished_req_ids:
            saved.pop(req_id, None)
    if leaving:
        event = getattr(runner, "num_accepted_tokens_event", None)
        if event is not None:
            event.synchronize()
        counts = batch.num_accepted_tokens_cpu
        for req_id in leaving:
            n = int(counts[batch.req_id_to_index[req_id]])
            if n > 1:
                saved[req_id] = n
    setattr(runner, _SAVED, saved)


def restore_returning(runner: Any, scheduler_output: Any) -> None:
    """After ``_prepare_inputs``: the counts of rows that came back this step."""
    saved: dict[str, int] | None = getattr(runner, _SAVED, None)
    if not saved:
        return
    batch = runner.input_batch
    resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
    rows: list[tuple[int, int]] = []
    for req_id in [r for r in saved if r in batch.req_id_to_index]:
        n = saved.pop(req_id)
        if req_id not in resumed:  # a preempted request prefills again
            rows.append((batch.req_id_to_index[req_id], n))
    if not rows:
        return
    buf = runner.num_accepted_tokens
    for i, n in rows:
        buf.np[i] = n
        batch.num_accepted_tokens_cpu[i] = n
        # Only these rows: the device copy of the others may be newer than the
        # host's (dflash_hybrid_no_accepted_sync leaves them to vLLM's GPU
        # correction). A scalar fill is a kernel launch, no host wait.
        buf.gpu[i : i + 1].fill_(n)


def probe() -> bool:
    """vLLM's add_request starts every (re)added row at one accepted token."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return code_reads(InputBatch.add_request, "num_accepted_tokens_cpu")


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_update = GPUModelRunner._update_states
    stock_prepare = GPUModelRunner._prepare_inputs

    def _update_states(self, scheduler_output):
        applies = getattr(self, _APPLIES, None)
        if applies is None:  # decided once per runner
            applies = _applies(self)
            setattr(self, _APPLIES, applies)
        if applies:
            save_unscheduled(self, scheduler_output)
        return stock_update(self, scheduler_output)

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        out = stock_prepare(self, scheduler_output, *args, **kwargs)
        if getattr(self, _SAVED, None):
            restore_returning(self, scheduler_output)
        return out

    replace_attr(GPUModelRunner, "_update_states", _update_states, NAME)
    replace_attr(GPUModelRunner, "_prepare_inputs", _prepare_inputs, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
    ),
    summary=(
        "Hybrid targets with DFlash: a decode left out of a step keeps its "
        "accepted-token count, so its next verify starts from the right GDN slot."
    ),
    why=(
        "vLLM resets the count to 1 when the request returns to the batch: its next "
        "verify reads the GDN state of slot 0 (wrong tokens after accepted drafts)."
    ),
    upstream="none merged (related, open: vllm-project/vllm#55504, #56531)",
    versions=V020,
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Drop when vLLM keeps the count for rows that leave the batch.",
    probe_false_reason="InputBatch.add_request no longer resets the accepted count",
)
