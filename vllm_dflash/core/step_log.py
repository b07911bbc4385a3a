# SPDX-License-Identifier: Apache-2.0
"""``VLLM_DFLASH_STEP_LOG=steps.jsonl``: one JSON line per engine step.

A measuring aid, installed only when the variable is set, in the engine core
(the scheduler's process). It adds no device sync: each line says what the
scheduler sent to the workers and its wall time (``core/step_clock.py``, the
clock ``"draft_length": "adaptive"`` measures with). So one log compares a
no-speculation engine's decode step with a DFlash engine's step at each draft
length, and shows which lengths an adaptive engine verified, batch by batch
(``benchmarks/gpu/perf_synthetic.py`` summarises it per timed batch).

Fields: ``t`` (wall clock at the output, seconds since the epoch), ``ms`` (the
step time above), ``reqs`` (requests scheduled), ``tokens`` (tokens scheduled),
``drafts`` (draft tokens verified, all requests), ``dmax`` (the most of one
request), ``new`` (requests scheduled for the first time) and ``decode`` (true when
every scheduled request runs one token plus its drafts: no prefill chunk).
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from vllm_dflash import envs
from vllm_dflash.core.step_clock import StepClock
from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    PatchState,
    replace_attr,
)

NAME = "dflash_step_log"


class StepLog:
    """Pairs each scheduler output with the model output that answers it and
    writes one line per step (line-buffered: a reader sees whole lines)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: IO[str] | None = None
        self._clock: StepClock[dict[str, Any]] = StepClock()

    def scheduled(self, out: Any) -> None:
        num_reqs = len(out.num_scheduled_tokens)
        if not num_reqs:
            return
        lengths = [len(ids) for ids in out.scheduled_spec_decode_tokens.values()]
        drafts = sum(lengths)
        tokens = int(out.total_num_scheduled_tokens)
        new = len(out.scheduled_new_reqs)
        self._clock.scheduled(
            out,
            {
                "reqs": num_reqs,
                "tokens": tokens,
                "drafts": drafts,
                "dmax": max(lengths, default=0),
                "new": new,
                "decode": new == 0 and tokens == num_reqs + drafts,
            },
        )

    def output(self, out: Any) -> None:
        step = self._clock.output(out)
        if step is None:
            return
        line = {"t": round(time.time(), 4), "ms": round(step.seconds * 1e3, 3)}
        line.update(step.payload)
        if self._fh is None:
            self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115
        self._fh.write(json.dumps(line) + "\n")


def probe() -> bool:
    return envs.step_log_path() is not None


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    log = StepLog(os.path.abspath(envs.step_log_path() or ""))
    # the current methods, so that a patch applied before this one stays in the chain
    stock_schedule = Scheduler.schedule
    stock_update = Scheduler.update_from_output

    def schedule(self, *args, **kwargs):
        out = stock_schedule(self, *args, **kwargs)
        log.scheduled(out)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        result = stock_update(self, scheduler_output, model_runner_output)
        log.output(scheduler_output)
        return result

    replace_attr(Scheduler, "schedule", schedule, NAME)
    replace_attr(Scheduler, "update_from_output", update_from_output, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    ),
    summary=(
        "VLLM_DFLASH_STEP_LOG=file.jsonl: one line per engine step (requests, "
        "tokens, drafts verified, wall time), no device sync."
    ),
    why=(
        "Compare a no-speculation decode step with a DFlash step at each draft "
        "length, and see the lengths an adaptive engine verified, batch by batch."
    ),
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Keep (plugin feature).",
    when_probe_false=PatchState.NOT_APPLICABLE,
    probe_false_reason="VLLM_DFLASH_STEP_LOG is not set",
)
