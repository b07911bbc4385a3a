# SPDX-License-Identifier: Apache-2.0
"""Asynchronous scheduling: a request that sits out a step drops its draft
placeholders.

With asynchronous scheduling, vLLM 0.20.x's ``AsyncScheduler`` gives every
scheduled decode ``k`` placeholder draft ids (``-1``); the worker replaces them
with the drafts its proposer left on the device for that request's row of the
previous step. A running request that the scheduler leaves out of a step keeps
those placeholders. When it is scheduled again, it is not in the worker's previous
batch, so nothing replaces them: the ``-1`` ids reach the target's token embedding
and the engine dies with a device-side assert (``indexSelectSmallIndex`` /
"unspecified launch failure" with ``CUDA_LAUNCH_BLOCKING=1``).

A request sits out a step at the end of its context: the step after the one that
reached ``max_model_len - 1`` schedules nothing for it, and when drafts of that
step were rejected it comes back one step later (measured on an H100, 2026-12-07:
the hybrid pair through ``vllm serve``, a request generating up to
``max_model_len``; synchronous scheduling passed). It also happens when the token
budget leaves a request out. vllm-project/vllm#46899 (closed, unmerged) describes
the same defect.

The patch clears the placeholders of every running request the step left out,
after vLLM's own bookkeeping of the step: the request comes back with a plain
decode step (its drafts were on the worker's previous batch, which it has left)
and the proposer drafts for it again. It costs one length comparison per step
when every running request was scheduled. DFlash engines only.
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
from vllm_dflash.spec_decode import uses_dflash

NAME = "dflash_async_stale_draft_placeholders"
_APPLIES = "_vllm_dflash_clears_stale_drafts"


def clear_stale(scheduler: Any, scheduler_output: Any) -> int:
    """Clear the draft placeholders of running requests this step left out;
    returns how many requests were cleared."""
    scheduled = scheduler_output.num_scheduled_tokens
    if len(scheduled) >= len(scheduler.running):
        return 0  # every running request was scheduled
    cleared = 0
    for request in scheduler.running:
        spec = request.spec_token_ids
        if spec and spec[0] == -1 and request.request_id not in scheduled:
            request.spec_token_ids = []
            cleared += 1
    return cleared


class _ProbeRequest:
    """The fields of a decoding request the scheduler's bookkeeping reads (hashable:
    later vLLMs keep requests in sets)."""

    def __init__(self, request_id: str, spec_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.num_computed_tokens = 10
        self.num_tokens = 11
        self.num_output_placeholders = 0
        self.use_structured_output = False
        self.is_prefill_chunk = False
        self.spec_token_ids = spec_token_ids


def _probe_state() -> tuple[Any, Any, Any]:
    """A two-request AsyncScheduler (no __init__): request "a" scheduled, "b"
    left out while holding the previous step's placeholders."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    sched = AsyncScheduler.__new__(AsyncScheduler)
    placeholders = [-1, -1]
    reqs = {rid: _ProbeRequest(rid, placeholders) for rid in ("a", "b")}
    sched.__dict__.update(
        requests=reqs,
        running=list(reqs.values()),
        _spec_token_placeholders=placeholders,
        finished_req_ids=set(),
        # what later vLLMs (0.22, 0.23) read there, off
        enable_return_routed_experts=False,
        _inflight_prefills=set(),
        use_v2_model_runner=False,
        current_step=0,
        pp_size=1,
    )
    out = SimpleNamespace(
        num_scheduled_tokens={"a": 3},
        scheduled_spec_decode_tokens={"a": [-1, -1]},
        has_structured_output_requests=False,
        pending_structured_output_tokens=False,
    )
    return sched, out, reqs["b"]


def probe() -> bool:
    """Does the stock scheduler leave the placeholders of a request it left out?"""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    sched, out, left_out = _probe_state()
    original(AsyncScheduler._update_after_schedule)(sched, out)
    return bool(left_out.spec_token_ids) and left_out.spec_token_ids[0] == -1


def apply() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    stock = AsyncScheduler._update_after_schedule

    def _update_after_schedule(self, scheduler_output):
        stock(self, scheduler_output)
        applies = self.__dict__.get(_APPLIES)
        if applies is None:  # decided once per scheduler
            applies = self.__dict__[_APPLIES] = uses_dflash(self.vllm_config)
        if applies:
            clear_stale(self, scheduler_output)

    replace_attr(AsyncScheduler, "_update_after_schedule", _update_after_schedule, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=(
        "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
    ),
    summary="DFlash with async scheduling: a running request left out of a step drops "
    "its -1 draft placeholders, so it never comes back with drafts no worker fills.",
    why="A request that sits out a step (at the end of its context, or over the "
    "token budget) kept the placeholders; scheduled again, it was not in the "
    "worker's previous batch and the -1 ids reached the target's embedding: the "
    "engine died with a device-side assert.",
    upstream="vllm-project/vllm#46899 (closed unmerged: clear stale async "
    "speculative placeholders); related #40768",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when vLLM's AsyncScheduler clears the placeholders of requests it "
    "leaves out; the probe then reports it not needed.",
    probe_false_reason="the async scheduler already clears the draft placeholders of "
    "requests it leaves out",
)
